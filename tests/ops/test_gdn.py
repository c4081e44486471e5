"""gdn family: gdn_conv, gdn_gates, gdn_recurrent.

CPU (CI): opcheck of every op, each reference against an independent formula (conv1d, the closed form of
the delta rule on HF's [dk, dv] state layout), the per-token states of the references against single-token
calls, and the chunk form the prefill kernel computes, in float32, against the reference. CUDA (-m cuda):
every kernel against the reference in float64, on random inputs, outputs poisoned first, at odd sizes and
the 27B shapes; gdn_recurrent's chunked prefill paths (T >= its threshold, csrc/cuda_bindings/gdn.cpp: the
tensor-core kernel at dk = 128 from 32 tokens, the float32 one elsewhere, QWEN38_GDN_PREFILL=fp32|mma forcing one;
the tensor-core kernel at each block size of QWEN38_GDN_MMA_ROWS) at rel L2 <= 1e-5
with gates at their edges; per-token states (speculative verify) and T <= 7 without them bit
for bit equal to T calls of one token; gdn_gates past 2^31 elements; two runs give the same bits; a captured
graph replays bit for bit like eager; bad arguments raise.
"""
import pytest
import torch
import torch.nn.functional as F

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import gdn as ref

from cuda_helpers import (TORCH_ERROR_CONTROL, assert_cuda_kernel, capture_graph, child_env, cuda,
                          progress, rows_view, run_in_child)
from numerics import rel_l2

ops = torch.ops.qwen38

# (num_k_heads, num_v_heads, head_k_dim, head_v_dim): the oracle, the 27B model, Hv/Hk = 2, odd dims.
SHAPE_ORACLE = (2, 6, 32, 32)
SHAPE_27B = (16, 48, 128, 128)
SHAPES = [SHAPE_ORACLE, SHAPE_27B, (4, 8, 64, 64), (2, 4, 48, 48), (3, 6, 64, 40), (2, 4, 100, 36),
          (1, 3, 30, 30), (2, 2, 200, 24), (2, 4, 256, 64)]


def channels(hk, hv, dk, dv):
    return 2 * hk * dk + hv * dv


def make_conv_inputs(T, hk, hv, dk, dv, taps=4, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = channels(hk, hv, dk, dv)
    qkv = torch.randn(T, C, generator=g, dtype=torch.float64)
    state = torch.randn(taps - 1, C, generator=g, dtype=torch.float64)
    weight = torch.randn(C, taps, generator=g, dtype=torch.float64) * 0.5
    return [x.to(device=device, dtype=dtype) for x in (qkv, state, weight)]


def make_recurrent_inputs(T, hk, hv, dk, dv, device="cpu", dtype=torch.float32, seed=0, gates="uniform"):
    """qkv as gdn_conv leaves it (q, k heads of unit norm), gates in their ranges, a random state.
    gates="edge": each decay one of exactly 0, ~1e-30, ~1e-3, uniform in (0, 1), 1 - ~1e-7, exactly 1, and
    each beta one of ~1e-7, uniform, 1 - ~1e-7, exactly 1 (where cumulative decay products underflow, and
    where the delta rule forgets or overwrites completely). gates="collinear": those gates, and each key
    head's k within ~1e-3 of one direction (k_i.k_j ~ 1: the chunk form's substitution at its hardest)."""
    g = torch.Generator().manual_seed(seed)
    qk = F.normalize(torch.randn(T, 2 * hk, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(T, hv * dv, generator=g, dtype=torch.float64)
    qkv = torch.cat([qk.reshape(T, -1), v], dim=1)
    beta = torch.rand(T, hv, generator=g, dtype=torch.float64)
    decay = 0.5 + 0.5 * torch.rand(T, hv, generator=g, dtype=torch.float64)
    state = torch.randn(hv, dv, dk, generator=g, dtype=torch.float64) * 0.5
    if gates == "collinear":
        direction = torch.randn(hk, dk, generator=g, dtype=torch.float64)
        k = F.normalize(direction + 1e-3 * torch.randn(T, hk, dk, generator=g, dtype=torch.float64), dim=-1)
        qkv[:, hk * dk : 2 * hk * dk] = k.reshape(T, -1)
    if gates in ("edge", "collinear"):
        u = torch.rand(T, hv, generator=g, dtype=torch.float64)
        decays = torch.stack([0 * u, 1e-30 * u, 1e-3 * u, u, 1 - 1e-7 * u, 1 + 0 * u])
        decay = decays.gather(0, torch.randint(0, 6, (1, T, hv), generator=g))[0]
        betas = torch.stack([1e-7 * u, beta, 1 - 1e-7 * u, 1 + 0 * u])
        beta = betas.gather(0, torch.randint(0, 4, (1, T, hv), generator=g))[0]
    return [x.to(device=device, dtype=dtype) for x in (qkv, beta, decay, state)]


def make_gate_inputs(T, hv, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ba = torch.randn(T, 2 * hv, generator=g, dtype=torch.float64) * 4
    ba[0, hv] = 30.0  # a + dt_bias > 20: softplus's linear branch
    a_neg = -torch.exp(torch.randn(hv, generator=g, dtype=torch.float64) - 2)
    dt_bias = torch.randn(hv, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (ba, a_neg, dt_bias)]


# ---------------------------------------------------------------------------------------------------
# CPU: opcheck and the references against independent formulas.

def test_opcheck_cpu():
    hk, hv, dk, dv = SHAPE_ORACLE
    T = 3
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv)
    torch.library.opcheck(ops.gdn_conv.default, (qkv, state, weight, hk, dk, torch.empty_like(qkv)))
    ba, a_neg, dt_bias = make_gate_inputs(T, hv)
    torch.library.opcheck(ops.gdn_gates.default, (ba, a_neg, dt_bias, torch.empty(T, hv), torch.empty(T, hv)))
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv)
    torch.library.opcheck(ops.gdn_recurrent.default, (qkv, beta, decay, state, torch.empty(T, hv, dv)))


def test_opcheck_cpu_token_states():
    hk, hv, dk, dv = SHAPE_ORACLE
    T = 3
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv)
    torch.library.opcheck(ops.gdn_conv.default, (qkv, state, weight, hk, dk, torch.empty_like(qkv),
                                                 torch.empty(T, *state.shape)))
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv)
    torch.library.opcheck(ops.gdn_recurrent.default, (qkv, beta, decay, state, torch.empty(T, hv, dv),
                                                      torch.empty(T, *state.shape)))


@pytest.mark.parametrize("T", [1, 2, 6])
def test_conv_reference_vs_conv1d(T):
    hk, hv, dk, dv = SHAPE_ORACLE
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv, dtype=torch.float64)
    out = torch.empty_like(qkv)
    new_state = state.clone()
    ref.gdn_conv(qkv, new_state, weight, hk, dk, out)
    # torch's depthwise conv1d over [state | qkv] (cross-correlation: the last tap meets the newest input)
    x = torch.cat([state, qkv]).T[None]  # [1, C, K-1+T]
    y = F.silu(F.conv1d(x, weight[:, None, :], groups=qkv.shape[1])[0].T)  # [T, C]
    qk = y[:, : 2 * hk * dk].reshape(T, 2 * hk, dk)
    qk = qk / torch.sqrt((qk**2).sum(-1, keepdim=True) + 1e-6)
    expected = torch.cat([qk.reshape(T, -1), y[:, 2 * hk * dk :]], dim=1)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_state, torch.cat([state, qkv])[-(weight.shape[1] - 1) :], rtol=0, atol=0)


