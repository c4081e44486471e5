"""attention_prefill: causal GQA attention of a prompt chunk over the KV cache (tensor-core kernel).

CPU (CI): opcheck, the reference against an explicit per-token softmax loop, and the split-K count (which
calls are split, how many ways). CUDA (-m cuda): the kernel against the float64 reference on random inputs,
at odd T around the 64-row block (1, 7, 63, 64, 65, 200), continuing from cached positions (first position 0,
5, 1000), non-consecutive positions, the oracle and 27B shapes and every head dim, both cache dtypes; the
split-K path (few rows: T = 9, 33, 100, 101 over 1k, 16k and 33k cached rows, every head dim and group size)
and the unsplit one (>= 353 rows at 27B); outputs and the workspace NaN-poisoned before each run and cache
rows past the last position NaN (a read past the causal bound shows); two runs give the same bits; a
captured graph replays bit for bit like eager; bad arguments raise.

Bars, by cache dtype (errors relative to the reference's scale; figures printed with -s):
- float32 (bf16 hi + lo split, three MMAs, ~1e-5): rel L2 <= 3e-5.
- bfloat16 (q and p rounded to bf16, flash-attention's usual precision): max abs error <= 2e-2 max|ref|,
  rel L2 <= 1e-2.
"""
import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.attention_prefill import num_splits, workspace_numel
from qwen38_ops.reference import attention_prefill as ref

from cuda_helpers import TORCH_ERROR_CONTROL, assert_cuda_kernel, capture_graph, cuda, progress, run_in_child

ops = torch.ops.qwen38

# (Hq, Hkv, hd): the oracle and the 27B model.
ORACLE = (4, 2, 32)
M27B = (24, 4, 256)
CACHE_DTYPES = [torch.float32, torch.bfloat16]


def make_inputs(T, shape, positions, cache_dtype, device="cpu", seed=0):
    """q [T, Hq, hd] (N(0, 1.5^2)), caches with random rows 0..max(positions) and NaN rows after them."""
    hq, hkv, hd = shape
    g = torch.Generator().manual_seed(seed)
    last = max(positions)
    max_seq = last + 9
    k = torch.randn(max_seq, hkv, hd, generator=g, dtype=torch.float64)
    v = torch.randn(max_seq, hkv, hd, generator=g, dtype=torch.float64)
    k[last + 1 :] = float("nan")
    v[last + 1 :] = float("nan")
    q = torch.randn(T, hq, hd, generator=g) * 1.5
    pos = torch.tensor(positions, dtype=torch.int32)
    return [x.to(device) for x in (q, k.to(cache_dtype), v.to(cache_dtype), pos)]


# ---------------------------------------------------------------------------------------------------
# CPU: opcheck and the reference against an independent formula.

def new_workspace(T, shape, device="cpu"):
    return torch.full((workspace_numel(T, *shape),), float("nan"), device=device)


def test_opcheck_cpu():
    q, k_cache, v_cache, positions = make_inputs(3, ORACLE, [2, 5, 9], torch.float32)
    out = torch.empty_like(q)
    torch.library.opcheck(ops.attention_prefill.default,
                          (q, k_cache, v_cache, positions, 32**-0.5, out, new_workspace(3, ORACLE)))


def test_split_count():
    """The split-K covers a few rows over a long cache and leaves prompt chunks unsplit: at the 27B shape the
    issue-13 turn (T = 101: 10 row blocks x 4 kv heads = 40 blocks) is dealt 6 ways (240 blocks of the 264
    targeted); the last split call is T = 352 (33 x 4 = 132 blocks, 2 ways), T = 353 and the 512- and
    4096-row chunks run unsplit with no workspace."""
    hq, hkv, hd = M27B
    assert [num_splits(T, hq, hkv) for T in (9, 33, 100, 101, 200, 352, 353, 512, 4096)] == [
        64, 16, 6, 6, 3, 2, 1, 1, 1]
    assert workspace_numel(101, hq, hkv, hd) == 6 * 101 * hq * (hd + 2)
    assert workspace_numel(353, hq, hkv, hd) == 0 and workspace_numel(0, hq, hkv, hd) == 0
    assert num_splits(9, *ORACLE[:2]) == 64  # 1 row block x 2 kv heads: 132 ways, capped


