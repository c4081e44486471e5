"""q8_gemv family: q8_0_gemv (f32 activations), q8_0_gemv_int8, q8_0_gemv_int8x2.

CPU (CI): opcheck of every op; the reference against an independent formula (gguf's own Q8_0 dequantizer,
then a float64 matmul of the dequantized activation). CUDA (-m cuda): the kernel against the reference in
float64 on the CPU, on random inputs, outputs poisoned with NaN first, at odd sizes (K % 512 != 0, K = 32,
N not a multiple of anything) and at the six 27B shapes, for every compiled decode config; two runs give
the same bits; a captured graph replays bit for bit like eager (with and without PDL); bad arguments raise.

Error bound (all lanes): |y - y_ref| <= 1e-5 * sum_k |w_k x_k| (+1e-30). The kernel's float32 sum has at most
~60 roundings on any path (16 in a lane's 16-weight dot or exact int32 block sums, one per 512-weight piece
it accumulates -- K/512 <= 34 -- a 5-level shuffle tree and the <= 4-way split-K combine), i.e.
<= 60 * 2^-24 = 3.6e-6 of the absolute sum.
"""
import numpy as np
import pytest
import torch

import qwen38_ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import q8_gemv as ref

from cuda_helpers import capture_graph, cuda, needs_gpu, run_in_child

ops = torch.ops.qwen38

SHAPES_27B = [(16384, 5120), (34816, 5120), (14336, 5120), (5120, 6144), (5120, 17408), (248320, 5120)]
ODD_SHAPES = [(1, 32), (7, 96), (33, 160), (130, 544), (257, 1056), (64, 5120), (5, 17408), (100, 6176)]
# The decode configs compiled in csrc/kernels/q8_gemv.h (QWEN38_Q8_GEMV_CONFIGS): pieces, split, rows.
CONFIGS = ["4,1,2", "4,4,1", "8,1,1", "16,1,1", "8,2,1", "4,2,2", "2,1,4"]
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
@needs_gpu
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", ODD_SHAPES)
@pytest.mark.parametrize("T", [1, 2, 5])
def test_cuda_odd_shapes(lane, N, K, T):
    assert_cuda_kernels()
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=N + K)
    act = make_activation(lane, T, K, device="cuda", seed=T)
    check_against_reference(lane, act, weight_q, weight_d, run_cuda(lane, act, weight_q, weight_d))


@cuda
@needs_gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("lane", LANES)
def test_cuda_every_config(lane, config, monkeypatch):
    """Every compiled decode config (the binding's default is one of them), at tails and a narrow N."""
    monkeypatch.setenv("QWEN38_Q8_GEMV_CONFIG", config)
    for N, K in [(1, 32), (37, 160), (130, 1056), (11, 5120), (3, 17408)]:
        weight_q, weight_d = make_weights(N, K, device="cuda", seed=N)
        act = make_activation(lane, 1, K, device="cuda", seed=K)
        check_against_reference(lane, act, weight_q, weight_d, run_cuda(lane, act, weight_q, weight_d))


@cuda
@needs_gpu
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_27b_shapes(lane, N, K):
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=7)
    act = make_activation(lane, 1, K, device="cuda", seed=8)
    out = run_cuda(lane, act, weight_q, weight_d)
    check_against_reference(lane, act, weight_q, weight_d, out, rows=sample_rows(N))
    assert torch.equal(run_cuda(lane, act, weight_q, weight_d), out), "two runs differ"


@cuda
@needs_gpu
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


@cuda
@needs_gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("lane", LANES)
def test_cuda_graph_replay_bitwise(lane, pdl, monkeypatch):
    """A captured graph of dependent launches (GEMV -> GEMV, with PDL on and off) equals eager bit for bit."""
    monkeypatch.setenv("QWEN38_PDL", pdl)
    N, K = 5120, 6144
    w1 = make_weights(K, K, device="cuda", seed=1)
    w2 = make_weights(N, K, device="cuda", seed=2)
    act = make_activation(lane, 1, K, device="cuda", seed=3)
    mid = torch.empty(1, K, device="cuda")
    out = torch.empty(1, N, device="cuda")

    def step():
        op_for(lane)(*act, *w1, mid)  # the second GEMV reads what the first wrote: PDL must wait for it
        ops.q8_0_gemv(mid, *w2, out)

    step()
    torch.cuda.synchronize()
    eager_mid, eager_out = mid.clone(), out.clone()
    mid.fill_(float("nan"))
    out.fill_(float("nan"))
    step()
    torch.cuda.synchronize()
    assert torch.equal(mid, eager_mid) and torch.equal(out, eager_out), "two eager runs differ"
    graph = capture_graph(step)
    mid.fill_(float("nan"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(mid, eager_mid) and torch.equal(out, eager_out), "graph replay differs from eager"
    check_against_reference("f32", (eager_mid,), *w2, out)


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
@needs_gpu
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
