"""Gated full attention: per-head QK RMSNorm, partial NEOX RoPE, KV cache, causal GQA, sigmoid gate.

The caches are [max_seq, Hkv, hd], one cache the T rows of a call share (a sequence's decode step, verify or
prompt), or [B, max_seq, Hkv, hd] with B dividing T: batched rows, T / B consecutive rows a sequence with its own
cache (one row: its decode step; more: its verify). A batched call is, by definition, B calls of T / B rows, each
on its own cache."""
import torch

from .norm_quant import write_activation


def split_qgkv(qgkv, num_kv_heads: int, head_dim: int):
    """qgkv rows = [query_0 | gate_0 | query_1 | gate_1 | ... | k | v]: q_proj keeps the checkpoint's
    per-head interleave of query and gate (not two halves)."""
    num_tokens = qgkv.shape[0]
    kv_dim = num_kv_heads * head_dim
    qg = qgkv[:, : qgkv.shape[1] - 2 * kv_dim].reshape(num_tokens, -1, 2 * head_dim)
    k = qgkv[:, qgkv.shape[1] - 2 * kv_dim : qgkv.shape[1] - kv_dim].reshape(num_tokens, num_kv_heads, head_dim)
    v = qgkv[:, qgkv.shape[1] - kv_dim :].reshape(num_tokens, num_kv_heads, head_dim)
    return qg[..., :head_dim], qg[..., head_dim:], k, v


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_cos_sin(positions, rope_theta: float, rotary_dim: int, dtype):
    # Frequencies over the rotary width (not the head dim), angles formed in the compute dtype like HF.
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=dtype, device=positions.device) / rotary_dim))
    angles = positions.to(dtype)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rope(x, cos, sin, rotary_dim):
    half = rotary_dim // 2
    rot = x[..., :rotary_dim]
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, x[..., rotary_dim:]], dim=-1)


def sequence_rows(num_rows: int, caches) -> int:
    """Rows of each sequence in a batched call of num_rows rows over caches (or states) [B, ...]."""
    if caches.shape[0] < 1 or num_rows % caches.shape[0]:
        raise RuntimeError(f"batched rows: the caches' (states') B = {caches.shape[0]} must divide the {num_rows} rows "
                           "(B sequences of the same number of consecutive rows)")
    return num_rows // caches.shape[0]


def attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, eps, rope_theta, rotary_dim, q_out, k_cache,
                            v_cache, bad_position=None) -> None:
    """Rows at positions outside the cache are not stored; they set bad_position to 1 (as the kernel does): its
    one element, shared by the rows, or element t of its T, row t's own flag."""
    if k_cache.dim() == 4:
        per = sequence_rows(qgkv.shape[0], k_cache)
        for b in range(k_cache.shape[0]):
            rows = slice(b * per, (b + 1) * per)
            shared = bad_position is None or bad_position.numel() == 1
            flag = bad_position if shared else bad_position.view(-1)[rows]
            attn_qk_norm_rope_store(qgkv[rows], q_norm, k_norm, positions[rows], eps, rope_theta, rotary_dim,
                                    q_out[rows], k_cache[b], v_cache[b], flag)
        return
    dtype = q_out.dtype
    q, _, k, v = split_qgkv(qgkv.to(dtype), k_cache.shape[1], q_norm.shape[0])
    cos, sin = rope_cos_sin(positions, rope_theta, rotary_dim, dtype)
    q_out.copy_(_rope(_rms(q, q_norm, eps), cos, sin, rotary_dim))
    rows = positions.long()
    inside = (rows >= 0) & (rows < k_cache.shape[0])
    if bad_position is not None:
        outside = ~inside if bad_position.numel() > 1 else ~inside.all().reshape(1)
        bad_position.view(-1).masked_fill_(outside, 1)
    k_cache.index_copy_(0, rows[inside], _rope(_rms(k, k_norm, eps), cos, sin, rotary_dim)[inside].to(k_cache.dtype))
    v_cache.index_copy_(0, rows[inside], v[inside].to(v_cache.dtype))


# Query rows per block: a block's float64 scores [rows, Hq, L] stay near 2^24 elements (128 MB) whatever the
# prompt length; unblocked, T = 4000 held 1.7 GB of scores and took 34 s.
SCORE_ELEMENTS = 1 << 24


def attention(q, k_cache, v_cache, positions, scale, out, workspace) -> None:
    """Query t sees cache rows 0..positions[t]; the workspace only serves the CUDA kernel's split-K.
    Computed in float64 whatever the inputs, so a query's result does not depend on how many queries
    share the call (prefill vs decode) and the kernels are measured against the exact value. Queries go
    in blocks of rows (memory O(rows * H * L), not O(T^2 H)); query head h reads KV head h // (Hq / Hkv),
    without copying K and V per query head."""
    if k_cache.dim() == 4:
        per = sequence_rows(q.shape[0], k_cache)
        for b in range(k_cache.shape[0]):
            rows = slice(b * per, (b + 1) * per)
            attention(q[rows], k_cache[b], v_cache[b], positions[rows], scale, out[rows], workspace)
        return
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    length = int(positions.max()) + 1
    k = k_cache[:length].to(torch.float64)  # [L, Hkv, hd]
    v = v_cache[:length].to(torch.float64)
    rows = max(1, SCORE_ELEMENTS // (num_heads * length))
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        seen = positions[start:end].long()
        visible = int(seen.max()) + 1  # the block's queries see no row past this
        qg = q[start:end].to(torch.float64).reshape(end - start, num_kv_heads, group, head_dim)
        scores = torch.einsum("tkgd,lkd->tkgl", qg, k[:visible]) * scale
        hidden = torch.arange(visible, device=q.device)[None, :] > seen[:, None]  # [t, L]: rows past the query
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        block = torch.einsum("tkgl,lkd->tkgd", torch.softmax(scores, dim=-1), v[:visible])
        out[start:end] = block.reshape(end - start, num_heads, head_dim)


def attention_gated(q, k_cache, v_cache, positions, scale, qgkv, workspace, out, out_q=None, out_q_lo=None,
                    out_d=None) -> None:
    """attention, then attn_output_gate on its float32 output: what the CUDA kernel computes with the gate
    applied in its split-K combine."""
    attn = torch.empty(q.shape, dtype=out.dtype, device=q.device)
    attention(q, k_cache, v_cache, positions, scale, attn, workspace)
    attn_output_gate(attn, qgkv, out, out_q, out_q_lo, out_d)


def attn_output_gate(attn, qgkv, out, out_q=None, out_q_lo=None, out_d=None) -> None:
    num_tokens, num_heads, head_dim = attn.shape
    gate = qgkv[:, : 2 * num_heads * head_dim].reshape(num_tokens, num_heads, 2 * head_dim)[..., head_dim:]
    y = attn.to(out.dtype) * torch.sigmoid(gate.to(out.dtype))
    write_activation(y.reshape(out.shape), out, out_q, out_q_lo, out_d)
