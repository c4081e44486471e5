"""embedding family: q8_0_embedding.

CPU (CI): opcheck; the reference against gguf's own Q8_0 dequantizer. CUDA (-m cuda): the kernel against
the reference (bit for bit: each value is one float32 product of an int8 and an fp16 scale, so there is no
rounding freedom), outputs poisoned first, at odd widths and the 27B table [248320, 5120]; out-of-range
tokens give NaN rows; a captured graph replays bit for bit and follows a token changed on the device;
bad arguments raise.
"""
import numpy as np
import pytest
import torch

import qwen38_ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import embedding as ref

from cuda_helpers import capture_graph, cuda, needs_gpu, run_in_child

ops = torch.ops.qwen38


def make_table(V, D, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    weight_q = torch.randint(-128, 128, (V, D), generator=g, device=device, dtype=torch.int8)
    weight_d = (torch.randn(V, D // 32, generator=g, device=device) * 0.02).half()
    return weight_q, weight_d


def test_opcheck_cpu():
    weight_q, weight_d = make_table(10, 64)
    token = torch.tensor([3, 0, 9], dtype=torch.int32)
    torch.library.opcheck(ops.q8_0_embedding.default, (token, weight_q, weight_d, torch.empty(3, 64)))


def test_reference_vs_gguf_dequantize():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    V, D = 12, 96
    weight_q, weight_d = make_table(V, D, seed=1)
    token = torch.tensor([11, 0, 5, 5], dtype=torch.int32)
    out = torch.empty(4, D)
    ref.q8_0_embedding(token, weight_q, weight_d, out)
    blocks = np.concatenate([weight_d.numpy().reshape(V, D // 32, 1).view(np.uint8),
                             weight_q.numpy().reshape(V, D // 32, 32).view(np.uint8)], axis=2)
    table = torch.from_numpy(np.ascontiguousarray(
        gguf_quants.dequantize(blocks.reshape(V, -1), GGMLQuantizationType.Q8_0))).reshape(V, D)
    assert torch.equal(out, table[token.long()])


def expected_rows(token, weight_q, weight_d):
    out = torch.empty(token.shape[0], weight_q.shape[1])
    ref.q8_0_embedding(token.cpu(), weight_q.cpu(), weight_d.cpu(), out)
    return out


@cuda
@needs_gpu
@pytest.mark.parametrize("V,D", [(7, 32), (100, 96), (1000, 160), (300, 5120)])
@pytest.mark.parametrize("T", [1, 5])
def test_cuda_matches_reference(V, D, T):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qwen38::q8_0_embedding", "CUDA")
    weight_q, weight_d = make_table(V, D, device="cuda", seed=V)
    token = torch.randint(0, V, (T,), dtype=torch.int32, device="cuda")
    token[0] = V - 1
    out = torch.full((T, D), float("nan"), device="cuda")
    ops.q8_0_embedding(token, weight_q, weight_d, out)
    assert torch.equal(out.cpu(), expected_rows(token, weight_q, weight_d))


@cuda
@needs_gpu
def test_cuda_27b_table_strided_out_and_bad_tokens():
    V, D = 248320, 5120
    weight_q, weight_d = make_table(V, D, device="cuda", seed=3)
    token = torch.tensor([0, V - 1, 123457, -1, V], dtype=torch.int32, device="cuda")
    out = torch.full((5, D + 64), float("nan"), device="cuda")[:, 32:32 + D]
    ops.q8_0_embedding(token, weight_q, weight_d, out)
    good = token[:3]
    assert torch.equal(out[:3].cpu(), expected_rows(good, weight_q, weight_d))
    assert out[3:].isnan().all(), "out-of-range tokens must give NaN rows"


@cuda
@needs_gpu
def test_cuda_graph_replay_follows_device_token():
    V, D = 500, 5120
    weight_q, weight_d = make_table(V, D, device="cuda", seed=4)
    token = torch.tensor([17], dtype=torch.int32, device="cuda")
    out = torch.empty(1, D, device="cuda")
    graph = capture_graph(lambda: ops.q8_0_embedding(token, weight_q, weight_d, out))
    eager = out.clone()  # the warm-up's rows: capturing launches nothing
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    token.fill_(401)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), expected_rows(token, weight_q, weight_d))


def check_bad_arguments():
    """Every wrong argument raises a RuntimeError naming it (run in a child by the test below)."""
    weight_q, weight_d = make_table(10, 64, device="cuda")
    token = torch.tensor([1], dtype=torch.int32, device="cuda")
    out = torch.empty(1, 64, device="cuda")
    token_long, token_cpu, wd_f32 = token.long(), token.cpu(), weight_d.float()
    out_wide, out_unaligned = torch.empty(1, 96, device="cuda"), torch.empty(1, 65, device="cuda")[:, 1:]
    with pytest.raises(RuntimeError, match="token must be"):
        ops.q8_0_embedding(token_long, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="token must be a CUDA tensor"):
        ops.q8_0_embedding(token_cpu, weight_q, weight_d, out)
    with pytest.raises(RuntimeError, match="weight_d must be"):
        ops.q8_0_embedding(token, weight_q, wd_f32, out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.q8_0_embedding(token, weight_q, weight_d, out_wide)
    with pytest.raises(RuntimeError, match="aligned"):
        ops.q8_0_embedding(token, weight_q, weight_d, out_unaligned)


@cuda
@needs_gpu
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
