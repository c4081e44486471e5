"""Install as a newcomer does it: the README's `make demo` in a fresh virtual environment; the build's CUDA
probe on toolkits that only look usable; the torch version check at import; the package metadata."""
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
import torch

import qwen38_model

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its build runs only as __main__), for its CUDA toolkit probe."""
    spec = importlib.util.spec_from_file_location("qwen38_setup", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_toolkit(root: pathlib.Path, nvcc_script: str, headers=()) -> pathlib.Path:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\n{nvcc_script}\n")
    nvcc.chmod(0o755)
    for header in headers:
        (root / "include" / header).write_text("")
    return root


def test_cuda_probe_wants_a_working_nvcc_and_the_headers(setup_py, monkeypatch, tmp_path):
    monkeypatch.delenv("QWEN38_NO_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as under a CUDA build of torch
    release = "echo 'Cuda compilation tools, release 13.0, V13.0.88'"
    cases = {  # the machine: an nvcc wrapper whose toolkit is missing
        "wrapper": (fake_toolkit(tmp_path / "a", "exec /no/such/cuda/bin/nvcc \"$@\""), "reports no release"),
        "no headers": (fake_toolkit(tmp_path / "b", release), "cuda_runtime.h not found in"),
        "no bf16 header": (fake_toolkit(tmp_path / "c", release, ["cuda_runtime.h"]), "cuda_bf16.h not found in"),
    }
    for name, (home, reason) in cases.items():
        monkeypatch.setattr(setup_py, "CUDA_HOME", str(home))
        assert reason in (setup_py.cuda_toolkit_problem() or ""), name
    monkeypatch.setattr(setup_py, "CUDA_HOME", str(fake_toolkit(tmp_path / "d", release, ["cuda_runtime.h", "cuda_bf16.h"])))
    assert setup_py.cuda_toolkit_problem() is None
    monkeypatch.setenv("QWEN38_NO_CUDA", "1")
    assert setup_py.cuda_toolkit_problem() == "QWEN38_NO_CUDA=1"
    monkeypatch.delenv("QWEN38_NO_CUDA")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert setup_py.cuda_toolkit_problem() == f"torch {torch.__version__} is a CPU build"


def test_import_refuses_an_extension_built_for_another_torch():
    code = "import torch; torch.__version__ = '0.0.1'; import qwen38_ops"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert (f"ImportError: qwen38_ops._C was built against torch {torch.__version__}, but torch 0.0.1 is installed: "
            "rebuild with `python -m pip install --no-build-isolation -e .`") in result.stderr, result.stderr


def test_an_isolated_build_stops_with_the_command_that_works(tmp_path):
    """A plain `pip install .` (or ".[serve]") builds in an isolated environment: with torch among the build
    requirements that environment fetched another torch, built against it, replaced the working install
    and reported success. Now the build stops before it starts, saying what to run. `pip wheel` builds into
    tmp_path, so this test cannot break the installed package whatever happens."""
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path), str(REPO)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and not list(tmp_path.glob("*.whl")), result.stdout[-2000:]
    assert "builds its extension against the installed torch" in result.stdout + result.stderr
    assert "--no-build-isolation" in result.stdout + result.stderr


def test_package_metadata():
    meta = importlib.metadata.metadata("qwen38")
    assert meta["Version"] == qwen38_model.__version__
    assert meta["License"] == "MIT" and (REPO / "LICENSE").read_text().startswith("MIT License")
    assert not any(r.startswith("ninja") for r in importlib.metadata.requires("qwen38")), "ninja is build-only"


def see_this_torch(venv: pathlib.Path) -> None:
    """Make the new venv find the torch this test runs under. --system-site-packages shows the base
    interpreter's packages only: run from inside a venv, that base has no torch (the outer venv's packages
    are not "system" ones), and `make demo` would install another. A path line in a .pth file appends
    torch's folder to sys.path after the venv's own site-packages, without running that folder's .pth
    files (so the outer environment's editable install of qwen38 stays out). Under a system Python or a
    conda env torch's folder is already the system one, and the line changes nothing."""
    site_packages = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    torch_folder = pathlib.Path(torch.__file__).resolve().parents[1]
    (pathlib.Path(site_packages) / "outer_torch.pth").write_text(f"{torch_folder}\n")


@pytest.mark.slow  # ~20 s on the 2-core CI machine: it builds the extension again
def test_make_demo_in_a_fresh_venv(tmp_path):
    """The README's path, literally: `make demo` in a new virtual environment on this checkout's files.
    The venv sees the system's packages (--system-site-packages) so that the installed torch is reused
    instead of downloaded again; everything else (setuptools, the editable install, the build of the
    extension, the console script) happens in the venv."""
    if not (REPO / ".git").exists() or shutil.which("make") is None:
        pytest.skip("needs a git checkout (to list its files) and make")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split("\0")
    checkout = tmp_path / "qwen38"
    for name in filter(None, files):
        if (REPO / name).is_file():  # a file deleted in the working tree is still listed
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=300)
    see_this_torch(venv)
    # A fresh shell with the venv activated: no make state of an outer `make test` (a `make test PY=...`
    # exports PY to its recipes, which would send the inner `make demo` to the outer interpreter).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHONPATH", "PY")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv))
    start = time.perf_counter()
    result = subprocess.run(["make", "demo"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    print(f"make demo in a fresh venv: {time.perf_counter() - start:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"torch {torch.__version__} is installed: keeping it" in result.stdout
    assert "qwen38_ops: CPU-only build" in result.stdout or "qwen38_ops: CUDA kernels" in result.stdout
    assert "The quick brown fox" in result.stdout and "decode (" in result.stderr, result.stderr[-3000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import qwen38_model; print(qwen38_model.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(checkout / "qwen38_model" / "__init__.py"), where.stdout + where.stderr
    script = venv / "bin" / "qwen38"  # the console script, run by the venv's interpreter
    assert script.is_file() and script.read_text().startswith(f"#!{venv / 'bin' / 'python'}"), script
    # A second `make demo` / `make test` does not reinstall; a change to what the build reads does.
    again = subprocess.run(["make", "ready"], cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "not reinstalling" in again.stdout, again.stdout + again.stderr
    (checkout / "csrc" / "bindings.cpp").touch()
    check = subprocess.run([str(venv / "bin" / "python"), "scripts/install_is_current.py"], cwd=checkout, env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 1 and "csrc/bindings.cpp changed" in check.stdout, check.stdout + check.stderr


def test_a_missing_test_dependency_fails_under_ci(monkeypatch):
    """conftest.require: a skip on a developer's machine, a failure in CI (three files needed transformers and
    skipped whole under CI=true when it was missing)."""
    from conftest import require

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_qwen38 is not installed, under CI=true"):
        require("no_such_module_qwen38")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        require("no_such_module_qwen38")
    assert require("json").dumps([]) == "[]"
