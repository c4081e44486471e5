"""HF Qwen3.5 folder -> `qwen35` GGUF, as llama.cpp's convert_hf_to_gguf.py writes it, byte for byte.

`hf_to_gguf` converts a folder (text or VLM form) the way the converter does for `Qwen3_5TextModel`, with
`--no-mtp` or (mtp=True) with the MTP block as `blk.{num_hidden_layers}`: tensor names, value-head reorder,
+1 norms, -exp(A_log), output types, tensor order, metadata keys and order, tokenizer metadata. It holds the
whole model in memory: meant for test-sized models (the default model, the tests' checkpoints).

The value-head reorder and the other tensor transforms are this module's own, on purpose, not
`checkpoint/layout.py`'s (`hf_to_internal`, which the loader applies to HF checkpoints): this code is held
to llama.cpp's own output byte for byte (tests/model/test_synthetic.py), so a GGUF written here is an
independent check of the loader's conventions. Sharing the loader's code would make that check circular.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

import gguf
import numpy as np
import safetensors
import torch

from .config import GDN, layer_types_from_interval
from .errors import CheckpointError
from .stop_tokens import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED

GGUF_TYPES = {  # qtype argument -> (type of the big matrices, general.file_type)
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


def hf_to_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "f32", *,
               model_name: str | None = None, mtp: bool = False) -> pathlib.Path:
    """Convert an HF Qwen3.5 folder (text or VLM form) to a `qwen35` GGUF, as llama.cpp's converter does with
    `--outtype qtype --no-mtp`, or without `--no-mtp` when mtp=True (model_name = its `--model-name`).
    Returns out_path."""
    if qtype not in GGUF_TYPES:
        raise ValueError(f"qtype must be one of {sorted(GGUF_TYPES)}, not {qtype!r}")
    hf_dir, out_path = pathlib.Path(hf_dir), pathlib.Path(out_path)
    hparams = gguf_hparams(hf_dir)
    num_mtp = hparams.get("mtp_num_hidden_layers", 0) if mtp else 0
    matrix_type, file_type = GGUF_TYPES[qtype]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35])
    # The converter maps names over block_count = trunk + MTP layers: the MTP layer is one more block.
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, hparams["num_hidden_layers"] + num_mtp)
    for hf_name, tensor in _read_hf_tensors(hf_dir, hparams["num_hidden_layers"] if num_mtp else None):
        name, tensor = convert_hf_tensor(hf_name, tensor.to(torch.float32), hparams)
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias")) or _nextn_gguf_name(name)
        if gguf_name is None:
            raise CheckpointError(f"{hf_dir}: cannot map tensor {hf_name!r} to a qwen35 GGUF name")
        data, data_type = _encode_tensor(gguf_name, tensor.numpy(), matrix_type)
        writer.add_tensor(gguf_name, data, raw_dtype=data_type)
    _add_general_metadata(writer, hf_dir, model_name)
    _add_model_metadata(writer, hparams, file_type, num_mtp)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer_metadata(writer, hf_dir, hparams["vocab_size"])
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def gguf_hparams(hf_dir: pathlib.Path) -> dict[str, Any]:
    """config.json with a VLM's text_config lifted to the top level (as the converter does)."""
    with open(hf_dir / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    return {**config, **config.get("text_config", {})}


def _read_hf_tensors(hf_dir: pathlib.Path, mtp_block: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Text-model tensors in the converter's order: shard files sorted, names sorted within each shard
    (gguf-py's SafetensorsLocal; a renamed tensor keeps its place). Vision tower skipped; the VLM's
    `model.language_model.` prefix becomes `model.`. The MTP block is skipped (`--no-mtp`) when mtp_block is
    None, else renamed into layer mtp_block (the converter's _Qwen35MtpMixin)."""
    for part in _safetensors_parts(hf_dir):
        with safetensors.safe_open(part, framework="pt") as f:
            for name in sorted(f.keys()):
                if "visual." in name or (name.startswith("mtp.") and mtp_block is None):
                    continue
                if name.startswith("mtp."):
                    yield mtp_tensor_name(name, mtp_block), f.get_tensor(name)
                    continue
                yield name.replace("model.language_model.", "model.", 1), f.get_tensor(name)


# The MTP block's own HF tensors, as the converter renames them inside layer n (then mapped to blk.n.nextn.*).
MTP_RENAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "shared_head.norm"}
NEXTN_TENSORS = {"eh_proj": gguf.MODEL_TENSOR.NEXTN_EH_PROJ, "enorm": gguf.MODEL_TENSOR.NEXTN_ENORM,
                 "hnorm": gguf.MODEL_TENSOR.NEXTN_HNORM, "shared_head.norm": gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM}


def mtp_tensor_name(name: str, first_block: int) -> str:
    """mtp.layers.i.X -> model.layers.{first_block + i}.X; mtp.fc/pre_fc_norm_*/norm -> model.layers.{first_block}
    .eh_proj/enorm/hnorm/shared_head.norm (names ending in norm.weight then get the +1 like every norm)."""
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{first_block + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in MTP_RENAMES:
        return f"model.layers.{first_block}.{MTP_RENAMES[parts[1]]}.{parts[2]}"
    return name  # not a tensor of the block: left for the name map to reject


def _nextn_gguf_name(name: str) -> str | None:
    """blk.N.nextn.* for the block's own tensors. llama.cpp's gguf-py lists them for qwen35; the released
    gguf-py 0.19 does not, so its name map cannot (same names, from its own TENSOR_NAMES)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"] or not parts[2].isdecimal() or parts[-1] != "weight":
        return None
    tensor = NEXTN_TENSORS.get(".".join(parts[3:-1]))
    return None if tensor is None else gguf.TENSOR_NAMES[tensor].format(bid=int(parts[2])) + ".weight"


def _safetensors_parts(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = set(json.load(f)["weight_map"].values())
    else:
        names = {p.name for p in hf_dir.iterdir() if p.name.startswith("model") and p.name.endswith(".safetensors")}
    if not names:
        raise CheckpointError(f"{hf_dir}: no model*.safetensors files")
    return [hf_dir / name for name in sorted(names)]


def convert_hf_tensor(name: str, tensor: torch.Tensor, hparams: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """One float32 HF text tensor (`model.*` naming) -> (converter name, GGUF value), in the converter's order:
    value-head reorder, then -exp(A_log) / dt_bias rename / conv squeeze / +1 on zero-centred norms."""
    if "linear_attn." in name and hparams["linear_num_key_heads"] != hparams["linear_num_value_heads"]:
        tensor = reorder_v_heads_of(name, tensor, hparams)
    if name.endswith(".A_log"):
        # Correctly rounded: float32 exp kernels differ by an ulp between CPUs (the oracle's llama.cpp run
        # got the correctly rounded value where this machine's float32 torch.exp does not).
        tensor = -torch.exp(tensor.double()).float()
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        tensor = tensor.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        tensor = tensor + 1
    return name, tensor


def reorder_v_heads(tensor: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int,
                    head_dim: int) -> torch.Tensor:
    """Value heads along `dim` from HF's grouped order (head k*r + j reads key head k) to ggml's tiled
    order (head j*Hk + k reads key head k): view the axis as [Hk, r, head_dim] and swap the first two."""
    shape = list(tensor.shape)
    dim %= len(shape)
    grouped = tensor.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def reorder_v_heads_of(name: str, tensor: torch.Tensor, hparams: dict[str, Any]) -> torch.Tensor:
    """Apply reorder_v_heads to the value-head axis of one GDN tensor (its q/k parts stay put)."""
    Hk, Hv = hparams["linear_num_key_heads"], hparams["linear_num_value_heads"]
    dv, qk_rows = hparams["linear_value_head_dim"], 2 * Hk * hparams["linear_key_head_dim"]
    r = Hv // Hk
    if ".in_proj_qkv." in name:
        return torch.cat([tensor[:qk_rows], reorder_v_heads(tensor[qk_rows:], 0, Hk, r, dv)])
    if ".conv1d" in name:
        tensor = tensor.squeeze()
        return torch.cat([tensor[:qk_rows], reorder_v_heads(tensor[qk_rows:], 0, Hk, r, dv)])
    if ".in_proj_z." in name:
        return reorder_v_heads(tensor, 0, Hk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(tensor, 0, Hk, r, 1)
    if ".out_proj." in name:
        return reorder_v_heads(tensor, 1, Hk, r, dv)
    return tensor  # linear_attn.norm: one [dv] vector shared by all heads


def gguf_tensor_type(gguf_name: str, n_dims: int, matrix_type: gguf.GGMLQuantizationType):
    """The converter's rule: 1-D tensors, norms, the conv kernel and non-`.weight` tensors stay F32."""
    if n_dims <= 1 or gguf_name.endswith("_norm.weight") or gguf_name.endswith(".ssm_conv1d.weight") \
            or not gguf_name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return matrix_type


def _encode_tensor(gguf_name: str, data: np.ndarray, matrix_type: gguf.GGMLQuantizationType):
    data_type = gguf_tensor_type(gguf_name, data.ndim, matrix_type)
    try:
        return gguf.quants.quantize(data, data_type), data_type
    except gguf.QuantError:  # e.g. a row length not a multiple of 32 for Q8_0: the converter uses F16
        return gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16), gguf.GGMLQuantizationType.F16


def _add_general_metadata(writer: gguf.GGUFWriter, hf_dir: pathlib.Path, model_name: str | None) -> None:
    # As the converter: name from --model-name, the model card or the folder name; size label from the
    # parameter count of the tensors already added.
    total_params, shared_params, expert_params, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, hf_dir, model_name, total_params)
    if metadata.name is None:
        metadata.name = hf_dir.name
    if metadata.size_label is None and total_params > 0:
        metadata.size_label = gguf.size_label(total_params, shared_params, expert_params, expert_count)
    writer.add_type(gguf.GGUFType.MODEL)
    metadata.set_gguf_meta_model(writer)


def _add_model_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any], file_type: gguf.LlamaFileType,
                        num_mtp: int) -> None:
    """`qwen35.*` keys in the order the converter writes them; block_count counts the MTP layers, and
    nextn_predict_layers (written last) says how many of the blocks they are."""
    rope = hp.get("rope_parameters") or {}
    writer.add_block_count(hp["num_hidden_layers"] + num_mtp)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    if "mrope_section" in rope:
        writer.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    writer.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta")))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_key_length(hp["head_dim"])
    writer.add_value_length(hp["head_dim"])
    writer.add_file_type(file_type)
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hp["linear_key_head_dim"])
    writer.add_ssm_group_count(hp["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent_layers(hp))
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    # The converter reads a top-level partial_rotary_factor (absent in Qwen3.5 configs, so always its
    # default 0.25); the factor that HF applies lives in rope_parameters, so read it there first.
    factor = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.25))
    writer.add_rope_dimension_count(int(hp["head_dim"] * factor))
    if "mrope_section" not in rope:  # llama.cpp requires the key: the converter writes the default
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if num_mtp:
        writer.add_nextn_predict_layers(num_mtp)


