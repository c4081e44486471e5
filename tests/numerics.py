"""The tests' one measure of agreement: relative L2 distance, computed in float64 on the CPU (the oracle's bars
and every op test's bar are stated in it)."""
import torch


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm())


def row_rel_l2(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row (position) of the last dimension: the int8 lane's bar is on the median row."""
    got, want = got.double().cpu(), want.double().cpu()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)
