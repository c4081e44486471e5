"""torch.ops.qwen38.*: the decode-step ops of Qwen3.8 (qwen35) as PyTorch custom ops.

Call them as torch.ops.qwen38.<op>(..., outputs) with the outputs passed in (graph capture needs fixed
buffers); each family module here says what its ops compute. Schemas live in csrc/bindings.cpp; CUDA
kernels register for the CUDA dispatch key when the extension was built with CUDA; the plain-PyTorch
references in qwen38_ops.reference register under CompositeExplicitAutograd so every op runs anywhere.
"""
import functools
import warnings

import torch

from . import _C  # noqa: F401  (loads the schemas and, in a CUDA build, the kernels)
from . import attention, embedding, gdn, norm_quant, q8_gemv, sampling  # noqa: F401


@functools.cache
def cuda_kernels_available() -> bool:
    """True when this build registered CUDA kernels (not only the references)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("qwen38::q8_0_gemv", "CUDA")


@functools.cache
def warn_if_no_cuda_kernels() -> None:
    """Warn once when CUDA tensors will run through the slow references."""
    if not cuda_kernels_available():
        warnings.warn(
            "qwen38_ops was built without CUDA kernels, so CUDA tensors run the plain-PyTorch reference ops "
            "(correct but slow). Rebuild with a CUDA build of torch and nvcc on the PATH: "
            "`python -m pip install --no-build-isolation -e .` (QWEN38_NO_CUDA must not be 1).",
            stacklevel=3,
        )