def test_gates_reference_vs_formula():
    ba, a_neg, dt_bias = make_gate_inputs(5, 6, dtype=torch.float64)
    beta, decay = torch.empty(5, 6, dtype=torch.float64), torch.empty(5, 6, dtype=torch.float64)
    ref.gdn_gates(ba, a_neg, dt_bias, beta, decay)
    b, a = ba[:, :6], ba[:, 6:]
    x = a + dt_bias
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(beta, 1 / (1 + torch.exp(-b)), rtol=1e-14, atol=0)
    torch.testing.assert_close(decay, torch.exp(a_neg * softplus), rtol=1e-14, atol=0)


@pytest.mark.parametrize("shape", [SHAPE_ORACLE, (4, 8, 16, 24)])
def test_recurrent_reference_vs_closed_form(shape):
    """Closed form S_t = a (I - b k k^T) S + b k v^T on HF's [dk, dv] state, o = S^T q / sqrt(dk), with the
    value head h reading key head h % Hk (ggml's tiled order, the internal one)."""
    hk, hv, dk, dv = shape
    T = 4
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, dtype=torch.float64)
    out = torch.empty(T, hv, dv, dtype=torch.float64)
    new_state = state.clone()
    ref.gdn_recurrent(qkv, beta, decay, new_state, out)
    q = qkv[:, : hk * dk].reshape(T, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].reshape(T, hk, dk)
    v = qkv[:, 2 * hk * dk :].reshape(T, hv, dv)
    eye = torch.eye(dk, dtype=torch.float64)
    for h in range(hv):
        s = state[h].T.clone()  # [dk, dv]
        kh = h % hk
        for t in range(T):
            kk = k[t, kh][:, None]
            s = decay[t, h] * (eye - beta[t, h] * kk @ kk.T) @ s + beta[t, h] * kk @ v[t, h][None]
            torch.testing.assert_close(out[t, h], s.T @ q[t, kh] / dk**0.5, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(new_state[h], s.T, rtol=1e-12, atol=1e-12)


def conv_steps(qkv, conv_state, weight, hk, dk):
    """T calls of gdn_conv with one token each (plain decode), from conv_state (not modified): returns
    (out [T, C], the conv state after each token [T, K-1, C]), each output poisoned before its call."""
    state = conv_state.clone()
    outs = torch.full_like(qkv, float("nan"))
    states = torch.full((qkv.shape[0], *state.shape), float("nan"), dtype=state.dtype, device=state.device)
    for t in range(qkv.shape[0]):
        ops.gdn_conv(qkv[t : t + 1], state, weight, hk, dk, outs[t : t + 1])
        states[t] = state
    return outs, states


def recurrent_steps(qkv, beta, decay, state):
    """T calls of gdn_recurrent with one token each (plain decode; qkv rows sliced from the same tensor, so
    the same alignment), from state (not modified): returns (out [T, Hv, dv], the state after each token
    [T, Hv, dv, dk]), each output poisoned before its call."""
    s = state.clone()
    hv, dv, _ = state.shape
    outs = torch.full((qkv.shape[0], hv, dv), float("nan"), dtype=state.dtype, device=state.device)
    states = torch.full((qkv.shape[0], *state.shape), float("nan"), dtype=state.dtype, device=state.device)
    for t in range(qkv.shape[0]):
        ops.gdn_recurrent(qkv[t : t + 1], beta[t : t + 1], decay[t : t + 1], s, outs[t : t + 1])
        states[t] = s
    return outs, states


@pytest.mark.parametrize("T,taps", [(1, 4), (5, 4), (4, 2), (6, 3)])
def test_conv_reference_token_states(T, taps):
    """token_conv_states[t] is the last K-1 inputs after token t, i.e. what t+1 single-token calls leave in
    conv_state; the outputs and the final state are those of the call without it."""
    hk, hv, dk, dv = SHAPE_ORACLE
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv, taps=taps, seed=T)
    out, new_state = torch.full_like(qkv, float("nan")), state.clone()
    token_states = torch.full((T, taps - 1, qkv.shape[1]), float("nan"))
    ops.gdn_conv(qkv, new_state, weight, hk, dk, out, token_states)
    window = torch.cat([state, qkv])
    for t in range(T):
        assert torch.equal(token_states[t], window[t + 1 : t + taps])
    step_out, step_states = conv_steps(qkv, state, weight, hk, dk)
    assert torch.equal(token_states, step_states) and torch.equal(new_state, token_states[-1])
    plain_out, plain_state = torch.full_like(qkv, float("nan")), state.clone()
    ops.gdn_conv(qkv, plain_state, weight, hk, dk, plain_out)
    assert torch.equal(out, plain_out) and torch.equal(new_state, plain_state)
    torch.testing.assert_close(step_out, out, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [SHAPE_ORACLE, (3, 7, 32, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_recurrent_reference_token_states(shape, dtype):
    """token_states[t] equals the state t+1 single-token calls leave (bit for bit: the reference runs the
    same per-token operations either way), token_states[T-1] the final state; out and the final state are
    those of the call without token_states."""
    hk, hv, dk, dv = shape
    T = 5
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, dtype=dtype, seed=7, gates="edge")
    out = torch.full((T, hv, dv), float("nan"), dtype=dtype)
    new_state = state.clone()
    token_states = torch.full((T, hv, dv, dk), float("nan"), dtype=dtype)
    ops.gdn_recurrent(qkv, beta, decay, new_state, out, token_states)
    step_out, step_states = recurrent_steps(qkv, beta, decay, state)
    assert torch.equal(token_states, step_states) and torch.equal(out, step_out)
    assert torch.equal(new_state, token_states[-1])
    plain_out, plain_state = torch.full_like(out, float("nan")), state.clone()
    ops.gdn_recurrent(qkv, beta, decay, plain_state, plain_out)
    assert torch.equal(out, plain_out) and torch.equal(new_state, plain_state)


def chunked_delta_rule(qkv, beta, decay, state, chunk=16):
    """The chunk form csrc/kernels/gdn_prefill.cu computes, in the inputs' dtype, vectorized over heads and
    state rows. Per chunk, from the state S0 it starts from (G_ij = g_{j+1} ... g_i, gamma_i = g_0 ... g_i):
    x_i = S0[a].k_i, y_i = S0[a].q_i; delta_i = beta_i (v_i - gamma_i x_i) - sum_{j<i} L_ij delta_j with
    L_ij = beta_i G_ij k_i.k_j; o_i = gamma_i y_i + sum_{j<=i} G_ij (q_i.k_j) delta_j; S = gamma_{n-1} S0 +
    sum_j G_{n-1,j} delta_j k_j. Tokens past T pad the last chunk with beta = 0, decay = 1, zero q, k, v.
    Returns (out [T, Hv, dv], new state)."""
    hv, dv, dk = state.shape
    T = qkv.shape[0]
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    key_head = torch.arange(hv) % hk
    dtype, n = state.dtype, chunk
    pad = -T % n
    x = torch.cat([qkv, qkv.new_zeros(pad, qkv.shape[1])])
    q = x[:, : hk * dk].reshape(-1, n, hk, dk)[:, :, key_head].transpose(1, 2)  # [chunks, Hv, n, dk]
    k = x[:, hk * dk : 2 * hk * dk].reshape(-1, n, hk, dk)[:, :, key_head].transpose(1, 2)
    v = x[:, 2 * hk * dk :].reshape(-1, n, hv, dv).transpose(1, 2)  # [chunks, Hv, n, dv]
    b = torch.cat([beta, beta.new_zeros(pad, hv)]).reshape(-1, n, hv).transpose(1, 2)  # [chunks, Hv, n]
    g = torch.cat([decay, decay.new_ones(pad, hv)]).reshape(-1, n, hv).transpose(1, 2)
    s, outs = state.clone(), []
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool))
    for c in range(q.shape[0]):
        gc = g[c]
        G = torch.zeros(hv, n, n, dtype=dtype)  # G[:, i, j] = g_{j+1} ... g_i for j <= i
        for j in range(n):
            G[:, j, j] = 1
            for i in range(j + 1, n):
                G[:, i, j] = G[:, i - 1, j] * gc[:, i]
        gamma = gc[:, :1] * G[:, :, 0]
        L = b[c][:, :, None] * G * (k[c] @ k[c].transpose(1, 2)) * torch.tril(lower, -1)
        M = G * (q[c] @ k[c].transpose(1, 2)) * lower
        xs, ys = s @ k[c].transpose(1, 2), s @ q[c].transpose(1, 2)  # [Hv, dv, n]
        delta = b[c][:, None] * (v[c].transpose(1, 2) - gamma[:, None] * xs)
        for i in range(1, n):
            delta[:, :, i] -= (delta[:, :, :i] * L[:, None, i, :i]).sum(-1)
        outs.append((gamma[:, None] * ys + delta @ M.transpose(1, 2)) * dk**-0.5)  # [Hv, dv, n]
        s = gamma[:, -1, None, None] * s + (delta * G[:, None, -1]) @ k[c]
    return torch.cat(outs, dim=2).permute(2, 0, 1)[:T], s


