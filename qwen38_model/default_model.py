"""The built-in default model: a small random Qwen3.5, built once into a cache folder as HF and Q8_0 GGUF.

What the command line and `qwen38_model.load()` run without a path: `synthetic.write_hf_checkpoint`'s
default shape with the MTP block, its <|im_end|> head row damped, converted by `convert.hf_to_gguf`.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
import time

import safetensors.torch
import torch

from .convert import hf_to_gguf
from .errors import Qwen38Error
from .synthetic import write_hf_checkpoint

# Bumped whenever the default model's bytes would change, so stale caches are not reused.
DEFAULT_MODEL_VERSION = 3


def default_model_path() -> pathlib.Path:
    """The built-in default model's Q8_0 GGUF (created on first use; see default_model_dir)."""
    return default_model_dir() / "model-q8_0.gguf"


def default_hf_path() -> pathlib.Path:
    """The HF folder (bfloat16) the default GGUF was converted from."""
    return default_model_dir() / "hf"


# What a finished default-model folder holds. Builds are renamed into place whole, so a folder missing any
# of these was emptied or damaged from outside: it is rebuilt.
DEFAULT_MODEL_FILES = ("model-q8_0.gguf", "hf/config.json", "hf/generation_config.json", "hf/model.safetensors",
                       "hf/tokenizer.json", "hf/tokenizer_config.json")
STALE_BUILD_SECONDS = 3600  # a build takes seconds: a .building-* folder older than this was left by a killed one


def default_model_dir() -> pathlib.Path:
    """$QWEN38_CACHE (else ~/.cache/qwen38)/synthetic-default-v<N>, holding hf/ and model-q8_0.gguf.

    Built in a temporary folder and renamed into place, so concurrent callers never see a partial model.
    Temporary folders of killed builds are removed once stale; an incomplete folder is rebuilt."""
    root = pathlib.Path(os.environ.get("QWEN38_CACHE") or pathlib.Path.home() / ".cache" / "qwen38")
    final = root / f"synthetic-default-v{DEFAULT_MODEL_VERSION}"
    if all((final / name).is_file() for name in DEFAULT_MODEL_FILES):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(root)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            # With the MTP block (as released), so that --speculative mtp runs out of the box.
            write_hf_checkpoint(tmp / "hf", {}, seed=0, dtype=torch.bfloat16, mtp=True)
            _damp_end_of_turn(tmp / "hf")
            hf_to_gguf(tmp / "hf", tmp / "model-q8_0.gguf", "q8_0", model_name="qwen38-synthetic-default", mtp=True)
            _move_aside_incomplete(final)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():  # not a lost race with another process: a real error
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    except OSError as e:
        raise Qwen38Error(f"cannot build the built-in model in {root} ({e.strerror}: {e.filename}); set QWEN38_CACHE "
                          "to a writable folder") from None
    return final


# The built-in model's random head puts <|im_end|> first or within the top 3 after most chat prompts (it
# follows the prompt's own <|im_start|>...<|im_end|> pattern), so a greedy chat reply was often empty.
# Its head row, scaled by this, ranks far lower: replies are gibberish of some length, and can still end.
END_OF_TURN_HEAD_SCALE = 0.5


def _damp_end_of_turn(hf_dir: pathlib.Path) -> None:
    weights = safetensors.torch.load_file(hf_dir / "model.safetensors")
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    token = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    weights["lm_head.weight"][token] *= END_OF_TURN_HEAD_SCALE
    safetensors.torch.save_file(weights, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _remove_stale_builds(root: pathlib.Path) -> None:
    now = time.time()
    for folder in root.glob(".building-*"):
        try:
            if now - folder.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # removed by a concurrent caller
            pass


def _move_aside_incomplete(final: pathlib.Path) -> None:
    """A folder of that name that is not a complete model (checked again: another process may have just
    finished one) is renamed out of the way, then removed."""
    if not final.exists() or all((final / name).is_file() for name in DEFAULT_MODEL_FILES):
        return
    doomed = final.with_name(f".building-incomplete-{os.getpid()}-{time.time_ns()}")
    try:
        os.rename(final, doomed)
    except FileNotFoundError:  # a concurrent caller moved it first
        return
    shutil.rmtree(doomed, ignore_errors=True)
