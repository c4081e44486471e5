"""The command line as a user runs it: streamed text, the statistics and memory lines, prompts from a file
or stdin, sampling defaults from the checkpoint, a GGUF's header read once before the load, help with
defaults, --version, the benchmarks' --help without a GPU, and every user mistake as one line with exit
code 2. Most cases call main() in this process (a subprocess costs a torch import); the README's commands
and the console script run as subprocesses."""
import io
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from qwen38_model import __version__, cli, sampling_defaults
from qwen38_model.cli import options
from qwen38_model.cli.generate import PREFILL_BAR_TOKENS
from qwen38_model.cli.source import CPU_WARN_BYTES
from qwen38_model.cli.terminal import TERMINAL_ESCAPES

REPO = pathlib.Path(__file__).resolve().parents[2]


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "qwen38_model", *args], capture_output=True, text=True,
                          input=stdin, timeout=300)


def run_main(capsys, monkeypatch, *args, stdin: str = ""):
    """main() in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_on_the_default_model():
    result = run_cli("generate", "--prompt", "The quick brown fox", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The quick brown fox") and len(result.stdout) > len("The quick brown fox")
    assert re.search(r"prefill: \d+ tokens, [\d.]+ tok/s, time to first token [\d.]+ s \| "
                     r"decode \((eager|CUDA graph)\): 8 tokens, [\d.]+ tok/s", result.stderr), result.stderr
    assert re.search(r"memory: weights [\d.]+ GB, KV cache [\d.]+ GB \(\d+ tokens\), GDN state [\d.]+ GB, "
                     r"peak [\d.]+ GB", result.stderr), result.stderr


def test_console_script_names_itself_in_usage():
    script = pathlib.Path(sys.executable).parent / "qwen38"
    if not script.is_file():
        pytest.skip(f"console script not installed next to {sys.executable}")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: qwen38 "), result.stdout


def test_help_shows_defaults_and_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["generate", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # help lines wrap with the terminal width
    for expected in ["--max-new-tokens N stop after N new tokens (default: 64)", "(default: int8)",
                     "0 = greedy (default: 0.0)", "0 = off (default: 50)", "generation_config.json",
                     "--prompt-file PATH", "--system TEXT", "--max-context N", "a random seed, printed",
                     "KV cache dtype (default: bfloat16 on CUDA, float32 on CPU)", "0 to 4294967295"]:
        assert expected in text, expected
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"qwen38 {__version__} (torch {torch.__version__}")


def test_chat_prints_the_reply_not_the_template(capsys, monkeypatch):
    code, out, err = run_main(capsys, monkeypatch, "generate", "--prompt", "Hi", "--chat", "--no-thinking",
                              "--system", "Be brief.", "--max-new-tokens", "4", "--temperature", "0.8",
                              "--top-p", "0.9", "--seed", "3")
    assert code == 0, err
    assert "<|im_start|>" not in out and "Be brief." not in out and out.endswith("\n")
    assert ("sampling: temperature 0.8, top_k 50, top_p 0.9, min_p 0, repetition_penalty 1, presence_penalty 0, "
            "seed 3") in err
    # --system alone implies --chat: the same reply.
    code, again, err = run_main(capsys, monkeypatch, "generate", "--prompt", "Hi", "--no-thinking",
                                "--system", "Be brief.", "--max-new-tokens", "4", "--temperature", "0.8",
                                "--top-p", "0.9", "--seed", "3")
    assert code == 0 and again == out, err


def test_prompt_from_file_stdin_and_option_agree(capsys, monkeypatch, tmp_path):
    prompt = "Once upon a time"
    (tmp_path / "prompt.txt").write_text(prompt)
    runs = [run_main(capsys, monkeypatch, "generate", "--prompt", prompt, "--max-new-tokens", "5"),
            run_main(capsys, monkeypatch, "generate", "--prompt-file", str(tmp_path / "prompt.txt"),
                     "--max-new-tokens", "5"),
            run_main(capsys, monkeypatch, "generate", "--max-new-tokens", "5", stdin=prompt),
            run_main(capsys, monkeypatch, "generate", "--prompt-file", "-", "--max-new-tokens", "5", stdin=prompt)]
    assert all(code == 0 for code, _, _ in runs), runs
    assert len({out for _, out, _ in runs}) == 1 and runs[0][1].startswith(prompt)
    assert all("greedy: temperature 0" in err for _, _, err in runs)


def test_random_seed_is_printed_and_repeats_the_run(capsys, monkeypatch):
    args = ("generate", "--prompt", "Once upon a time", "--max-new-tokens", "6", "--temperature", "1.0")
    code, first, err = run_main(capsys, monkeypatch, *args)
    assert code == 0, err
    seed = re.search(r", seed (\d+)\n", err).group(1)
    code, again, _ = run_main(capsys, monkeypatch, *args, "--seed", seed)
    assert code == 0 and again == first


def test_sampling_defaults_come_from_generation_config(capsys, monkeypatch, tmp_path, oracle_dir):
    folder = tmp_path / "hf"
    shutil.copytree(oracle_dir / "hf", folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    (folder / "generation_config.json").write_text(json.dumps(config))
    args = ("generate", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "3", "--seed", "1")
    code, _, err = run_main(capsys, monkeypatch, *args)
    assert code == 0, err
    assert "sampling: temperature 0.6, top_k 20, top_p 0.95, min_p 0, repetition_penalty 1, presence_penalty 0, seed 1" in err
    code, _, err = run_main(capsys, monkeypatch, *args, "--top-k", "5", "--temperature", "0")
    assert code == 0 and "greedy: temperature 0, top_k 5, top_p 0.95" in err, err


def test_sampling_defaults_readers():
    from_generation_config = sampling_defaults.from_generation_config
    assert from_generation_config({"temperature": 0.7, "top_k": 20}) == {"top_k": 20, "temperature": 0.0}
    assert from_generation_config({"do_sample": True, "top_p": 0.8}) == {"top_p": 0.8, "temperature": 1.0}
    # Nothing about sampling (the built-in model's file): the caller's default temperature, greedy for the
    # command line, OpenAI's 1.0 for the server.
    assert from_generation_config({"top_k": 20, "eos_token_id": 2}) == {"top_k": 20}
    gguf_keys = {"general.sampling.temp": 0.6, "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.1,
                 "general.name": "x"}
    assert sampling_defaults.from_gguf_metadata(gguf_keys) == {"temperature": 0.6, "top_k": 20,
                                                               "repetition_penalty": 1.1}


def test_a_gguf_header_is_read_once_before_the_load(capsys, monkeypatch):
    """The tokenizer, the sampling defaults and the --max-context check share one read of the GGUF header;
    from_pretrained reads it once more, as the load (four reads before: each of them read it itself)."""
    from qwen38_model.checkpoint import gguf_file

    read_header, reads = gguf_file.read_header, []

    def counted(path):
        reads.append(path)
        return read_header(path)

    for module in [m for name, m in sys.modules.items() if name.startswith("qwen38_model")]:
        if getattr(module, "read_header", None) is read_header:  # every module that holds the function
            monkeypatch.setattr(module, "read_header", counted)
    code, _, err = run_main(capsys, monkeypatch, "generate", "--prompt", "Hi", "--max-new-tokens", "2",
                            "--max-context", "64")
    assert code == 0 and "(64 tokens)" in err, err
    assert len(reads) == 2, reads


def test_max_context_sizes_the_cache(capsys, monkeypatch):
    code, _, err = run_main(capsys, monkeypatch, "generate", "--prompt", "Hello", "--max-new-tokens", "4",
                            "--max-context", "64")
    assert code == 0 and "(64 tokens)" in err, err
    code, _, err = run_main(capsys, monkeypatch, "generate", "--prompt", "Hello there", "--max-new-tokens", "8",
                            "--max-context", "8")
    assert code == 2 and one_line_error(code, err).startswith("error: context overflow"), err


def test_long_prompt_shows_a_prefill_bar(capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdin", io.StringIO(" a" * 1100))
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["generate", "--max-new-tokens", "2"]) == 0
    bar = re.findall(r"prefill \[#*\s*\] (\d+)/(\d+) tokens", terminal.getvalue())
    assert bar and bar[-1][0] == bar[-1][1] and int(bar[-1][1]) > PREFILL_BAR_TOKENS, terminal.getvalue()[-500:]


def test_generated_text_cannot_drive_the_terminal(capsys, monkeypatch):
    """The built-in model's random weights emit control bytes (bell, vertical tab, ...): piped, the text is
    exact; on a terminal each control character but tab, newline and CR shows as its \\xNN escape."""
    args = ("generate", "--prompt", "The quick brown fox")
    code, piped, _ = run_main(capsys, monkeypatch, *args)
    controls = {c for c in piped if ord(c) in TERMINAL_ESCAPES}
    assert code == 0 and controls, "the default model's greedy text has no control characters left to test"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert cli.main(list(args)) == 0
    shown = terminal.getvalue()
    assert shown == piped.translate(TERMINAL_ESCAPES)
    assert not any(ord(c) in TERMINAL_ESCAPES for c in shown), repr(shown)


@pytest.mark.parametrize("module, list_options", [("decode", ["--lanes", "--contexts"]),
                                                  ("prefill", ["--lengths", "--lanes", "--chunks"]),
                                                  ("batch", ["--batches", "--contexts", "--mtp-batches"])])
def test_benchmark_help_works_without_a_gpu(module, list_options):
    """The README's `python -m benchmarks.decode` / `benchmarks.prefill`, from the source checkout."""
    result = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage: "), result.stdout + result.stderr
    text = " ".join(result.stdout.split())
    for option in list_options:  # each list option says what it takes, and its default
        assert re.search(f"{option} [A-Z]+ [^-]*comma-separated[^-]*\\(default: ", text), (option, text)


