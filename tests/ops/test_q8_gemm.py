"""q8_gemm: the tensor-core GEMM of the two integer lanes (q8_0_gemm_int8, q8_0_gemm_int8x2) for
prompt-sized T. Same arguments and references as the GEMV lanes (test_q8_gemv.py has the helpers).

CPU (CI): opcheck. CUDA (-m cuda): the mma.sync kernel against the float64 reference, outputs poisoned with
NaN, at T across every tile boundary (32/64/128 tokens, each tile forced), odd N and K, the 27B shapes at
T = 512; up to 64 rows the K splits (default and forced) at the 27B shapes; strided activation rows; two runs give
the same bits; graph replay == eager; bad arguments raise.
The sm_90a kernels (wgmma, and wgmma_iadd, its other accumulator reset; forced with QWEN38_Q8_GEMM_KERNEL): the
same checks, and the same bits as the mma.sync kernel everywhere (same per-block arithmetic, same block order),
at odd T and N, K % 256 != 0 (stages past K, which must add nothing), several tiles per persistent block, the 27B shapes at T = 512 and
4096; skipped unless the build is sm_90a and the device sm_90.

Error bound: each block's int32 dot is exact; per block the kernel rounds twice (int8: dot * weight_d,
then the FMA with x_d into the float32 sum; two-word: 127 hi + lo, then the FMA with the exact scale
product), in block order, so |y - y_ref| <= (2 K/32 + 4) * 2^-24 * sum_k |w_k x_k|.
"""
import os

import pytest
import torch

import qwen38_ops
import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from test_q8_gemv import check_against_reference, make_activation, make_weights, sample_rows

from cuda_helpers import assert_cuda_kernel, capture_graph, cuda, run_in_child

ops = torch.ops.qwen38
LANES = ["int8", "int8x2"]
SHAPES_27B = [(16480, 5120), (34816, 5120), (14336, 5120), (5120, 6144), (5120, 17408)]
ODD_SHAPES = [(1, 64), (7, 128), (33, 192), (130, 576), (257, 1088), (100, 6144)]
TILES = ["32", "64", "128"]
WGMMA_KERNELS = ["wgmma", "wgmma_iadd"]
WGMMA_TILES = {"int8": ["128", "64"], "int8x2": ["64"]}
# T around the wgmma tiles (128 and 64 tokens); (4160, 1088): K % 256 == 64, and at T = 513 more tiles than SMs
# (33 x 5 of 128 tokens, 33 x 9 of 64): two per persistent block.
WGMMA_T = (1, 2, 17, 63, 64, 65, 127, 128, 129, 300, 513)
WGMMA_SHAPES = ODD_SHAPES + [(4160, 1088)]


def op_for(lane):
    return {"int8": ops.q8_0_gemm_int8, "int8x2": ops.q8_0_gemm_int8x2}[lane]


def rel_bound(K):
    """Two roundings a block, plus one a K split (up to 16, q8_gemm.cu) where the splits' sums are added."""
    return (2 * (K // 32) + 4 + 16) * 2.0**-24


def require_wgmma():
    """The wgmma kernels exist only in an sm_90a build (setup.py's default) and run only on an sm_90 device."""
    if "sm_90a" not in qwen38_ops.BUILD_SUMMARY or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"wgmma GEMM needs an sm_90a build on an sm_90 device ({qwen38_ops.BUILD_SUMMARY}; device "
                    f"{torch.cuda.get_device_capability()})")


def run_kernel(kernel, monkeypatch, lane, act, weight_q, weight_d, out=None):
    """run_cuda with the GEMM kernel forced (poisoned output, synchronized)."""
    monkeypatch.setenv("QWEN38_Q8_GEMM_KERNEL", kernel)
    return run_cuda(lane, act, weight_q, weight_d, out)


def run_cuda(lane, act, weight_q, weight_d, out=None):
    T, N = act[0].shape[0], weight_q.shape[0]
    out = torch.empty(T, N, device="cuda") if out is None else out
    out.fill_(float("nan"))
    op_for(lane)(*act, weight_q, weight_d, out)
    torch.cuda.synchronize()
    return out


def assert_graph_replays_eager(lane, act, weight_q, weight_d):
    """The op captured once into a CUDA graph and replayed into a poisoned output: the eager bits."""
    out = torch.empty(act[0].shape[0], weight_q.shape[0], device="cuda")
    eager = run_cuda(lane, act, weight_q, weight_d, out).clone()
    graph = capture_graph(lambda: op_for(lane)(*act, weight_q, weight_d, out))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), f"T = {act[0].shape[0]}: graph replay differs from eager"


@pytest.mark.parametrize("lane", LANES)
def test_opcheck_cpu(lane):
    weight_q, weight_d = make_weights(6, 128)
    act = make_activation(lane, 3, 128)
    torch.library.opcheck(op_for(lane).default, (*act, weight_q, weight_d, torch.empty(3, 6)))


