"""gdn_step: one GDN layer's decode step (T <= MAX_TOKENS tokens: a decode step or a speculative verify)
between its two projections, as one kernel: conv (+ conv state, SiLU, q/k L2 norm), gates, the delta-rule
recurrence token by token and the gated RMSNorm (+ the out projection's quantized input), reading the fused
projection's [q | k | v | z | b | a] rows. Every output is bitwise what gdn_conv, gdn_gates, gdn_recurrent
(token by token) and gated_rms_norm give on the same inputs; prompts keep running those ops (the chunked
recurrence).

Batched rows: conv_state [T, K-1, C] and state [T, Hv, dv, dk] (one leading dimension more) make x's T rows T
sequences of one token each, row t on conv_state[t] and state[t], any T >= 1 (not limited to MAX_TOKENS), no
token_conv_states / token_states; row t's outputs and new states are bitwise a one-row call's on its own states."""
from ._registry import register
from .limits import GDN_STEP_MAX_TOKENS as MAX_TOKENS  # kGdnStepMaxTokens (csrc/kernels/op_limits.h)
from .reference import gdn_step as ref

register("gdn_step", ref.gdn_step)