def one_line_error(code: int, err: str) -> str:
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_user_mistakes_are_one_line(capsys, monkeypatch, tmp_path):
    def error(*args, stdin=""):
        return one_line_error(*run_main(capsys, monkeypatch, *args, stdin=stdin)[::2])

    assert error("generate", "--model", "/no/such/model.gguf", "--prompt", "x") == \
        "error: /no/such/model.gguf: no such file or folder"
    assert error("generate", "--prompt-file", str(tmp_path / "none.txt")) == \
        f"error: --prompt-file {tmp_path / 'none.txt'}: No such file or directory"
    assert error("generate") == "error: the prompt is empty"
    assert error("generate", "--prompt", "x", "--max-new-tokens", "0") == "error: --max-new-tokens must be >= 1, found 0"
    for seed in ("-1", str(2**32)):
        assert error("generate", "--prompt", "x", "--seed", seed) == \
            f"error: --seed must be in [0, 4294967295] (the sampler's seed is 32 bits), found {seed}"
    if not torch.cuda.is_available():
        assert error("generate", "--prompt", "x", "--device", "cuda").startswith("error: device='cuda' but ")
    with pytest.raises(SystemExit) as exit_info:  # argparse's own usage errors: exit code 2 as well
        cli.parse_args(["generate", "--device", "nonsense"])
    assert exit_info.value.code == 2


