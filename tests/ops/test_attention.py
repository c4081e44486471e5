"""attention family: attn_qk_norm_rope_store, attention, attn_output_gate.

CPU (CI): opcheck of every op, and the references against independent formulas (RoPE as a rotation of
complex pairs, attention as an explicit per-token softmax loop, the quantized gate output against
gguf-style block rounding). CUDA (-m cuda): every kernel against the reference in float64 on the CPU, on
random inputs, outputs and unread cache rows poisoned, at odd sizes and the 27B shapes, both cache dtypes;
two runs give the same bits; a captured graph replays bit for bit like eager, also after the device-held
positions move, and gives the same bits with programmatic dependent launch on and off; bad arguments raise.

Batched rows (caches [T, max_seq, Hkv, hd]: row t a sequence of its own with cache t): on the CPU the reference
against one-row calls and an explicit softmax loop, opcheck, per-row bad_position flags; on CUDA the kernels
against the reference (each row at its own context length, unread cache rows poisoned), every row bit for bit a
T = 1 call on its own cache for T up to 64, per-row flags, the workspace rule, bad arguments.

Batched verify rows (caches [B, max_seq, Hkv, hd] for B * n rows: n consecutive rows a sequence, at consecutive
positions, causal within the sequence): on the CPU the reference against each sequence's n-row call and a softmax
loop, opcheck; on CUDA the store and attention against the float64 reference (unread rows poisoned), attention_gated
the bits of attention then the gate, and every sequence's rows bit for bit its own n-row call on its cache alone
(the one-sequence verify), at odd sizes and the 27B shape with B * n up to 112 rows.
"""
import os
from contextlib import nullcontext

import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.attention import ATTENTION_SPLITS, BAD_POSITION, SAME_SPLIT_TOKENS, num_splits, workspace_numel
from qwen38_ops.reference import attention as ref
from qwen38_ops.reference import norm_quant as ref_quant

from cuda_helpers import (TORCH_ERROR_CONTROL, assert_cuda_kernel, assert_same_bits_pdl_on_and_off, capture_graph,
                          cuda, progress, rows_view, run_in_child)

ops = torch.ops.qwen38

# (Hq, Hkv, hd, rotary_dim): the oracle and the 27B model.
ORACLE = (4, 2, 32, 8)
M27B = (24, 4, 256, 64)
THETA = 1e7
EPS = 1e-6


def make_qgkv(T, hq, hkv, hd, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qgkv = torch.randn(T, 2 * hq * hd + 2 * hkv * hd, generator=g, dtype=torch.float64) * 2
    q_norm = 1 + 0.3 * torch.randn(hd, generator=g, dtype=torch.float64)
    k_norm = 1 + 0.3 * torch.randn(hd, generator=g, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype) for x in (qgkv, q_norm, k_norm)]


def make_cache(max_seq, hkv, hd, dtype, device="cpu", seed=0, poison_from=None):
    """Random rows; rows from `poison_from` on are NaN: a kernel that reads past its bound shows it."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(max_seq, hkv, hd, generator=g, dtype=torch.float64)
    v = torch.randn(max_seq, hkv, hd, generator=g, dtype=torch.float64)
    if poison_from is not None:
        k[poison_from:] = float("nan")
        v[poison_from:] = float("nan")
    return k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# CPU: opcheck and the references against independent formulas.

def test_opcheck_cpu():
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 3, 16
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd)
    positions = torch.tensor([2, 5, 9], dtype=torch.int32)
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.float32)
    q_out = torch.empty(T, hq, hd)
    torch.library.opcheck(ops.attn_qk_norm_rope_store.default,
                          (qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache))
    out = torch.empty(T, hq, hd)
    workspace = torch.empty(workspace_numel(T, hq, hd))
    torch.library.opcheck(ops.attention.default, (q_out, k_cache, v_cache, positions, hd**-0.5, out, workspace))
    width = hq * hd
    gated = torch.empty(T, width)
    torch.library.opcheck(ops.attn_output_gate.default, (out, qgkv, gated, None, None, None))
    out_q, out_d = torch.empty(T, width, dtype=torch.int8), torch.empty(T, width // 32)
    torch.library.opcheck(ops.attn_output_gate.default, (out, qgkv, gated, out_q, None, out_d))
    torch.library.opcheck(ops.attention_gated.default,
                          (q_out, k_cache, v_cache, positions, hd**-0.5, qgkv, workspace, gated, out_q, None, out_d))


def test_qk_norm_rope_reference_vs_complex_rotation():
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 3, 12
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, dtype=torch.float64)
    positions = torch.tensor([0, 7, 3], dtype=torch.int32)
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.float64)
    q_out = torch.empty(T, hq, hd, dtype=torch.float64)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    ref.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache)

    def expected(x, w, pos):  # RMSNorm, then rotate the complex numbers (x_i + i x_{i+rd/2}) by pos*freq_i
        y = x / torch.sqrt((x * x).mean() + EPS) * w
        half = rd // 2
        freq = torch.tensor([THETA ** (-2 * i / rd) for i in range(half)], dtype=torch.float64)
        z = torch.complex(y[:half], y[half:rd]) * torch.polar(torch.ones(half, dtype=torch.float64), pos * freq)
        return torch.cat([z.real, z.imag, y[rd:]])

    k_expected, v_expected = k_before.clone(), v_before.clone()
    for t in range(T):
        pos = int(positions[t])
        for h in range(hq):
            x = qgkv[t, h * 2 * hd : h * 2 * hd + hd]  # query half of head h's [query | gate] pair
            torch.testing.assert_close(q_out[t, h], expected(x, q_norm, pos), rtol=1e-12, atol=1e-12)
        for h in range(hkv):
            x = qgkv[t, 2 * hq * hd + h * hd : 2 * hq * hd + (h + 1) * hd]
            k_expected[pos, h] = expected(x, k_norm, pos)
            v_expected[pos, h] = qgkv[t, 2 * hq * hd + hkv * hd + h * hd : 2 * hq * hd + hkv * hd + (h + 1) * hd]
    torch.testing.assert_close(k_cache, k_expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0)


def test_attention_reference_vs_softmax_loop():
    hq, hkv, hd = 6, 2, 16
    T = 3
    positions = torch.tensor([4, 9, 2], dtype=torch.int32)
    k_cache, v_cache = make_cache(12, hkv, hd, torch.float64, poison_from=10)
    q = torch.randn(T, hq, hd, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = torch.empty(T, hq, hd, dtype=torch.float64)
    scale = hd**-0.5
    ref.attention(q, k_cache, v_cache, positions, scale, out, torch.empty(workspace_numel(T, hq, hd)))
    for t in range(T):
        n = int(positions[t]) + 1
        for h in range(hq):
            kv = h // (hq // hkv)  # GQA: consecutive query heads share a kv head
            p = torch.softmax(k_cache[:n, kv] @ q[t, h] * scale, dim=0)
            torch.testing.assert_close(out[t, h], p @ v_cache[:n, kv], rtol=1e-12, atol=1e-12)


def test_output_gate_reference_vs_formula():
    hq, hkv, hd, _ = ORACLE
    T = 2
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd)
    attn = torch.randn(T, hq, hd)
    out = torch.empty(T, hq * hd)
    ref.attn_output_gate(attn, qgkv, out)
    gate = torch.stack([qgkv[:, h * 2 * hd + hd : (h + 1) * 2 * hd] for h in range(hq)], dim=1)
    torch.testing.assert_close(out, (attn / (1 + torch.exp(-gate))).reshape(T, -1), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# CPU: batched rows (caches [T, max_seq, Hkv, hd], row t a sequence of its own with cache t).

def make_row_caches(positions, max_seq, hkv, hd, dtype, device="cpu", seed=0):
    """Batched rows' caches [T, max_seq, Hkv, hd]: cache t random up to row positions[t], NaN past it (a kernel
    that reads past a row's own bound shows it)."""
    pairs = [make_cache(max_seq, hkv, hd, dtype, device, seed=seed + t, poison_from=int(p) + 1)
             for t, p in enumerate(positions)]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


