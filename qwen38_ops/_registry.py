"""Registers each op's reference and its fake against the schemas of csrc/bindings.cpp."""
import torch

from . import _C  # noqa: F401  (the schemas: an op is registered against its definition)

_LIB = torch.library.Library("qwen38", "IMPL")


def _writes_outputs_only(*args, **kwargs) -> None:
    # Every qwen38 op writes into buffers it is given and returns nothing, so under FakeTensor /
    # torch.compile there is nothing to allocate or infer.
    return None


def register(name: str, reference) -> None:
    """The reference runs for every backend without a kernel of its own (CPU always; CUDA before its
    kernel exists); a CUDA kernel registered by the extension takes precedence."""
    _LIB.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"qwen38::{name}", _writes_outputs_only, lib=_LIB)
