"""`torchrun --nproc-per-node 2 -m qwen38_model generate` on the CPU (gloo): one pair of processes, against the
same command in one process. Rank 0 reads the prompt from standard input and writes all the output."""
import subprocess
import sys

ARGS = ["generate", "--device", "cpu", "--max-new-tokens", "12", "--temperature", "0", "--speculative", "mtp"]
PROMPT = "Once upon a time"


def run(*command):
    done = subprocess.run([sys.executable, *command], input=PROMPT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_two_ranks_print_what_one_process_prints():
    one = run("-m", "qwen38_model", *ARGS)  # also builds the default model, before the ranks read it
    two = run("-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "qwen38_model", *ARGS)
    assert two.stdout == one.stdout and one.stdout.startswith(PROMPT)
    assert "over 2 ranks" in two.stderr and two.stderr.count("greedy:") == 1  # rank 0 alone reports


def test_chat_and_serve_under_torchrun_are_refused(monkeypatch, capsys):
    """Each rank would load the whole model and run alone: a one-line error (exit 2) before any load."""
    from qwen38_model.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    for command in ("chat", "serve"):
        assert main([command, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert "only `generate` runs tensor parallel" in err and f"`{command}` is single-GPU" in err
