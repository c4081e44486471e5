"""gdn_step: one GDN layer's decode step (T <= MAX_TOKENS tokens: a decode step or a speculative verify)
between its two projections, as one kernel: conv (+ conv state, SiLU, q/k L2 norm), gates, the delta-rule
recurrence token by token and the gated RMSNorm (+ the out projection's quantized input), reading the fused
projection's [q | k | v | z | b | a] rows. Every output is bitwise what gdn_conv, gdn_gates, gdn_recurrent
(token by token) and gated_rms_norm give on the same inputs; prompts keep running those ops (the chunked
recurrence).

Batched rows: conv_state [B, K-1, C] and state [B, Hv, dv, dk] (one leading dimension more), B dividing x's T
rows, make x's rows B sequences of T / B consecutive tokens, sequence b's on conv_state[b] and state[b]: one token
each at any B (not limited to MAX_TOKENS: B sequences' decode steps), or up to MAX_TOKENS each (their speculative
verify, token states [T, ...] in x's row order); a sequence's outputs and new states are bitwise a call of its
tokens alone on its own states."""
from ._registry import register
from .limits import GDN_STEP_MAX_TOKENS as MAX_TOKENS  # kGdnStepMaxTokens (csrc/kernels/op_limits.h)
from .reference import gdn_step as ref

register("gdn_step", ref.gdn_step)
