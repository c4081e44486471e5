"""The CPU reference attention in blocks of query rows (issue 10: unblocked, T = 4000 held O(T^2 H) float64
scores, 1.7 GB): the same bits as one unblocked float64 softmax, whatever the block size, GQA grouping
and positions; its score memory stays bounded at long prompts."""
import pytest
import torch

from qwen38_ops.reference import attention as ref


def unblocked(q, k_cache, v_cache, positions, scale):
    """The spec in one piece: KV heads repeated per query head, one [T, H, L] float64 softmax."""
    length = int(positions.max()) + 1
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[:length].double().repeat_interleave(group, dim=1)
    v = v_cache[:length].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    hidden = torch.arange(length)[None, :] > positions.long()[:, None]
    scores = scores.masked_fill(hidden[:, None, :], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(scores, dim=-1), v).float()


@pytest.mark.parametrize("T,L,hq,hkv,hd,first", [(1, 64, 4, 2, 32, 63), (37, 100, 6, 2, 16, 0),
                                                  (200, 300, 8, 8, 8, 50), (9, 40, 24, 4, 16, 31)])
@pytest.mark.parametrize("score_elements", [1, 1000, 1 << 24])
def test_blocks_give_the_unblocked_bits(monkeypatch, T, L, hq, hkv, hd, first, score_elements):
    monkeypatch.setattr(ref, "SCORE_ELEMENTS", score_elements)
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(n, h, hd, generator=g) for n, h in ((T, hq), (L, hkv), (L, hkv)))
    positions = torch.arange(first, first + T, dtype=torch.int32) % L  # includes a wrap: any order works
    out = torch.empty(T, hq, hd)
    ref.attention(q, k, v, positions, hd ** -0.5, out, None)
    assert torch.equal(out, unblocked(q, k, v, positions, hd ** -0.5))


def test_long_prompt_score_memory_is_bounded(monkeypatch):
    """Every einsum's operands and result at T = 4000 stay within one block's budget (2^24 scores)."""
    largest = []
    einsum = torch.einsum

    def measured(equation, *operands):
        result = einsum(equation, *operands)
        largest.append(max(t.numel() for t in (*operands, result)))
        return result

    monkeypatch.setattr(torch, "einsum", measured)
    T, hq, hkv, hd = 4000, 4, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(T, hq, hd, generator=g), torch.randn(T, hkv, hd, generator=g), torch.randn(T, hkv, hd, generator=g)
    ref.attention(q, k, v, torch.arange(T, dtype=torch.int32), 0.1, torch.empty(T, hq, hd), None)
    assert max(largest) <= ref.SCORE_ELEMENTS < T * T * hq