def recurrent_layers(hp: dict[str, Any]) -> list[bool]:
    """Per layer: True for a Gated DeltaNet layer (from layer_types, else from full_attention_interval)."""
    if "layer_types" in hp:
        return [t == "linear_attention" for t in hp["layer_types"]]
    interval = hp.get("full_attention_interval", 4)
    return [t == GDN for t in layer_types_from_interval(hp["num_hidden_layers"], interval)]


def _add_tokenizer_metadata(writer: gguf.GGUFWriter, hf_dir: pathlib.Path, vocab_size: int) -> None:
    tokens, token_types = gguf_vocab(hf_dir, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    # gguf-py's SpecialVocab is the converter's own code for merges, special ids, add_*_token, chat template.
    gguf.SpecialVocab(hf_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def gguf_vocab(hf_dir: pathlib.Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """tokenizer.ggml.tokens / token_type from tokenizer.json: ids without a token become `[PAD<id>]`
    (UNUSED); added tokens are CONTROL when special or shaped like <|...|>, else USER_DEFINED."""
    tokenizer_file = hf_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(f"{hf_dir}: no tokenizer.json, cannot write the GGUF vocabulary")
    with open(tokenizer_file, encoding="utf-8") as f:
        tokenizer = json.load(f)
    added = {t["id"]: t for t in tokenizer.get("added_tokens", [])}
    id_to_token = {i: token for token, i in tokenizer["model"]["vocab"].items()}
    id_to_token.update({i: t["content"] for i, t in added.items()})
    if max(id_to_token) >= vocab_size:
        raise CheckpointError(f"{hf_dir}: token id {max(id_to_token)} >= vocab_size {vocab_size}")
    tokens, token_types = [], []
    for i in range(vocab_size):
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            token_types.append(TOKEN_UNUSED)
            continue
        tokens.append(id_to_token[i])
        if i not in added:
            token_types.append(TOKEN_NORMAL)
        elif added[i]["special"] or _looks_special(added[i]["content"]):
            token_types.append(TOKEN_CONTROL)
        else:
            token_types.append(TOKEN_USER_DEFINED)
    return tokens, token_types


def _looks_special(token: str) -> bool:
    return token.startswith("<|") and token.endswith("|>")
