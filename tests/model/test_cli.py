"""The README's main command, as a user runs it: streamed text, then the prefill/decode line."""
import subprocess
import sys


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "qwen38_model", *args], capture_output=True, text=True, timeout=300)


def test_generate_on_the_default_model():
    result = run_cli("generate", "--prompt", "The quick brown fox", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The quick brown fox") and len(result.stdout) > len("The quick brown fox")
    assert "decode (eager): 8 tokens" in result.stderr or "decode (CUDA graph): 8 tokens" in result.stderr


def test_chat_and_sampling_options():
    result = run_cli("generate", "--prompt", "Hi", "--chat", "--no-thinking", "--max-new-tokens", "4",
                     "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" in result.stdout


def test_user_mistakes_are_one_line():
    result = run_cli("generate", "--model", "/no/such/model.gguf", "--prompt", "x")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: /no/such/model.gguf: no such file or folder"
    assert "Traceback" not in result.stderr
