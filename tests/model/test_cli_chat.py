"""`chat`, the interactive REPL, driven through standard input in a subprocess on the built-in default
model: every turn after the first prefills only its own tokens, /save and /load carry a conversation
across /reset, mistakes leave the chat running, and Ctrl-C stops a reply, not the chat."""
import io
import os
import re
import select
import signal
import subprocess
import sys
import time

from qwen38_model import cli

from conftest import default_sigint

STATS = re.compile(r"\[prefill (\d+) tokens in [\d.]+ s \| reply (\d+) tokens, [\d.]+ tok/s \| context (\d+) tokens\]")


def chat_process(*args):
    return subprocess.Popen([sys.executable, "-m", "qwen38_model", "chat", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)


def turns(stderr: str) -> list[tuple[int, int, int]]:
    return [tuple(map(int, m)) for m in STATS.findall(stderr)]


def chat_here(capsys, monkeypatch, script: str, *args) -> tuple[int, str]:
    """The chat in this process (a subprocess costs a torch import), the script on stdin: (exit code, stderr)."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    code = cli.main(["chat", *args])
    return code, capsys.readouterr().err


def test_a_failed_save_is_one_line_and_the_chat_goes_on(capsys, monkeypatch, tmp_path):
    missing = tmp_path / "no" / "chat.safetensors"
    code, err = chat_here(capsys, monkeypatch, f"Hello\n/save {missing}\n/save {tmp_path}\nMore\n/quit\n",
                          "--max-new-tokens", "4")
    assert code == 0 and "Traceback" not in err, err
    assert f"error: cannot save the conversation to {missing}: no folder {missing.parent}\n" in err
    assert f"error: cannot save the conversation to {tmp_path}: it is a folder\n" in err
    assert len(turns(err)) == 2  # the turn after the failed saves ran in the same conversation


def test_context_limits_name_the_options(capsys, monkeypatch, tmp_path):
    """A conversation that cannot take another turn within --max-context is refused at /load, and a turn
    that would overflow is refused before it runs, both naming the options (generate() names its
    max_seq_len)."""
    saved = tmp_path / "chat.safetensors"
    code, err = chat_here(capsys, monkeypatch, f"Hello there\n/save {saved}\n/quit\n", "--max-new-tokens", "6")
    (_, _, length), = turns(err)
    assert code == 0 and f"[saved {length} tokens to {saved}]" in err, err
    code, err = chat_here(capsys, monkeypatch, f"/load {saved}\nHi\n/quit\n", "--max-new-tokens", "6",
                          "--max-context", str(length + 6))
    assert code == 0 and "Traceback" not in err, err
    assert (f"error: {saved}: its conversation of {length} tokens leaves no room for a turn and --max-new-tokens 6 "
            f"within --max-context {length + 6}\n") in err
    assert len(turns(err)) == 1  # "Hi" began a new conversation
    code, err = chat_here(capsys, monkeypatch, "word " * 40 + "\n/quit\n", "--max-new-tokens", "6", "--max-context", "30")
    assert code == 0 and re.search(r"error: context full: 0 tokens in the conversation \+ \d+ in this turn \+ "
                                   r"--max-new-tokens 6 > --max-context 30 \(/reset starts over\)\n", err), err


def test_turns_prefill_only_their_tokens_and_survive_save_reset_load(tmp_path):
    saved = tmp_path / "chat.safetensors"
    script = f"Hello there\nHow are you?\n/save {saved}\n/reset\nHi\n/load {saved}\nMore\n/bogus\n/load {tmp_path}/none\n/quit\n"
    process = chat_process("--max-new-tokens", "6", "--system", "Be brief.")
    out, err = process.communicate(script, timeout=300)
    assert process.returncode == 0 and "Traceback" not in err, err
    (p1, r1, c1), (p2, r2, c2), (p3, r3, c3), (p4, r4, c4) = turns(err)
    assert p1 == c1 - r1  # the first turn: its whole prompt
    # A later turn: its own tokens, plus the previous reply's last token (never fed back by a step).
    assert p2 == c2 - r2 - c1 + 1
    assert p3 == c3 - r3  # after /reset: a fresh conversation
    assert p4 == c4 - r4 - c2 + 1  # after /load: continues the saved conversation, nothing re-read
    assert f"[saved {c2} tokens to {saved}]" in err and f"[loaded {c2} tokens from {saved}]" in err
    assert "error: unknown command /bogus" in err and f"error: No such file or directory: {tmp_path}/none" in err


def test_ctrl_c_stops_the_reply_not_the_chat():
    # min-new-tokens holds back the end of turn: the reply runs until interrupted.
    process = chat_process("--max-new-tokens", "3000", "--min-new-tokens", "3000")
    try:
        process.stdin.write("Tell me a long story\n")
        process.stdin.flush()
        received, deadline = "", time.monotonic() + 120
        while len(received) < 40 and time.monotonic() < deadline:  # the reply is streaming
            if select.select([process.stdout], [], [], 1)[0]:
                received += os.read(process.stdout.fileno(), 4096).decode(errors="replace")
        assert len(received) >= 40, received
        process.send_signal(signal.SIGINT)
        out, err = process.communicate("/quit\n", timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err
    kept = re.search(r"\[stopped: (\d+) tokens kept\]", err)
    assert kept and 0 < int(kept.group(1)) < 3000, err


def test_a_bad_file_at_load_is_one_line_and_the_chat_goes_on(capsys, monkeypatch, tmp_path):
    """Each bad conversation file at /load (a FIFO once hung the chat; a bad header, a missing or misshapen
    tensor, a NaN, an id outside the vocabulary once ended it with a traceback or loaded a wrong state) is
    one error line naming the file, and the next turn runs."""
    import json

    import safetensors
    import safetensors.torch
    import torch

    saved = tmp_path / "chat.safetensors"
    code, err = chat_here(capsys, monkeypatch, f"Hello there\n/save {saved}\n/quit\n", "--max-new-tokens", "4")
    assert code == 0 and f"to {saved}]" in err, err
    with safetensors.safe_open(str(saved), "pt") as f:
        meta = f.metadata()
    tensors = safetensors.torch.load_file(saved)
    attention = next(name for name, t in tensors.items() if name.endswith(".a") and t.dim() == 3 and
                     t.shape[0] == int(meta["qwen38.position"]))

    def write(name, changes=None, **meta_changes):
        path = tmp_path / name
        safetensors.torch.save_file(dict(tensors, **(changes or {})), str(path), metadata=dict(meta, **meta_changes))
        return path

    config = json.loads(meta["qwen38.config"])
    bad = [write("config-list", **{"qwen38.config": "[]"}), write("config-null", **{"qwen38.config": "null"}),
           write("config-5", **{"qwen38.config": "5"}),
           write("config-other", **{"qwen38.config": json.dumps(dict(config, hidden_size=1))}),
           write("position", **{"qwen38.position": str(int(meta["qwen38.position"]) + 1)}),
           write("position-text", **{"qwen38.position": "seven"}),
           write("kv-1-row", {attention: tensors[attention][:1].clone()}),
           write("nan", {"0.b": torch.full_like(tensors["0.b"], float("nan"))}),
           write("id-2^40", {"tokens": torch.cat([tensors["tokens"][:-1], torch.tensor([2**40])])}),
           write("id-minus-5", {"tokens": torch.cat([tensors["tokens"][:-1], torch.tensor([-5])])})]
    missing_layer = dict(tensors)
    del missing_layer["0.a"]
    safetensors.torch.save_file(missing_layer, str(tmp_path / "no-layer"), metadata=meta)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "folder").mkdir()
    bad += [tmp_path / "no-layer", tmp_path / "fifo", tmp_path / "folder"]
    script = "".join(f"/load {path}\n" for path in bad) + f"/load {saved}\nMore\n/quit\n"
    code, err = chat_here(capsys, monkeypatch, script, "--max-new-tokens", "4")
    assert code == 0 and "Traceback" not in err, err
    for path in bad:
        assert f"error: {path}" in err, (path, err)
    assert err.count("error: ") == len(bad), err
    assert "[loaded " in err and len(turns(err)) == 1  # the good file loaded after them, and a turn ran on it