@pytest.mark.parametrize("shape", [SHAPE_ORACLE, (3, 7, 32, 20)])
@pytest.mark.parametrize("gates", ["uniform", "edge", "collinear"])
@pytest.mark.parametrize("T", [1, 2, 17, 63, 64, 65, 130])
def test_chunk_form_float32_vs_reference(shape, gates, T):
    """The prefill kernel's algorithm in float32 is as close to the float64 reference as float32 token by
    token is (both ~1e-7 rel L2 here, ~2e-7 at T = 4096 and dk = 128): bar 1e-6. Partial last chunks, value
    heads not a multiple of the key heads, decays at 0 and 1 (no 0/0 from underflowed products), nearly
    collinear keys."""
    hk, hv, dk, dv = shape
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, seed=T, gates=gates)
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = chunked_delta_rule(qkv, beta, decay, state)
    assert rel_l2(out, exp_out) <= 1e-6 and rel_l2(new_state, exp_state) <= 1e-6, (rel_l2(out, exp_out),
                                                                                    rel_l2(new_state, exp_state))


def tf32(x):
    """cvt.rna.tf32.f32: float32 to 10 mantissa bits, ties away from zero (on the sign-magnitude bits)."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def mma_accumulate(acc, a, b, group=4):
    """acc + a @ b on a truncating model of the tensor core's float32 sums: per `group` products (exact, of
    TF32 operands), every term, the accumulator too, truncated to 24 bits below the largest one's leading bit,
    the exact sum truncated to float32. Coarser than the hardware (which aligns 8 products of an m16n8k8 at
    once): an upper estimate of its error."""
    for k0 in range(0, a.shape[-1], group):
        p = a[..., :, k0 : k0 + group, None].double() * b[..., None, k0 : k0 + group, :].double()
        terms = torch.cat([acc.double()[..., :, None, :], p], dim=-2)
        _, exponent = torch.frexp(terms.abs().amax(dim=-2, keepdim=True))
        quantum = torch.ldexp(torch.ones_like(terms[..., :1, :]), exponent - 24)
        total = (torch.trunc(terms / quantum) * quantum).sum(dim=-2)
        nearest = total.float()
        acc = torch.where(nearest.double().abs() > total.abs(), torch.nextafter(nearest, torch.zeros_like(nearest)),
                          nearest)
    return acc


def mm_3xtf32(a, b):
    """a @ b as gdn_chunk_mma.cu computes it: x = hi + lo (hi = tf32(x), lo = tf32(x - hi)), per k-step of 8
    lo*hi, hi*lo, hi*hi into one float32 accumulator."""
    a, b = a.float(), b.float()
    a_hi, b_hi = tf32(a), tf32(b)
    a_lo, b_lo = tf32(a - a_hi), tf32(b - b_hi)
    shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = torch.zeros(shape)
    for k0 in range(0, a.shape[-1], 8):
        k = slice(k0, k0 + 8)
        for x, y in ((a_lo, b_hi), (a_hi, b_lo), (a_hi, b_hi)):
            acc = mma_accumulate(acc, x[..., k], y[..., k, :])
    return acc


def fma32(a, b, c):
    return (a.double() * b.double() + c.double()).float()


def mma_chunked_delta_rule(qkv, beta, decay, state, chunk=32):
    """The algorithm of csrc/kernels/gdn_chunk_mma.cu in its precision scheme, vectorized over value heads:
    per chunk, G, gamma and the tail by float32 products in the kernel's order; K K^T, Q K^T, X = K S^T,
    Y = Q S^T, D = T R, M D and the update D^T diag(tail) K by mm_3xtf32; L, M, R elementwise in float32;
    T = (I + L)^-1 by the kernel's right-looking substitution (float32 FMAs); O and S by float32 FMAs onto
    the products. Tokens past T pad the last chunk with beta = 0, decay = 1, zero q, k, v. Returns (out, state)."""
    hv, dv, dk = state.shape
    T, n = qkv.shape[0], chunk
    hk = (qkv.shape[1] - hv * dv) // (2 * dk)
    key_head = torch.arange(hv) % hk
    pad = -T % n
    x = torch.cat([qkv, qkv.new_zeros(pad, qkv.shape[1])])
    q = x[:, : hk * dk].reshape(-1, n, hk, dk)[:, :, key_head].transpose(1, 2)  # [chunks, Hv, n, dk]
    k = x[:, hk * dk : 2 * hk * dk].reshape(-1, n, hk, dk)[:, :, key_head].transpose(1, 2)
    v = x[:, 2 * hk * dk :].reshape(-1, n, hv, dv).transpose(1, 2)  # [chunks, Hv, n, dv]
    b = torch.cat([beta, beta.new_zeros(pad, hv)]).reshape(-1, n, hv).transpose(1, 2)  # [chunks, Hv, n]
    g = torch.cat([decay, decay.new_ones(pad, hv)]).reshape(-1, n, hv).transpose(1, 2)
    q_scale = 1.0 / torch.tensor(float(dk)).sqrt()
    strictly_lower = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
    s, outs = state.clone(), []
    for c in range(q.shape[0]):
        G = torch.zeros(hv, n, n)  # G[:, i, j] = g_{j+1} ... g_i, multiplied in that order
        for j in range(n):
            G[:, j, j] = 1
            for i in range(j + 1, n):
                G[:, i, j] = G[:, i - 1, j] * g[c][:, i]
        gamma, product = torch.empty(hv, n), torch.ones(hv)  # g_0 ... g_i, float32 products from g_0 on
        for i in range(n):
            product = product * g[c][:, i]
            gamma[:, i] = product
        tail = G[:, -1, :]
        kt = k[c].transpose(1, 2)
        L = torch.where(strictly_lower, b[c][:, :, None] * G * mm_3xtf32(k[c], kt), 0.0)
        M = G * mm_3xtf32(q[c], kt)
        Tm, partial = torch.zeros(hv, n, n), torch.zeros(hv, n, n)  # T = (I + L)^-1, columns in parallel
        for step in range(n):
            Tm[:, step] = torch.eye(n)[step] - partial[:, step]
            partial[:, step + 1 :] = fma32(L[:, step + 1 :, step, None], Tm[:, step, None, :], partial[:, step + 1 :])
        st = s.transpose(1, 2)
        xs, ys = mm_3xtf32(k[c], st), mm_3xtf32(q[c], st)  # [Hv, n, dv]
        R = b[c][:, :, None] * fma32(-gamma[:, :, None].expand_as(xs), xs, v[c])
        D = mm_3xtf32(Tm, R)
        outs.append(fma32(gamma[:, :, None].expand_as(ys), ys, mm_3xtf32(M, D)) * q_scale)
        update = mm_3xtf32((D * tail[:, :, None]).transpose(1, 2), k[c])
        s = fma32(gamma[:, -1, None, None].expand_as(s), s, update)
    return torch.cat(outs, dim=1).transpose(0, 1)[:T], s


@pytest.mark.parametrize("gates", ["uniform", "edge", "collinear"])
@pytest.mark.parametrize("T", [8, 33, 100])
def test_mma_chunk_form_vs_reference(gates, T):
    """gdn_chunk_mma.cu's algorithm in its precision scheme (3xTF32 on a pessimistic model of the tensor core's
    sums) against the float64 reference at dk = 128 (the kernel's head), 2 chunks of 32 and a partial one, edge
    and nearly collinear gates: rel L2 <= 3e-6 (measured ~1.4e-6 at worst, collinear, also at T = 4096 with the
    27B head, by the same emulation in float64; with exact float32 products 7e-8: the split's error dominates,
    K K^T's most). The CUDA tests hold the kernel to 1e-5."""
    hk, hv, dk, dv = 1, 3, 128, 32
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, seed=T, gates=gates)
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = mma_chunked_delta_rule(qkv, beta, decay, state)
    errors = rel_l2(out, exp_out), rel_l2(new_state, exp_state)
    assert max(errors) <= 3e-6, errors


# ---------------------------------------------------------------------------------------------------
# CUDA: kernels against the float64 reference.


def run_conv_cuda(qkv, state, weight, hk, dk, out=None):
    state = state.clone()
    out = torch.full_like(qkv, float("nan")) if out is None else out.fill_(float("nan"))
    ops.gdn_conv(qkv, state, weight, hk, dk, out)
    return out, state


@cuda
@pytest.mark.parametrize("shape", SHAPES[:6])
@pytest.mark.parametrize("T,taps", [(1, 4), (2, 4), (7, 4), (3, 3), (1, 2)])
def test_conv_cuda_matches_reference(shape, T, taps):
    """Error bound: 2e-6 absolute + 2e-6 relative (outputs are O(1); float32 conv, fast-math SiLU, L2 norm)."""
    assert_cuda_kernel("gdn_conv")
    hk, hv, dk, dv = shape
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv, taps=taps, seed=T + taps)
    exp_out, exp_state = torch.empty_like(qkv, dtype=torch.float64), state.double()
    ref.gdn_conv(qkv.double(), exp_state, weight.double(), hk, dk, exp_out)
    out, new_state = run_conv_cuda(qkv.cuda(), state.cuda(), weight.cuda(), hk, dk)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(new_state.cpu().double(), exp_state, rtol=0, atol=0)


