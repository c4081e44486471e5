"""torch.ops.qwen38.*: the decode-step ops of Qwen3.8 (qwen35) as PyTorch custom ops.

Call them as torch.ops.qwen38.<op>(..., outputs) with the outputs passed in (graph capture needs fixed
buffers); each family module here says what its ops compute. Schemas live in csrc/bindings.cpp; CUDA
kernels register for the CUDA dispatch key when the extension was built with CUDA; the plain-PyTorch
references in qwen38_ops.reference register under CompositeExplicitAutograd so every op runs anywhere.

Importing the package checks the build and loads nothing native: qwen38_ops.reference, the plain-PyTorch
specification of each op, imports without the extension. `import qwen38_ops.ops` loads the extension _C and
registers every op (so does importing one family module, for its own ops).
"""
import functools
import warnings

import torch

REBUILD = "`python -m pip install --no-build-isolation -e .` in the source checkout (or `make install`)"

try:
    from . import _build_info
except ImportError:
    raise ImportError(f"qwen38_ops is not built: run {REBUILD}") from None
# A C++ extension is tied to the torch it was compiled against: another torch fails with undefined
# symbols (or worse), so say what to do before loading it.
if _build_info.TORCH_VERSION != torch.__version__:
    raise ImportError(f"qwen38_ops._C was built against torch {_build_info.TORCH_VERSION}, but torch "
                      f"{torch.__version__} is installed: rebuild with {REBUILD}")

BUILD_SUMMARY = _build_info.SUMMARY  # which build this is: CUDA kernels, or CPU-only and why


@functools.cache
def cuda_kernels_available() -> bool:
    """True when this build registered CUDA kernels (not only the references)."""
    from . import ops  # noqa: F401  (the kernels register as the extension loads)

    return torch._C._dispatch_has_kernel_for_dispatch_key("qwen38::q8_0_gemv", "CUDA")


@functools.cache
def warn_if_no_cuda_kernels() -> None:
    """Warn once when CUDA tensors will run through the slow references."""
    if not cuda_kernels_available():
        warnings.warn(
            f"qwen38_ops has no CUDA kernels ({BUILD_SUMMARY}), so CUDA tensors run the plain-PyTorch "
            f"reference ops (correct but slow). With a CUDA build of torch and the CUDA toolkit, rebuild: {REBUILD}.",
            stacklevel=3,
        )
