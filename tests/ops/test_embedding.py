"""embedding family: q8_0_embedding (Q8_0 table) and embedding (dense table: float32, bfloat16, float16).

CPU (CI): opcheck; the Q8_0 reference against gguf's own dequantizer, the dense one against the table's
rows; an id outside [0, V) (negative, V, the int32 extremes) is a ValueError naming it. CUDA (-m cuda): the
kernels against the references (bit for bit: a Q8_0 value is one float32 product of an int8 and an fp16
scale, a dense one an exact widening, so there is no rounding freedom), outputs poisoned first, at odd
sizes and the 27B table [248320, 5120]; out-of-range ids give NaN rows and OR BAD_TOKEN into the flag
(keeping a condition already flagged), in range ones leave it alone; a captured graph replays bit for bit,
follows a token changed on the device and flags a bad one at replay; bad arguments raise.

Batched rows (the T rows T sequences): bad_token may have T elements, row t ORing into element t only; opcheck and
the reference take it on the CPU, the kernels flag per row on CUDA (graph replay too).
"""
import numpy as np
import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.embedding import BAD_TOKEN
from qwen38_ops.reference import embedding as ref

from cuda_helpers import capture_graph, cuda, run_in_child

ops = torch.ops.qwen38


def make_table(V, D, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    weight_q = torch.randint(-128, 128, (V, D), generator=g, device=device, dtype=torch.int8)
    weight_d = (torch.randn(V, D // 32, generator=g, device=device) * 0.02).half()
    return weight_q, weight_d


DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BAD_IDS = (-1, "V", 2**31 - 1, -(2**31))  # "V": the vocabulary size itself, one past the last row


def make_dense_table(V, D, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(V, D, generator=g, device=device).to(dtype)


def no_flag(device="cpu"):
    return torch.zeros(1, dtype=torch.int32, device=device)


def test_opcheck_cpu():
    weight_q, weight_d = make_table(10, 64)
    token = torch.tensor([3, 0, 9], dtype=torch.int32)
    torch.library.opcheck(ops.q8_0_embedding.default, (token, weight_q, weight_d, torch.empty(3, 64)))
    torch.library.opcheck(ops.q8_0_embedding.default, (token, weight_q, weight_d, torch.empty(3, 64), no_flag()))
    for dtype in DENSE_DTYPES:
        weight = make_dense_table(10, 33, dtype)
        torch.library.opcheck(ops.embedding.default, (token, weight, torch.empty(3, 33)))
        torch.library.opcheck(ops.embedding.default, (token, weight, torch.empty(3, 33), no_flag()))
    row_flags = torch.zeros(3, dtype=torch.int32)  # a flag a row (batched rows)
    torch.library.opcheck(ops.q8_0_embedding.default, (token, weight_q, weight_d, torch.empty(3, 64), row_flags))
    torch.library.opcheck(ops.embedding.default, (token, make_dense_table(10, 33, torch.float32), torch.empty(3, 33),
                                                  row_flags))


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_dense_reference_is_the_table_rows(dtype):
    weight = make_dense_table(12, 40, dtype, seed=2)
    token = torch.tensor([11, 0, 5, 5], dtype=torch.int32)
    out, flag = torch.full((4, 40), float("nan")), no_flag()
    ops.embedding(token, weight, out, flag)
    assert torch.equal(out, weight.float()[token.long()])
    assert int(flag) == 0


def test_reference_takes_a_flag_a_row():
    """The references take bad_token of T elements as of one (they raise for a bad id instead of flagging): the
    rows and the flags, untouched, as with no flag."""
    weight_q, weight_d = make_table(12, 64, seed=4)
    weight = make_dense_table(12, 40, torch.bfloat16, seed=4)
    token = torch.tensor([11, 0, 5], dtype=torch.int32)
    flags = torch.tensor([0, 1, 2], dtype=torch.int32)
    out_q8, out_dense = torch.full((3, 64), float("nan")), torch.full((3, 40), float("nan"))
    ops.q8_0_embedding(token, weight_q, weight_d, out_q8, flags)
    ops.embedding(token, weight, out_dense, flags)
    assert torch.equal(out_q8, expected_rows(token, weight_q, weight_d))
    assert torch.equal(out_dense, weight.float()[token.long()]) and flags.tolist() == [0, 1, 2]


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("op", ["q8_0_embedding", "embedding"])
def test_out_of_range_ids_raise_on_cpu(op, bad):
    """The reference raises at once (a negative id would otherwise read a row from the table's end, V one
    past it); the message names the id and the vocabulary."""
    V, D = 10, 64
    bad = V if bad == "V" else bad
    token = torch.tensor([3, bad, 0], dtype=torch.int32)
    weight_q, weight_d = make_table(V, D)
    tables = {"q8_0_embedding": (weight_q, weight_d), "embedding": (make_dense_table(V, D, torch.bfloat16),)}
    with pytest.raises(ValueError, match=rf"{op}: token id {bad} \(row 1 of 3\) is outside the vocabulary \[0, {V}\)"):
        getattr(ops, op)(token, *tables[op], torch.empty(3, D), no_flag())


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
def test_cuda_27b_table_strided_out_and_bad_tokens():
    V, D = 248320, 5120
    weight_q, weight_d = make_table(V, D, device="cuda", seed=3)
    token = torch.tensor([0, V - 1, 123457, -1, V, 2**31 - 1, -(2**31)], dtype=torch.int32, device="cuda")
    out = torch.full((7, D + 64), float("nan"), device="cuda")[:, 32:32 + D]
    flag = no_flag("cuda")
    ops.q8_0_embedding(token[:3], weight_q, weight_d, out[:3], flag)
    assert int(flag) == 0, "in-range ids must leave the flag alone"
    good = out[:3].clone()
    out.fill_(float("nan"))
    flag.fill_(1)  # attention's condition, flagged earlier: the OR must keep it
    ops.q8_0_embedding(token, weight_q, weight_d, out, flag)
    assert torch.equal(out[:3].cpu(), expected_rows(token[:3], weight_q, weight_d))
    assert torch.equal(out[:3], good)
    assert out[3:].isnan().all(), "out-of-range tokens must give NaN rows"
    assert int(flag) == 1 | BAD_TOKEN


@cuda
@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("V,D", [(7, 1), (100, 33), (503, 192), (1000, 5120)])
@pytest.mark.parametrize("T", [1, 5])
def test_cuda_dense_matches_reference(dtype, V, D, T):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qwen38::embedding", "CUDA")
    weight = make_dense_table(V, D, dtype, device="cuda", seed=V + D)
    token = torch.randint(0, V, (T,), dtype=torch.int32, device="cuda")
    token[0] = V - 1
    out, flag = torch.full((T, D), float("nan"), device="cuda"), no_flag("cuda")
    ops.embedding(token, weight, out, flag)
    assert torch.equal(out.cpu(), weight.cpu().float()[token.cpu().long()])
    assert int(flag) == 0


@cuda
def test_cuda_dense_27b_table_strided_out_and_bad_tokens():
    V, D = 248320, 5120
    weight = make_dense_table(V, D, torch.bfloat16, device="cuda", seed=5)
    token = torch.tensor([0, V - 1, 123457, -1, V, 2**31 - 1, -(2**31)], dtype=torch.int32, device="cuda")
    out = torch.full((7, D + 3), float("nan"), device="cuda")[:, 1:1 + D]  # rows need no alignment
    flag = no_flag("cuda")
    ops.embedding(token, weight, out, flag)
    assert torch.equal(out[:3], weight[token[:3].long()].float())
    assert out[3:].isnan().all(), "out-of-range tokens must give NaN rows"
    assert int(flag) == BAD_TOKEN
    flag.fill_(1)
    ops.embedding(token[3:4], weight, out[3:4], flag)
    assert int(flag) == 1 | BAD_TOKEN, "the OR must keep a condition already flagged"


@cuda
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


@cuda
def test_cuda_dense_graph_replay_follows_device_token_and_flags_a_bad_one():
    V, D = 503, 192
    weight = make_dense_table(V, D, torch.bfloat16, device="cuda", seed=6)
    token = torch.tensor([17, 3], dtype=torch.int32, device="cuda")
    out, flag = torch.empty(2, D, device="cuda"), no_flag("cuda")
    graph = capture_graph(lambda: ops.embedding(token, weight, out, flag))
    out.fill_(float("nan"))
    token[1] = 401
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, weight[token.long()].float()) and int(flag) == 0
    token[1] = V  # a bad id arriving on the device, as a decode step's would: a flag, not a device assert
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], weight[17].float()) and out[1].isnan().all()
    assert int(flag) == BAD_TOKEN


@cuda
@pytest.mark.parametrize("op", ["q8_0_embedding", "embedding"])
def test_cuda_per_row_bad_token_flags(op):
    """bad_token of T elements (batched rows): an id outside [0, V) gives its row NaN and ORs BAD_TOKEN into its
    own element only, keeping what the element held (1: attention's condition, flagged earlier); in-range rows
    keep their element as it was and their row is the reference's. Eagerly and replayed from a captured graph."""
    V, D = 300, 5120
    weight_q, weight_d = make_table(V, D, device="cuda", seed=8)
    tables = {"q8_0_embedding": (weight_q, weight_d), "embedding": (make_dense_table(V, D, torch.bfloat16, "cuda", 8),)}
    token = torch.tensor([0, V - 1, -1, 5, V, 2**31 - 1, 3], dtype=torch.int32, device="cuda")
    bad = torch.tensor([False, False, True, False, True, True, False])
    before = [0, 1, 0, 0, 0, 1, 1]
    expected_flags = [f | (BAD_TOKEN if b else 0) for f, b in zip(before, bad.tolist())]
    out = torch.full((token.shape[0], D), float("nan"), device="cuda")
    flags = torch.tensor(before, dtype=torch.int32, device="cuda")
    run = lambda: getattr(ops, op)(token, *tables[op], out, flags)
    run()
    assert flags.tolist() == expected_flags
    good = out[~bad.cuda()].clone()
    if op == "q8_0_embedding":
        assert torch.equal(good.cpu(), expected_rows(token[~bad.cuda()], weight_q, weight_d))
    else:
        assert torch.equal(good, tables[op][0][token[~bad.cuda()].long()].float())
    assert out[bad.cuda()].isnan().all()
    graph = capture_graph(run)
    out.fill_(float("nan"))
    flags.copy_(torch.tensor(before, dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert flags.tolist() == expected_flags and torch.equal(out[~bad.cuda()], good) and out[bad.cuda()].isnan().all()


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
    flag_long = torch.zeros(1, dtype=torch.int64, device="cuda")
    for flag in (flag_long, torch.zeros(2, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="bad_token must be contiguous int32 with 1 element"):
            ops.q8_0_embedding(token, weight_q, weight_d, out, flag)
    token3, out3 = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda"), torch.empty(3, 64, device="cuda")
    strided = torch.zeros(6, dtype=torch.int32, device="cuda")[::2]
    for flag in (torch.zeros(2, dtype=torch.int32, device="cuda"), strided):
        with pytest.raises(RuntimeError, match="bad_token must be contiguous int32 with 1 element .* or T = 3"):
            ops.q8_0_embedding(token3, weight_q, weight_d, out3, flag)

    weight = make_dense_table(10, 64, torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="token must be"):
        ops.embedding(token_long, weight, out)
    with pytest.raises(RuntimeError, match="token must be a CUDA tensor"):
        ops.embedding(token_cpu, weight, out)
    with pytest.raises(RuntimeError, match="weight must be float32, bfloat16 or float16"):
        ops.embedding(token, weight_q, out)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        ops.embedding(token, weight.t(), out)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.embedding(token, weight, out_wide)
    with pytest.raises(RuntimeError, match="out must be"):
        ops.embedding(token, weight, out.half())
    with pytest.raises(RuntimeError, match="bad_token must be contiguous int32 with 1 element"):
        ops.embedding(token, weight, out, flag_long)
    with pytest.raises(RuntimeError, match="bad_token must be contiguous int32 with 1 element .* or T = 3"):
        ops.embedding(token3, weight, out3, torch.zeros(4, dtype=torch.int32, device="cuda"))


@cuda
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
