"""The ONE internal weight layout, and how an HF checkpoint is converted into it.

The internal layout is llama.cpp's qwen35 GGUF layout, named by GGUF tensor names: norms stored as the
multiplier applied (1 + w), ssm_a = -exp(A_log), conv weight squeezed to [C, K], value heads in ggml's
tiled order (value head m reads key head m % Hk), q_proj's per-head [query | gate] interleave kept. A GGUF
is then read as is, and HF tensors get exactly the converter's transforms (reference doc, section 2.3).
"""
from __future__ import annotations

import torch

from ..config import ATTENTION, Qwen38Config

# Parts of each layer kind, by GGUF name (without the "blk.{i}." prefix).
COMMON_PARTS = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down")
GDN_PARTS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_norm",
             "ssm_out")
ATTENTION_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
GLOBAL_PARTS = ("token_embd", "output_norm", "output")
# The MTP (nextn) block's own tensors, beside its one full-attention layer (blk.{num_layers}.* in a GGUF):
# eh_proj [D, 2D] maps concat[enorm(embedding); hnorm(hidden)] to D, shared_head_norm precedes the shared head.
MTP_PARTS = ("nextn.eh_proj", "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")
MTP_NORMS = {"nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm"}

# Stored float32 whatever the checkpoint's dtype (DESIGN: small tensors are float32).
SMALL_PARTS = {"attn_norm", "post_attention_norm", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_norm", "attn_q_norm",
               "attn_k_norm", "output_norm"} | MTP_NORMS


def gguf_tensor_name(part: str, layer: int | None) -> str:
    if layer is None:
        return f"{part}.weight"
    if part == "ssm_a":
        return f"blk.{layer}.ssm_a"
    if part == "ssm_dt":
        return f"blk.{layer}.ssm_dt.bias"
    return f"blk.{layer}.{part}.weight"


def layer_parts(config: Qwen38Config, layer: int) -> tuple[str, ...]:
    """The parts of trunk layer `layer`, or of the MTP block when layer == num_layers (a full-attention
    layer plus the block's own tensors)."""
    if layer >= config.num_layers:
        return COMMON_PARTS + ATTENTION_PARTS + MTP_PARTS
    kind = ATTENTION_PARTS if config.layer_types[layer] == ATTENTION else GDN_PARTS
    return COMMON_PARTS + kind


def expected_shape(config: Qwen38Config, part: str) -> tuple[int, ...]:
    """Torch-order shape of each internal part: what a checkpoint must provide."""
    c = config
    D, F = c.hidden_size, c.intermediate_size
    q_dim, kv_dim = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "token_embd": (c.vocab_size, D), "output": (c.vocab_size, D), "output_norm": (D,),
        "attn_norm": (D,), "post_attention_norm": (D,),
        "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F),
        "attn_qkv": (c.conv_dim, D), "attn_gate": (c.linear_value_dim, D),
        "ssm_beta": (c.linear_num_value_heads, D), "ssm_alpha": (c.linear_num_value_heads, D),
        "ssm_conv1d": (c.conv_dim, c.conv_kernel), "ssm_dt": (c.linear_num_value_heads,),
        "ssm_a": (c.linear_num_value_heads,), "ssm_norm": (c.linear_value_head_dim,),
        "ssm_out": (D, c.linear_value_dim),
        "attn_q": (2 * q_dim, D), "attn_k": (kv_dim, D), "attn_v": (kv_dim, D), "attn_output": (D, q_dim),
        "attn_q_norm": (c.head_dim,), "attn_k_norm": (c.head_dim,),
        "nextn.eh_proj": (D, 2 * D), "nextn.enorm": (D,), "nextn.hnorm": (D,), "nextn.shared_head_norm": (D,),
    }[part]


# ---- HF -> internal ------------------------------------------------------------------------------------

HF_NAMES = {
    "token_embd": "embed_tokens.weight", "output_norm": "norm.weight",
    "attn_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
    "ffn_gate": "mlp.gate_proj.weight", "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight",
    "attn_qkv": "linear_attn.in_proj_qkv.weight", "attn_gate": "linear_attn.in_proj_z.weight",
    "ssm_beta": "linear_attn.in_proj_b.weight", "ssm_alpha": "linear_attn.in_proj_a.weight",
    "ssm_conv1d": "linear_attn.conv1d.weight", "ssm_dt": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm.weight", "ssm_out": "linear_attn.out_proj.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_output": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
}
# The MTP block's own tensors sit at the top level (its layer is mtp.layers.0.*, named as a trunk layer's).
MTP_HF_NAMES = {"nextn.eh_proj": "mtp.fc.weight", "nextn.enorm": "mtp.pre_fc_norm_embedding.weight",
                "nextn.hnorm": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm": "mtp.norm.weight"}
# Zero-centred RMSNorm weights: HF stores w, the model multiplies by 1 + w (the GDN gated norm excepted).
PLUS_ONE_PARTS = {"attn_norm", "post_attention_norm", "output_norm", "attn_q_norm", "attn_k_norm"} | MTP_NORMS


def value_head_order(config: Qwen38Config) -> torch.Tensor:
    """Internal (ggml tiled) value head m holds HF (grouped) head (m % Hk) * r + m // Hk, so that value head
    m reads key head m % Hk in both layouts' own terms."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    m = torch.arange(hv)
    return (m % hk) * (hv // hk) + m // hk


def _permute_heads(t: torch.Tensor, order: torch.Tensor, head_dim: int, dim: int) -> torch.Tensor:
    shape = t.shape
    heads = t.reshape(*shape[:dim], len(order), head_dim, *shape[dim + 1:])
    return heads.index_select(dim, order.to(t.device)).reshape(shape)


def hf_to_internal(part: str, t: torch.Tensor, config: Qwen38Config) -> torch.Tensor:
    """Apply the converter's transform for one part to an HF tensor (already on the target device)."""
    if part in PLUS_ONE_PARTS:
        return t.to(torch.float32) + 1
    if part == "ssm_a":
        t = (-torch.exp(t.to(torch.float64))).to(torch.float32)  # correctly rounded, as the oracle GGUF holds
    if part == "ssm_conv1d":
        t = t.to(torch.float32).reshape(t.shape[0], t.shape[-1])
    if part in ("ssm_dt", "ssm_norm"):
        t = t.to(torch.float32)
    order = value_head_order(config)
    dv = config.linear_value_head_dim
    if part in ("attn_qkv", "ssm_conv1d"):
        k_rows = 2 * config.linear_key_dim  # only the V rows are per value head
        return torch.cat([t[:k_rows], _permute_heads(t[k_rows:], order, dv, 0)])
    if part == "attn_gate":
        return _permute_heads(t, order, dv, 0)
    if part in ("ssm_beta", "ssm_alpha", "ssm_dt", "ssm_a"):
        return _permute_heads(t, order, 1, 0)
    if part == "ssm_out":
        return _permute_heads(t, order, dv, 1)
    return t
