"""q8_gemv family: q8_0_gemv (f32 activations), q8_0_gemv_int8, q8_0_gemv_int8x2.

CPU (CI): opcheck of every op; the reference against an independent formula (gguf's own Q8_0 dequantizer,
then a float64 matmul of the dequantized activation); the int8 kernel-order emulation below against the
reference, and that the order-sensitive data tells summation orders apart. CUDA (-m cuda): the kernel
against the reference in float64 on the CPU, on random inputs, outputs poisoned with NaN first, at odd sizes
(K % 512 != 0, K = 32, N not a multiple of anything) and at the six 27B shapes, for every compiled config
(each in its own process: the config is read once per process); the int8 lane bit for bit equal to its
emulation (the summation order the previous kernel fixed, so the same bits as before the rebuild); each row
of a T-row call (T = 2..8: one pass each, the lanes of a pair splitting the rows, the 5120-row shapes' parts
split over warps; T = 9: two passes of 5) bit for bit a T = 1 call on that row, every lane; two runs
give the same bits; a captured graph replays bit for bit like eager, with PDL on and with PDL off (each in
its own process), and both settings give the same bits; bad arguments raise.

Error bound (all lanes): |y - y_ref| <= 1e-5 * sum_k |w_k x_k| (+1e-30). The kernel's float32 sum has at most
~60 roundings on any path (16 in a lane's 16-weight dot or exact int32 block sums, one per 512-weight piece
it accumulates -- K/512 <= 34 -- a 5-level shuffle tree and the <= 4 parts added at the end), i.e.
<= 60 * 2^-24 = 3.6e-6 of the absolute sum.
"""
import numpy as np
import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.limits import Q8_0_GEMV_CONFIGS
from qwen38_ops.reference import q8_gemv as ref

from cuda_helpers import assert_same_bits_pdl_on_and_off, capture_graph, child_env, cuda, run_in_child

ops = torch.ops.qwen38

SHAPES_27B = [(16384, 5120), (34816, 5120), (14336, 5120), (5120, 6144), (5120, 17408), (248320, 5120)]
ODD_SHAPES = [(1, 32), (7, 96), (33, 160), (130, 544), (257, 1056), (64, 5120), (5, 17408), (100, 6176)]
# The configs compiled in csrc/kernels/op_limits.h (QWEN38_Q8_GEMV_CONFIGS), read from the extension: "trip,parts".
CONFIGS = [f"{trip},{parts}" for trip, parts in Q8_0_GEMV_CONFIGS]
LANES = ["f32", "int8", "int8x2"]
REL_BOUND = 1e-5


