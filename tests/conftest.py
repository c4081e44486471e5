"""Shared fixtures: the oracle (a tiny checkpoint converted and run by llama.cpp and transformers)."""
import os
import pathlib
import shutil
import signal
import tempfile

import pytest
import safetensors.torch
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
# The oracle travels with the repository (17 MB), so every machine runs every test; test_oracle_copy.py
# holds it byte for byte to the project's ../shared/oracle/mini where that exists.
ORACLE = REPO / "tests" / "oracle" / "mini"


def pytest_configure(config):
    """The tests' built-in default model and anything else cached goes to a temporary folder, not the user's
    ~/.cache/qwen38 (set before any test, and inherited by the commands the tests start). An explicit
    QWEN38_CACHE is kept: the device run points it at a folder it reuses."""
    if "QWEN38_CACHE" not in os.environ:
        os.environ["QWEN38_CACHE"] = config.qwen38_temporary_cache = tempfile.mkdtemp(prefix="qwen38-test-cache-")
    single_thread_cpu_suite(config)


def pytest_unconfigure(config):
    if hasattr(config, "qwen38_temporary_cache"):
        shutil.rmtree(config.qwen38_temporary_cache, ignore_errors=True)


def single_thread_cpu_suite(config):
    """The CPU suite (`-m 'not cuda'`, the default) runs torch on one thread, here and in the subprocesses
    it starts, unless OMP_NUM_THREADS says otherwise. Its models are tiny: a second thread gains little on
    the 2-core CI machine, and when anything else runs there the threads spin against it (measured:
    test_api, test_readme and test_generation took 103-161 s on 2 threads and 7 s on 1, at a load of 4).
    The GPU run (`-m cuda`) keeps torch's default: its CPU references are large."""
    if "not cuda" in config.getoption("markexpr"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """The one GPU marker: a test marked `cuda` is skipped where no CUDA GPU is visible (`-m cuda` on a CPU
    machine), so no test needs a second, skipif decorator."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def require(module: str):
    """The module, imported; missing, a skip that names it, and under CI=true a failure: a CI run must not go
    green by skipping whole files (transformers is in the test extra, so `make test` has it)."""
    if os.environ.get("CI") == "true":
        try:
            return __import__(module)
        except ImportError as e:
            pytest.fail(f"{module} is not installed, under CI=true ({e})", pytrace=False)
    return pytest.importorskip(module)


def default_sigint():
    """preexec_fn for a child the test sends Ctrl-C: run from a background job (a CI runner's, or `cmd &`), the
    suite inherits SIGINT ignored, and Python installs its KeyboardInterrupt handler only over the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def oracle_dir() -> pathlib.Path:
    """$QWEN38_ORACLE, else the repository's copy. Missing: a failure under CI, a skip elsewhere."""
    path = pathlib.Path(os.environ.get("QWEN38_ORACLE") or ORACLE)
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