@cuda
def test_conv_cuda_strided_rows():
    """qkv and out as slices of wider projections (row stride != C, misaligned)."""
    hk, hv, dk, dv = SHAPE_ORACLE
    qkv, state, weight = make_conv_inputs(5, hk, hv, dk, dv, seed=11)
    exp_out, exp_state = torch.empty_like(qkv, dtype=torch.float64), state.double()
    ref.gdn_conv(qkv.double(), exp_state, weight.double(), hk, dk, exp_out)
    out = rows_view(torch.empty_like(qkv).cuda(), pad=1)
    out, new_state = run_conv_cuda(rows_view(qkv.cuda()), state.cuda(), weight.cuda(), hk, dk, out=out)
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(new_state.cpu().double(), exp_state, rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("T,hv", [(1, 48), (5, 6), (3, 33)])
def test_gates_cuda_matches_reference(T, hv):
    """Error bound: 2e-6 relative (fast exp/log1p in float32)."""
    assert_cuda_kernel("gdn_gates")
    ba, a_neg, dt_bias = make_gate_inputs(T, hv, seed=T)
    exp_beta, exp_decay = torch.empty(T, hv, dtype=torch.float64), torch.empty(T, hv, dtype=torch.float64)
    ref.gdn_gates(ba.double(), a_neg.double(), dt_bias.double(), exp_beta, exp_decay)
    beta = torch.full((T, hv), float("nan"), device="cuda")
    decay = torch.full((T, hv), float("nan"), device="cuda")
    ops.gdn_gates(rows_view(ba.cuda()), a_neg.cuda(), dt_bias.cuda(), beta, decay)
    torch.testing.assert_close(beta.cpu().double(), exp_beta, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(decay.cpu().double(), exp_decay, rtol=2e-6, atol=1e-7)


@cuda
def test_gates_cuda_past_2_31_elements():
    """T * Hv > 2^31 (T = 44.7M tokens at Hv = 48; ba 17 GB, beta and decay 8.6 GB each): every element
    written (NaN-poisoned first) and the rows around element 2^31 and the last rows equal the reference's
    (a 32-bit index wraps there: the kernel wrote nothing at all)."""
    hv = 48
    T = 2**31 // hv + 5
    small_ba, a_neg, dt_bias = [x.cuda() for x in make_gate_inputs(64, hv, seed=12)]
    ba = small_ba.repeat(T // 64 + 1, 1)[:T]  # [T, 2*Hv]: row r is small_ba's row r % 64
    beta = torch.full((T, hv), float("nan"), device="cuda")
    decay = torch.full((T, hv), float("nan"), device="cuda")
    ops.gdn_gates(ba, a_neg, dt_bias, beta, decay)
    assert not beta.isnan().any() and not decay.isnan().any()
    for first in (2**31 // hv - 2, T - 3):
        rows = slice(first, first + 3)
        exp_beta, exp_decay = torch.empty(3, hv, device="cuda"), torch.empty(3, hv, device="cuda")
        ref.gdn_gates(ba[rows], a_neg, dt_bias, exp_beta, exp_decay)
        torch.testing.assert_close(beta[rows], exp_beta, rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(decay[rows], exp_decay, rtol=2e-6, atol=1e-7)


def run_recurrent_cuda(qkv, beta, decay, state):
    state = state.clone()
    hv, dv, _ = state.shape
    out = torch.full((qkv.shape[0], hv, dv), float("nan"), device=qkv.device)
    ops.gdn_recurrent(qkv, beta, decay, state, out)
    return out, state


def recurrent_expected(qkv, beta, decay, state):
    """The reference in float64, on the inputs' device (the GPU makes T = 4096 at the 27B shape a second)."""
    hv, dv, _ = state.shape
    out = torch.empty(qkv.shape[0], hv, dv, dtype=torch.float64, device=qkv.device)
    new_state = state.double()
    ref.gdn_recurrent(qkv.double(), beta.double(), decay.double(), new_state, out)
    return out, new_state


@cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 4])
def test_recurrent_cuda_matches_reference(shape, T):
    """Error bound: 2e-5 absolute on out and state (|S| ~ 1, unit-norm q and k, float32 dot products
    over dk <= 256, T <= 4 steps)."""
    assert_cuda_kernel("gdn_recurrent")
    hk, hv, dk, dv = shape
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, seed=dk + T)
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = run_recurrent_cuda(qkv.cuda(), beta.cuda(), decay.cuda(), state.cuda())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(new_state.cpu().double(), exp_state, rtol=0, atol=2e-5)


@cuda
def test_recurrent_cuda_long_prefill_and_scalar_path():
    """T = 64 tokens in one launch, and a misaligned qkv (the kernel's 4-byte-load path)."""
    hk, hv, dk, dv = SHAPE_ORACLE
    qkv, beta, decay, state = make_recurrent_inputs(64, hk, hv, dk, dv, seed=5)
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    for x in (qkv.cuda(), rows_view(qkv.cuda())):
        out, new_state = run_recurrent_cuda(x, beta.cuda(), decay.cuda(), state.cuda())
        torch.testing.assert_close(out.cpu().double(), exp_out, rtol=0, atol=5e-5)
        torch.testing.assert_close(new_state.cpu().double(), exp_state, rtol=0, atol=5e-5)


def padded(t, pad=64):
    """t's values in the middle of a NaN-filled buffer, pad elements either side (alignment kept): returns
    (view, buffer). A kernel reading outside t shows as NaN in its results, writing outside it as padding
    that is no longer NaN."""
    buf = torch.full((t.numel() + 2 * pad,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[pad : pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def aligned_rows_view(x, pad=4):
    """x's values as rows of a wider NaN-filled buffer whose rows start 16-byte aligned (the chunked kernel's
    vector copies need that; rows_view's misaligned rows run token by token)."""
    stride = (x.shape[1] + 3) // 4 * 4 + 2 * pad
    wide = torch.full((x.shape[0], stride), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, pad : pad + x.shape[1]] = x
    return wide[:, pad : pad + x.shape[1]]


def run_recurrent_padded(qkv, beta, decay, state):
    """gdn_recurrent with qkv as aligned rows of a NaN-padded buffer and the state and out (out poisoned with
    NaN) inside NaN-padded buffers; asserts the padding is untouched. Returns (out, new state)."""
    hv, dv, _ = state.shape
    new_state, state_buf = padded(state)
    out, out_buf = padded(torch.full((qkv.shape[0], hv, dv), float("nan"), device=qkv.device))
    ops.gdn_recurrent(aligned_rows_view(qkv), beta, decay, new_state, out)
    pad = (state_buf.numel() - state.numel()) // 2
    for buf in (state_buf, out_buf):
        assert buf[:pad].isnan().all() and buf[-pad:].isnan().all(), "a write outside the state or out"
    return out, new_state


def assert_float32_error(out, new_state, exp_out, exp_state, bar=1e-5):
    """rel L2 <= bar for out, for out of each value head, and for the final state (float32 error: ~2e-7
    expected from the float32 emulation of the chunk form, as token by token)."""
    assert torch.isfinite(out).all() and torch.isfinite(new_state).all()
    err = (out.double() - exp_out.to(out.device)).norm(dim=(0, 2)) / exp_out.to(out.device).norm(dim=(0, 2))
    errors = dict(out=rel_l2(out, exp_out.to(out.device)), worst_head=err.max().item(),
                  state=rel_l2(new_state, exp_state.to(new_state.device)))
    assert max(errors.values()) <= bar, errors


@cuda
@pytest.mark.parametrize("gates", ["uniform", "edge", "collinear"])
@pytest.mark.parametrize("T", [1, 2, 7, 8, 9, 16, 17, 63, 64, 65, 1000, 4096])
def test_recurrent_prefill_27b_matches_reference(T, gates):
    """The 27B shape over T tokens (chunked from the threshold up, partial last chunks, 256 chunks at 4096)
    against the float64 reference: rel L2 <= 1e-5; out poisoned, state and out inside NaN padding."""
    hk, hv, dk, dv = SHAPE_27B
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda", seed=T, gates=gates)
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = run_recurrent_padded(qkv, beta, decay, state)
    assert_float32_error(out, new_state, exp_out, exp_state)


@cuda
@pytest.mark.parametrize("shape", SHAPES + [(3, 7, 32, 20), (4, 2, 32, 16), (1, 5, 32, 32), (3, 7, 128, 128),
                                            (4, 2, 128, 64), (1, 5, 128, 192), (2, 4, 128, 96)])
@pytest.mark.parametrize("T", [17, 65])
def test_recurrent_prefill_shapes(shape, T):
    """Odd shapes at edge gates: Hv not a multiple of Hk (7 value heads on 3 key heads), Hv < Hk, dk from
    32 to 256 and not a power of 2, dv not a multiple of 16. The tensor-core kernel takes dk = 128 and
    dv % 64 == 0 at any Hv / Hk ((1, 5, 128, 192): 3 blocks a head, 5 value heads on one key head); the float32
    one dk % 4 == 0, dk <= 256 and Hv / Hk <= 4 ((2, 4, 128, 96) among them); the others ((1, 3, 30, 30),
    (1, 5, 32, 32)) run token by token, same bar."""
    hk, hv, dk, dv = shape
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda", seed=dk + T, gates="edge")
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = run_recurrent_padded(qkv, beta, decay, state)
    assert_float32_error(out, new_state, exp_out, exp_state)


def kernels_run_by(fn) -> str:
    """The names of the CUDA kernels fn() launches (profiler), space-separated."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.key for e in prof.key_averages())


def recurrent_kernel(fn) -> str:
    """Which gdn_recurrent kernel fn() runs: "mma" (gdn_chunk_mma.cu), "fp32" (gdn_prefill.cu) or "per-token"
    (gdn.cu); exactly one of them."""
    names = kernels_run_by(fn)
    found = [label for kernel, label in (("gdn_prefill_mma_kernel", "mma"), ("gdn_prefill_kernel", "fp32"),
                                         ("gdn_recurrent_kernel", "per-token")) if kernel in names]
    assert len(found) == 1, names
    return found[0]


@cuda
def test_recurrent_dispatch(monkeypatch):
    """A 64-token prompt at the 27B shape runs the tensor-core kernel (from 32 tokens), T = 8 (the chunked
    threshold) the float32 one, which QWEN38_GDN_PREFILL=fp32 forces and =mma overrides (read at each launch); the
    oracle shape (dk = 32) and
    dv = 96 run the float32 one; one token, T = 7, misaligned qkv rows, an unsupported group at dk = 32
    (Hv / Hk = 5) and any T with token_states run the per-token kernel. (The other tests pass with any
    kernel: this one says which.)"""
    monkeypatch.delenv("QWEN38_GDN_PREFILL", raising=False)

    def kernels(T, shape, view, with_token_states=False):
        hk, hv, dk, dv = shape
        qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda")
        out = torch.empty(T, hv, dv, device="cuda")
        tokens = torch.empty(T, hv, dv, dk, device="cuda") if with_token_states else None
        return recurrent_kernel(lambda: ops.gdn_recurrent(view(qkv), beta, decay, state, out, tokens))

    assert kernels(64, SHAPE_27B, aligned_rows_view) == "mma"
    assert kernels(32, SHAPE_27B, lambda x: x) == "mma"
    assert kernels(31, SHAPE_27B, lambda x: x) == "fp32"
    assert kernels(8, SHAPE_27B, lambda x: x) == "fp32"
    assert kernels(8, (1, 5, 128, 128), lambda x: x) == "mma"  # Hv / Hk = 5: the float32 kernel cannot
    assert kernels(64, SHAPE_ORACLE, lambda x: x) == "fp32"
    assert kernels(64, (2, 4, 128, 96), lambda x: x) == "fp32"
    assert kernels(1, SHAPE_27B, lambda x: x) == "per-token"
    assert kernels(7, SHAPE_27B, lambda x: x) == "per-token"
    assert kernels(64, SHAPE_27B, rows_view) == "per-token"
    assert kernels(64, (1, 5, 32, 32), lambda x: x) == "per-token"
    assert kernels(8, SHAPE_27B, lambda x: x, with_token_states=True) == "per-token"
    assert kernels(64, SHAPE_27B, aligned_rows_view, with_token_states=True) == "per-token"
    monkeypatch.setenv("QWEN38_GDN_PREFILL", "fp32")
    assert kernels(64, SHAPE_27B, aligned_rows_view) == "fp32"
    assert kernels(64, (1, 5, 128, 128), lambda x: x) == "mma"
    monkeypatch.setenv("QWEN38_GDN_PREFILL", "mma")
    assert kernels(8, SHAPE_27B, lambda x: x) == "mma"
    assert kernels(64, SHAPE_ORACLE, lambda x: x) == "fp32"  # dk = 32: the tensor-core kernel cannot


@cuda
@pytest.mark.parametrize("kernel", ["mma", "fp32"])
@pytest.mark.parametrize("initial", ["random", "zero"])
@pytest.mark.parametrize("gates", ["uniform", "edge", "collinear"])
@pytest.mark.parametrize("T", [31, 32, 33, 95, 4127])
def test_recurrent_prefill_27b_kernels(kernel, initial, gates, T, monkeypatch):
    """Both chunked kernels at the 27B shape, each forced by QWEN38_GDN_PREFILL (the default picks by T), against the float64 reference at rel L2 <= 1e-5: T either side of the
    32-token chunk and not a multiple of it (4127 = 128 chunks + 31), from a random state and from zero;
    out poisoned, state and out inside NaN padding. Uniform gates too: at edge gates a decay of exactly 0
    late in the last chunk leaves a final state that no earlier token reaches."""
    monkeypatch.setenv("QWEN38_GDN_PREFILL", kernel)
    hk, hv, dk, dv = SHAPE_27B
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda", seed=T + 1, gates=gates)
    if initial == "zero":
        state.zero_()
    probe_out = torch.empty(T, hv, dv, device="cuda")
    assert recurrent_kernel(lambda: ops.gdn_recurrent(qkv, beta, decay, state.clone(), probe_out)) == kernel
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = run_recurrent_padded(qkv, beta, decay, state)
    assert_float32_error(out, new_state, exp_out, exp_state)


@cuda
@pytest.mark.parametrize("rows", [64, 32, 16])
@pytest.mark.parametrize("gates", ["uniform", "edge", "collinear"])
@pytest.mark.parametrize("T", [33, 4127])
def test_recurrent_prefill_mma_rows(rows, gates, T, monkeypatch):
    """Each block size of the tensor-core kernel (state rows a block, QWEN38_GDN_MMA_ROWS of
    gdn_chunk_mma.cu, read at each launch) at the 27B shape against the float64 reference at rel L2 <= 1e-5: the
    instance the knob names runs (its name in the profiler), a chunk and a token, 128 chunks and 31 tokens."""
    monkeypatch.setenv("QWEN38_GDN_PREFILL", "mma")
    monkeypatch.setenv("QWEN38_GDN_MMA_ROWS", str(rows))
    hk, hv, dk, dv = SHAPE_27B
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda", seed=T + rows, gates=gates)
    probe_out = torch.empty(T, hv, dv, device="cuda")
    names = kernels_run_by(lambda: ops.gdn_recurrent(qkv, beta, decay, state.clone(), probe_out))
    assert f"gdn_prefill_mma_kernel<{rows}>" in names, names
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    out, new_state = run_recurrent_padded(qkv, beta, decay, state)
    assert_float32_error(out, new_state, exp_out, exp_state)


@cuda
def test_recurrent_prefill_continues_state():
    """A prompt in pieces, each call starting from the state the last left: 37 tokens, 28, one decode step,
    30 (chunk boundaries fall mid-piece) == the reference over all 96 at rel L2 <= 1e-5."""
    hk, hv, dk, dv = SHAPE_27B
    qkv, beta, decay, state = make_recurrent_inputs(96, hk, hv, dk, dv, device="cuda", seed=9, gates="edge")
    exp_out, exp_state = recurrent_expected(qkv, beta, decay, state)
    s, outs = state.clone(), []
    for a, b in ((0, 37), (37, 65), (65, 66), (66, 96)):
        out = torch.full((b - a, hv, dv), float("nan"), device="cuda")
        ops.gdn_recurrent(qkv[a:b], beta[a:b], decay[a:b], s, out)
        outs.append(out)
    assert_float32_error(torch.cat(outs), s, exp_out, exp_state)


@cuda
@pytest.mark.parametrize("shape", [SHAPE_27B, (2, 4, 64, 64), (3, 6, 64, 40), (1, 3, 30, 30)])
def test_small_T_equals_token_by_token_bitwise(shape):
    """A FACT the model relies on: T <= 7 tokens in one call, without per-token states, give bit for bit what
    T calls of one token give (conv out and state, recurrent out and state). Below the chunked kernel's
    threshold (kGdnPrefillMinTokens = 8, csrc/cuda_bindings/gdn.cpp) a T-token call runs the decode kernel,
    whose per-token float operations are pinned (csrc/kernels/gdn.cu); the conv is one kernel for any T."""
    hk, hv, dk, dv = shape
    for T in range(1, 8):
        qkv, conv_state, weight = [x.cuda() for x in make_conv_inputs(T, hk, hv, dk, dv, seed=T)]
        _, beta, decay, state = [x.cuda() for x in make_recurrent_inputs(T, hk, hv, dk, dv, seed=T, gates="edge")]
        conv_all, cs_all = run_conv_cuda(qkv, conv_state, weight, hk, dk)
        out_all, s_all = run_recurrent_cuda(conv_all, beta, decay, state)
        conv_one, conv_states = conv_steps(qkv, conv_state, weight, hk, dk)
        out_one, states = recurrent_steps(conv_one, beta, decay, state)
        assert torch.isfinite(out_all).all() and torch.isfinite(s_all).all()
        assert torch.equal(conv_all, conv_one) and torch.equal(cs_all, conv_states[-1]), T
        assert torch.equal(out_all, out_one) and torch.equal(s_all, states[-1]), T


def padding_untouched(buf, numel, pad=64):
    """The NaN padding padded() put around numel values is still NaN (nothing written outside them)."""
    return bool(buf[:pad].isnan().all() and buf[pad + numel :].isnan().all())


@cuda
@pytest.mark.parametrize("shape", SHAPES[:6])
@pytest.mark.parametrize("T,taps", [(1, 4), (3, 4), (8, 4), (20, 4), (5, 2), (6, 3)])
def test_conv_token_states_cuda(shape, T, taps):
    """token_conv_states (NaN-poisoned, inside NaN padding) == the reference's exactly (they are copies of
    inputs); out as the reference (2e-6, as test_conv_cuda_matches_reference) and bit for bit as without
    them; final state == token_conv_states[T-1]; every out row and per-token state bit for bit those of T
    calls of one token (T = 20: two of the kernel's 16-token runs, the second starting from qkv rows)."""
    assert_cuda_kernel("gdn_conv")
    hk, hv, dk, dv = shape
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv, taps=taps, seed=T + taps)
    C = qkv.shape[1]
    exp_out, exp_state = torch.empty_like(qkv, dtype=torch.float64), state.double()
    exp_tokens = torch.empty(T, taps - 1, C, dtype=torch.float64)
    ref.gdn_conv(qkv.double(), exp_state, weight.double(), hk, dk, exp_out, exp_tokens)
    qkv, state, weight = qkv.cuda(), state.cuda(), weight.cuda()
    new_state, out = state.clone(), torch.full_like(qkv, float("nan"))
    tokens, tokens_buf = padded(torch.full((T, taps - 1, C), float("nan"), device="cuda"))
    ops.gdn_conv(qkv, new_state, weight, hk, dk, out, tokens)
    assert padding_untouched(tokens_buf, tokens.numel()), "a write outside token_conv_states"
    assert torch.equal(tokens.cpu().double(), exp_tokens) and torch.equal(new_state, tokens[-1])
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=2e-6, atol=2e-6)
    plain_out, plain_state = run_conv_cuda(qkv, state, weight, hk, dk)
    assert torch.equal(out, plain_out) and torch.equal(new_state, plain_state)
    one_out, one_states = conv_steps(qkv, state, weight, hk, dk)
    assert torch.equal(out, one_out) and torch.equal(tokens, one_states)


@cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 3, 8, 9])
def test_recurrent_token_states_cuda(shape, T):
    """token_states (NaN-poisoned, inside NaN padding) and out against the float64 reference at edge gates
    (5e-5 absolute: |S| ~ 1, unit q and k, float32 dot products over dk <= 256, T <= 9 steps); final state ==
    token_states[T-1]; every out and per-token state bit for bit those of T calls of one token, also at
    T >= 8, where a call without token_states would run the chunked kernel. dk = 30 runs the scalar path."""
    assert_cuda_kernel("gdn_recurrent")
    hk, hv, dk, dv = shape
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, seed=dk + T, gates="edge")
    exp_out, exp_state = torch.empty(T, hv, dv, dtype=torch.float64), state.double()
    exp_tokens = torch.empty(T, hv, dv, dk, dtype=torch.float64)
    ref.gdn_recurrent(qkv.double(), beta.double(), decay.double(), exp_state, exp_out, exp_tokens)
    qkv, beta, decay, state = qkv.cuda(), beta.cuda(), decay.cuda(), state.cuda()
    new_state, out = state.clone(), torch.full((T, hv, dv), float("nan"), device="cuda")
    tokens, tokens_buf = padded(torch.full((T, hv, dv, dk), float("nan"), device="cuda"))
    ops.gdn_recurrent(qkv, beta, decay, new_state, out, tokens)
    assert padding_untouched(tokens_buf, tokens.numel()), "a write outside token_states"
    assert torch.isfinite(out).all() and torch.isfinite(tokens).all()
    torch.testing.assert_close(out.cpu().double(), exp_out, rtol=0, atol=5e-5)
    torch.testing.assert_close(tokens.cpu().double(), exp_tokens, rtol=0, atol=5e-5)
    assert torch.equal(new_state, tokens[-1])
    one_out, one_states = recurrent_steps(qkv, beta, decay, state)
    assert torch.equal(out, one_out) and torch.equal(tokens, one_states)


