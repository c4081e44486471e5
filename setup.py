"""Builds qwen38_ops._C: the op schemas (csrc/bindings.cpp) always, the CUDA kernels when possible.

CUDA sources are compiled when the installed torch is a CUDA build and cpp_extension finds CUDA_HOME
(not torch.cuda.is_available(): a GPU-less builder can still compile them), unless QWEN38_NO_CUDA=1.
Install with --no-build-isolation: an isolated build environment would pull another torch.
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def want_cuda() -> bool:
    if os.environ.get("QWEN38_NO_CUDA", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = ["csrc/bindings.cpp"]
    if not want_cuda():
        return CppExtension("qwen38_ops._C", sources, extra_compile_args={"cxx": ["-O2"]})
    sources += sorted(glob.glob("csrc/kernels/*.cu")) + sorted(glob.glob("csrc/cuda_bindings/*.cpp"))
    arch = os.environ.get("QWEN38_CUDA_ARCH", "90")
    # No --use_fast_math: the int8 lane must reproduce ggml's activation rounding, and approximate
    # exp/rsqrt/division move values across rounding boundaries (measured: 1.8e-2 vs llama.cpp's logits).
    nvcc = ["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}", "--expt-relaxed-constexpr"]
    return CUDAExtension("qwen38_ops._C", sources, extra_compile_args={"cxx": ["-O2"], "nvcc": nvcc})


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
