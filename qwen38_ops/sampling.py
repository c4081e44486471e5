"""Next-token selection on the device: argmax_advance writes the token and advances the position."""
from ._registry import register
from .reference import sampling as ref

register("argmax_advance", ref.argmax_advance)
