"""Greedy next token, with the position advanced on the device, and the sampler's bookkeeping."""
import torch


def argmax_advance(logits, token, position, seen=None, generated=None, num_generated=None, nonfinite=None) -> None:
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    winner = torch.argmax(logits.reshape(-1)).reshape(1)
    token.copy_(winner.to(token.dtype).reshape(token.shape))
    position.add_(1)
    for mask in (seen, generated):
        if mask is not None:
            mask.index_fill_(0, winner, True)
    if num_generated is not None:
        num_generated.add_(1)
    if nonfinite is not None:
        nonfinite.logical_or_(~torch.isfinite(logits).all())