@cuda
@pytest.mark.parametrize("gates", ["uniform", "edge"])
@pytest.mark.parametrize("T", [2, 5, 8])
@pytest.mark.parametrize("view", ["aligned", "misaligned"])
def test_verify_27b_equals_decode_steps(T, gates, view):
    """Speculative verify at the 27B shape (conv K = 4, C = 10240): conv with token_conv_states, gates, then
    the recurrence with token_states over T tokens == T plain decode steps of the three ops, bit for bit in
    every output and every per-token state, so the state after any prefix of the verified tokens is the
    one decode would hold. misaligned: qkv rows 16-byte misaligned (the recurrence's 4-byte-load path) in
    both runs."""
    hk, hv, dk, dv = SHAPE_27B
    qkv, conv_state, weight = [x.cuda() for x in make_conv_inputs(T, hk, hv, dk, dv, seed=T)]
    ba, a_neg, dt_bias = [x.cuda() for x in make_gate_inputs(T, hv, seed=T)]
    _, _, _, state = [x.cuda() for x in make_recurrent_inputs(T, hk, hv, dk, dv, seed=T, gates=gates)]
    C = qkv.shape[1]
    place = rows_view if view == "misaligned" else (lambda x: x)

    conv = place(torch.full_like(qkv, float("nan")))
    cs, conv_tokens = conv_state.clone(), torch.full((T, 3, C), float("nan"), device="cuda")
    ops.gdn_conv(qkv, cs, weight, hk, dk, conv, conv_tokens)
    beta, decay = torch.full((T, hv), float("nan"), device="cuda"), torch.full((T, hv), float("nan"), device="cuda")
    ops.gdn_gates(ba, a_neg, dt_bias, beta, decay)
    s, out = state.clone(), torch.full((T, hv, dv), float("nan"), device="cuda")
    tokens = torch.full((T, hv, dv, dk), float("nan"), device="cuda")
    ops.gdn_recurrent(conv, beta, decay, s, out, tokens)

    cs1, s1 = conv_state.clone(), state.clone()
    conv1 = place(torch.full_like(qkv, float("nan")))
    for t in range(T):
        ops.gdn_conv(qkv[t : t + 1], cs1, weight, hk, dk, conv1[t : t + 1])
        assert torch.equal(conv[t], conv1[t]) and torch.equal(conv_tokens[t], cs1), t
        b1, d1 = torch.full((1, hv), float("nan"), device="cuda"), torch.full((1, hv), float("nan"), device="cuda")
        ops.gdn_gates(ba[t : t + 1], a_neg, dt_bias, b1, d1)
        assert torch.equal(beta[t : t + 1], b1) and torch.equal(decay[t : t + 1], d1), t
        out1 = torch.full((1, hv, dv), float("nan"), device="cuda")
        ops.gdn_recurrent(conv1[t : t + 1], b1, d1, s1, out1)
        assert torch.equal(out[t : t + 1], out1) and torch.equal(tokens[t], s1), t
    assert torch.equal(conv, conv1) and torch.equal(cs, cs1) and torch.equal(s, s1)
    assert torch.isfinite(out).all() and torch.isfinite(tokens).all()