def test_max_context_beyond_the_model_or_the_memory_is_one_line(capsys, monkeypatch):
    """Checked before the weights load (the only line is the error), naming the option: a 10^8-token
    --max-context used to allocate until torch failed, in a 29-line traceback."""
    from qwen38_model import state

    def error(*args):
        return one_line_error(*run_main(capsys, monkeypatch, *args)[::2])

    for command in (["generate", "--prompt", "Hi"], ["chat"]):
        assert error(*command, "--max-context", "262145") == \
            "error: --max-context 262145 exceeds the model's context of 262144 tokens"
    from qwen38_model.checkpoint import open_checkpoint
    from qwen38_model.default_model import default_model_path

    config = open_checkpoint(default_model_path()).config
    needed = state.state_bytes(config, 262144, torch.float32, mtp=config.num_mtp_layers > 0)
    monkeypatch.setattr(state, "available_memory", lambda device: needed - 1)
    assert error("generate", "--prompt", "Hi", "--max-context", "262144") == \
        f"error: --max-context 262144: the state (KV caches and GDN states, KV in torch.float32) needs " \
        f"{needed / 1e9:.2f} GB, cpu has {(needed - 1) / 1e9:.2f} GB available"


def test_kv_dtype_default_follows_the_device():
    """Unset, generate() gets None (its default: bfloat16 on CUDA, float32 on the CPU); the size check
    resolves it the same way."""
    args = cli.parse_args(["generate"])
    assert args.kv_dtype is None and options.generation_kwargs(args, {"temperature": 0.0}, None)["kv_dtype"] is None
    assert options.kv_dtype(args, torch.device("cuda")) == torch.bfloat16
    assert options.kv_dtype(args, torch.device("cpu")) == torch.float32
    chosen = cli.parse_args(["chat", "--kv-dtype", "float32"])
    assert options.kv_dtype(chosen, torch.device("cuda")) == torch.float32
    assert options.generation_kwargs(chosen, {"temperature": 0.0}, None)["kv_dtype"] == torch.float32