def test_reference_vs_softmax_loop():
    """Non-consecutive and repeated positions, GQA 6 query heads on 2 kv heads."""
    hq, hkv, hd = 6, 2, 16
    positions = [4, 9, 2, 9, 0]
    q, k_cache, v_cache, pos = make_inputs(len(positions), (hq, hkv, hd), positions, torch.float64)
    q = q.double()
    out = torch.empty_like(q)
    scale = hd**-0.5
    ref.attention_prefill(q, k_cache, v_cache, pos, scale, out, torch.empty(0))
    for t, p in enumerate(positions):
        for h in range(hq):
            kv = h // (hq // hkv)  # GQA: consecutive query heads share a kv head
            weights = torch.softmax(k_cache[: p + 1, kv] @ q[t, h] * scale, dim=0)
            torch.testing.assert_close(out[t, h], weights @ v_cache[: p + 1, kv], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------
# CUDA: the kernel against the reference.

def expected_float64(q, k_cache, v_cache, positions, scale):
    """The reference in float64 over the very values the kernel reads (bf16 is exact in float64), computed
    on the GPU (float64 matmuls: a 33k context takes seconds on the CPU), returned on the CPU."""
    q, k_cache, v_cache, positions = (x.cuda() for x in (q, k_cache, v_cache, positions))
    out = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    ref.attention_prefill(q.double(), k_cache.double(), v_cache.double(), positions, scale, out, None)
    return out.cpu()


def run_cuda(q, k_cache, v_cache, positions, scale, workspace=None):
    """out NaN-poisoned (every element must be written), the workspace too unless given (a split's stale or
    unwritten partials must never be read)."""
    T, hq, hd = q.shape
    if workspace is None:
        workspace = new_workspace(T, (hq, k_cache.shape[1], hd), device="cuda")
    out = torch.full(q.shape, float("nan"), device="cuda")
    ops.attention_prefill(q, k_cache, v_cache, positions, scale, out, workspace)
    return out


def assert_within_bars(got, expected, cache_dtype, label, float32_rel_l2=3e-5):
    assert torch.isfinite(got).all(), f"{label}: non-finite outputs"
    err = got.cpu().double() - expected
    rel_l2 = (err.norm() / expected.norm()).item()
    max_rel = (err.abs().max() / expected.abs().max()).item()
    print(f"{label} {str(cache_dtype)[6:]}: rel L2 {rel_l2:.2e}, max abs / max|ref| {max_rel:.2e}")
    if cache_dtype == torch.float32:
        assert rel_l2 <= float32_rel_l2, (label, rel_l2, max_rel)
    else:
        assert rel_l2 <= 1e-2 and max_rel <= 2e-2, (label, rel_l2, max_rel)


CASES = (
    # (shape, T, first position): T around the 64-row block, from position 0 and continuing a cache
    [(s, T, first) for s in (ORACLE, M27B) for T in (1, 7, 63, 64, 65, 200) for first in (0, 5, 1000)]
    # the 27B shape at a 512-token chunk over a 1.5k context; every head dim and group size 1..8
    + [(M27B, 512, 1024), ((8, 1, 64), 65, 5), ((2, 2, 64), 7, 0), ((6, 3, 128), 63, 1000),
       ((12, 2, 128), 200, 0), ((7, 1, 256), 33, 300)]
    # enough rows to run unsplit (most cases above are split): > 132 blocks of 64 rows
    + [(M27B, 353, 0), (ORACLE, 2200, 0), ((8, 1, 64), 1100, 5), ((6, 3, 128), 2900, 40)]
)


@cuda
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0][0]}x{c[0][1]}_hd{c[0][2]}_T{c[1]}_from{c[2]}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_matches_reference(case, cache_dtype):
    assert_cuda_kernel("attention_prefill")
    shape, T, first = case
    positions = list(range(first, first + T))
    q, k_cache, v_cache, pos = make_inputs(T, shape, positions, cache_dtype, seed=T + first)
    scale = shape[2] ** -0.5
    expected = expected_float64(q, k_cache, v_cache, pos, scale)
    got = run_cuda(q.cuda(), k_cache.cuda(), v_cache.cuda(), pos.cuda(), scale)
    assert_within_bars(got, expected, cache_dtype, f"{shape} T={T} from {first}")