@cuda
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_back_to_back_recurrent_on_one_state(pdl):
    """check_back_to_back_recurrent_on_one_state with programmatic dependent launch on and off (children)."""
    run_in_child(__file__, "check_back_to_back_recurrent_on_one_state", preamble=child_env(QWEN38_PDL=pdl))


def check_back_to_back_recurrent_on_one_state():
    """T calls of one token launched back to back on the SAME state, nothing in between, eagerly and in a
    captured graph: with programmatic dependent launch each call must still see the previous call's
    state (the kernels load nothing before griddepcontrol.wait). Equals one call of T tokens."""
    hk, hv, dk, dv = SHAPE_27B
    T = 8
    qkv, beta, decay, state = [x.cuda() for x in make_recurrent_inputs(T, hk, hv, dk, dv, seed=6)]
    out_all, s_all = run_recurrent_cuda(qkv, beta, decay, state)
    beta_t = [beta[t : t + 1].contiguous() for t in range(T)]
    decay_t = [decay[t : t + 1].contiguous() for t in range(T)]
    s = state.clone()
    outs = [torch.empty(1, hv, dv, device="cuda") for _ in range(T)]

    def steps():
        for t in range(T):
            ops.gdn_recurrent(qkv[t : t + 1], beta_t[t], decay_t[t], s, outs[t])

    steps()
    torch.testing.assert_close(torch.cat(outs), out_all, rtol=0, atol=1e-6)
    torch.testing.assert_close(s, s_all, rtol=0, atol=1e-6)
    eager = [o.clone() for o in outs] + [s.clone()]
    graph = torch.cuda.CUDAGraph()
    s.copy_(state)
    with torch.cuda.graph(graph):
        steps()
    s.copy_(state)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs + [s], eager):
        assert torch.equal(got, want)


