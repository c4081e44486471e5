"""The README as a newcomer reads it: its Python blocks run as written (on the built-in model, on the CPU
here), and every QWEN38_* environment variable the code reads is documented there."""
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
# Reads of an environment variable in Python, C++ and shell (os.environ.get("X"), getenv("X"), ${X}, ...).
ENV_READ = re.compile(r"""(?:getenv\(|environ\.get\(|environ\[|setenv\(|env_vars\()\s*["']?(QWEN38_\w+)|\$\{?(QWEN38_\w+)""")
SOURCES = {".py", ".sh", ".cu", ".cuh", ".cpp", ".h"}


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_python_block_runs_as_written(index, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    assert re.search(r"prefill: \d+ tokens, [\d.]+ tok/s, time to first token [\d.]+ s \| decode .*tok/s", out), out


def test_every_environment_variable_is_documented():
    names = set()
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if path.suffix in SOURCES and not parts[0].startswith(".") and parts[0] != "build" and path.is_file():
            names |= {a or b for a, b in ENV_READ.findall(path.read_text(errors="replace"))}
    assert {"QWEN38_NO_CUDA", "QWEN38_CUDA_ARCH", "QWEN38_ORACLE", "QWEN38_CACHE"} <= names
    missing = sorted(name for name in names if f"`{name}" not in README)
    assert not missing, f"read from the environment but not in the README: {missing}"
