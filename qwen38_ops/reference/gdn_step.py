"""gdn_step: a GDN layer's decode step between its two projections, composed from the references of the
ops it fuses (gdn_conv -> gdn_gates -> gdn_recurrent -> gated_rms_norm), which define it.

Batched rows: with conv_state [B, K-1, C] and state [B, Hv, dv, dk] (one leading dimension more), B dividing x's
T rows, x's rows are B sequences of T / B consecutive tokens, sequence b's on conv_state[b] and state[b] (its
token states, when kept, at its rows of token_conv_states / token_states [T, ...]): by definition B calls of T / B
rows."""
import torch

from .attention import sequence_rows
from .gdn import gdn_conv, gdn_gates, gdn_recurrent
from .norm_quant import gated_rms_norm


def gdn_step(x, conv_weight, a_neg, dt_bias, norm_weight, eps, conv_state, state, out, out_q=None, out_q_lo=None,
             out_d=None, token_conv_states=None, token_states=None) -> None:
    """x [T, C + Hv*dv + 2*Hv] = [q | k | v | z | b | a]; sizes from conv_weight [C, K] and state [Hv, dv, dk]
    (or [B, Hv, dv, dk]: batched rows)."""
    if state.dim() == 4:
        per = sequence_rows(x.shape[0], state)
        for b in range(state.shape[0]):
            rows = slice(b * per, (b + 1) * per)
            gdn_step(x[rows], conv_weight, a_neg, dt_bias, norm_weight, eps, conv_state[b], state[b], out[rows],
                     *(o if o is None else o[rows] for o in (out_q, out_q_lo, out_d, token_conv_states, token_states)))
        return
    num_v_heads, dv, dk = state.shape
    channels = conv_weight.shape[0]
    num_k_heads = (channels - num_v_heads * dv) // (2 * dk)
    z_end = channels + num_v_heads * dv
    rows, dtype = x.shape[0], out.dtype
    conv = torch.empty(rows, channels, dtype=dtype, device=x.device)
    gdn_conv(x[:, :channels], conv_state, conv_weight, num_k_heads, dk, conv, token_conv_states)
    beta = torch.empty(rows, num_v_heads, dtype=dtype, device=x.device)
    decay = torch.empty_like(beta)
    gdn_gates(x[:, z_end:], a_neg, dt_bias, beta, decay)
    core = torch.empty(rows, num_v_heads, dv, dtype=dtype, device=x.device)
    gdn_recurrent(conv, beta, decay, state, core, token_states)
    gated_rms_norm(core.view(rows, -1), x[:, channels:z_end], norm_weight, eps, out, out_q, out_q_lo, out_d)
