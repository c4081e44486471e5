"""Every qwen38 op, registered: import this module before calling torch.ops.qwen38.*. The extension _C defines
the schemas (and, in a CUDA build, registers the kernels); each family module registers its reference and
its fake."""
from . import _C  # noqa: F401
from . import attention, attention_prefill, embedding, gdn, gdn_step, norm_quant, q8_gemv, sampling  # noqa: F401