def make_weights(N, K, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    weight_q = torch.randint(-127, 128, (N, K), generator=g, device=device, dtype=torch.int8)
    scale = torch.rand(N, K // 32, generator=g, device=device) * 0.02 + 0.001
    sign = torch.randint(0, 2, (N, K // 32), generator=g, device=device) * 2 - 1
    return weight_q, (scale * sign).to(torch.float16)


def make_activation(lane, T, K, device="cpu", seed=1):
    """The lane's activation tensors, as the producers would emit them (random, never all zero)."""
    g = torch.Generator(device=device).manual_seed(seed)
    if lane == "f32":
        return (torch.randn(T, K, generator=g, device=device),)
    x_q = torch.randint(-127, 128, (T, K), generator=g, device=device, dtype=torch.int8)
    x_d = (torch.rand(T, K // 32, generator=g, device=device) * 0.05 + 1e-3).to(torch.float16).float()
    if lane == "int8":
        return x_q, x_d
    x_q_lo = torch.randint(-64, 65, (T, K), generator=g, device=device, dtype=torch.int8)
    return x_q, x_q_lo, x_d


def op_for(lane):
    return {"f32": ops.q8_0_gemv, "int8": ops.q8_0_gemv_int8, "int8x2": ops.q8_0_gemv_int8x2}[lane]


def ref_for(lane):
    return {"f32": ref.q8_0_gemv, "int8": ref.q8_0_gemv_int8, "int8x2": ref.q8_0_gemv_int8x2}[lane]


def dequantized_activation(lane, act):
    """The activation as float64 [T, K], written independently of the reference."""
    if lane == "f32":
        return act[0].double()
    x_q, x_d = act[0], act[-1]
    value = x_q.double()
    if lane == "int8x2":
        value = value + act[1].double() / 127
    return (value.reshape(x_q.shape[0], -1, 32) * x_d.double()[..., None]).reshape(x_q.shape)


def gguf_dequantize(weight_q, weight_d):
    """Independent Q8_0 dequantizer: pack ggml's block layout (fp16 d, 32 int8) and let gguf decode it."""
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    N, K = weight_q.shape
    blocks = np.concatenate([weight_d.numpy().reshape(N, K // 32, 1).view(np.uint8),
                             weight_q.numpy().reshape(N, K // 32, 32).view(np.uint8)], axis=2)
    out = gguf_quants.dequantize(blocks.reshape(N, -1), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(out)).double().reshape(N, K)


def abs_dot(lane, act, weight_q, weight_d):
    """sum_k |w_k x_k| in float64: the scale of the error bound."""
    w = ref.dequantize_q8_0(weight_q, weight_d, torch.float64).abs()
    return dequantized_activation(lane, act).abs() @ w.T


def default_parts(lane, N):
    """The summation order the binding picks for a shape (q8_0_gemv_default_config in q8_gemv.cu): the int
    lanes keep the previous kernel's (4 interleaved K parts for N <= 8192, one above)."""
    return 4 if lane != "f32" and N <= 8192 else 1


def order_sensitive(lane, weights, act):
    """The same inputs where every row's first and last blocks hold the same quants with weight scales
    +4096 and -4096 (activation scale 4096 on both, int lanes): terms of ~1e12 that cancel exactly, so the
    result rounded to float depends on the order the kernel adds blocks in (the sum's low bits are lost to
    the huge partial sums, differently in each order). Needs K >= 64. Not for the error-bound checks: the
    bound scales with sum |w x|, which these blocks make huge."""
    weight_q, weight_d = (w.clone() for w in weights)
    act = tuple(a.clone() for a in act)
    last = weight_d.shape[1] - 1
    weight_q[:, 32 * last :] = weight_q[:, :32]
    weight_d[:, 0], weight_d[:, last] = 4096.0, -4096.0
    for a in act:
        if a.shape[1] == weight_q.shape[1]:  # x, x_q, x_q_lo
            a[:, 32 * last :] = a[:, :32]
    if lane != "f32":
        act[-1][:, 0] = act[-1][:, last] = 4096.0
    return (weight_q, weight_d), act


def int8_kernel_sum(x_q, x_d, weight_q, weight_d, parts):
    """The int8 lane exactly as the kernel forms it (csrc/kernels/q8_gemv.cu), in float64 on the CPU.

    Each 32-block's term sumi * (d_w * d_x) is exact in double. Lane pair m of a warp holds blocks 16p + m of
    the 512-weight pieces p; piece p goes to partial sum p % parts, and each partial sum adds its terms in
    piece order, starting from 0. Each part's 16 pair sums are added by a butterfly (xor 8, 4, 2, 1 over the
    pairs: the lane shuffles xor 16, 8, 4, 2), then the parts in order, then one rounding to float. Every
    float64 operation here is one IEEE operation in a fixed order, as on the GPU."""
    T, K = x_q.shape
    N, blocks, pieces = weight_q.shape[0], K // 32, -(-K // 512)
    sumi = torch.einsum("tbi,nbi->tnb", x_q.double().reshape(T, blocks, 32),
                        weight_q.double().reshape(N, blocks, 32))  # integers < 2^20: exact in any order
    terms = sumi * (x_d.double()[:, None, :] * weight_d.double()[None, :, :])
    terms = torch.nn.functional.pad(terms, (0, 16 * pieces - blocks)).reshape(T, N, pieces, 16)
    acc = [torch.zeros(T, N, 16, dtype=torch.float64) for _ in range(parts)]
    for p in range(pieces):
        acc[p % parts] = acc[p % parts] + terms[:, :, p]
    pair = torch.arange(16)
    part_sums = []
    for v in acc:
        for o in (8, 4, 2, 1):
            v = v + v[..., pair ^ o]
        part_sums.append(v[..., 0])
    total = part_sums[0]
    for v in part_sums[1:]:
        total = total + v
    return total.float()


# ---- CPU ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lane", LANES)
def test_opcheck_cpu(lane):
    weight_q, weight_d = make_weights(6, 96)
    act = make_activation(lane, 3, 96)
    out = torch.empty(3, 6)
    torch.library.opcheck(op_for(lane).default, (*act, weight_q, weight_d, out))


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("T,N,K", [(1, 5, 32), (3, 17, 160), (2, 9, 544)])
def test_reference_vs_gguf_dequantize_matmul(lane, T, N, K):
    weight_q, weight_d = make_weights(N, K, seed=T)
    act = make_activation(lane, T, K, seed=N)
    out = torch.empty(T, N, dtype=torch.float64)
    ref_for(lane)(*act, weight_q, weight_d, out)
    expected = dequantized_activation(lane, act) @ gguf_dequantize(weight_q, weight_d).T
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_int8_kernel_sum_emulation_cpu():
    """The emulation is the int8 lane's value (within a float rounding of the float64 reference), and the
    order-sensitive data makes the orders differ: so the CUDA tests that compare bits against it can fail."""
    N, K = 48, 5120
    weights = make_weights(N, K, seed=3)
    act = make_activation("int8", 2, K, seed=4)
    expected = torch.empty(2, N, dtype=torch.float64)
    ref.q8_0_gemv_int8(*act, *weights, expected)
    for parts in (1, 4):
        got = int8_kernel_sum(*act, *weights, parts)
        assert ((got.double() - expected).abs() <= expected.abs() * 2.0**-24 + 1e-30).all()
    weights, act = order_sensitive("int8", weights, act)
    one, four = int8_kernel_sum(*act, *weights, 1), int8_kernel_sum(*act, *weights, 4)
    ref.q8_0_gemv_int8(*act, *weights, expected)
    assert (one != four).float().mean() > 0.5, "orders 1 and 4 agree: the data does not test the order"
    assert (one != expected.float()).float().mean() > 0.5


# ---- CUDA ---------------------------------------------------------------------------------------------


def assert_cuda_kernels():
    for name in ("q8_0_gemv", "q8_0_gemv_int8", "q8_0_gemv_int8x2"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qwen38::{name}", "CUDA"), \
            f"{name}: no CUDA kernel registered (extension built without CUDA?)"


def run_cuda(lane, act, weight_q, weight_d, out=None):
    T, N = act[0].shape[0], weight_q.shape[0]
    if out is None:
        out = torch.full((T, N), float("nan"), device="cuda")
    else:
        out.fill_(float("nan"))
    op_for(lane)(*act, weight_q, weight_d, out)
    torch.cuda.synchronize()
    return out


def check_against_reference(lane, act, weight_q, weight_d, out, rows=None, rel_bound=REL_BOUND):
    """Compare out (CUDA) with the float64 CPU reference, on all rows or a subset of them."""
    assert not out.isnan().any(), "some outputs were not written (still NaN)"
    act_cpu = tuple(a.cpu() for a in act)
    wq, wd = weight_q, weight_d
    got = out
    if rows is not None:
        wq, wd, got = weight_q[rows], weight_d[rows], out[:, rows]
    wq, wd = wq.cpu(), wd.cpu()
    expected = torch.empty(got.shape, dtype=torch.float64)
    ref_for(lane)(*act_cpu, wq, wd, expected)
    bound = rel_bound * abs_dot(lane, act_cpu, wq, wd) + 1e-30
    err = (got.cpu().double() - expected).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3g}x the bound (max abs err {err.max().item():.3g})"
    return worst


def sample_rows(N, count=4096, seed=0):
    if N <= count:
        return None
    g = torch.Generator().manual_seed(seed)
    picked = torch.randperm(N, generator=g)[: count - 128]
    return torch.cat([torch.arange(64), picked, torch.arange(N - 64, N)]).unique().cuda()


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", ODD_SHAPES)
@pytest.mark.parametrize("T", [1, 2, 3, 5, 8, 9])  # 9: two passes of 5 rows (f32: three of 3)
def test_cuda_odd_shapes(lane, N, K, T):
    assert_cuda_kernels()
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=N + K)
    act = make_activation(lane, T, K, device="cuda", seed=T)
    check_against_reference(lane, act, weight_q, weight_d, run_cuda(lane, act, weight_q, weight_d))


def first_rows(act, T):
    return tuple(a[:T] for a in act)


def rows_and_singles(lane, weights, act):
    """Makes the inputs order-sensitive (when K allows) and returns them with the T = 1 output of each row of
    x, after asserting that every row of a T-row call (T = 2..rows) is bit for bit that T = 1 output."""
    if weights[0].shape[1] >= 64:
        weights, act = order_sensitive(lane, weights, act)
    rows = act[0].shape[0]
    singles = torch.cat([run_cuda(lane, tuple(a[t : t + 1] for a in act), *weights) for t in range(rows)])
    for T in range(2, rows + 1):
        out = run_cuda(lane, first_rows(act, T), *weights)
        differ = (out != singles[:T]).any(1).nonzero().flatten().tolist()
        assert not differ, f"{lane}: T = {T}, rows {differ} differ from their T = 1 calls"
    return weights, act, singles


def assert_int8_emulated(act, weights, out, parts, rows=None):
    """out (CUDA [T, N], int8 lane) is bit for bit int8_kernel_sum with `parts`, on all rows or on `rows`."""
    if rows is not None:
        weights, out = tuple(w[rows] for w in weights), out[:, rows]
    expected = int8_kernel_sum(*(a.cpu() for a in act), *(w.cpu() for w in weights), parts)
    differ = (out.cpu() != expected).sum().item()
    assert differ == 0, f"int8: {differ} of {expected.numel()} outputs differ from the kernel-order emulation"


def check_every_lane_with_env_config():
    """Run in a child with QWEN38_Q8_GEMV_CONFIG="trip,parts": every lane at tails and narrow N, for T = 1,
    2, 3, 5 and 8, against the reference; each row of T-row calls (T = 2..8) bitwise a T = 1 call, and the
    int8 lane bitwise its emulation with the config's parts. Then the variable changes to a config that is not
    compiled and a call still runs: the config was read once."""
    import os

    parts = int(os.environ["QWEN38_Q8_GEMV_CONFIG"].split(",")[1])
    for lane in LANES:
        for N, K in [(1, 32), (37, 160), (130, 1056), (11, 5120), (3, 17408), (9, 6176)]:
            weights = make_weights(N, K, device="cuda", seed=N)
            act = make_activation(lane, 8, K, device="cuda", seed=K)
            for T in (1, 2, 3, 5, 8):
                check_against_reference(lane, first_rows(act, T), *weights,
                                        run_cuda(lane, first_rows(act, T), *weights))
            weights, act, singles = rows_and_singles(lane, weights, act)
            if lane == "int8":
                assert_int8_emulated(act, weights, singles, parts)
    os.environ["QWEN38_Q8_GEMV_CONFIG"] = "3,3"
    weights = make_weights(9, 160, device="cuda")
    act = make_activation("int8", 1, 160, device="cuda")
    check_against_reference("int8", act, *weights, run_cuda("int8", act, *weights))


@cuda
@pytest.mark.parametrize("config", CONFIGS)
def test_cuda_every_config(config):
    """Every compiled config (the binding's defaults are among them), each in its own process."""
    assert_cuda_kernels()
    run_in_child(__file__, "check_every_lane_with_env_config", child_env(QWEN38_Q8_GEMV_CONFIG=config))


def check_config_not_compiled_raises():
    """Run in a child with QWEN38_Q8_GEMV_CONFIG set to what no build compiles."""
    weights = make_weights(9, 160, device="cuda")
    for lane in LANES:
        act = make_activation(lane, 1, 160, device="cuda")
        with pytest.raises(RuntimeError, match="QWEN38_Q8_GEMV_CONFIG must name a compiled"):
            op_for(lane)(*act, *weights, torch.empty(1, 9, device="cuda"))


@cuda
@pytest.mark.parametrize("config", ["2,1,4", "4,4", "two"])
def test_cuda_config_not_compiled_raises(config):
    """The previous kernel's three-number configs, an uncompiled pair and junk are errors, not defaults."""
    run_in_child(__file__, "check_config_not_compiled_raises", child_env(QWEN38_Q8_GEMV_CONFIG=config))


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_27b_shapes(lane, N, K):
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=7)
    act = make_activation(lane, 1, K, device="cuda", seed=8)
    out = run_cuda(lane, act, weight_q, weight_d)
    check_against_reference(lane, act, weight_q, weight_d, out, rows=sample_rows(N))
    assert torch.equal(run_cuda(lane, act, weight_q, weight_d), out), "two runs differ"


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", SHAPES_27B + ODD_SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES_27B + ODD_SHAPES])
def test_cuda_rows_bitwise_as_one_row_calls(lane, N, K):
    """Speculative decoding's verify relies on it: row t of a T-row call (T = 2..8, each one pass sharing
    every weight load among its T rows, in the int lanes with the rows split over the lanes of a pair and,
    on N <= 8192, the parts over 4 warps; T = 9, two passes of 5 rows) is bit for bit a T = 1 call on row t
    alone, every lane, every output, on data whose last bits depend on the summation order. The int8 lane's
    bits are its emulation (int8_kernel_sum: the previous kernel's order, so the bits from before the
    rebuild; on 4096 sampled rows of the wide shapes)."""
    weights = make_weights(N, K, device="cuda", seed=N + K)
    act = make_activation(lane, 9, K, device="cuda", seed=K)
    weights, act, singles = rows_and_singles(lane, weights, act)
    if lane == "int8":
        assert_int8_emulated(act, weights, singles, default_parts(lane, N), sample_rows(N))


# The rows kernel's two forms (csrc/kernels/q8_gemv_rows.cu), QWEN38_Q8_GEMV_ROWS_KERNEL, read at each call.
ROWS_KERNELS = ["smem", "direct"]


@cuda
@pytest.mark.parametrize("kernel", ROWS_KERNELS)
@pytest.mark.parametrize("N,K", SHAPES_27B + ODD_SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES_27B + ODD_SHAPES])
def test_cuda_int8_many_rows_bitwise_as_one_row_calls(N, K, kernel, monkeypatch):
    """A batched decode step relies on it: every row of a T-row int8 call, T up to 80 (the tensor-core form of
    csrc/kernels/q8_gemv_rows.cu where K % 512 == 0, either of its forms, else passes of the T-row forms), eager
    and replayed in a graph, is bit for bit the T = 1 call on that row, on order-sensitive data; and the T = 1
    bits are the kernel-order emulation's. The T cover each form's tiles: one and two n8 tiles, the direct form's
    4 and 8 (PARTS = 1) and its blocks of 16 rows (PARTS = 4), and a second block of 64 rows (T = 80)."""
    monkeypatch.setenv("QWEN38_Q8_GEMV_ROWS_KERNEL", kernel)
    weights = make_weights(N, K, device="cuda", seed=N + 3 * K)
    act = make_activation("int8", 80, K, device="cuda", seed=K + 1)
    if K >= 64:
        weights, act = order_sensitive("int8", weights, act)
    singles = torch.cat([run_cuda("int8", tuple(a[t : t + 1] for a in act), *weights) for t in range(80)])
    assert_int8_emulated(first_rows(act, 9), weights, singles[:9], default_parts("int8", N), sample_rows(N))
    for T in (2, 8, 9, 16, 17, 33, 64, 80):
        out = run_cuda("int8", first_rows(act, T), *weights)
        differ = (out != singles[:T]).any(1).nonzero().flatten().tolist()
        assert not differ, f"{kernel}, T = {T}: rows {differ} differ from their T = 1 calls"
    x, x_d = first_rows(act, 40)
    out = torch.full((40, N), float("nan"), device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.ops.qwen38.q8_0_gemv_int8(x, x_d, *weights, out)  # warm-up outside the capture
    with torch.cuda.graph(graph):
        torch.ops.qwen38.q8_0_gemv_int8(x, x_d, *weights, out)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, singles[:40]), f"{kernel}: the replayed 40-row call differs from the T = 1 calls"


@cuda
def test_cuda_rows_kernel_unknown_raises(monkeypatch):
    """QWEN38_Q8_GEMV_ROWS_KERNEL is read at each call: another value than smem or direct fails the call that
    reaches the rows kernel, naming the variable (in this process: the failure is before any launch)."""
    N, K, T = 64, 512, 16
    weights = make_weights(N, K, device="cuda")
    x_q, x_d = make_activation("int8", T, K, device="cuda")
    out = torch.empty(T, N, device="cuda")
    monkeypatch.setenv("QWEN38_Q8_GEMV_ROWS_KERNEL", "register")
    with pytest.raises(RuntimeError, match="QWEN38_Q8_GEMV_ROWS_KERNEL must be smem or direct"):
        ops.q8_0_gemv_int8(x_q, x_d, *weights, out)
    monkeypatch.setenv("QWEN38_Q8_GEMV_ROWS_KERNEL", "direct")
    ops.q8_0_gemv_int8(x_q, x_d, *weights, out)
    check_against_reference("int8", (x_q, x_d), *weights, out)


@cuda
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_int8_bits_on_random_data(N, K):
    """The int8 lane on the random data of the other tests (no huge blocks), T = 1, 3 and 8: bit for bit its
    emulation, so bit for bit what the previous kernel gave."""
    weights = make_weights(N, K, device="cuda", seed=11)
    act = make_activation("int8", 8, K, device="cuda", seed=12)
    for T in (1, 3, 8):
        out = run_cuda("int8", first_rows(act, T), *weights)
        assert_int8_emulated(first_rows(act, T), weights, out, default_parts("int8", N), sample_rows(N))


@cuda
@pytest.mark.parametrize("lane", LANES)
def test_cuda_strided_activation_rows(lane):
    """Activations may be row slices of a wider buffer (a fused projection's output)."""
    N, K, T = 70, 544, 3
    weight_q, weight_d = make_weights(N, K, device="cuda")
    act = make_activation(lane, T, K + 32, device="cuda")  # rows 32 values wider than the op sees
    sliced = tuple(a[:, : K // 32] if lane != "f32" and a.dtype == torch.float32 else a[:, :K] for a in act)
    out_buf = torch.empty(T, N + 5, device="cuda")
    out = out_buf[:, :N]
    run_cuda(lane, sliced, weight_q, weight_d, out=out)
    check_against_reference(lane, sliced, weight_q, weight_d, out)


def check_graph_replay_bitwise():
    """Run in a child with QWEN38_PDL set: per lane, T = 1, 3 and 7, a GEMV whose output the next GEMV
    reads (with PDL the second must wait for it), twice eagerly and once from a captured graph, outputs
    poisoned between runs: the same bits every time, within the bound of the reference. The outputs go to
    the safetensors file $QWEN38_TEST_OUT for the parent to compare across PDL settings."""
    import os

    from safetensors.torch import save_file

    N, K = 5120, 6144
    w1 = make_weights(K, K, device="cuda", seed=1)
    w2 = make_weights(N, K, device="cuda", seed=2)
    results = {}
    for lane in LANES:
        for T in (1, 3, 7):
            act = make_activation(lane, T, K, device="cuda", seed=3)
            mid = torch.empty(T, K, device="cuda")
            out = torch.empty(T, N, device="cuda")

            def step(act=act, mid=mid, out=out):
                op_for(lane)(*act, *w1, mid)
                ops.q8_0_gemv(mid, *w2, out)

            def poisoned_run(run):
                mid.fill_(float("nan"))
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                return mid.clone(), out.clone()

            eager = poisoned_run(step)
            again = poisoned_run(step)
            assert all(map(torch.equal, again, eager)), f"{lane} T={T}: two eager runs differ"
            replayed = poisoned_run(capture_graph(step).replay)
            assert all(map(torch.equal, replayed, eager)), f"{lane} T={T}: graph replay differs from eager"
            check_against_reference("f32", (eager[0],), *w2, eager[1])
            results[f"{lane}_T{T}_mid"], results[f"{lane}_T{T}_out"] = (t.cpu() for t in eager)
    save_file(results, os.environ["QWEN38_TEST_OUT"])


@cuda
def test_cuda_graph_replay_bitwise_pdl_on_and_off(tmp_path):
    """check_graph_replay_bitwise with PDL on and with PDL off (QWEN38_PDL is read once per process, so each
    runs in its own child), and both give the same bits."""
    assert_same_bits_pdl_on_and_off(__file__, "check_graph_replay_bitwise", str(tmp_path))


def check_bad_arguments():
    """Every wrong argument raises a RuntimeError naming it (run in a child by the test below)."""
    N, K = 64, 256
    weight_q, weight_d = make_weights(N, K, device="cuda")
    x = torch.randn(1, K, device="cuda")
    out = torch.empty(1, N, device="cuda")
    x_q, x_d = make_activation("int8", 1, K, device="cuda")
    x_f64, x_cpu, x_wide = x.double(), x.cpu(), torch.randn(1, K + 32, device="cuda")
    wd_f32 = weight_d.float()
    wq_40, wd_40 = weight_q[:, :40].contiguous(), weight_d[:, :1].contiguous()
    xq_unaligned = torch.empty(1, K + 1, device="cuda", dtype=torch.int8)[:, 1:]
    out_wide = torch.empty(1, N + 1, device="cuda")
    xd_half, xq_float = x_d.half(), x_q.float()
    with pytest.raises(RuntimeError, match="x must be"):
        ops.q8_0_gemv(x_f64, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="x is on"):
        ops.q8_0_gemv(x_cpu, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match=r"must be \[1, 256\]"):
        ops.q8_0_gemv(x_wide, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="weight_d must be"):
        ops.q8_0_gemv(x, weight_q, wd_f32, out)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.q8_0_gemv(x[:, :40], wq_40, wd_40, out)
    with pytest.raises(RuntimeError, match="aligned"):
        ops.q8_0_gemv_int8(xq_unaligned, x_d, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.q8_0_gemv_int8(x_q, x_d, weight_q, weight_d, out_wide)
    with pytest.raises(RuntimeError, match="x_d must be"):
        ops.q8_0_gemv_int8(x_q, xd_half, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="x_q_lo must be"):
        ops.q8_0_gemv_int8x2(x_q, xq_float, x_d, weight_q, weight_d, out)


@cuda
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