def opcheck_batched_rows(device, cache_dtype):
    """opcheck of the three decode-step ops with caches [T, max_seq, Hkv, hd] and a flag a row."""
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 3, 16
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, device=device)
    positions = torch.tensor([2, 15, 0], dtype=torch.int32)
    k_cache, v_cache = make_row_caches(positions, max_seq, hkv, hd, cache_dtype, device=device)
    positions = positions.to(device)
    empty = lambda *size, dtype=torch.float32: torch.empty(size, dtype=dtype, device=device)
    q_out, flags = empty(T, hq, hd), torch.zeros(T, dtype=torch.int32, device=device)
    torch.library.opcheck(ops.attn_qk_norm_rope_store.default,
                          (qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, flags))
    out, workspace = empty(T, hq, hd), empty(workspace_numel(T, hq, hd, batched=True))
    torch.library.opcheck(ops.attention.default, (q_out, k_cache, v_cache, positions, hd**-0.5, out, workspace))
    width = hq * hd
    gated, out_q, out_d = empty(T, width), empty(T, width, dtype=torch.int8), empty(T, width // 32)
    torch.library.opcheck(ops.attention_gated.default,
                          (q_out, k_cache, v_cache, positions, hd**-0.5, qgkv, workspace, gated, out_q, None, out_d))


def test_opcheck_cpu_batched_rows():
    opcheck_batched_rows("cpu", torch.float32)


def test_batched_store_reference_is_one_row_calls():
    """Row t of a batched store is a one-row store into cache t alone: its q_out row and cache t bit for bit."""
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 4, 12
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=5)
    positions = torch.tensor([3, 11, 0, 3], dtype=torch.int32)  # rows 0 and 3: the same row of different caches
    g = torch.Generator().manual_seed(5)
    k0, v0 = (torch.randn(T, max_seq, hkv, hd, generator=g) for _ in range(2))
    q_out, k_cache, v_cache = torch.empty(T, hq, hd), k0.clone(), v0.clone()
    ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache)
    for t in range(T):
        q_row, k_row, v_row = torch.empty(1, hq, hd), k0[t].clone(), v0[t].clone()
        ops.attn_qk_norm_rope_store(qgkv[t : t + 1], q_norm, k_norm, positions[t : t + 1], EPS, THETA, rd, q_row,
                                    k_row, v_row)
        assert torch.equal(q_out[t : t + 1], q_row) and torch.equal(k_cache[t], k_row), t
        assert torch.equal(v_cache[t], v_row), t
        assert not torch.equal(k_cache[t], k0[t]), t  # something was stored


def test_batched_attention_reference_vs_softmax_loop():
    """Row t attends rows 0..positions[t] of cache t only (the other caches' rows at those positions are other
    sequences'): an explicit softmax loop per row and head; attention_gated is attention then the gate."""
    hq, hkv, hd = 6, 2, 16
    positions = torch.tensor([4, 9, 0, 9], dtype=torch.int32)
    T, scale = positions.shape[0], hd**-0.5
    k_cache, v_cache = make_row_caches(positions, 12, hkv, hd, torch.float64, seed=3)
    q = torch.randn(T, hq, hd, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = torch.empty(T, hq, hd, dtype=torch.float64)
    ref.attention(q, k_cache, v_cache, positions, scale, out, None)
    for t in range(T):
        n = int(positions[t]) + 1
        for h in range(hq):
            kv = h // (hq // hkv)
            p = torch.softmax(k_cache[t, :n, kv] @ q[t, h] * scale, dim=0)
            torch.testing.assert_close(out[t, h], p @ v_cache[t, :n, kv], rtol=1e-12, atol=1e-12)
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd, dtype=torch.float64, seed=2)
    gated, expected = torch.empty(T, hq * hd, dtype=torch.float64), torch.empty(T, hq * hd, dtype=torch.float64)
    ref.attention_gated(q, k_cache, v_cache, positions, scale, qgkv, None, gated)
    ref.attn_output_gate(out, qgkv, expected)
    assert torch.equal(gated, expected)


def check_per_row_flags(device):
    """bad_position with a flag a row (T elements): a row whose position is outside its cache stores nothing and
    sets its own element to BAD_POSITION; a row inside leaves its element as it was (2 here: another condition
    flagged earlier). Both cache ranks; and batched rows with one shared flag."""
    hq, hkv, hd, rd = ORACLE
    max_seq = 8
    positions = torch.tensor([2, 8, 5, -1], dtype=torch.int32, device=device)
    T = positions.shape[0]
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, device=device, seed=1)
    q_out = torch.empty(T, hq, hd, device=device)
    for shape in ((max_seq, hkv, hd), (T, max_seq, hkv, hd)):
        k_cache = torch.full(shape, float("nan"), device=device)
        v_cache = torch.full(shape, float("nan"), device=device)
        flags = torch.tensor([0, 0, 2, 0], dtype=torch.int32, device=device)
        ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, flags)
        assert flags.tolist() == [0, BAD_POSITION, 2, BAD_POSITION], shape
        stored = torch.zeros(shape[:-2], dtype=torch.bool, device=device)  # [max_seq] or [T, max_seq]
        if len(shape) == 3:
            stored[[2, 5]] = True
        else:
            stored[0, 2] = stored[2, 5] = True
        assert torch.isfinite(k_cache[stored]).all() and torch.isnan(k_cache[~stored]).all(), shape
        assert torch.isfinite(v_cache[stored]).all() and torch.isnan(v_cache[~stored]).all(), shape
    k_cache = torch.zeros(T, max_seq, hkv, hd, device=device)
    v_cache = torch.zeros_like(k_cache)
    shared = torch.zeros(1, dtype=torch.int32, device=device)
    ops.attn_qk_norm_rope_store(qgkv[:1], q_norm, k_norm, positions[:1], EPS, THETA, rd, q_out[:1], k_cache[:1],
                                v_cache[:1], shared)
    assert int(shared) == 0
    ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, shared)
    assert int(shared) == BAD_POSITION


def test_per_row_bad_position_flags():
    check_per_row_flags("cpu")


# ---------------------------------------------------------------------------------------------------
# CPU: batched verify rows (caches [B, max_seq, Hkv, hd], n consecutive rows a sequence).

def verify_positions(bases, n):
    """Each sequence's n rows at positions base .. base + n - 1 (its pending token and drafts), flattened."""
    return torch.tensor([b + j for b in bases for j in range(n)], dtype=torch.int32)


def test_opcheck_cpu_batched_verify_rows():
    hq, hkv, hd, rd = ORACLE
    bases, n, max_seq = [2, 9, 0], 3, 16
    T = len(bases) * n
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd)
    positions = verify_positions(bases, n)
    k_cache, v_cache = make_row_caches([b + n - 1 for b in bases], max_seq, hkv, hd, torch.float32)
    q_out, flags = torch.empty(T, hq, hd), torch.zeros(T, dtype=torch.int32)
    torch.library.opcheck(ops.attn_qk_norm_rope_store.default,
                          (qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, flags))
    out, workspace = torch.empty(T, hq, hd), torch.empty(workspace_numel(T, hq, hd, batched=True))
    torch.library.opcheck(ops.attention.default, (q_out, k_cache, v_cache, positions, hd**-0.5, out, workspace))
    gated = torch.empty(T, hq * hd)
    torch.library.opcheck(ops.attention_gated.default,
                          (q_out, k_cache, v_cache, positions, hd**-0.5, qgkv, workspace, gated, None, None, None))


def test_batched_verify_reference_is_each_sequences_call():
    """B sequences of n rows: sequence b's store and attention are its own n-row call on cache b alone (bit for
    bit), and row j of it attends rows 0..base + j of cache b only (an explicit softmax loop): the causal bound
    within the sequence is its position, the other caches are other sequences'."""
    hq, hkv, hd, rd = 6, 2, 16, 8
    bases, n, max_seq = [4, 0, 9], 3, 14
    T, scale = len(bases) * n, hd**-0.5
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, dtype=torch.float64, seed=7)
    positions = verify_positions(bases, n)
    g = torch.Generator().manual_seed(4)
    k0, v0 = (torch.randn(len(bases), max_seq, hkv, hd, generator=g, dtype=torch.float64) for _ in range(2))
    q, k_cache, v_cache = torch.empty(T, hq, hd, dtype=torch.float64), k0.clone(), v0.clone()
    ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q, k_cache, v_cache)
    out = torch.empty(T, hq, hd, dtype=torch.float64)
    ops.attention(q, k_cache, v_cache, positions, scale, out, torch.empty(0))
    for b, base in enumerate(bases):
        rows = slice(b * n, (b + 1) * n)
        q_b, k_b, v_b = torch.empty(n, hq, hd, dtype=torch.float64), k0[b].clone(), v0[b].clone()
        ops.attn_qk_norm_rope_store(qgkv[rows], q_norm, k_norm, positions[rows], EPS, THETA, rd, q_b, k_b, v_b)
        assert torch.equal(q[rows], q_b) and torch.equal(k_cache[b], k_b) and torch.equal(v_cache[b], v_b), b
        for j in range(n):
            seen = base + j + 1
            for h in range(hq):
                kv = h // (hq // hkv)
                p = torch.softmax(k_b[:seen, kv] @ q_b[j, h] * scale, dim=0)
                torch.testing.assert_close(out[b * n + j, h], p @ v_b[:seen, kv], rtol=1e-12, atol=1e-12)