@cuda
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", ODD_SHAPES)
def test_cuda_odd_shapes_every_tile(lane, N, K, tile, monkeypatch):
    monkeypatch.setenv("QWEN38_Q8_GEMM_TILE", tile)
    assert_cuda_kernel(f"q8_0_gemm_{lane}")
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=N + K)
    for T in (2, 17, 32, 33, 64, 65, 129, 300):
        act = make_activation(lane, T, K, device="cuda", seed=T)
        check_against_reference(lane, act, weight_q, weight_d, run_cuda(lane, act, weight_q, weight_d),
                                rel_bound=rel_bound(K))


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_27b_shapes(lane, N, K):
    """The default tile at T = 512, sampled rows against the reference, and the same bits twice."""
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=7)
    act = make_activation(lane, 512, K, device="cuda", seed=8)
    out = run_cuda(lane, act, weight_q, weight_d)
    rows = sample_rows(N, count=1024)
    check_against_reference(lane, tuple(a[::7] for a in act), weight_q, weight_d, out[::7], rows=rows,
                            rel_bound=rel_bound(K))
    assert torch.equal(run_cuda(lane, act, weight_q, weight_d), out), "two runs differ"


@cuda
@pytest.mark.parametrize("lane", LANES)
def test_cuda_strided_activation_rows(lane):
    """Activations and outputs may be row slices of wider buffers (fused projections)."""
    N, K, T = 70, 576, 40
    weight_q, weight_d = make_weights(N, K, device="cuda")
    act = make_activation(lane, T, K + 64, device="cuda")
    sliced = tuple(a[:, : K // 32] if a.dtype == torch.float32 else a[:, :K] for a in act)
    out = torch.empty(T, N + 5, device="cuda")[:, :N]
    run_cuda(lane, sliced, weight_q, weight_d, out=out)
    check_against_reference(lane, sliced, weight_q, weight_d, out, rel_bound=rel_bound(K))


@cuda
@pytest.mark.parametrize("lane", LANES)
def test_cuda_graph_replay_bitwise(lane):
    N, K, T = 1000, 1024, 100
    weight_q, weight_d = make_weights(N, K, device="cuda")
    act = make_activation(lane, T, K, device="cuda")
    assert_graph_replays_eager(lane, act, weight_q, weight_d)


@cuda
@pytest.mark.parametrize("kernel", WGMMA_KERNELS)
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", WGMMA_SHAPES)
def test_cuda_wgmma_odd_shapes_bitwise_mma(lane, N, K, kernel, monkeypatch):
    """Each compiled token tile (QWEN38_Q8_GEMM_TILE with the kernel forced) against the reference and against
    the mma.sync kernel's bits (its 32-token tile: the two tile T differently)."""
    require_wgmma()
    monkeypatch.setenv("QWEN38_Q8_GEMM_SPLITS", "1")  # the wgmma kernel does not split K; its bits are unsplit ones
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=N + K)
    rows = sample_rows(N, count=1024)
    for T in WGMMA_T:
        act = make_activation(lane, T, K, device="cuda", seed=T)
        monkeypatch.setenv("QWEN38_Q8_GEMM_TILE", "32")
        mma = run_kernel("mma", monkeypatch, lane, act, weight_q, weight_d).clone()
        for tile in WGMMA_TILES[lane]:
            monkeypatch.setenv("QWEN38_Q8_GEMM_TILE", tile)
            out = run_kernel(kernel, monkeypatch, lane, act, weight_q, weight_d)
            if tile == WGMMA_TILES[lane][0]:
                check_against_reference(lane, act, weight_q, weight_d, out, rows=rows, rel_bound=rel_bound(K))
            assert torch.equal(out, mma), (f"T = {T}, tile {tile}: {kernel} differs from mma.sync in "
                                           f"{(out != mma).sum().item()} outputs")


@cuda
@pytest.mark.parametrize("kernel", WGMMA_KERNELS)
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("T", [512, 4096])
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_wgmma_27b_shapes(lane, N, K, T, kernel, monkeypatch):
    """The default tile: sampled rows against the reference; every output the mma.sync kernel's bits; the same
    bits twice."""
    require_wgmma()
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=7)
    act = make_activation(lane, T, K, device="cuda", seed=8)
    mma = run_kernel("mma", monkeypatch, lane, act, weight_q, weight_d).clone()
    out = run_kernel(kernel, monkeypatch, lane, act, weight_q, weight_d)
    rows, step = sample_rows(N, count=1024), T // 73  # ~74 tokens: the float64 reference costs seconds
    check_against_reference(lane, tuple(a[::step] for a in act), weight_q, weight_d, out[::step], rows=rows,
                            rel_bound=rel_bound(K))
    assert torch.equal(out, mma), f"{kernel} differs from mma.sync in {(out != mma).sum().item()} outputs"
    assert torch.equal(run_kernel(kernel, monkeypatch, lane, act, weight_q, weight_d), out), "two runs differ"


