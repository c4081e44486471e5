"""Shared fixtures: the oracle (a tiny checkpoint converted and run by llama.cpp and transformers)."""
import os
import pathlib

import pytest
import safetensors.torch
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """The CPU suite (`-m 'not cuda'`, the default) runs torch on one thread, here and in the subprocesses
    it starts, unless OMP_NUM_THREADS says otherwise. Its models are tiny: a second thread gains little on
    the 2-core CI machine, and when anything else runs there the threads spin against it (measured:
    test_api, test_readme and test_generation took 103-161 s on 2 threads and 7 s on 1, at a load of 4).
    The GPU run (`-m cuda`) keeps torch's default: its CPU references are large."""
    if "not cuda" in config.getoption("markexpr"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def oracle_dir() -> pathlib.Path:
    """$QWEN38_ORACLE, else <repo>/../shared/oracle/mini. Missing: a failure under CI, a skip elsewhere."""
    path = pathlib.Path(os.environ.get("QWEN38_ORACLE") or REPO.parent / "shared" / "oracle" / "mini")
    if not (path / "hf" / "config.json").is_file():
        message = f"oracle not found at {path}: set QWEN38_ORACLE to its mini/ folder (README: The test oracle)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def oracle_ref(oracle_dir) -> dict:
    """ref.safetensors: prompt ids and reference logits (see the oracle's README)."""
    return safetensors.torch.load_file(oracle_dir / "ref.safetensors")
