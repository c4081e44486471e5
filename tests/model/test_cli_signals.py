"""The command line under misuse and signals (issue 10): one line on stderr and a documented exit code,
never a traceback. 2: a user mistake (bad option value, unusable checkpoint or cache path); 130: Ctrl-C,
also while torch is still loading; 141: stdout closed by its reader (`| head`), quietly."""
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from qwen38_model import cli

from conftest import default_sigint


def cli_process(oracle_dir, *args):
    return subprocess.Popen([sys.executable, "-m", "qwen38_model", "generate", "--model",
                             str(oracle_dir / "mini-q8_0.gguf"), "--prompt", "hi", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)


def error_line(capsys, monkeypatch, *args) -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["generate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("option,message", [
    (["--temperature", "-1"], "error: --temperature must be >= 0 (0 = greedy), found -1.0"),
    (["--temperature", "nan"], "error: --temperature must be a finite float, found nan"),
    (["--top-p", "inf"], "error: --top-p must be a finite float, found inf"),
    (["--presence-penalty", "nan"], "error: presence_penalty must be a finite number, found nan"),
    (["--stop", ""], "error: --stop must not be empty (an empty stop string would end the output at once)"),
])
def test_sampling_nonsense_is_an_error_not_greedy(capsys, monkeypatch, oracle_dir, option, message):
    assert error_line(capsys, monkeypatch, "--model", str(oracle_dir / "mini-q8_0.gguf"), "--prompt", "x",
                      *option) == message


def test_unusable_paths(capsys, monkeypatch, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    assert error_line(capsys, monkeypatch, "--model", str(fifo), "--prompt", "x") == \
        f"error: {fifo}: not a regular file (the checkpoint file must be one; found a FIFO)"
    blocker = tmp_path / "cache"
    blocker.write_text("a file, not a folder")
    monkeypatch.setenv("QWEN38_CACHE", str(blocker))
    assert error_line(capsys, monkeypatch, "--prompt", "x").startswith(f"error: cannot build the built-in model in "
                                                                        f"{blocker} (File exists")


def test_bad_generation_config_values_are_named(capsys, monkeypatch, oracle_dir, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    (folder / "generation_config.json").write_text('{"do_sample": true, "top_k": [40], "eos_token_id": 500}')
    assert error_line(capsys, monkeypatch, "--model", str(folder), "--prompt", "x") == \
        f"error: top_k in the checkpoint {folder} must be a finite int, found [40]"


def test_ctrl_c_while_torch_loads(oracle_dir):
    process = cli_process(oracle_dir)
    deadline = time.monotonic() + 60
    with open(f"/proc/{process.pid}/maps") as maps:  # torch's libraries mapped: the guarded imports run
        while "torch" not in maps.read() and time.monotonic() < deadline:
            maps.seek(0)
            time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.decode().endswith("\ninterrupted\n") and "Traceback" not in err.decode()


def test_ctrl_c_while_generating(oracle_dir):
    process = cli_process(oracle_dir, "--max-new-tokens", "5000")
    process.stdout.read(4)  # text is streaming
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.decode().endswith("\n\ninterrupted\n") and "Traceback" not in err.decode()


def test_stdout_closed_by_its_reader(oracle_dir):
    """`qwen38 generate ... | head -c 4`: the pipe closes mid-stream."""
    process = cli_process(oracle_dir, "--max-new-tokens", "5000")
    process.stdout.read(4)
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141
    assert "Traceback" not in err.decode() and "Exception ignored" not in err.decode() and "error" not in err.decode()