def test_batched_rows_that_no_sequence_count_divides_are_refused():
    hq, hkv, hd, rd = ORACLE
    k_cache, v_cache = make_row_caches([3, 3], 8, hkv, hd, torch.float32)
    qgkv, q_norm, k_norm = make_qgkv(3, hq, hkv, hd)
    positions = torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="B = 2 must divide the 3 rows"):
        ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, torch.empty(3, hq, hd), k_cache,
                                    v_cache)
    with pytest.raises(RuntimeError, match="B = 2 must divide the 3 rows"):
        ops.attention(torch.zeros(3, hq, hd), k_cache, v_cache, positions, 0.1, torch.empty(3, hq, hd), torch.empty(0))


# ---------------------------------------------------------------------------------------------------
# CUDA: kernels against the reference.

CACHE_DTYPES = [torch.float32, torch.bfloat16]


def run_store_cuda(qgkv, q_norm, k_norm, positions, rd, k_cache, v_cache, hq):
    T, hd = qgkv.shape[0], q_norm.shape[0]
    q_out = torch.full((T, hq, hd), float("nan"), device="cuda")
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache)
    return q_out, k_cache, v_cache


def store_against_reference(qgkv, q_norm, k_norm, positions, rd, k_cache, v_cache, hq, cache_dtype):
    """attn_qk_norm_rope_store on the GPU (caches float64 on the CPU, stored in cache_dtype there) and the float64
    reference on the same inputs: checks q (bound 5e-5; float32 angles at small positions are within 4e-6 rad)
    and returns the caches stored, the expected ones and the bound for a stored k (one bf16 rounding on a bf16
    cache)."""
    T, hd = positions.shape[0], k_cache.shape[-1]
    exp_q = torch.empty(T, hq, hd, dtype=torch.float64)
    exp_k, exp_v = k_cache.clone(), v_cache.clone()
    ref.attn_qk_norm_rope_store(qgkv.double(), q_norm.double(), k_norm.double(), positions, EPS, THETA, rd, exp_q,
                                exp_k, exp_v)
    q_out, k_out, v_out = run_store_cuda(rows_view(qgkv.cuda()), q_norm.cuda(), k_norm.cuda(), positions.cuda(), rd,
                                         k_cache.to(cache_dtype).cuda(), v_cache.to(cache_dtype).cuda(), hq)
    assert torch.isfinite(q_out).all()
    torch.testing.assert_close(q_out.cpu().double(), exp_q, rtol=0, atol=5e-5)
    tol = dict(rtol=0, atol=5e-5) if cache_dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
    return k_out, v_out, exp_k, exp_v, tol


@cuda
@pytest.mark.parametrize("shape", [ORACLE, M27B, (6, 3, 64, 64), (4, 1, 128, 32), (2, 2, 80, 0)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_qk_norm_rope_store_cuda_float64(shape, cache_dtype, T):
    """Against the float64 reference at small positions (< 64, where float32 angles are within 4e-6 rad
    of exact): bound 5e-5 on q and a float32 cache; one bf16 rounding (2^-8 relative) on a bf16 cache.
    Rows not written keep their NaN poison."""
    assert_cuda_kernel("attn_qk_norm_rope_store")
    hq, hkv, hd, rd = shape
    max_seq = 64
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=T + hd)
    positions = torch.tensor([5, 63, 0, 17][:T], dtype=torch.int32)
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.float64, poison_from=0)  # all NaN
    k_out, v_out, exp_k, exp_v, tol = store_against_reference(qgkv, q_norm, k_norm, positions, rd, k_cache, v_cache,
                                                             hq, cache_dtype)
    written = positions.long()
    untouched = torch.ones(max_seq, dtype=torch.bool)
    untouched[written] = False
    assert torch.isnan(k_out.cpu()[untouched].float()).all() and torch.isnan(v_out.cpu()[untouched].float()).all()
    torch.testing.assert_close(k_out.cpu().double()[written], exp_k[written], equal_nan=False, **tol)
    torch.testing.assert_close(v_out.cpu().double()[written], exp_v[written].to(cache_dtype).double(), rtol=0, atol=0)


def hf_float32_angle_rope(x, weight, pos, rd):
    """RMSNorm + RoPE in float64, but with the angle formed the way HF forms it in float32: inv_freq =
    1 / theta^(2i/rd) rounded to float32 at each step, angle = float32(pos * inv_freq). (The float64
    reference forms exact angles instead; at pos ~ 1e5 the two differ by ~0.01 rad: float32's own ulp.)"""
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * weight
    exponent = (torch.arange(0, rd, 2, dtype=torch.float32) / rd).double()
    inv_freq = (1.0 / (THETA**exponent).float().double()).float().double()
    angle = (pos * inv_freq).float().double()  # a product of two float32 is exact in float64: rounded once
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([angle.sin(), angle.sin()])
    rot = y[..., :rd]
    rotated = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, y[..., rd:]], dim=-1)


@cuda
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_qk_norm_rope_store_cuda_large_positions_float32_angles(cache_dtype):
    """Positions up to 2^17: bound 5e-5 against float32-formed angles (see hf_float32_angle_rope); a
    fast-math powf/sinf would be off by up to ~0.03 rad here."""
    hq, hkv, hd, rd = M27B
    T, max_seq = 4, 1 << 17
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=3)
    positions = torch.tensor([1000, 32767, 65536 + 123, max_seq - 1], dtype=torch.int32)
    q, _, k, _ = ref.split_qgkv(qgkv.double(), hkv, hd)
    k_cache = torch.zeros(max_seq, hkv, hd, dtype=cache_dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q_out = torch.full((T, hq, hd), float("nan"), device="cuda")
    ops.attn_qk_norm_rope_store(qgkv.cuda(), q_norm.cuda(), k_norm.cuda(), positions.cuda(), EPS, THETA, rd, q_out,
                                k_cache, v_cache)
    rows = positions.long()
    k_got = k_cache[rows.cuda()].cpu().double()
    tol = dict(rtol=0, atol=5e-5) if cache_dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
    for t in range(T):
        pos = int(positions[t])
        exp_q = hf_float32_angle_rope(q[t], q_norm.double(), pos, rd)
        torch.testing.assert_close(q_out[t].cpu().double(), exp_q, rtol=0, atol=5e-5)
        torch.testing.assert_close(k_got[t], hf_float32_angle_rope(k[t], k_norm.double(), pos, rd), **tol)


def attention_expected(q, k_cache, v_cache, positions, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    ref.attention(q.double(), k_cache.double(), v_cache.double(), positions, scale, out, None)
    return out


def run_attention_cuda(q, k_cache, v_cache, positions, scale):
    T, hq, hd = q.shape
    out = torch.full((T, hq, hd), float("nan"), device="cuda")
    workspace = torch.full((workspace_numel(T, hq, hd, batched=k_cache.dim() == 4),), float("nan"), device="cuda")
    ops.attention(q, k_cache, v_cache, positions, scale, out, workspace)
    return out


ATTENTION_CASES = [
    # (Hq, Hkv, hd, T, positions): decode at several context lengths (1 row, one tile, many splits),
    # the oracle, every group-size instance (1, 2, 3->4, 5->6, 6, 8), causal prefill blocks (T = 7: the
    # decode step's 64 splits each; T = 40: one split, no combine; T = 70: workspace sized by T).
    (24, 4, 256, 1, [0]),
    (24, 4, 256, 1, [37]),
    (24, 4, 256, 1, [4999]),
    (4, 2, 32, 1, [1234]),
    (4, 2, 32, 3, [0, 1, 2]),
    (2, 2, 64, 1, [700]),
    (6, 2, 128, 2, [300, 2100]),
    (5, 1, 64, 1, [999]),
    (8, 1, 128, 1, [2048]),
    (24, 4, 256, 7, list(range(1500, 1507))),
    (4, 2, 32, 40, list(range(100, 140))),
    (6, 3, 64, 70, list(range(10, 80))),
]


def check_attention_against_reference(k_cache, v_cache, positions, num_heads):
    """attention on random queries against the float64 reference over the same cache values (a bf16 cache is
    exact in float64): bound 2e-5 absolute (outputs are convex combinations of N(0,1) values, float32 softmax)."""
    T, hd = positions.shape[0], k_cache.shape[-1]
    q = torch.randn(T, num_heads, hd, generator=torch.Generator().manual_seed(T)) * 1.5
    scale = hd**-0.5
    expected = attention_expected(q, k_cache, v_cache, positions, scale)
    out = run_attention_cuda(q.cuda(), k_cache.cuda(), v_cache.cuda(), positions.cuda(), scale)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.cpu().double(), expected, rtol=0, atol=2e-5)


@cuda
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_T{c[3]}_p{c[4][-1]}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_cuda_matches_reference(case, cache_dtype):
    """Against the float64 reference over the same cache values (a bf16 cache is exact in float64):
    bound 2e-5 absolute (outputs are convex combinations of N(0,1) values, float32 softmax). Cache rows
    past the largest position are NaN, so a read past the causal bound fails the test."""
    assert_cuda_kernel("attention")
    hq, hkv, hd, T, pos = case
    max_seq = max(pos) + 9
    positions = torch.tensor(pos, dtype=torch.int32)
    k_cache, v_cache = make_cache(max_seq, hkv, hd, cache_dtype, seed=hd + T, poison_from=max(pos) + 1)
    check_attention_against_reference(k_cache, v_cache, positions, hq)


@cuda
def test_attention_graph_serves_every_position_bitwise():
    """One capture, positions changed on the device between replays: each replay equals an eager call at
    those positions bit for bit; two eager calls are bit-identical (fixed-order combine)."""
    hq, hkv, hd, _ = M27B
    max_seq = 9000
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.bfloat16, device="cuda", seed=2)
    q = torch.randn(1, hq, hd, device="cuda")
    positions = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1, hq, hd, device="cuda")
    workspace = torch.empty(workspace_numel(1, hq, hd), device="cuda")
    scale = hd**-0.5

    def step():
        ops.attention(q, k_cache, v_cache, positions, scale, out, workspace)

    graph = capture_graph(step)
    for pos in (0, 31, 32, 1000, 8191, max_seq - 1):
        positions.fill_(pos)
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        eager = run_attention_cuda(q, k_cache, v_cache, positions, scale)
        assert torch.equal(replayed, eager), pos
        assert torch.equal(eager, run_attention_cuda(q, k_cache, v_cache, positions, scale)), pos