@cuda
@pytest.mark.parametrize("kernel", WGMMA_KERNELS)
@pytest.mark.parametrize("lane", LANES)
def test_cuda_wgmma_strided_activation_rows(lane, kernel, monkeypatch):
    """Row slices of wider buffers: the tensor maps take the row strides, the scale copies x_d's."""
    require_wgmma()
    N, K, T = 70, 576, 140
    weight_q, weight_d = make_weights(N, K, device="cuda")
    act = make_activation(lane, T, K + 64, device="cuda")
    sliced = tuple(a[:, : K // 32] if a.dtype == torch.float32 else a[:, :K] for a in act)
    out = torch.empty(T, N + 5, device="cuda")[:, :N]
    run_kernel(kernel, monkeypatch, lane, sliced, weight_q, weight_d, out=out)
    check_against_reference(lane, sliced, weight_q, weight_d, out, rel_bound=rel_bound(K))
    assert torch.equal(out, run_kernel("mma", monkeypatch, lane, sliced, weight_q, weight_d).clone())


@cuda
@pytest.mark.parametrize("lane", LANES)
def test_cuda_wgmma_graph_replay_bitwise(lane, monkeypatch):
    """The tensor maps are kernel parameters, encoded at the call: a captured graph replays them."""
    require_wgmma()
    monkeypatch.setenv("QWEN38_Q8_GEMM_KERNEL", "wgmma")
    N, K, T = 1000, 1024, 300
    weight_q, weight_d = make_weights(N, K, device="cuda")
    act = make_activation(lane, T, K, device="cuda")
    assert_graph_replays_eager(lane, act, weight_q, weight_d)


SPLIT_T = (1, 8, 16, 33, 64)


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("N,K", SHAPES_27B, ids=[f"{n}x{k}" for n, k in SHAPES_27B])
def test_cuda_small_t_splits(lane, N, K, monkeypatch):
    """Up to 64 rows the K range is split (q8_0_gemm_splits): the default splits and forced 1, 3 and 16 against the
    reference (outputs poisoned), the same bits twice, and the default in a captured graph (its partial sums from
    the graph's pool) bit for bit like eager."""
    weight_q, weight_d = make_weights(N, K, device="cuda", seed=11)
    rows = sample_rows(N, count=512)
    for T in SPLIT_T:
        act = make_activation(lane, T, K, device="cuda", seed=T)
        for splits in (None, "1", "3", "16"):
            if splits is None:
                monkeypatch.delenv("QWEN38_Q8_GEMM_SPLITS", raising=False)
            else:
                monkeypatch.setenv("QWEN38_Q8_GEMM_SPLITS", splits)
            out = run_cuda(lane, act, weight_q, weight_d)
            check_against_reference(lane, act, weight_q, weight_d, out, rows=rows, rel_bound=rel_bound(K))
            assert torch.equal(run_cuda(lane, act, weight_q, weight_d), out), (T, splits, "two runs differ")
        monkeypatch.delenv("QWEN38_Q8_GEMM_SPLITS")
        assert_graph_replays_eager(lane, act, weight_q, weight_d)


def check_bad_arguments():
    N, K, T = 64, 256, 40
    weight_q, weight_d = make_weights(N, K, device="cuda")
    x_q, x_d = make_activation("int8", T, K, device="cuda")
    out = torch.empty(T, N, device="cuda")
    wq_96, wd_96 = weight_q[:, :96].contiguous(), weight_d[:, :3].contiguous()
    xq_96, xd_3 = x_q[:, :96].contiguous(), x_d[:, :3].contiguous()
    xd_odd = torch.empty(T, K // 32 + 1, device="cuda")[:, 1:]
    xd_odd.copy_(x_d)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.q8_0_gemm_int8(xq_96, xd_3, wq_96, wd_96, out)
    with pytest.raises(RuntimeError, match="8-byte aligned"):
        ops.q8_0_gemm_int8(x_q, xd_odd, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.q8_0_gemm_int8(x_q, x_d, weight_q, weight_d, out[:, :10])
    os.environ["QWEN38_Q8_GEMM_KERNEL"] = "fastest"
    with pytest.raises(RuntimeError, match="QWEN38_Q8_GEMM_KERNEL must be mma, wgmma or wgmma_iadd"):
        ops.q8_0_gemm_int8(x_q, x_d, weight_q, weight_d, out)
    os.environ["QWEN38_Q8_GEMM_KERNEL"], os.environ["QWEN38_Q8_GEMM_TILE"] = "wgmma", "32"  # no 32-token wgmma tile
    with pytest.raises(RuntimeError, match="QWEN38_Q8_GEMM_TILE 64 or 128"):
        ops.q8_0_gemm_int8(x_q, x_d, weight_q, weight_d, out)
    del os.environ["QWEN38_Q8_GEMM_KERNEL"], os.environ["QWEN38_Q8_GEMM_TILE"]
    os.environ["QWEN38_Q8_GEMM_SPLITS"] = "0"
    with pytest.raises(RuntimeError, match="QWEN38_Q8_GEMM_SPLITS must be 1 .. 64, found 0"):
        ops.q8_0_gemm_int8(x_q, x_d, weight_q, weight_d, out)
    del os.environ["QWEN38_Q8_GEMM_SPLITS"]


@cuda
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
