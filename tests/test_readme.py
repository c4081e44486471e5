"""The README as a newcomer reads it: its Python blocks run as written (on the built-in model, on the CPU
here), and every QWEN38_* environment variable the code reads is documented there."""
import pathlib
import re

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
# Reads of an environment variable in Python, C++ and shell (os.environ.get("X"), getenv("X"), ${X}, ...).
ENV_READ = re.compile(r"""(?:getenv\(|environ\.get\(|environ\[|setenv\(|env_vars\()\s*["']?(QWEN38_\w+)|\$\{?(QWEN38_\w+)""")
SOURCES = {".py", ".sh", ".cu", ".cuh", ".cpp", ".h"}


def run_block(index: int, capsys) -> dict:
    """Runs README Python block `index` as written; returns its variables."""
    variables = {"__name__": "__readme__"}
    exec(compile(BLOCKS[index], f"README.md python block {index + 1}", "exec"), variables)
    out = capsys.readouterr().out
    assert re.search(r"prefill: \d+ tokens, [\d.]+ tok/s, time to first token [\d.]+ s \| decode .*tok/s", out), out
    return variables


def model_of(variables: dict):
    return variables["model"] if "model" in variables else variables["llm"].model


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_python_block_runs_as_written(index, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    run_block(index, capsys)


@pytest.mark.cuda
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_python_block_runs_as_written_on_the_gpu(index, capsys, monkeypatch, tmp_path):
    """The same blocks where a GPU is visible: the model lands on it and decodes through the graph."""
    monkeypatch.chdir(tmp_path)
    model = model_of(run_block(index, capsys))
    assert model.device.type == "cuda" and model.last_generation_stats.graph


def test_every_environment_variable_is_documented():
    names = set()
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if path.suffix in SOURCES and not parts[0].startswith(".") and parts[0] != "build" and path.is_file():
            names |= {a or b for a, b in ENV_READ.findall(path.read_text(errors="replace"))}
    assert {"QWEN38_NO_CUDA", "QWEN38_CUDA_ARCH", "QWEN38_ORACLE", "QWEN38_CACHE"} <= names
    missing = sorted(name for name in names if f"`{name}" not in README)
    assert not missing, f"read from the environment but not in the README: {missing}"
