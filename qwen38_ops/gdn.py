"""Gated DeltaNet ops: gdn_conv (conv + SiLU + q/k L2 norm), gdn_gates (beta, decay), gdn_recurrent
(delta rule on the float32 [Hv, dv, dk] state, in place). All take T >= 1 tokens: T = 1 is decode.
gdn_conv and gdn_recurrent optionally also write the state after each token (token_conv_states
[T, K-1, C], token_states [T, Hv, dv, dk]), for speculative decoding's verify: the state passed in is the
initial one and receives the final one, as without them."""
from ._registry import register
from .reference import gdn as ref

for _name in ("gdn_conv", "gdn_gates", "gdn_recurrent"):
    register(_name, getattr(ref, _name))
