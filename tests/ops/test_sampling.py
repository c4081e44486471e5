"""sampling family: argmax_advance (with the sampler's bookkeeping).

CPU (CI): opcheck; the reference against numpy's argmax (first maximal index, NaN first) and its bookkeeping
against the formulas. CUDA (-m cuda): the kernel against the reference on random logits at odd sizes and the
27B vocabulary (248320), with planted ties (the lowest index must win), NaN (ranks above every number, as
torch.argmax: the first NaN wins), all -inf, an unaligned view; position advances by one per call; the
bookkeeping (seen, generated, num_generated, nonfinite) equals the reference's; a captured graph follows
logits changed between replays; bad arguments raise. Exact: an index and flags, no rounding.
"""
import numpy as np
import pytest
import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import sampling as ref

from cuda_helpers import capture_graph, cuda, run_in_child

ops = torch.ops.qwen38


def test_opcheck_cpu():
    logits = torch.randn(1000)
    torch.library.opcheck(ops.argmax_advance.default,
                          (logits, torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)))
    torch.library.opcheck(ops.argmax_advance.default,
                          (logits, torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                           *make_books(1000)))


def make_books(V, seed=0):
    """seen, generated (random masks), num_generated, nonfinite: the sampler state argmax_advance updates."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(V, generator=g) < 0.1, torch.rand(V, generator=g) < 0.05,
            torch.tensor([17], dtype=torch.int32), torch.zeros(1, dtype=torch.bool))


@pytest.mark.parametrize("case", ["random", "nan", "pos_inf", "neg_inf"])
def test_reference_bookkeeping(case):
    V = 300
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    if case == "nan":
        logits[7] = float("nan")
    elif case == "pos_inf":
        logits[8] = float("inf")
    elif case == "neg_inf":
        logits[9] = float("-inf")
    seen, generated, num_generated, nonfinite = books = make_books(V)
    before = [b.clone() for b in books]
    token, position = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ref.argmax_advance(logits, token, position, *books)
    winner = token.item()
    for mask, old in ((seen, before[0]), (generated, before[1])):
        expected = old.clone()
        expected[winner] = True
        assert torch.equal(mask, expected)
    assert num_generated.item() == 18
    assert nonfinite.item() == (case != "random")


@pytest.mark.parametrize("case", ["random", "ties", "nan", "neg_inf"])
def test_reference_vs_numpy(case):
    logits = torch.randn(777, generator=torch.Generator().manual_seed(0))
    if case == "ties":
        logits[[30, 400, 776]] = 10.0
    elif case == "nan":
        logits[[500, 90]] = float("nan")
    elif case == "neg_inf":
        logits.fill_(float("-inf"))
    token, position = torch.zeros(1, dtype=torch.int32), torch.tensor([41], dtype=torch.int32)
    ref.argmax_advance(logits, token, position)
    assert token.item() == int(np.argmax(logits.numpy())) and position.item() == 42


def expected_token(logits):
    token, position = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    ref.argmax_advance(logits.cpu(), token, position)
    return token.item()


def run(logits, start_position=7):
    """The kernel without bookkeeping, then with it: the same token, and the bookkeeping the reference's."""
    token = torch.full((1,), -5, dtype=torch.int32, device=logits.device)
    position = torch.tensor([start_position], dtype=torch.int32, device=logits.device)
    ops.argmax_advance(logits, token, position)
    assert position.item() == start_position + 1
    books = make_books(logits.numel(), seed=logits.numel())
    expected = [b.clone() for b in books]
    ref.argmax_advance(logits.cpu(), torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), *expected)
    token_books = torch.full((1,), -5, dtype=torch.int32, device=logits.device)
    cuda_books = [b.to(logits.device) for b in books]
    ops.argmax_advance(logits, token_books, position, *cuda_books)
    assert token_books.item() == token.item() and position.item() == start_position + 2
    for name, got, want in zip(("seen", "generated", "num_generated", "nonfinite"), cuda_books, expected):
        assert torch.equal(got.cpu(), want), name
    return token.item()


@cuda
@pytest.mark.parametrize("V", [1, 2, 3, 5, 31, 1000, 4097, 65537, 248320, 248323])
@pytest.mark.parametrize("case", ["random", "ties", "nan", "neg_inf", "pos_inf", "unaligned"])
def test_cuda_matches_reference(V, case):
    assert torch._C._dispatch_has_kernel_for_dispatch_key("qwen38::argmax_advance", "CUDA")
    g = torch.Generator().manual_seed(V)
    buf = torch.randn(V + 3, generator=g)
    logits = buf[:V]
    if case == "unaligned":
        logits = buf[3:3 + V]  # 12 bytes past a 16-byte boundary
    elif case == "ties" and V > 2:
        idx = torch.randperm(V, generator=g)[:3]
        logits[idx] = logits.max() + 1.0
    elif case == "nan":
        idx = torch.randperm(V, generator=g)[:2]
        logits[idx] = float("nan")
    elif case == "neg_inf":
        logits.fill_(float("-inf"))
    elif case == "pos_inf":
        logits[V // 2] = float("inf")
    cuda_buf = buf.cuda()
    cuda_logits = cuda_buf[3:3 + V] if case == "unaligned" else cuda_buf[:V]
    assert run(cuda_logits) == expected_token(logits)


@cuda
def test_cuda_graph_follows_new_logits():
    V = 248320
    logits = torch.randn(V, device="cuda")
    token = torch.zeros(1, dtype=torch.int32, device="cuda")
    position = torch.zeros(1, dtype=torch.int32, device="cuda")
    graph = capture_graph(lambda: ops.argmax_advance(logits, token, position))
    for step, winner in enumerate([5, 248319, 0, 123456]):
        logits[winner] = 100.0 + step
        graph.replay()
        torch.cuda.synchronize()
        assert token.item() == winner
    assert position.item() == 5


def check_bad_arguments():
    """Every wrong argument raises a RuntimeError naming it (run in a child by the test below)."""
    logits = torch.randn(100, device="cuda")
    token = torch.zeros(1, dtype=torch.int32, device="cuda")
    position = torch.zeros(1, dtype=torch.int32, device="cuda")
    logits_f64, token_long, position_cpu = logits.double(), token.long(), position.cpu()
    token_two = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="logits must be"):
        ops.argmax_advance(logits_f64, token, position)
    with pytest.raises(RuntimeError, match="token must be"):
        ops.argmax_advance(logits, token_long, position)
    with pytest.raises(RuntimeError, match="position is on"):
        ops.argmax_advance(logits, token, position_cpu)
    with pytest.raises(RuntimeError, match="token must hold one value"):
        ops.argmax_advance(logits, token_two, position)
    seen, generated, num_generated, nonfinite = (b.cuda() for b in make_books(100))
    with pytest.raises(RuntimeError, match="seen must be contiguous Bool with 100 values"):
        ops.argmax_advance(logits, token, position, seen[:50], generated, num_generated, nonfinite)
    with pytest.raises(RuntimeError, match="num_generated must be contiguous Int"):
        ops.argmax_advance(logits, token, position, seen, generated, num_generated.long(), nonfinite)
    with pytest.raises(RuntimeError, match="nonfinite must be on"):
        ops.argmax_advance(logits, token, position, seen, generated, num_generated, nonfinite.cpu())


@cuda
def test_cuda_bad_arguments_raise():
    run_in_child(__file__, "check_bad_arguments")