def test_stop_strings_are_left_out(capsys, monkeypatch):
    """As the server and the OpenAI API do: the output ends before the stop string."""
    prompt = "The quick brown fox"
    code, whole, _ = run_main(capsys, monkeypatch, "generate", "--prompt", prompt, "--max-new-tokens", "40")
    text = whole[len(prompt):-1]  # less the final newline
    stop = re.search(r"[a-z]{3}", text[4:]).group()  # some later plain text of the (deterministic) reply
    assert code == 0 and text.index(stop) > 0
    code, out, err = run_main(capsys, monkeypatch, "generate", "--prompt", prompt, "--max-new-tokens", "40",
                              "--stop", stop, "--stop", "never in the text")
    assert code == 0 and out == prompt + text[:text.index(stop)] + "\n", (stop, text, out)
    code, out, _ = run_main(capsys, monkeypatch, "generate", "--prompt", prompt, "--max-new-tokens", "40",
                            "--stop", "never in the text")
    assert code == 0 and out == whole  # the held-back tail is printed at the end


def test_serve_install_hint_keeps_the_installed_torch(capsys, monkeypatch):
    """`pip install 'qwen38[serve]'` in a source checkout rebuilt the package against another torch."""
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "--help"])
    assert "python3 -m pip install starlette uvicorn" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn raises ImportError
    assert one_line_error(*run_main(capsys, monkeypatch, "serve")[::2]).startswith(
        "error: serve needs starlette and uvicorn: python3 -m pip install starlette uvicorn (")


def test_a_large_checkpoint_on_the_cpu_is_warned(capsys, monkeypatch, tmp_path):
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # sparse: no disk used
        f.truncate(int(CPU_WARN_BYTES) + 1)
    code, _, err = run_main(capsys, monkeypatch, "generate", "--model", str(big), "--prompt", "x", "--device", "cpu")
    assert code == 2 and err.startswith("warning: a 2.0 GB checkpoint on the CPU: the CPU path runs the plain-PyTorch "
                                        "reference ops"), err


@pytest.mark.cuda
def test_generate_on_the_gpu(capsys, monkeypatch):
    code, out, err = run_main(capsys, monkeypatch, "generate", "--prompt", "The quick brown fox", "--max-new-tokens", "8")
    assert code == 0, err
    assert "on cuda" in err and "decode (CUDA graph): 8 tokens" in err and "allocated on the GPU" in err, err
