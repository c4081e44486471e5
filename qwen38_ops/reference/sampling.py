"""Greedy next token, with the position advanced on the device."""
import torch


def argmax_advance(logits, token, position) -> None:
    # torch.argmax returns the first maximal index: ties go to the lowest token id.
    token.copy_(torch.argmax(logits.reshape(-1)).to(token.dtype).reshape(token.shape))
    position.add_(1)