@cuda
@pytest.mark.parametrize("shape", [ORACLE, M27B])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_unordered_positions(shape, cache_dtype):
    """Positions shuffled, repeated and far apart inside one 64-row block and across blocks: each row masks
    by its own position, and a block walks to the largest position among its rows."""
    g = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 700, (90,), generator=g).tolist() + [0, 0, 1500, 3, 1500, 64, 63, 65]
    q, k_cache, v_cache, pos = make_inputs(len(positions), shape, positions, cache_dtype, seed=9)
    scale = shape[2] ** -0.5
    expected = expected_float64(q, k_cache, v_cache, pos, scale)
    got = run_cuda(q.cuda(), k_cache.cuda(), v_cache.cuda(), pos.cuda(), scale)
    assert_within_bars(got, expected, cache_dtype, f"{shape} unordered")


@cuda
@pytest.mark.parametrize("shape,T", [(ORACLE, 65), (M27B, 16)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_long_context(shape, T, cache_dtype):
    """A chunk at position 32000. O accumulates in the MMA accumulators over all ctx / 16 MMAs of a row;
    if each MMA rounds its fp32 sum toward zero (as tensor cores were measured to on earlier GPUs), that
    alone simulates to rel L2 2e-6 at 1.5k, 1.4e-5 at 8k, 4.6e-5 at 32k on this data: float32 bar 1e-4 here."""
    positions = list(range(32000, 32000 + T))
    q, k_cache, v_cache, pos = make_inputs(T, shape, positions, cache_dtype, seed=11)
    scale = shape[2] ** -0.5
    expected = expected_float64(q, k_cache, v_cache, pos, scale)
    got = run_cuda(q.cuda(), k_cache.cuda(), v_cache.cuda(), pos.cuda(), scale)
    assert_within_bars(got, expected, cache_dtype, f"{shape} T={T} from 32000", float32_rel_l2=1e-4)


@cuda
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_deterministic(cache_dtype):
    """Two runs give the same bits (no atomics, a fixed reduction order)."""
    q, k_cache, v_cache, pos = make_inputs(200, M27B, list(range(300, 500)), cache_dtype, device="cuda", seed=3)
    first = run_cuda(q, k_cache, v_cache, pos, 256**-0.5)
    assert torch.equal(first, run_cuda(q, k_cache, v_cache, pos, 256**-0.5))


# ---------------------------------------------------------------------------------------------------
# CUDA: the split-K path (few query rows over a long cache, the issue-13 turn).

SPLIT_CASES = (
    # (shape, T, cached rows before the chunk): the 27B shape at the model's few-row chunks
    [(M27B, T, history) for T in (9, 33, 100, 101) for history in (1000, 16384, 33000)]
    # a first chunk (most splits get no tile); every head dim and group sizes 1, 2, 6, 7, 8
    + [(M27B, 101, 0), ((8, 1, 64), 9, 5000), ((6, 3, 128), 33, 16384), ((2, 2, 64), 100, 1000),
       ((7, 1, 256), 101, 4000), ((12, 2, 128), 9, 33000), (ORACLE, 33, 16384)]
)


@cuda
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"H{c[0][0]}x{c[0][1]}_hd{c[0][2]}_T{c[1]}_after{c[2]}")
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_split_matches_reference(case, cache_dtype):
    """The split path against the float64 reference, with the bars of the unsplit tests (float32: the
    long-context bar 1e-4 past 32k cached rows, as test_attention_prefill_cuda_long_context)."""
    assert_cuda_kernel("attention_prefill")
    shape, T, history = case
    splits = num_splits(T, shape[0], shape[1])
    assert splits > 1, f"{case} would not exercise the split path"
    positions = list(range(history, history + T))
    q, k_cache, v_cache, pos = make_inputs(T, shape, positions, cache_dtype, seed=T + history)
    scale = shape[2] ** -0.5
    expected = expected_float64(q, k_cache, v_cache, pos, scale)
    got = run_cuda(q.cuda(), k_cache.cuda(), v_cache.cuda(), pos.cuda(), scale)
    assert_within_bars(got, expected, cache_dtype, f"{shape} T={T} after {history}, {splits} splits",
                       float32_rel_l2=1e-4 if history > 32000 else 3e-5)


@cuda
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_split_deterministic(cache_dtype):
    """The issue-13 turn (T = 101 after 16k rows, 6 splits): the same bits run to run, whatever the workspace
    held before (NaN, or another call's partials)."""
    q, k_cache, v_cache, pos = make_inputs(101, M27B, list(range(16384, 16485)), cache_dtype, device="cuda", seed=4)
    workspace = new_workspace(101, M27B, device="cuda")
    first = run_cuda(q, k_cache, v_cache, pos, 256**-0.5, workspace)
    run_cuda(q.flip(0).contiguous(), k_cache, v_cache, pos.flip(0).contiguous(), 256**-0.5, workspace)
    assert torch.equal(first, run_cuda(q, k_cache, v_cache, pos, 256**-0.5, workspace))
    assert torch.equal(first, run_cuda(q, k_cache, v_cache, pos, 256**-0.5))


@cuda
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_attention_prefill_cuda_split_graph_replay_bitwise(cache_dtype):
    """One capture of the T = 101 call; the positions changed on the device between replays (a later turn,
    a first chunk, a short history): each replay equals an eager call at those positions bit for bit."""
    T, (hq, hkv, hd) = 101, M27B
    q, k_cache, v_cache, _ = make_inputs(T, M27B, [20000], cache_dtype, device="cuda", seed=6)
    positions = torch.arange(16384, 16384 + T, dtype=torch.int32, device="cuda")
    out = torch.empty(T, hq, hd, device="cuda")
    workspace = new_workspace(T, M27B, device="cuda")

    def call():
        ops.attention_prefill(q, k_cache, v_cache, positions, hd**-0.5, out, workspace)

    graph = capture_graph(call)
    for first in (16384, 0, 1000, 19900):
        positions.copy_(torch.arange(first, first + T, dtype=torch.int32))
        out.fill_(float("nan"))
        workspace.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        assert torch.isfinite(replayed).all(), first
        assert torch.equal(replayed, run_cuda(q, k_cache, v_cache, positions, hd**-0.5)), first


@cuda
def test_opcheck_cuda():
    """A split call (T = 3) and an unsplit one (T = 353 at 27B, empty workspace), both cache dtypes."""
    for cache_dtype in CACHE_DTYPES:
        for T, shape in ((3, ORACLE), (353, M27B)):
            q, k_cache, v_cache, positions = make_inputs(T, shape, list(range(5, 5 + T)), cache_dtype, device="cuda")
            out, workspace = torch.empty_like(q), new_workspace(T, shape, "cuda")
            torch.library.opcheck(ops.attention_prefill.default,
                                  (q, k_cache, v_cache, positions, shape[2]**-0.5, out, workspace))


def check_bad_inputs():
    """Every wrong argument raises a RuntimeError naming the op and the argument (run in a child process
    by test_bad_inputs_raise)."""
    q, k_cache, v_cache, positions = make_inputs(2, ORACLE, [3, 4], torch.float32, device="cuda")
    out = torch.empty_like(q)
    ws = new_workspace(2, ORACLE, device="cuda")
    prefill = ops.attention_prefill
    progress()
    with pytest.raises(RuntimeError, match="attention_prefill: q must be a CUDA tensor"):
        prefill(q.cpu(), k_cache, v_cache, positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="attention_prefill: q must be Float"):
        prefill(q.double(), k_cache, v_cache, positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="q must be contiguous"):
        prefill(q.transpose(0, 1), k_cache, v_cache, positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="head_dim must be one of"):
        prefill(q[..., :24].contiguous(), k_cache[..., :24].contiguous(), v_cache[..., :24].contiguous(),
                positions, 0.1, out[..., :24].contiguous(), ws)
    progress()
    with pytest.raises(RuntimeError, match="k_cache must be float32 or bfloat16"):
        prefill(q, k_cache.half(), v_cache.half(), positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="v_cache must have k_cache's dtype"):
        prefill(q, k_cache, v_cache.bfloat16(), positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="v_cache must be shaped like k_cache"):
        prefill(q, k_cache, v_cache[:-1], positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="k_cache and v_cache must be contiguous"):
        prefill(q, k_cache.transpose(0, 1).contiguous().transpose(0, 1), v_cache, positions, 0.1, out, ws)
    progress()  # a cache a row (batched rows) is the decode-step ops' mode only
    with pytest.raises(RuntimeError, match="attention_prefill: k_cache must be \\[max_seq, Hkv, hd\\]"):
        prefill(q, k_cache.expand(2, -1, -1, -1).contiguous(), v_cache.expand(2, -1, -1, -1).contiguous(),
                positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="Hq must be a multiple of Hkv"):
        prefill(q[:, :3].contiguous(), k_cache, v_cache, positions, 0.1, out[:, :3].contiguous(), ws)
    progress()
    with pytest.raises(RuntimeError, match="positions must be contiguous int32"):
        prefill(q, k_cache, v_cache, positions.long(), 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="positions must be on"):
        prefill(q, k_cache, v_cache, positions.cpu(), 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="out must be shaped like q"):
        prefill(q, k_cache, v_cache, positions, 0.1, out[:1], ws)
    progress()
    with pytest.raises(RuntimeError, match="out must be Float"):
        prefill(q, k_cache, v_cache, positions, 0.1, out.double(), ws)
    progress()
    misaligned = torch.empty(q.numel() + 1, device="cuda")[1:].view(q.shape).copy_(q)
    with pytest.raises(RuntimeError, match="must be 16-byte aligned"):
        prefill(misaligned, k_cache, v_cache, positions, 0.1, out, ws)
    progress()
    with pytest.raises(RuntimeError, match="workspace must hold"):
        prefill(q, k_cache, v_cache, positions, 0.1, out, ws[:-1])
    progress()
    with pytest.raises(RuntimeError, match="workspace must be Float"):
        prefill(q, k_cache, v_cache, positions, 0.1, out, ws.double())
    progress()
    with pytest.raises(RuntimeError, match="but workspace is on cpu"):
        prefill(q, k_cache, v_cache, positions, 0.1, out, ws.cpu())
    progress()
    with pytest.raises(RuntimeError, match="workspace must be 16-byte aligned"):
        prefill(q, k_cache, v_cache, positions, 0.1, out, torch.empty(ws.numel() + 1, device="cuda")[1:])
    # The binding asks for exactly workspace_numel floats (the C++ and Python split counts agree): one fewer
    # raises, that many runs; an unsplit call takes an empty workspace.
    for T in (9, 101, 353):
        q, k_cache, v_cache, positions = make_inputs(T, M27B, list(range(T)), torch.bfloat16, device="cuda")
        out = torch.empty_like(q)
        ws = new_workspace(T, M27B, device="cuda")
        progress()
        if ws.numel():
            with pytest.raises(RuntimeError, match="workspace must hold"):
                prefill(q, k_cache, v_cache, positions, 0.1, out, ws[:-1])
        prefill(q, k_cache, v_cache, positions, 0.1, out, ws)
        torch.cuda.synchronize()


@cuda
def test_bad_inputs_raise():
    """check_bad_inputs in a child process (see cuda_helpers.run_in_child for why), after the control
    TORCH_ERROR_CONTROL."""
    run_in_child(__file__, "check_bad_inputs", preamble=TORCH_ERROR_CONTROL)
