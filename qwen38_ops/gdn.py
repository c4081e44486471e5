"""Gated DeltaNet ops: gdn_conv (conv + SiLU + q/k L2 norm), gdn_gates (beta, decay), gdn_recurrent
(delta rule on the float32 [Hv, dv, dk] state, in place). All take T >= 1 tokens: T = 1 is decode."""
from ._registry import register
from .reference import gdn as ref

for _name in ("gdn_conv", "gdn_gates", "gdn_recurrent"):
    register(_name, getattr(ref, _name))