@cuda
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_deterministic_and_graph_replay_bitwise(pdl):
    """check_deterministic_and_graph_replay_bitwise with programmatic dependent launch on and off (children):
    a decode step, a 100-token prompt (the chunked kernel) and an 8-token verify with per-token states."""
    run_in_child(__file__, "check_deterministic_and_graph_replay_bitwise", preamble=child_env(QWEN38_PDL=pdl))


def check_deterministic_and_graph_replay_bitwise():
    for T, verify in ((1, False), (100, False), (8, True)):
        print("checking T =", T, "verify =", verify, flush=True)
        deterministic_and_graph_replay_bitwise(T, verify)


def deterministic_and_graph_replay_bitwise(T, verify):
    """Two eager runs give the same bits, and a captured CUDA graph replays exactly like eager."""
    hk, hv, dk, dv = SHAPE_27B
    qkv, conv_state, weight = [x.cuda() for x in make_conv_inputs(T, hk, hv, dk, dv, seed=8)]
    ba, a_neg, dt_bias = [x.cuda() for x in make_gate_inputs(T, hv, seed=8)]
    _, _, _, state = [x.cuda() for x in make_recurrent_inputs(T, hk, hv, dk, dv, seed=8)]

    bufs = dict(conv_state=conv_state.clone(), state=state.clone(), conv=torch.empty_like(qkv),
                beta=torch.empty(T, hv, device="cuda"), decay=torch.empty(T, hv, device="cuda"),
                out=torch.empty(T, hv, dv, device="cuda"))
    if verify:
        bufs.update(conv_tokens=torch.empty(T, *conv_state.shape, device="cuda"),
                    tokens=torch.empty(T, *state.shape, device="cuda"))

    def step():
        ops.gdn_conv(qkv, bufs["conv_state"], weight, hk, dk, bufs["conv"], bufs.get("conv_tokens"))
        ops.gdn_gates(ba, a_neg, dt_bias, bufs["beta"], bufs["decay"])
        ops.gdn_recurrent(bufs["conv"], bufs["beta"], bufs["decay"], bufs["state"], bufs["out"], bufs.get("tokens"))

    def reset():
        bufs["conv_state"].copy_(conv_state)
        bufs["state"].copy_(state)
        for k in bufs.keys() - {"conv_state", "state"}:
            bufs[k].fill_(float("nan"))

    results = []
    for _ in range(2):
        reset()
        step()
        results.append({k: v.clone() for k, v in bufs.items()})
    for k in bufs:
        assert torch.equal(results[0][k], results[1][k]), (T, k)

    reset()
    graph = capture_graph(step)
    reset()
    graph.replay()
    torch.cuda.synchronize()
    for k in bufs:
        assert torch.equal(bufs[k], results[0][k]), (T, k)