@cuda
def test_layer_graph_replay_bitwise_pdl_on_and_off(tmp_path):
    """check_layer_graph_replay_bitwise with programmatic dependent launch on and off (each in its own child:
    QWEN38_PDL is read once per process): the same bits both ways."""
    assert_same_bits_pdl_on_and_off(__file__, "check_layer_graph_replay_bitwise", str(tmp_path))


def check_layer_graph_replay_bitwise():
    """store -> attention (split-K + combine) -> gate (int8 lane) -> attention_gated, launched back to back,
    captured once and replayed at a moved position == eager, for both cache dtypes; the fused op equals the
    two; saves the eager results."""
    from safetensors.torch import save_file

    hq, hkv, hd, rd = M27B
    max_seq = 600
    results = {}
    for cache_dtype in CACHE_DTYPES:
        qgkv, q_norm, k_norm = [x.cuda() for x in make_qgkv(1, hq, hkv, hd, seed=4)]
        k0, v0 = make_cache(max_seq, hkv, hd, cache_dtype, device="cuda", seed=4)
        bufs = dict(k=k0.clone(), v=v0.clone(), q=torch.empty(1, hq, hd, device="cuda"),
                    attn=torch.empty(1, hq, hd, device="cuda"), out=torch.empty(1, hq * hd, device="cuda"),
                    out_q=torch.empty(1, hq * hd, dtype=torch.int8, device="cuda"),
                    out_d=torch.empty(1, hq * hd // 32, device="cuda"))
        bufs.update(fused=torch.empty_like(bufs["out"]), fused_q=torch.empty_like(bufs["out_q"]),
                    fused_d=torch.empty_like(bufs["out_d"]))
        positions = torch.tensor([100], dtype=torch.int32, device="cuda")
        workspace = torch.empty(workspace_numel(1, hq, hd), device="cuda")

        def step():
            ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, bufs["q"], bufs["k"],
                                        bufs["v"])
            ops.attention(bufs["q"], bufs["k"], bufs["v"], positions, hd**-0.5, bufs["attn"], workspace)
            ops.attn_output_gate(bufs["attn"], qgkv, bufs["out"], bufs["out_q"], None, bufs["out_d"])
            ops.attention_gated(bufs["q"], bufs["k"], bufs["v"], positions, hd**-0.5, qgkv, workspace,
                                bufs["fused"], bufs["fused_q"], None, bufs["fused_d"])

        def reset():
            bufs["k"].copy_(k0)
            bufs["v"].copy_(v0)
            for name in ("q", "attn", "out", "out_d", "fused", "fused_d"):
                bufs[name].fill_(float("nan"))
            bufs["out_q"].fill_(0x7F)
            bufs["fused_q"].fill_(0x7F)

        graph = capture_graph(step)
        positions.fill_(517)
        reset()
        step()
        eager = {k: v.clone() for k, v in bufs.items()}
        reset()
        graph.replay()
        torch.cuda.synchronize()
        for name in bufs:
            assert torch.equal(bufs[name], eager[name]), (cache_dtype, name)
            results[f"{str(cache_dtype).split('.')[-1]}_{name}"] = eager[name].cpu()
        assert torch.isfinite(eager["out"]).all()
        for name in ("", "_q", "_d"):  # the gate in the combine: the bits of the separate gate
            assert torch.equal(eager[f"fused{name}"], eager[f"out{name}"]), (cache_dtype, name)
    save_file(results, os.environ["QWEN38_TEST_OUT"])


@cuda
@pytest.mark.parametrize("shape,T", [(ORACLE, 3), (M27B, 1), (M27B, 2)])
@pytest.mark.parametrize("lane", ["f32", "int8", "int8x2"])
def test_output_gate_cuda(shape, T, lane):
    """out against the float64 reference (bound 1e-6 relative: fast sigmoid); the quantized words and
    scales equal, exactly, the reference quantizer applied to the kernel's own float32 out."""
    assert_cuda_kernel("attn_output_gate")
    hq, hkv, hd, _ = shape
    width = hq * hd
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd, seed=T)
    attn = torch.randn(T, hq, hd, generator=torch.Generator().manual_seed(7)) * 3
    attn[0, 0, :32] = 0.0  # an all-zero quantization block: d = 0
    expected = torch.empty(T, width, dtype=torch.float64)
    ref.attn_output_gate(attn.double(), qgkv.double(), expected)
    out = rows_view(torch.empty(T, width, device="cuda")).fill_(float("nan"))
    out_q = out_q_lo = out_d = None
    if lane != "f32":
        out_q = torch.full((T, width), 0x7F, dtype=torch.int8, device="cuda")
        out_d = torch.full((T, width // 32), float("nan"), device="cuda")
    if lane == "int8x2":
        out_q_lo = torch.full((T, width), 0x7F, dtype=torch.int8, device="cuda")
    ops.attn_output_gate(attn.cuda(), rows_view(qgkv.cuda()), out, out_q, out_q_lo, out_d)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-6, atol=1e-7)
    if lane == "f32":
        return
    got = out.cpu().contiguous()
    if lane == "int8":
        q, d = ref_quant.quantize_int8(got)
        assert torch.equal(out_q.cpu(), q)
    else:
        q, q_lo, d = ref_quant.quantize_int8x2(got)
        assert torch.equal(out_q.cpu(), q) and torch.equal(out_q_lo.cpu(), q_lo)
    assert torch.equal(out_d.cpu(), d)


GATED_CASES = [  # (Hq, Hkv, hd, T, last position): the 27B shape (decode, verify of 3 and of 8 rows), the
    # oracle, odd head counts and the smallest head_dim
    (24, 4, 256, 1, 4999),
    (24, 4, 256, 3, 77),
    (24, 4, 256, 8, 2000),
    (4, 2, 32, 2, 40),
    (5, 1, 64, 1, 999),
    (6, 3, 128, 5, 300),
]


def check_gated_equals_unfused(q, k_cache, v_cache, positions, qgkv, lane, batched):
    """attention_gated (outputs poisoned first) gives the bits of attention followed by attn_output_gate, and
    its float output is within the float64 reference's bound. batched: caches [T, max_seq, Hkv, hd], else one
    shared cache."""
    T, hq, hd = q.shape
    width = hq * hd
    args = (q.cuda(), k_cache.cuda(), v_cache.cuda(), positions.cuda(), hd**-0.5)

    def outputs():
        out = rows_view(torch.full((T, width), float("nan"), device="cuda"))
        if lane == "f32":
            return out, None, None, None
        out_q = torch.full((T, width), 0x7F, dtype=torch.int8, device="cuda")
        out_q_lo = torch.full((T, width), 0x7F, dtype=torch.int8, device="cuda") if lane == "int8x2" else None
        return out, out_q, out_q_lo, torch.full((T, width // 32), float("nan"), device="cuda")

    workspace = torch.full((workspace_numel(T, hq, hd, batched=batched),), float("nan"), device="cuda")
    attn = torch.full((T, hq, hd), float("nan"), device="cuda")
    ops.attention(*args, attn, workspace)
    unfused = outputs()
    ops.attn_output_gate(attn, rows_view(qgkv.cuda()), *unfused)
    workspace.fill_(float("nan"))
    fused = outputs()
    ops.attention_gated(*args, rows_view(qgkv.cuda()), workspace, *fused)
    for name, got, want in zip(("out", "out_q", "out_q_lo", "out_d"), fused, unfused):
        if want is not None:
            assert torch.equal(got, want), name
    expected = torch.empty(T, width, dtype=torch.float64)
    ref.attention_gated(q.double(), k_cache.double(), v_cache.double(), positions, hd**-0.5, qgkv.double(), None,
                        expected)
    torch.testing.assert_close(fused[0].cpu().double(), expected, rtol=0, atol=2e-5)


@cuda
@pytest.mark.parametrize("case", GATED_CASES, ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_T{c[3]}_p{c[4]}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("lane", ["f32", "int8", "int8x2"])
def test_attention_gated_cuda_equals_attention_then_gate(case, cache_dtype, lane):
    """The gate applied in the combine gives the bits of attention followed by attn_output_gate (same float
    expressions, same order), every output poisoned first; and the float output is within the float64
    reference's bound."""
    assert_cuda_kernel("attention_gated")
    hq, hkv, hd, T, last = case
    max_seq = last + 9
    positions = torch.arange(last - T + 1, last + 1, dtype=torch.int32)
    k_cache, v_cache = make_cache(max_seq, hkv, hd, cache_dtype, seed=hd + T, poison_from=last + 1)
    q = torch.randn(T, hq, hd, generator=torch.Generator().manual_seed(T)) * 1.5
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd, seed=T + 1)
    check_gated_equals_unfused(q, k_cache, v_cache, positions, qgkv, lane, batched=False)


@cuda
def test_opcheck_cuda():
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 2, 16
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, device="cuda")
    positions = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.bfloat16, device="cuda")
    q_out = torch.empty(T, hq, hd, device="cuda")
    torch.library.opcheck(ops.attn_qk_norm_rope_store.default,
                          (qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache))
    out = torch.empty(T, hq, hd, device="cuda")
    workspace = torch.empty(workspace_numel(T, hq, hd), device="cuda")
    torch.library.opcheck(ops.attention.default, (q_out, k_cache, v_cache, positions, hd**-0.5, out, workspace))
    width = hq * hd
    gate_outs = (torch.empty(T, width, device="cuda"), torch.empty(T, width, dtype=torch.int8, device="cuda"),
                 torch.empty(T, width, dtype=torch.int8, device="cuda"), torch.empty(T, width // 32, device="cuda"))
    torch.library.opcheck(ops.attn_output_gate.default, (out, qgkv, *gate_outs))
    torch.library.opcheck(ops.attention_gated.default,
                          (q_out, k_cache, v_cache, positions, hd**-0.5, qgkv, workspace, *gate_outs))


def check_bad_inputs():
    """Every wrong argument raises a RuntimeError naming the op and the argument (run in a child
    process by test_bad_inputs_raise)."""
    hq, hkv, hd, rd = ORACLE
    T, max_seq = 2, 16
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, device="cuda")
    positions = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    k_cache, v_cache = make_cache(max_seq, hkv, hd, torch.float32, device="cuda")
    q_out = torch.empty(T, hq, hd, device="cuda")
    store = ops.attn_qk_norm_rope_store
    progress()
    with pytest.raises(RuntimeError, match="positions must be"):
        store(qgkv, q_norm, k_norm, positions.long(), EPS, THETA, rd, q_out, k_cache, v_cache)
    progress()
    with pytest.raises(RuntimeError, match="positions must be on"):
        store(qgkv, q_norm, k_norm, positions.cpu(), EPS, THETA, rd, q_out, k_cache, v_cache)
    progress()
    with pytest.raises(RuntimeError, match="k_cache must be float32 or bfloat16"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache.half(), v_cache.half())
    progress()
    with pytest.raises(RuntimeError, match="v_cache must have k_cache's dtype"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache.bfloat16())
    progress()
    with pytest.raises(RuntimeError, match="qgkv must be"):
        store(qgkv[:, :-1], q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache)
    progress()
    with pytest.raises(RuntimeError, match="rotary_dim"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, 7, q_out, k_cache, v_cache)
    out = torch.empty(T, hq, hd, device="cuda")
    workspace = torch.empty(workspace_numel(T, hq, hd), device="cuda")
    progress()
    with pytest.raises(RuntimeError, match="workspace must hold"):
        ops.attention(q_out, k_cache, v_cache, positions, 0.1, out, workspace[:-1])
    progress()
    with pytest.raises(RuntimeError, match="head_dim must be one of"):
        ops.attention(q_out[..., :24].contiguous(), k_cache[..., :24].contiguous(), v_cache[..., :24].contiguous(),
                      positions, 0.1, out[..., :24].contiguous(), workspace)
    progress()
    with pytest.raises(RuntimeError, match="Hq must be a multiple of Hkv"):
        ops.attention(q_out[:, :3].contiguous(), k_cache, v_cache, positions, 0.1, out[:, :3].contiguous(), workspace)
    progress()
    with pytest.raises(RuntimeError, match="attention: q must be Float"):
        ops.attention(q_out.double(), k_cache, v_cache, positions, 0.1, out, workspace)
    width = hq * hd
    progress()
    with pytest.raises(RuntimeError, match="out_q and out_d come together"):
        ops.attn_output_gate(out, qgkv, torch.empty(T, width, device="cuda"),
                             torch.empty(T, width, dtype=torch.int8, device="cuda"), None, None)
    progress()
    with pytest.raises(RuntimeError, match="out must be"):
        ops.attn_output_gate(out, qgkv, torch.empty(T, width + 1, device="cuda"), None, None, None)
    progress()
    with pytest.raises(RuntimeError, match="attn_output_gate"):
        ops.attn_output_gate(out.cpu(), qgkv, torch.empty(T, width, device="cuda"), None, None, None)
    progress()
    rows = 9  # one past the decode step's same-split rows
    q9 = torch.zeros(rows, hq, hd, device="cuda")
    with pytest.raises(RuntimeError, match="attention_gated: T must be at most 8"):
        ops.attention_gated(q9, k_cache, v_cache, torch.zeros(rows, dtype=torch.int32, device="cuda"), 0.1,
                            torch.zeros(rows, qgkv.shape[1], device="cuda"),
                            torch.empty(workspace_numel(rows, hq, hd), device="cuda"),
                            torch.empty(rows, width, device="cuda"), None, None, None)
    progress()
    with pytest.raises(RuntimeError, match="attention_gated: out_q and out_d come together"):
        ops.attention_gated(q_out, k_cache, v_cache, positions, 0.1, qgkv, workspace,
                            torch.empty(T, width, device="cuda"),
                            torch.empty(T, width, dtype=torch.int8, device="cuda"), None, None)
    progress()
    with pytest.raises(RuntimeError, match="attention_gated: qgkv must be"):
        ops.attention_gated(q_out, k_cache, v_cache, positions, 0.1, qgkv[:, :width], workspace,
                            torch.empty(T, width, device="cuda"), None, None, None)

    # Batched rows: caches [T, max_seq, Hkv, hd], flags [1] or [T], the batched workspace.
    row_k, row_v = k_cache.expand(T, -1, -1, -1).contiguous(), v_cache.expand(T, -1, -1, -1).contiguous()
    three_k, three_v = k_cache.expand(3, -1, -1, -1).contiguous(), v_cache.expand(3, -1, -1, -1).contiguous()
    progress()
    with pytest.raises(RuntimeError, match="attn_qk_norm_rope_store: a 4-D k_cache holds a cache a sequence: .* B "
                                           "dividing T = 2"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, three_k, three_v)
    progress()
    with pytest.raises(RuntimeError, match="attn_qk_norm_rope_store: k_cache must be \\[max_seq, Hkv, hd\\], or"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, row_k[None], row_v[None])
    progress()
    with pytest.raises(RuntimeError, match="v_cache must be shaped like k_cache"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, row_k, v_cache)
    progress()
    with pytest.raises(RuntimeError, match="max_seq >= 1"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, row_k[:, :0], row_v[:, :0])
    progress()
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be contiguous"):
        store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, row_k.transpose(0, 1), row_v.transpose(0, 1))
    for flag in (torch.zeros(T + 1, dtype=torch.int32, device="cuda"), torch.zeros(T, dtype=torch.int32),
                 torch.zeros(T, dtype=torch.int64, device="cuda"),
                 torch.zeros(2 * T, dtype=torch.int32, device="cuda")[::2]):
        progress()
        with pytest.raises(RuntimeError, match="bad_position must be contiguous int32 with 1 element"):
            store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, row_k, row_v, flag)
    progress()
    with pytest.raises(RuntimeError, match="attention: a 4-D k_cache holds a cache a sequence"):
        ops.attention(q_out, three_k, three_v, positions, 0.1, out, workspace)
    rows_k, rows_v = k_cache.expand(rows, -1, -1, -1).contiguous(), v_cache.expand(rows, -1, -1, -1).contiguous()
    shared_size = torch.empty(workspace_numel(rows, hq, hd), device="cuda")  # the shared cache's: fewer splits
    progress()
    with pytest.raises(RuntimeError, match="workspace must hold .*batched=True"):
        ops.attention(q9, rows_k, rows_v, torch.zeros(rows, dtype=torch.int32, device="cuda"), 0.1,
                      torch.empty(rows, hq, hd, device="cuda"), shared_size)
    progress()
    with pytest.raises(RuntimeError, match="attention_gated: workspace must hold .*batched=True"):
        ops.attention_gated(q9, rows_k, rows_v, torch.zeros(rows, dtype=torch.int32, device="cuda"), 0.1,
                            torch.zeros(rows, qgkv.shape[1], device="cuda"), shared_size,
                            torch.empty(rows, width, device="cuda"), None, None, None)


