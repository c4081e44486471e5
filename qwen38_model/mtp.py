"""The MTP (multi-token prediction, nextn) block: one draft step from the trunk's normed hidden state.

    e = Embed(x_{t+1})                     the model's embedding table (shared)
    c = concat[enorm(e) ; hnorm(h_t)]      embedding half first; h_t = the trunk's hidden AFTER its final norm
    y = DecoderLayer(eh_proj c)            one full gated-attention layer with its own KV cache
    logits(x_{t+2}) = lm_head(shared_head_norm(y))   the model's LM head (shared)

The pair (h_t, x_{t+1}) is processed at position t (vLLM's proposer; llama.cpp's graph_mtp agrees on the
inputs). Later draft steps feed the block's own normed output back as h. Reference doc section 7.
"""
from __future__ import annotations

import torch
from torch import nn

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)

from .checkpoint import Q8Tensor
from .config import Qwen38Config
from .formats import ActFormat, Activation
from .layers import MLP, DecoderLayer, GatedAttention, embed_into, make_linear
from .scratch import Scratch
from .state import KVCache

ops = torch.ops.qwen38


class MTPBlock(nn.Module):
    scratch_role = "mtp"

    def __init__(self, config: Qwen38Config, w: dict, embed: torch.Tensor | Q8Tensor, lane: ActFormat,
                 head_format: ActFormat):
        """w: the block's weights by internal part name (the layer's fused groups included); embed: the model's
        embedding table, shared (registered here too, same storage); head_format: the input format of the
        model's lm_head (and of a draft head over its rows), which reads this block's output."""
        super().__init__()
        self.eps = config.rms_norm_eps
        self.out_format = head_format  # what the shared head norm writes
        if isinstance(embed, Q8Tensor):
            self.register_buffer("embed_q", embed.q)
            self.register_buffer("embed_d", embed.d)
        else:
            self.register_buffer("embed", embed)
        self.register_buffer("enorm", w["nextn.enorm"])
        self.register_buffer("hnorm", w["nextn.hnorm"])
        self.eh_proj = make_linear(w["nextn.eh_proj"], lane, "mtp.eh_proj")
        self.eh_in_format = self.eh_proj.input_format  # what the concat (and its quantize_act) writes
        self.layer = DecoderLayer(config, GatedAttention(config, w, lane), MLP(config, w, lane), w)
        self.register_buffer("shared_head_norm", w["nextn.shared_head_norm"])
        # Scratch roles of their own: a speculative step runs the trunk over k+1 rows and this block over 1,
        # and a shared role would reallocate its buffer at every switch (under a captured graph: a stale
        # address). The block's input (the trunk's normed hidden) is never among them.
        for module in self.layer.modules():
            module.scratch_role = "mtp." + getattr(module, "scratch_role", type(module).__name__)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                scratch: Scratch) -> Activation:
        """hidden float32 [T, D]: the trunk's normed hidden at positions (or this block's previous output x);
        ids int32 [T]: the tokens that follow them; positions int32 [T]; cache: this block's KV cache.
        Returns the shared-head-normed output in the lm_head's input format: model.lm_head(act, scratch) gives
        the logits of the token after ids, act.x is the hidden of the next draft step."""
        rows, width = hidden.shape
        embedded = self._embed(ids, scratch, cache.bad_position)
        e = scratch.empty(self, "enorm", (rows, width))
        h = scratch.empty(self, "hnorm", (rows, width))
        ops.rms_norm(embedded, self.enorm, self.eps, e, None, None, None)
        ops.rms_norm(hidden, self.hnorm, self.eps, h, None, None, None)
        # Quantized after the concat: the two halves are whole 32-blocks, so this equals quantizing each norm's
        # output, and the norms need no strided outputs.
        fused = scratch.activation(self, "eh_in", rows, 2 * width, self.eh_in_format)
        torch.cat([e, h], dim=1, out=fused.x)
        if self.eh_in_format is not ActFormat.F32:
            ops.quantize_act(fused.x, fused.q, fused.q_lo, fused.d)
        residual = self.eh_proj(fused, scratch)  # the layer's residual stream, updated in place
        delta = self.layer(residual, None, cache, positions, scratch)
        out = scratch.activation(self, "normed", rows, width, self.out_format)
        ops.add_rms_norm(residual, delta, self.shared_head_norm, self.eps, *out.outs())
        return out

    def _embed(self, ids: torch.Tensor, scratch: Scratch, bad_token: torch.Tensor | None) -> torch.Tensor:
        return embed_into(self, ids, scratch.empty(self, "embedding", (ids.shape[0], self.enorm.shape[0])), bad_token)
