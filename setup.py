"""Builds qwen38_ops._C: the op schemas (csrc/bindings.cpp) always, the CUDA kernels when the toolkit works.

The CUDA sources are compiled when the installed torch is a CUDA build and a probe of the toolkit passes:
CUDA_HOME/bin/nvcc runs and reports its release, and CUDA_HOME/include holds cuda_runtime.h and
cuda_bf16.h. An `nvcc` on the PATH is not enough (a wrapper script without the toolkit behind it made the
build fail). The probe does not ask for a GPU: a GPU-less builder can compile the kernels.
QWEN38_NO_CUDA=1 skips them; QWEN38_CUDA_ARCH (default 90a) picks the GPU architecture. The default, sm_90a,
is sm_90 with Hopper's arch-specific instructions (wgmma, setmaxnreg: the int8 prefill GEMM, q8_gemm_sm90.cu); its
cubin runs on sm_90 devices only. Any other value builds the portable kernels alone (QWEN38_CUDA_ARCH=90: the
mma.sync GEMM on the same H100/H200).

The build's summary and the torch version it compiles against go to qwen38_ops/_build_info.py:
`import qwen38_ops` refuses a _C built against another torch (C++ extensions are tied to one torch).
Install with --no-build-isolation: an isolated build environment would pull another torch.
"""
import glob
import os
import subprocess

try:
    import torch
except ImportError:  # an isolated build (pyproject.toml says why torch is not a build requirement)
    raise SystemExit("qwen38 builds its extension against the installed torch, which this build environment "
                     "does not see (pip's build isolation). Install with `make install`, or with "
                     "`python -m pip install --no-build-isolation -e .` in an environment that has torch "
                     "(README: What gets installed)") from None
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ARCH = os.environ.get("QWEN38_CUDA_ARCH", "90a")


def cuda_toolkit_problem() -> str | None:
    """Why the CUDA kernels cannot be compiled here, or None when they can."""
    if os.environ.get("QWEN38_NO_CUDA", "0") == "1":
        return "QWEN38_NO_CUDA=1"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME, or put the toolkit's nvcc on the PATH)"
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{nvcc} does not run ({e})"
    if "release" not in version:
        return f"{nvcc} --version reports no release"
    for header in ("cuda_runtime.h", "cuda_bf16.h"):
        if not os.path.isfile(os.path.join(CUDA_HOME, "include", header)):
            return f"{header} not found in {CUDA_HOME}/include (set CUDA_HOME to the CUDA toolkit)"
    return None


def extension(cuda: bool):
    sources = ["csrc/bindings.cpp"]
    if not cuda:
        return CppExtension("qwen38_ops._C", sources, extra_compile_args={"cxx": ["-O2"]})
    sources += sorted(glob.glob("csrc/kernels/*.cu")) + sorted(glob.glob("csrc/cuda_bindings/*.cpp"))
    # No --use_fast_math: the int8 lane must reproduce ggml's activation rounding, and approximate
    # exp/rsqrt/division move values across rounding boundaries (measured: 1.8e-2 vs llama.cpp's logits).
    nvcc = ["-O3", "-lineinfo", f"-gencode=arch=compute_{ARCH},code=sm_{ARCH}", "--expt-relaxed-constexpr"]
    if ARCH == "90a":  # the host code cannot see the device arch: this tells it the wgmma GEMM is compiled
        nvcc.append("-DQWEN38_WGMMA")
    return CUDAExtension("qwen38_ops._C", sources, extra_compile_args={"cxx": ["-O2"], "nvcc": nvcc})


def write_build_info(cuda: bool, summary: str) -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwen38_ops", "_build_info.py")
    with open(path, "w") as f:
        f.write("# Written by setup.py when qwen38_ops._C is built; checked by `import qwen38_ops`.\n"
                f"TORCH_VERSION = {torch.__version__!r}\nCUDA_KERNELS = {cuda!r}\nSUMMARY = {summary!r}\n")


def main() -> None:
    problem = cuda_toolkit_problem()
    if problem is None:
        summary = f"CUDA kernels for sm_{ARCH} (torch {torch.__version__}, CUDA_HOME={CUDA_HOME})"
    else:
        summary = f"CPU-only build: {problem}; every op runs its plain-PyTorch reference"
    print(f"qwen38: {summary}", flush=True)
    write_build_info(problem is None, summary)
    setup(ext_modules=[extension(problem is None)], cmdclass={"build_ext": BuildExtension})


if __name__ == "__main__":  # pip and `python setup.py` run it as __main__; tests import the probe
    main()
