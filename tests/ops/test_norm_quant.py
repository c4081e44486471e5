"""norm_quant family: quantize_act, rms_norm, add_rms_norm, silu_mul, gated_rms_norm.

CPU (CI): opcheck of every op, with and without the quantized outputs; the reference's quantizer against
gguf's own Q8_0 quantizer (bit for bit) and the two-word lane against its error bound; the norms against
torch's F.rms_norm / a per-head formula. CUDA (-m cuda): every kernel against the reference in float64 on
the CPU, on random inputs, outputs poisoned first, at odd widths (96, 160, 17408) and the decode shapes
(D = 5120, F = 17408, 48 heads of 128), T = 1 and T > 1, in all three lanes; the quantized words and scales
are checked bit for bit against the reference's quantizer applied to the kernel's own float output;
determinism; a captured graph replays bit for bit; bad arguments raise.

Error bounds: out within rtol 1e-5 (+ atol 1e-6 * max|ref|) of the float64 reference -- a float32 sum of
squares over <= 17408 values, an approximate rsqrt (2 ulp) and __expf in SiLU (~2 ulp), all << 1e-5;
residual (add_rms_norm) and the quantized lanes exact.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import norm_quant as ref

from cuda_helpers import capture_graph, child_env, cuda, run_in_child

ops = torch.ops.qwen38
EPS = 1e-6
LANES = [None, "int8", "int8x2"]


def randn(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device)


def quant_outputs(lane, T, D, device="cpu"):
    """(out_q, out_q_lo, out_d) for a lane, poisoned (0x7f words, NaN scales) so unwritten ones show."""
    if lane is None:
        return None, None, None
    out_q = torch.full((T, D), 0x7F, dtype=torch.int8, device=device)
    out_q_lo = torch.full((T, D), 0x7F, dtype=torch.int8, device=device) if lane == "int8x2" else None
    out_d = torch.full((T, D // 32), float("nan"), device=device)
    return out_q, out_q_lo, out_d


def run_producer(name, inputs, weight_args, T, D, lane, device, out=None):
    """Call op `name`; inputs are the leading tensors, weight_args (weight, eps) where the op has them."""
    out = torch.full((T, D), float("nan"), device=device) if out is None else out.fill_(float("nan"))
    q = quant_outputs(lane, T, D, device)
    getattr(ops, name)(*inputs, *weight_args, out, *q)
    return out, q


# ---- CPU ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lane", LANES)
def test_opcheck_cpu(lane):
    T, D, dv = 2, 64, 32
    x, z, res = randn(T, D, seed=1), randn(T, D, seed=2), randn(T, D, seed=3)
    w, wv = randn(D, seed=4), randn(dv, seed=5)
    gate_up = randn(T, 2 * D, seed=6)
    q = lambda: quant_outputs(lane, T, D)  # noqa: E731
    if lane is not None:
        q_, lo_, d_ = q()
        torch.library.opcheck(ops.quantize_act.default, (x, q_, lo_, d_))
    torch.library.opcheck(ops.rms_norm.default, (x, w, EPS, torch.empty(T, D), *q()))
    torch.library.opcheck(ops.add_rms_norm.default, (res.clone(), x, w, EPS, torch.empty(T, D), *q()))
    torch.library.opcheck(ops.silu_mul.default, (gate_up, torch.empty(T, D), *q()))
    torch.library.opcheck(ops.gated_rms_norm.default, (x, z, wv, EPS, torch.empty(T, D), *q()))


@pytest.mark.parametrize("D", [32, 96, 5120])
def test_int8_quantizer_matches_gguf(D):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    x = randn(3, D, seed=D) * torch.rand(3, D, generator=torch.Generator().manual_seed(1)) * 4
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    q, d = ref.quantize_int8(x)
    blocks = gguf_quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(3, D // 32, 34)
    gguf_d = torch.from_numpy(blocks[..., :2].copy().view(np.float16).astype(np.float32)).reshape(3, D // 32)
    gguf_q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(3, D)
    assert torch.equal(q, gguf_q)
    assert torch.equal(d, gguf_d)


def test_int8x2_quantizer_error_bound():
    x = randn(4, 256, seed=3) * 3
    x[1, 32:64] = 0.0
    q, q_lo, s = ref.quantize_int8x2(x)
    assert q.abs().max() <= 127 and q_lo.abs().max() <= 64
    value = s.repeat_interleave(32, dim=1) * (q.double() + q_lo.double() / 127)
    # half a low-word step, plus float32 rounding of t = x/s (|t| <= 127, so <= 127 * 2^-24 < 1e-5 of s)
    bound = s.repeat_interleave(32, dim=1) * (0.5 / 127 + 1e-5) + 1e-12
    assert ((value - x.double()).abs() <= bound).all()
    assert (s[1, 1] == 0) and (q[1, 32:64] == 0).all() and (q_lo[1, 32:64] == 0).all()


@pytest.mark.parametrize("T,D", [(1, 96), (3, 160)])
def test_norm_references_vs_formulas(T, D):
    x, res, w = randn(T, D, seed=1).double(), randn(T, D, seed=2).double(), randn(D, seed=3).double()
    out = torch.empty(T, D, dtype=torch.float64)
    ref.rms_norm(x, w, EPS, out)
    torch.testing.assert_close(out, F.rms_norm(x, (D,), w, EPS), rtol=1e-12, atol=1e-12)
    res_after = res.clone()
    ref.add_rms_norm(res_after, x, w, EPS, out)
    assert torch.equal(res_after, res + x)
    torch.testing.assert_close(out, F.rms_norm(res + x, (D,), w, EPS), rtol=1e-12, atol=1e-12)
    gate_up = randn(T, 2 * D, seed=4).double()
    ref.silu_mul(gate_up, out)
    torch.testing.assert_close(out, gate_up[:, :D] * torch.sigmoid(gate_up[:, :D]) * gate_up[:, D:])
    dv = 32
    z, wv = randn(T, D, seed=5).double(), randn(dv, seed=6).double()
    ref.gated_rms_norm(x, z, wv, EPS, out)
    for h in range(D // dv):
        xh, zh = x[:, h * dv:(h + 1) * dv], z[:, h * dv:(h + 1) * dv]
        expected = xh / torch.sqrt((xh * xh).mean(-1, keepdim=True) + EPS) * wv * (zh * torch.sigmoid(zh))
        torch.testing.assert_close(out[:, h * dv:(h + 1) * dv], expected, rtol=1e-12, atol=1e-12)


# ---- CUDA ---------------------------------------------------------------------------------------------

NAMES = ("quantize_act", "rms_norm", "add_rms_norm", "silu_mul", "gated_rms_norm")


def assert_cuda_kernels():
    for name in NAMES:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"qwen38::{name}", "CUDA"), \
            f"{name}: no CUDA kernel registered (extension built without CUDA?)"


def check_quantized(lane, out, q):
    """The quantized lane must be exactly the reference's quantization of the kernel's own float output."""
    if lane is None:
        return
    out_q, out_q_lo, out_d = q
    exp_q, exp_lo, exp_d = quant_outputs(lane, *out.shape)
    ref.quantize_act(out.cpu(), exp_q, exp_lo, exp_d)
    assert torch.equal(out_d.cpu(), exp_d), "quant scales differ from the reference's"
    assert torch.equal(out_q.cpu(), exp_q), f"quant words differ in {(out_q.cpu() != exp_q).sum().item()} places"
    if out_q_lo is not None:
        assert torch.equal(out_q_lo.cpu(), exp_lo), "low words differ from the reference's"


def assert_out_close(out, expected):
    assert not out.isnan().any(), "some outputs were not written (still NaN)"
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


@cuda
@pytest.mark.parametrize("lane", ["int8", "int8x2"])
@pytest.mark.parametrize("T,D", [(1, 32), (1, 96), (3, 160), (1, 5120), (2, 17408), (5, 6144)])
def test_cuda_quantize_act(lane, T, D):
    assert_cuda_kernels()
    x = randn(T, D, seed=D) * 3
    x[0, :32] = 0.0  # all-zero block
    q = quant_outputs(lane, T, D, "cuda")
    ops.quantize_act(x.cuda(), *q)
    check_quantized(lane, x.cuda(), q)


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("T,D", [(1, 96), (3, 160), (1, 5120), (4, 5120), (1, 17408), (2, 100)])
@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_cuda_rms_norm(lane, T, D, add):
    if lane is not None and D % 32:
        pytest.skip("quantized lanes need D % 32 == 0")
    x, res, w = randn(T, D, seed=1), randn(T, D, seed=2) * 2, randn(D, seed=3)
    expected = torch.empty(T, D, dtype=torch.float64)
    if add:
        res_expected = res.double().clone()
        ref.add_rms_norm(res_expected, x.double(), w.double(), EPS, expected)
        res_cuda = res.cuda()
        out, q = run_producer("add_rms_norm", (res_cuda, x.cuda()), (w.cuda(), EPS), T, D, lane, "cuda")
        assert torch.equal(res_cuda.cpu(), res + x), "residual must be residual + x, exactly"
    else:
        ref.rms_norm(x.double(), w.double(), EPS, expected)
        out, q = run_producer("rms_norm", (x.cuda(),), (w.cuda(), EPS), T, D, lane, "cuda")
    assert_out_close(out, expected)
    check_quantized(lane, out, q)


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("T,F_", [(1, 96), (3, 160), (1, 17408), (2, 17408), (1, 5120)])
def test_cuda_silu_mul(lane, T, F_):
    gate_up = randn(T, 2 * F_, seed=F_) * 3
    expected = torch.empty(T, F_, dtype=torch.float64)
    ref.silu_mul(gate_up.double(), expected)
    out, q = run_producer("silu_mul", (gate_up.cuda(),), (), T, F_, lane, "cuda")
    assert_out_close(out, expected)
    check_quantized(lane, out, q)


@cuda
@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("T,H,dv", [(1, 48, 128), (3, 48, 128), (1, 6, 32), (2, 3, 96), (1, 2, 256), (1, 5, 36)])
def test_cuda_gated_rms_norm(lane, T, H, dv):
    if lane is not None and dv % 32:
        pytest.skip("quantized lanes need dv % 32 == 0")
    D = H * dv
    x, z, w = randn(T, D, seed=1), randn(T, D, seed=2) * 2, randn(dv, seed=3)
    expected = torch.empty(T, D, dtype=torch.float64)
    ref.gated_rms_norm(x.double(), z.double(), w.double(), EPS, expected)
    out, q = run_producer("gated_rms_norm", (x.cuda(), z.cuda()), (w.cuda(), EPS), T, D, lane, "cuda")
    assert_out_close(out, expected)
    check_quantized(lane, out, q)


@cuda
def test_cuda_strided_rows():
    """Inputs and the float output may be row slices of wider buffers (fused projections); the quantized lane
    is contiguous (checks.h: one rule for every op that writes it; check_bad_arguments: a strided one raises)."""
    T, D = 3, 5120
    x_buf, w = randn(T, D + 64, seed=1).cuda(), randn(D, seed=2).cuda()
    x = x_buf[:, 64:]
    out = torch.empty(T, D + 32, device="cuda")[:, :D]
    q = quant_outputs("int8x2", T, D, "cuda")
    ops.rms_norm(x, w, EPS, out, *q)
    expected = torch.empty(T, D, dtype=torch.float64)
    ref.rms_norm(x.cpu().double(), w.cpu().double(), EPS, expected)
    assert_out_close(out, expected)
    check_quantized("int8x2", out, q)


def check_deterministic_and_graph_replay_bitwise():
    """One decode-like chain (add_rms_norm -> gemv -> silu_mul -> gated_rms_norm -> quantize_act), twice
    eagerly and once from a captured graph: the same bits every time (run in a child by the test below)."""
    D, F_, H, dv = 5120, 17408, 48, 128
    res0, x = randn(1, D, seed=1).cuda(), randn(1, D, seed=2).cuda()
    w = randn(D, seed=3).cuda()
    g = torch.Generator(device="cuda").manual_seed(4)
    wq = torch.randint(-127, 128, (2 * F_, D), generator=g, device="cuda", dtype=torch.int8)
    wd = (torch.rand(2 * F_, D // 32, generator=g, device="cuda") * 0.01).half()
    z, wv = randn(1, H * dv, seed=5).cuda(), randn(dv, seed=6).cuda()
    i8 = dict(dtype=torch.int8, device="cuda")
    b = dict(res=res0.clone(), n=torch.empty(1, D, device="cuda"), q=torch.empty(1, D, **i8),
             lo=torch.empty(1, D, **i8), d=torch.empty(1, D // 32, device="cuda"),
             gu=torch.empty(1, 2 * F_, device="cuda"), h=torch.empty(1, F_, device="cuda"),
             hq=torch.empty(1, F_, **i8), hd=torch.empty(1, F_ // 32, device="cuda"),
             g=torch.empty(1, H * dv, device="cuda"), gq=torch.empty(1, H * dv, **i8),
             gd=torch.empty(1, H * dv // 32, device="cuda"))

    def step():
        ops.add_rms_norm(b["res"], x, w, EPS, b["n"], b["q"], b["lo"], b["d"])
        ops.q8_0_gemv_int8x2(b["q"], b["lo"], b["d"], wq, wd, b["gu"])
        ops.silu_mul(b["gu"], b["h"], b["hq"], None, b["hd"])
        ops.gated_rms_norm(b["h"][:, : H * dv], z, wv, EPS, b["g"], b["gq"], None, b["gd"])
        ops.quantize_act(b["g"], b["gq"], None, b["gd"])

    def run_once():
        b["res"].copy_(res0)
        for k, t in b.items():
            if k != "res":
                t.fill_(0x7F if t.dtype == torch.int8 else float("nan"))
        step()
        torch.cuda.synchronize()
        return {k: t.clone() for k, t in b.items()}

    first, second = run_once(), run_once()
    for k in first:
        assert torch.equal(first[k], second[k]), f"{k}: two eager runs differ"
    graph = capture_graph(step)
    b["res"].copy_(res0)
    for k, t in b.items():
        if k != "res":
            t.fill_(0x7F if t.dtype == torch.int8 else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for k in first:
        assert torch.equal(b[k], first[k]), f"{k}: graph replay differs from eager"


@cuda
@pytest.mark.parametrize("pdl", ["1", "0"])
def test_cuda_deterministic_and_graph_replay_bitwise(pdl):
    """check_deterministic_and_graph_replay_bitwise with PDL on and off: QWEN38_PDL is read once per process
    (csrc/kernels/pdl.cuh), so each setting runs in its own child."""
    run_in_child(__file__, "check_deterministic_and_graph_replay_bitwise", child_env(QWEN38_PDL=pdl))


def check_bad_arguments():
    """Every wrong argument raises a RuntimeError naming it (run in a child by the test below)."""
    T, D = 2, 256
    x, w = torch.randn(T, D, device="cuda"), torch.randn(D, device="cuda")
    out = torch.empty(T, D, device="cuda")
    q, lo, d = quant_outputs("int8x2", T, D, "cuda")
    x_f64, w_cpu, out_wide = x.double(), w.cpu(), torch.empty(T, D + 4, device="cuda")
    x_unaligned = torch.randn(T, D + 1, device="cuda")[:, 1:]
    gate_up, d_half, w96 = torch.randn(T, 2 * D, device="cuda"), d.half(), torch.randn(96, device="cuda")
    q100, d3 = q[:, :100], d[:, :3]
    with pytest.raises(RuntimeError, match="x must be"):
        ops.rms_norm(x_f64, w, EPS, out, None, None, None)
    with pytest.raises(RuntimeError, match="weight is on"):
        ops.rms_norm(x, w_cpu, EPS, out, None, None, None)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.rms_norm(x, w, EPS, out_wide, None, None, None)
    with pytest.raises(RuntimeError, match="come together"):
        ops.rms_norm(x, w, EPS, out, q, None, None)
    with pytest.raises(RuntimeError, match="needs out_q"):
        ops.rms_norm(x, w, EPS, out, None, lo, None)
    with pytest.raises(RuntimeError, match="D % 32"):
        ops.quantize_act(x[:, :100], q100, None, d3)
    with pytest.raises(RuntimeError, match="aligned"):
        ops.rms_norm(x_unaligned, w, EPS, out, None, None, None)
    with pytest.raises(RuntimeError, match="out_d must be"):
        ops.silu_mul(gate_up, out, q, None, d_half)
    with pytest.raises(RuntimeError, match="multiple of dv"):
        ops.gated_rms_norm(x, x, w96, EPS, out, None, None, None)
    with pytest.raises(RuntimeError, match="residual must be"):
        ops.add_rms_norm(x_f64, x, w, EPS, out, None, None, None)
    # The quantized lane is contiguous int8 / float32 (one rule with gdn_step and attention's gate): row slices of
    # wider buffers raise.
    for i, strided in enumerate((torch.empty(T, D + 64, dtype=torch.int8, device="cuda")[:, 32 : 32 + D],
                                 torch.empty(T, D + 64, dtype=torch.int8, device="cuda")[:, :D],
                                 torch.empty(T, D // 32 + 3, device="cuda")[:, 1 : 1 + D // 32])):
        with pytest.raises(RuntimeError, match="rms_norm: out_(q|q_lo|d) must be contiguous"):
            ops.rms_norm(x, w, EPS, out, *(strided if j == i else t for j, t in enumerate((q, lo, d))))


@cuda
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