@cuda
def test_bad_inputs_raise():
    """check_bad_inputs in a child process (see cuda_helpers.run_in_child for why), after the control
    TORCH_ERROR_CONTROL."""
    run_in_child(__file__, "check_bad_inputs", preamble=TORCH_ERROR_CONTROL)


@cuda
def test_the_split_rule_is_the_kernels():
    """qwen38_ops.attention's split rule (hence workspace_numel) is the binding's, token count by token count:
    a workspace of exactly workspace_numel(T) floats is taken and one float fewer is refused. (A formula
    restated in the test could not fail when the Python copy of the rule drifted: the review's mutation M2,
    `num_tokens <= SAME_SPLIT_TOKENS` made `<= 1`, passed every CPU test.)"""
    hq, hkv, hd = 4, 2, 32
    k_cache, v_cache = make_cache(300, hkv, hd, torch.float32, device="cuda", seed=0)
    for T in (1, 2, SAME_SPLIT_TOKENS, SAME_SPLIT_TOKENS + 1, 31, 33, 64, 65, 200):
        q = torch.randn(T, hq, hd, device="cuda")
        positions = torch.arange(T, dtype=torch.int32, device="cuda")
        out = torch.empty(T, hq, hd, device="cuda")
        ops.attention(q, k_cache, v_cache, positions, hd**-0.5, out, torch.empty(workspace_numel(T, hq, hd), device="cuda"))
        with pytest.raises(RuntimeError, match="workspace must hold"):
            ops.attention(q, k_cache, v_cache, positions, hd**-0.5, out,
                          torch.empty(workspace_numel(T, hq, hd) - 1, device="cuda"))
    assert num_splits(1) == ATTENTION_SPLITS and num_splits(SAME_SPLIT_TOKENS + 1) < ATTENTION_SPLITS


