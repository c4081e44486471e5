"""Shared fixtures: the oracle (a tiny checkpoint converted and run by llama.cpp and transformers)."""
import os
import pathlib

import pytest
import safetensors.torch

REPO = pathlib.Path(__file__).resolve().parents[1]


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
