"""Shared by the CUDA tests of tests/ops (and tests/model/test_speculative_sampling.py): the markers, a registered-kernel assertion, a misaligned
row-strided view, running a check in a child interpreter (with progress lines; with PDL on and off), and
capturing a CUDA graph after a side-stream warm-up.

Imported as a top-level module (tests/ops has no __init__.py, so pytest's rootdir/prepend import mode
puts tests/ops on sys.path).
"""
import inspect
import os
import subprocess
import sys
from typing import Callable

import pytest
import torch

cuda = pytest.mark.cuda

# A run_in_child preamble: a torch-internal C++ error, raised and caught before the checks run. It raised
# normally on the device image where the bindings' own failed checks crashed (see run_in_child).
TORCH_ERROR_CONTROL = ("import torch\n"
                       "try:\n"
                       "    torch.empty(2, device='cuda').view(3)\n"
                       "except RuntimeError:\n"
                       "    print('control: a torch-internal C++ error raised normally', flush=True)\n")


def assert_cuda_kernel(name: str) -> None:
    """The op has a CUDA kernel registered (else a CUDA test would only exercise the reference)."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qwen38::{name}", "CUDA"), (
        f"qwen38::{name} has no CUDA kernel in this build (the test would only run the reference)")


def rows_view(x, pad=3):
    """The same values as a row-strided view of a wider tensor whose rows start 16-byte misaligned."""
    wide = torch.full((x.shape[0], x.shape[1] + pad + 5), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, pad : pad + x.shape[1]] = x
    return wide[:, pad : pad + x.shape[1]]


def run_in_child(test_file: str, function: str, preamble: str = "") -> None:
    """Run `function` of the test module at `test_file` in a fresh interpreter (`-X faulthandler`), after
    `preamble` (Python source run first in the child); fails with the child's rc and output tails.

    Why a child: on the device image (torch 2.11+cu130, extension built by /opt/gcc) a failed TORCH_CHECK
    whose message streamed an integer or a size segfaulted the process, in pytest and in a fresh child
    alike, while checks whose messages hold only names, dtypes and devices raised normally, as did a
    torch-internal error (TORCH_ERROR_CONTROL). The bindings now pre-format every number (see text() in
    csrc/cuda_bindings/checks.h), but in a child a crash still fails only the test that met it, and the
    output (progress() lines, the faulthandler traceback) names the call. The child puts the test file's
    folder and tests/ on sys.path first, so the module can import cuda_helpers and numerics as it does under
    pytest."""
    folder = os.path.dirname(os.path.abspath(test_file))
    code = ("import sys\n"
            f"sys.path[:0] = [{folder!r}, {os.path.dirname(folder)!r}]\n"
            f"{preamble}"
            "import importlib.util\n"
            f"spec = importlib.util.spec_from_file_location('child_checks', {test_file!r})\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            f"module.{function}()\n"
            f"print('{function}() returned', flush=True)\n")
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"rc {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"


def child_env(**values) -> str:
    """A run_in_child preamble setting environment variables before the extension reads them (it reads
    QWEN38_Q8_GEMV_CONFIG and QWEN38_PDL once per process)."""
    return "import os\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in values.items())


def assert_same_bits_pdl_on_and_off(test_file: str, function: str, out_dir) -> None:
    """Runs `function` of the test module (which saves its results to the safetensors file named by
    QWEN38_TEST_OUT) in a child with programmatic dependent launch on and in one with it off: a kernel that
    read its predecessor's output before its griddepcontrol.wait would be a race that only PDL exposes."""
    from safetensors.torch import load_file

    for pdl in ("1", "0"):
        run_in_child(test_file, function,
                     child_env(QWEN38_PDL=pdl, QWEN38_TEST_OUT=os.path.join(out_dir, f"pdl{pdl}.safetensors")))
    on, off = (load_file(os.path.join(out_dir, f"pdl{pdl}.safetensors")) for pdl in ("1", "0"))
    assert on.keys() == off.keys()
    for name in on:
        assert torch.equal(on[name], off[name]), f"{name}: PDL on and off differ"


def progress() -> None:
    """Print the caller's line about to run: if the child crashes there, its output names the call."""
    print("checking line", inspect.currentframe().f_back.f_lineno, flush=True)


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Run fn once on a side stream (warm-up outside the capture), then capture fn into a new CUDA graph
    (not replayed here)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