@cuda
@pytest.mark.parametrize("T", [2, 4, 7, 8])
def test_attention_rows_equal_single_token_calls_bitwise(T):
    """A speculative verify of T <= 8 tokens must compute each row exactly as the decode step does (greedy
    speculative output = plain greedy): row t of one T-row call equals a T = 1 call at positions[t], bit
    for bit, at the 27B shape over a long context (many splits per row)."""
    hq, hkv, hd, _ = M27B
    positions = torch.arange(5000, 5000 + T, dtype=torch.int32, device="cuda")
    k_cache, v_cache = make_cache(5000 + T + 3, hkv, hd, torch.bfloat16, device="cuda", seed=T)
    q = torch.randn(T, hq, hd, device="cuda")
    together = run_attention_cuda(q, k_cache, v_cache, positions, hd**-0.5)
    for t in range(T):
        alone = run_attention_cuda(q[t : t + 1].contiguous(), k_cache, v_cache, positions[t : t + 1], hd**-0.5)
        assert torch.equal(together[t : t + 1], alone), t


def test_position_outside_the_cache_sets_the_flag_and_stores_nothing():
    """The reference (and the kernel, below) store nothing for an out-of-range position and set the flag."""
    hq, hkv, hd, rd = 4, 2, 32, 8
    qgkv, q_norm, k_norm = make_qgkv(3, hq, hkv, hd, seed=1)
    k_cache, v_cache = torch.zeros(8, hkv, hd), torch.zeros(8, hkv, hd)
    flag = torch.zeros(1, dtype=torch.int32)
    q_out = torch.empty(3, hq, hd)
    positions = torch.tensor([2, 8, -1], dtype=torch.int32)
    ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, flag)
    assert int(flag) == 1
    assert k_cache[2].abs().sum() > 0 and k_cache[[0, 1, 3, 4, 5, 6, 7]].abs().sum() == 0
    flag.zero_()
    ops.attn_qk_norm_rope_store(qgkv[:1], q_norm, k_norm, positions[:1], EPS, THETA, rd, q_out[:1], k_cache, v_cache,
                                flag)
    assert int(flag) == 0


