"""Gated DeltaNet mixer: conv + gates + delta-rule recurrence, over T tokens continuing a state.

Internal value-head order is ggml's tiled one (value head h reads key head h % Hk); the HF checkpoint's
grouped order (h // r) is permuted into it at load, so one mapping serves both formats.
"""
import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # inside the sqrt of the sum of squares, as HF/FLA's l2norm


def gdn_conv(qkv, conv_state, conv_weight, num_k_heads, head_k_dim, out, token_conv_states=None) -> None:
    """token_conv_states (optional) [T, K-1, C]: the conv state after each token."""
    num_tokens = qkv.shape[0]
    taps = conv_weight.shape[1]
    dtype = out.dtype
    window = torch.cat([conv_state.to(dtype), qkv.to(dtype)], dim=0)  # [K-1+T, C], oldest first
    weight = conv_weight.to(dtype)
    y = sum(window[j : j + num_tokens] * weight[:, j] for j in range(taps))
    if token_conv_states is not None:
        for t in range(num_tokens):
            token_conv_states[t].copy_(window[t + 1 : t + taps])
    conv_state.copy_(window[num_tokens:])
    y = F.silu(y)
    qk_dim = 2 * num_k_heads * head_k_dim
    qk = y[:, :qk_dim].reshape(num_tokens, 2 * num_k_heads, head_k_dim)
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + L2_EPS)
    out.copy_(torch.cat([qk.reshape(num_tokens, qk_dim), y[:, qk_dim:]], dim=1))


def gdn_gates(ba, a_neg, dt_bias, beta, decay) -> None:
    b, a = ba.to(beta.dtype).chunk(2, dim=-1)
    beta.copy_(torch.sigmoid(b))
    decay.copy_(torch.exp(a_neg * F.softplus(a + dt_bias)))


def gdn_recurrent(qkv, beta, decay, state, out, token_states=None) -> None:
    """token_states (optional) [T, Hv, dv, dk]: the state after each token."""
    num_v_heads, dv, dk = state.shape
    num_tokens = qkv.shape[0]
    num_k_heads = (qkv.shape[1] - num_v_heads * dv) // (2 * dk)
    dtype = out.dtype
    key_head = torch.arange(num_v_heads, device=qkv.device) % num_k_heads
    x = qkv.to(dtype)
    q = x[:, : num_k_heads * dk].reshape(num_tokens, num_k_heads, dk)[:, key_head] * dk**-0.5
    k = x[:, num_k_heads * dk : 2 * num_k_heads * dk].reshape(num_tokens, num_k_heads, dk)[:, key_head]
    v = x[:, 2 * num_k_heads * dk :].reshape(num_tokens, num_v_heads, dv)
    s = state.to(dtype)  # [Hv, dv, dk]
    o = torch.empty(num_tokens, num_v_heads, dv, dtype=dtype, device=qkv.device)
    for t in range(num_tokens):
        s = s * decay[t].to(dtype)[:, None, None]
        kv = (s @ k[t, :, :, None]).squeeze(-1)
        delta = beta[t].to(dtype)[:, None] * (v[t] - kv)
        s = s + delta[:, :, None] * k[t, :, None, :]
        o[t] = (s @ q[t, :, :, None]).squeeze(-1)
        if token_states is not None:
            token_states[t].copy_(s)
    state.copy_(s)
    out.copy_(o)