@cuda
def test_opcheck_cuda():
    hk, hv, dk, dv = SHAPE_ORACLE
    T = 2
    qkv, state, weight = make_conv_inputs(T, hk, hv, dk, dv, device="cuda")
    torch.library.opcheck(ops.gdn_conv.default, (qkv, state, weight, hk, dk, torch.empty_like(qkv)))
    ba, a_neg, dt_bias = make_gate_inputs(T, hv, device="cuda")
    beta, decay = torch.empty(T, hv, device="cuda"), torch.empty(T, hv, device="cuda")
    torch.library.opcheck(ops.gdn_gates.default, (ba, a_neg, dt_bias, beta, decay))
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda")
    torch.library.opcheck(ops.gdn_recurrent.default, (qkv, beta, decay, state, torch.empty(T, hv, dv, device="cuda")))
    torch.library.opcheck(ops.gdn_recurrent.default, (qkv, beta, decay, state, torch.empty(T, hv, dv, device="cuda"),
                                                      torch.empty(T, hv, dv, dk, device="cuda")))
    qkv, cstate, weight = make_conv_inputs(T, hk, hv, dk, dv, device="cuda")
    torch.library.opcheck(ops.gdn_conv.default, (qkv, cstate, weight, hk, dk, torch.empty_like(qkv),
                                                 torch.empty(T, *cstate.shape, device="cuda")))


def check_bad_inputs():
    """Every wrong argument raises a RuntimeError naming the op and the argument (run in a child
    process by test_bad_inputs_raise)."""
    hk, hv, dk, dv = SHAPE_ORACLE
    T = 2
    qkv, cstate, weight = make_conv_inputs(T, hk, hv, dk, dv, device="cuda")
    out = torch.empty_like(qkv)
    progress()
    with pytest.raises(RuntimeError, match="gdn_conv: qkv must be Float"):
        ops.gdn_conv(qkv.double(), cstate, weight, hk, dk, out)
    progress()
    with pytest.raises(RuntimeError, match="gdn_conv"):
        ops.gdn_conv(qkv, cstate.cpu(), weight, hk, dk, out)
    progress()
    with pytest.raises(RuntimeError, match="conv_state must be"):
        ops.gdn_conv(qkv, cstate[:2], weight, hk, dk, out)
    progress()
    with pytest.raises(RuntimeError, match="out must be"):
        ops.gdn_conv(qkv, cstate, weight, hk, dk, out[:, :-1])
    progress()
    with pytest.raises(RuntimeError, match="token_conv_states must be"):
        ops.gdn_conv(qkv, cstate, weight, hk, dk, out, torch.empty(T + 1, *cstate.shape, device="cuda"))
    progress()
    with pytest.raises(RuntimeError, match="token_conv_states must be"):
        ops.gdn_conv(qkv, cstate, weight, hk, dk, out,
                     torch.empty(T, cstate.shape[1], cstate.shape[0], device="cuda").transpose(1, 2))
    progress()
    with pytest.raises(RuntimeError, match="token_conv_states is on"):
        ops.gdn_conv(qkv, cstate, weight, hk, dk, out, torch.empty(T, *cstate.shape))
    ba, a_neg, dt_bias = make_gate_inputs(T, hv, device="cuda")
    progress()
    with pytest.raises(RuntimeError, match="gdn_gates"):
        ops.gdn_gates(ba, a_neg[:-1], dt_bias, torch.empty(T, hv, device="cuda"), torch.empty(T, hv, device="cuda"))
    progress()
    with pytest.raises(RuntimeError, match="beta and decay"):
        ops.gdn_gates(ba, a_neg, dt_bias, torch.empty(T, hv, device="cuda", dtype=torch.float64),
                      torch.empty(T, hv, device="cuda"))
    qkv, beta, decay, state = make_recurrent_inputs(T, hk, hv, dk, dv, device="cuda")
    out = torch.empty(T, hv, dv, device="cuda")
    progress()
    with pytest.raises(RuntimeError, match="state must be"):
        ops.gdn_recurrent(qkv, beta, decay, state.double(), out)
    progress()
    with pytest.raises(RuntimeError, match="state must be contiguous"):
        ops.gdn_recurrent(qkv, beta, decay, state.transpose(1, 2), out)
    progress()
    with pytest.raises(RuntimeError, match="qkv must be"):
        ops.gdn_recurrent(qkv[:, 1:], beta, decay, state, out)
    progress()
    with pytest.raises(RuntimeError, match="out must be"):
        ops.gdn_recurrent(qkv, beta, decay, state, out.reshape(T, -1))
    progress()
    with pytest.raises(RuntimeError, match="gdn_recurrent"):
        ops.gdn_recurrent(qkv, beta.cpu(), decay, state, out)
    progress()
    with pytest.raises(RuntimeError, match="token_states must be"):
        ops.gdn_recurrent(qkv, beta, decay, state, out, torch.empty(T, hv, dv, dk, device="cuda", dtype=torch.float64))
    progress()
    with pytest.raises(RuntimeError, match="token_states must be"):
        ops.gdn_recurrent(qkv, beta, decay, state, out, torch.empty(T, hv, dk, dv, device="cuda").transpose(2, 3))
    progress()
    with pytest.raises(RuntimeError, match="token_states must be"):
        ops.gdn_recurrent(qkv, beta, decay, state, out, torch.empty(T - 1, hv, dv, dk, device="cuda"))
    progress()
    with pytest.raises(RuntimeError, match="token_states must start 16-byte aligned"):
        ops.gdn_recurrent(qkv, beta, decay, state, out,
                          torch.empty(T * hv * dv * dk + 1, device="cuda")[1:].view(T, hv, dv, dk))
    progress()
    with pytest.raises(RuntimeError, match="token_states is on"):
        ops.gdn_recurrent(qkv, beta, decay, state, out, torch.empty(T, hv, dv, dk))


@cuda
def test_bad_inputs_raise():
    """check_bad_inputs in a child process (see cuda_helpers.run_in_child for why), after the control
    TORCH_ERROR_CONTROL."""
    run_in_child(__file__, "check_bad_inputs", preamble=TORCH_ERROR_CONTROL)