@cuda
def test_cuda_position_outside_the_cache_sets_the_flag():
    hq, hkv, hd, rd = M27B
    qgkv, q_norm, k_norm = make_qgkv(3, hq, hkv, hd, seed=1)
    k_cache = torch.full((8, hkv, hd), float("nan"), device="cuda")
    v_cache = torch.full((8, hkv, hd), float("nan"), device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    q_out = torch.empty(3, hq, hd, device="cuda")
    positions = torch.tensor([2, 8, -1], dtype=torch.int32, device="cuda")
    ops.attn_qk_norm_rope_store(qgkv.cuda(), q_norm.cuda(), k_norm.cuda(), positions, EPS, THETA, rd, q_out, k_cache,
                                v_cache, flag)
    assert int(flag) == 1
    assert torch.isfinite(k_cache[2]).all() and torch.isnan(k_cache[[0, 1, 3, 4, 5, 6, 7]]).all()


# ---------------------------------------------------------------------------------------------------
# CUDA: batched rows.

@cuda
@pytest.mark.parametrize("shape", [ORACLE, M27B, (6, 3, 64, 64), (2, 2, 80, 0)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("T", [1, 3, 13])
def test_batched_store_cuda_float64(shape, cache_dtype, T):
    """Batched rows against the float64 reference (bounds as test_qk_norm_rope_store_cuda_float64): row t's q, and
    its k and v at row positions[t] of cache t; every other row of every cache keeps its NaN poison (rows of
    different caches at the same position included)."""
    assert_cuda_kernel("attn_qk_norm_rope_store")
    hq, hkv, hd, rd = shape
    max_seq = 64
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=T + hd + 1)
    positions = torch.randint(0, max_seq, (T,), generator=torch.Generator().manual_seed(T), dtype=torch.int32)
    k_cache = torch.full((T, max_seq, hkv, hd), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_out, v_out, exp_k, exp_v, tol = store_against_reference(qgkv, q_norm, k_norm, positions, rd, k_cache, v_cache,
                                                             hq, cache_dtype)
    written = torch.zeros(T, max_seq, dtype=torch.bool)
    written[torch.arange(T), positions.long()] = True
    k_out, v_out = k_out.cpu().double(), v_out.cpu().double()
    assert torch.isnan(k_out[~written]).all() and torch.isnan(v_out[~written]).all()
    torch.testing.assert_close(k_out[written], exp_k[written], **tol)
    torch.testing.assert_close(v_out[written], exp_v[written].to(cache_dtype).double(), rtol=0, atol=0)


BATCHED_CASES = [
    # (Hq, Hkv, hd, positions): a cache a row, each row at its own context length. The 27B shape (one row, one
    # tile, many splits in one call; 13 rows, more than a shared cache's 8), the oracle over 64 rows, every
    # group-size instance (1, 2, 3->4, 5->6, 6, 8) and head_dim.
    (24, 4, 256, [0, 37, 4999]),
    (24, 4, 256, [1500, 3, 700, 1999, 64, 65, 127, 128, 1000, 0, 31, 1234, 1777]),
    (4, 2, 32, [(t * 389) % 1300 for t in range(64)]),
    (2, 2, 64, [700, 3]),
    (6, 2, 128, [300, 2100]),
    (5, 1, 64, [999, 5, 0]),
    (6, 3, 64, [10, 500, 80, 1]),
    (8, 1, 128, [2048, 1, 129, 10]),
]


@cuda
@pytest.mark.parametrize("case", BATCHED_CASES, ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_T{len(c[3])}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_batched_attention_cuda_matches_reference(case, cache_dtype):
    """attention with caches [T, max_seq, Hkv, hd] against the float64 reference (bound as
    test_attention_cuda_matches_reference); cache t's rows past positions[t] are NaN, so a row that reads past its
    own bound fails; out and workspace poisoned."""
    assert_cuda_kernel("attention")
    hq, hkv, hd, pos = case
    T, max_seq = len(pos), max(pos) + 9
    positions = torch.tensor(pos, dtype=torch.int32)
    k_cache, v_cache = make_row_caches(positions, max_seq, hkv, hd, cache_dtype, seed=hd + T)
    check_attention_against_reference(k_cache, v_cache, positions, hq)


@cuda
@pytest.mark.parametrize("case", BATCHED_CASES[:3] + BATCHED_CASES[-1:],
                         ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_T{len(c[3])}")
@pytest.mark.parametrize("lane", ["f32", "int8", "int8x2"])
def test_batched_attention_gated_cuda_equals_attention_then_gate(case, lane):
    """Batched rows of any T (13 and 64 here: past the shared cache's limit of 8) through attention_gated: the bits
    of batched attention followed by attn_output_gate, every output poisoned first, and within the float64
    reference's bound."""
    assert_cuda_kernel("attention_gated")
    hq, hkv, hd, pos = case
    T, max_seq = len(pos), max(pos) + 9
    positions = torch.tensor(pos, dtype=torch.int32)
    k_cache, v_cache = make_row_caches(positions, max_seq, hkv, hd, torch.bfloat16, seed=hd + T)
    q = torch.randn(T, hq, hd, generator=torch.Generator().manual_seed(T)) * 1.5
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd, seed=T + 1)
    check_gated_equals_unfused(q, k_cache, v_cache, positions, qgkv, lane, batched=True)


@cuda
@pytest.mark.parametrize("T", [1, 2, 3, 8, 13, 64])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_batched_rows_equal_one_row_calls_bitwise(T, cache_dtype):
    """The batch-invariance contract: row t of a batched store -> attention -> attention_gated (int8 lane) gives,
    bit for bit, what T = 1 calls on cache t alone (the shared-cache mode) give: q_out, the whole of cache t,
    attention's out, the gated out and its quantized words and scales. The 27B shape, each row at its own context
    length (one row to many splits), qgkv row-strided."""
    hq, hkv, hd, rd = M27B
    width, scale, max_seq = hq * hd, hd**-0.5, 1500
    g = torch.Generator().manual_seed(T)
    positions = torch.randint(0, max_seq, (T,), generator=g, dtype=torch.int32)
    positions[0] = max_seq - 1
    positions = positions.cuda()
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=T)
    qgkv, q_norm, k_norm = rows_view(qgkv.cuda()), q_norm.cuda(), k_norm.cuda()
    g_cuda = torch.Generator(device="cuda").manual_seed(T)
    k0, v0 = (torch.randn(T, max_seq, hkv, hd, generator=g_cuda, device="cuda").to(cache_dtype) for _ in range(2))

    def step(rows, k_cache, v_cache):
        """The three ops on qgkv's rows `rows` (a slice) and the given caches, every output poisoned first."""
        n = rows.stop - rows.start
        nan = lambda *size: torch.full(size, float("nan"), device="cuda")
        o = dict(q=nan(n, hq, hd), attn=nan(n, hq, hd), out=nan(n, width),
                 out_q=torch.full((n, width), 0x7F, dtype=torch.int8, device="cuda"), out_d=nan(n, width // 32))
        batched = k_cache.dim() == 4
        workspace = nan(workspace_numel(n, hq, hd, batched=batched))
        ops.attn_qk_norm_rope_store(qgkv[rows], q_norm, k_norm, positions[rows], EPS, THETA, rd, o["q"], k_cache,
                                    v_cache)
        ops.attention(o["q"], k_cache, v_cache, positions[rows], scale, o["attn"], workspace)
        ops.attention_gated(o["q"], k_cache, v_cache, positions[rows], scale, qgkv[rows], workspace, o["out"],
                            o["out_q"], None, o["out_d"])
        return o

    k_cache, v_cache = k0.clone(), v0.clone()
    together = step(slice(0, T), k_cache, v_cache)
    assert torch.isfinite(together["out"]).all()
    for t in range(T):
        k_alone, v_alone = k0[t].clone(), v0[t].clone()
        alone = step(slice(t, t + 1), k_alone, v_alone)
        for name, value in alone.items():
            assert torch.equal(together[name][t : t + 1], value), (t, name)
        assert torch.equal(k_cache[t], k_alone) and torch.equal(v_cache[t], v_alone), t


@cuda
def test_opcheck_cuda_batched_rows():
    opcheck_batched_rows("cuda", torch.bfloat16)


@cuda
def test_cuda_per_row_bad_position_flags():
    assert_cuda_kernel("attn_qk_norm_rope_store")
    check_per_row_flags("cuda")


@cuda
def test_batched_workspace_rule_is_the_kernels():
    """workspace_numel(T, ..., batched=True) is the binding's size for caches [T, max_seq, Hkv, hd] at every T
    (ATTENTION_SPLITS a row, also past SAME_SPLIT_TOKENS): exactly that many floats are taken by attention and
    attention_gated, one fewer refused."""
    hq, hkv, hd = 4, 2, 32
    width = hq * hd
    for T in (1, 2, SAME_SPLIT_TOKENS, SAME_SPLIT_TOKENS + 1, 64, 65):
        assert num_splits(T, batched=True) == ATTENTION_SPLITS
        k_cache, v_cache = (c.view(T, 40, hkv, hd) for c in make_cache(T * 40, hkv, hd, torch.float32, device="cuda"))
        q = torch.randn(T, hq, hd, device="cuda")
        positions = torch.arange(T, dtype=torch.int32, device="cuda") % 40
        qgkv = torch.randn(T, 2 * width + 2 * hkv * hd, device="cuda")
        out, gated = torch.empty(T, hq, hd, device="cuda"), torch.empty(T, width, device="cuda")
        needed = workspace_numel(T, hq, hd, batched=True)
        for numel in (needed, needed - 1):
            workspace = torch.empty(numel, device="cuda")
            with pytest.raises(RuntimeError, match="workspace must hold") if numel < needed else nullcontext():
                ops.attention(q, k_cache, v_cache, positions, 0.1, out, workspace)
            with pytest.raises(RuntimeError, match="workspace must hold") if numel < needed else nullcontext():
                ops.attention_gated(q, k_cache, v_cache, positions, 0.1, qgkv, workspace, gated, None, None, None)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------
# CUDA: batched verify rows (caches [B, max_seq, Hkv, hd], n consecutive rows a sequence).

VERIFY_CASES = [
    # (Hq, Hkv, hd, n, bases): the 27B shape (verify of 2, 4 and 7 rows for 3 to 16 sequences, contexts from one
    # tile to many splits), the oracle, odd group sizes and head_dims.
    (24, 4, 256, 4, [0, 37, 4999]),
    (24, 4, 256, 2, [1500, 3, 700, 1999, 64, 65, 127, 128]),
    (24, 4, 256, 7, [(b * 389) % 1300 for b in range(16)]),
    (4, 2, 32, 3, [5, 0, 1234, 77, 9]),
    (5, 1, 64, 5, [999, 0]),
    (6, 3, 128, 2, [300, 2100, 1]),
    (8, 1, 128, 8, [2048, 129]),
]


def verify_caches(bases, n, hkv, hd, cache_dtype, seed):
    """Cache b random up to its last verify row, NaN past it, max_seq 9 rows past the longest."""
    last = [b + n - 1 for b in bases]
    return make_row_caches(torch.tensor(last), max(last) + 9, hkv, hd, cache_dtype, seed=seed)


@cuda
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_n{c[3]}_B{len(c[4])}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_batched_verify_attention_cuda_matches_reference(case, cache_dtype):
    """attention over B sequences of n rows against the float64 reference (bound as
    test_attention_cuda_matches_reference): each row sees its own cache up to its own position, the rows past it
    (the sequence's later drafts, then NaN) unread; out and workspace poisoned."""
    assert_cuda_kernel("attention")
    hq, hkv, hd, n, bases = case
    k_cache, v_cache = verify_caches(bases, n, hkv, hd, cache_dtype, seed=hd + n)
    check_attention_against_reference(k_cache, v_cache, verify_positions(bases, n), hq)


@cuda
@pytest.mark.parametrize("case", VERIFY_CASES[:4], ids=lambda c: f"H{c[0]}x{c[1]}_hd{c[2]}_n{c[3]}_B{len(c[4])}")
@pytest.mark.parametrize("lane", ["f32", "int8", "int8x2"])
def test_batched_verify_attention_gated_equals_attention_then_gate(case, lane):
    assert_cuda_kernel("attention_gated")
    hq, hkv, hd, n, bases = case
    k_cache, v_cache = verify_caches(bases, n, hkv, hd, torch.bfloat16, seed=hd + n)
    T = len(bases) * n
    q = torch.randn(T, hq, hd, generator=torch.Generator().manual_seed(T)) * 1.5
    qgkv, _, _ = make_qgkv(T, hq, hkv, hd, seed=T + 1)
    check_gated_equals_unfused(q, k_cache, v_cache, verify_positions(bases, n), qgkv, lane, batched=True)


@cuda
@pytest.mark.parametrize("shape", [ORACLE, M27B, (6, 3, 64, 64)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("n", [2, 5])
def test_batched_verify_store_cuda_float64(shape, cache_dtype, n):
    """The store of B sequences of n rows against the float64 reference: sequence b's k and v at rows base_b ..
    base_b + n - 1 of cache b, every other row of every cache still NaN."""
    assert_cuda_kernel("attn_qk_norm_rope_store")
    hq, hkv, hd, rd = shape
    max_seq, bases = 64, [3, 0, 50, 20]
    T = len(bases) * n
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=n + hd)
    positions = verify_positions(bases, n)
    k_cache = torch.full((len(bases), max_seq, hkv, hd), float("nan"), dtype=torch.float64)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_out, v_out, exp_k, exp_v, tol = store_against_reference(qgkv, q_norm, k_norm, positions, rd, k_cache, v_cache,
                                                             hq, cache_dtype)
    written = torch.zeros(len(bases), max_seq, dtype=torch.bool)
    for b, base in enumerate(bases):
        written[b, base : base + n] = True
    k_out, v_out = k_out.cpu().double(), v_out.cpu().double()
    assert torch.isnan(k_out[~written]).all() and torch.isnan(v_out[~written]).all()
    torch.testing.assert_close(k_out[written], exp_k[written], **tol)
    torch.testing.assert_close(v_out[written], exp_v[written].to(cache_dtype).double(), rtol=0, atol=0)


@cuda
@pytest.mark.parametrize("sequences, n", [(1, 4), (3, 2), (5, 7), (16, 4), (16, 7)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_batched_verify_rows_equal_one_sequence_calls_bitwise(sequences, n, cache_dtype):
    """The contract the batched speculative step rests on: sequence b's n rows of a batched store -> attention ->
    attention_gated (int8 lane) give, bit for bit, what the one-sequence verify (n rows on cache b alone, the
    shared-cache mode) gives, which gives a decode step's bits row by row (test_attention_rows_equal_single_token
    _calls_bitwise): q_out, the whole of cache b, attention's out, the gated out, its words and scales. The 27B
    shape, each sequence at its own context length, qgkv row-strided, outputs poisoned."""
    hq, hkv, hd, rd = M27B
    width, scale, max_seq = hq * hd, hd**-0.5, 1500
    g = torch.Generator().manual_seed(sequences * n)
    bases = torch.randint(0, max_seq - n, (sequences,), generator=g).tolist()
    bases[0] = max_seq - n
    positions = verify_positions(bases, n).cuda()
    T = sequences * n
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, seed=T)
    qgkv, q_norm, k_norm = rows_view(qgkv.cuda()), q_norm.cuda(), k_norm.cuda()
    g_cuda = torch.Generator(device="cuda").manual_seed(T)
    k0, v0 = (torch.randn(sequences, max_seq, hkv, hd, generator=g_cuda, device="cuda").to(cache_dtype)
              for _ in range(2))

    def step(rows, k_cache, v_cache):
        count = rows.stop - rows.start
        nan = lambda *size: torch.full(size, float("nan"), device="cuda")
        o = dict(q=nan(count, hq, hd), attn=nan(count, hq, hd), out=nan(count, width),
                 out_q=torch.full((count, width), 0x7F, dtype=torch.int8, device="cuda"),
                 out_d=nan(count, width // 32))
        workspace = nan(workspace_numel(count, hq, hd, batched=k_cache.dim() == 4))
        ops.attn_qk_norm_rope_store(qgkv[rows], q_norm, k_norm, positions[rows], EPS, THETA, rd, o["q"], k_cache,
                                    v_cache)
        ops.attention(o["q"], k_cache, v_cache, positions[rows], scale, o["attn"], workspace)
        ops.attention_gated(o["q"], k_cache, v_cache, positions[rows], scale, qgkv[rows], workspace, o["out"],
                            o["out_q"], None, o["out_d"])
        return o

    k_cache, v_cache = k0.clone(), v0.clone()
    together = step(slice(0, T), k_cache, v_cache)
    assert torch.isfinite(together["out"]).all()
    for b in range(sequences):
        rows = slice(b * n, (b + 1) * n)
        k_alone, v_alone = k0[b].clone(), v0[b].clone()
        alone = step(rows, k_alone, v_alone)
        for name, value in alone.items():
            assert torch.equal(together[name][rows], value), (b, name)
        assert torch.equal(k_cache[b], k_alone) and torch.equal(v_cache[b], v_alone), b


@cuda
def test_opcheck_cuda_batched_verify_rows():
    hq, hkv, hd, rd = ORACLE
    bases, n = [2, 9, 0], 3
    T = len(bases) * n
    qgkv, q_norm, k_norm = make_qgkv(T, hq, hkv, hd, device="cuda")
    positions = verify_positions(bases, n).cuda()
    k_cache, v_cache = make_row_caches([b + n - 1 for b in bases], 16, hkv, hd, torch.bfloat16, device="cuda")
    q_out, flags = torch.empty(T, hq, hd, device="cuda"), torch.zeros(T, dtype=torch.int32, device="cuda")
    torch.library.opcheck(ops.attn_qk_norm_rope_store.default,
                          (qgkv, q_norm, k_norm, positions, EPS, THETA, rd, q_out, k_cache, v_cache, flags))
    out, workspace = torch.empty(T, hq, hd, device="cuda"), torch.empty(workspace_numel(T, hq, hd, batched=True),
                                                                        device="cuda")
    torch.library.opcheck(ops.attention.default, (q_out, k_cache, v_cache, positions, hd**-0.5, out, workspace))
