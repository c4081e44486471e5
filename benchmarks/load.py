"""Load time of the 27B-shape Q8_0 GGUF from the page cache: from_pretrained + load_tokenizer, against this host's
page-cache read and pinned host->device copy speeds.

    python -m benchmarks.load [--path /tmp] [--json PATH] [--repeats 2] [--small]

Writes <path>/qwen38-load-27b-q8_0.gguf once (28.6 GB; reused while its tensor directory and vocabulary still
match): the 27B shape with random Q8_0 matrices (load speed does not depend on the values; they are finite) and
a real-size vocabulary (248,320 tokens, 247,587 merges), written with the gguf package's GGUFWriter as llama.cpp's
converter writes them. Reads it once to warm the page cache, then measures in one run: a page-cache read probe
(the file read by the loader's thread count and read size into reused buffers, no device), a one-thread probe
(numpy sums over the memory-mapped file), a pinned host->device copy probe, and `repeats` loads, each
from_pretrained(device="cuda") end to end with the command line's progress bar, then load_tokenizer. The headline is
the file's bytes over the time of both. --small: the same code on the CPU at a tiny shape (the CPU test runs it).
"""
from __future__ import annotations

import argparse
import itertools
import mmap
import os
import pathlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import gguf
import numpy as np
import torch

from benchmarks.decode import QWEN38_27B
from benchmarks.ops.common import default_result_path, env_info, print_table, write_json
from qwen38_model import Qwen38Config, Qwen38ForCausalLM
from qwen38_model.checkpoint.gguf_file import read_header
from qwen38_model.checkpoint.layout import SMALL_PARTS, expected_shape, gguf_tensor_name, layer_parts
from qwen38_model.checkpoint.q8_0 import Q8_BLOCK, Q8_BLOCK_BYTES
from qwen38_model.checkpoint.tensors import PIECE_BYTES, READ_THREADS
from qwen38_model.cli.terminal import progress_bar
from qwen38_model.config import GDN, layer_types_from_interval
from qwen38_model.errors import CheckpointError
from qwen38_model.synthetic import SYNTHETIC_CHAT_TEMPLATE
from qwen38_model.stop_tokens import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED
from qwen38_model.tokenizer import load_tokenizer

# Qwen3.5's vocabulary as llama.cpp's converter writes it: 248,320 rows (the embedding's), 247,587 merges.
REAL_VOCAB_TOKENS, REAL_VOCAB_MERGES = 248320, 247587
ADDED_TOKENS = (("<|endoftext|>", TOKEN_CONTROL), ("<|im_start|>", TOKEN_CONTROL), ("<|im_end|>", TOKEN_CONTROL),
                ("<think>", TOKEN_USER_DEFINED), ("</think>", TOKEN_USER_DEFINED))
SMALL_VOCAB_TOKENS, SMALL_VOCAB_MERGES = 4096, 3800
SMALL = Qwen38Config(
    vocab_size=SMALL_VOCAB_TOKENS, hidden_size=256, intermediate_size=512,
    layer_types=layer_types_from_interval(8, 4),
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=16, rope_theta=1e7,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    conv_kernel=4, rms_norm_eps=1e-6, source="small load-benchmark shape")
POOL_BLOCKS = 1 << 20  # random Q8_0 blocks (34 MB) that every matrix repeats: writing needs no 28 GB of randomness
DISK_MARGIN_BYTES = 2 << 30  # left free on the disk after writing the file
MMAP_PROBE_BYTES = 4 << 30  # the one-thread probe reads this much (or the whole file, if smaller)
COPY_PROBE_BYTES = 1 << 30  # pinned buffer of the copy probe, copied COPY_PROBE_REPEATS times
COPY_PROBE_REPEATS = 4


def real_size_vocabulary(num_tokens: int = REAL_VOCAB_TOKENS,
                         num_merges: int = REAL_VOCAB_MERGES) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) shaped like Qwen3.5's byte-level BPE in a GGUF: the 256 byte-level
    characters, one token per merge ("a b" -> "ab", each part a token before it), the added tokens, then
    `[PAD<id>]` UNUSED rows up to num_tokens, as the converter pads to the embedding's rows."""
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(ord("¡"), ord("¬") + 1)] \
        + [chr(c) for c in range(ord("®"), ord("ÿ") + 1)]
    alphabet += [chr(256 + n) for n in range(256 - len(alphabet))]  # GPT-2's bytes_to_unicode, as a set
    pairs = itertools.chain(((a, b) for a in alphabet for b in alphabet),
                            ((a + b, c) for a in alphabet for b in alphabet for c in alphabet))
    merges, tokens = [], list(alphabet)
    for a, b in itertools.islice(pairs, num_merges):
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    token_types = [TOKEN_NORMAL] * len(tokens)
    for token, kind in ADDED_TOKENS:
        tokens.append(token)
        token_types.append(kind)
    if len(tokens) > num_tokens:
        raise ValueError(f"{num_merges} merges need {len(tokens)} tokens, more than {num_tokens}")
    tokens += [f"[PAD{i}]" for i in range(len(tokens), num_tokens)]
    token_types += [TOKEN_UNUSED] * (num_tokens - len(token_types))
    return tokens, token_types, merges


def add_tokenizer_metadata(writer: gguf.GGUFWriter, tokens: list[str], token_types: list[int],
                           merges: list[str]) -> None:
    """The converter's tokenizer keys (gguf-py's SpecialVocab writes the merges, the ids and the template)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(SYNTHETIC_CHAT_TEMPLATE)


def add_model_metadata(writer: gguf.GGUFWriter, c: Qwen38Config) -> None:
    """The `qwen35.*` keys the converter writes, from a config (attention every 4th layer)."""
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_dim)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == GDN for t in c.layer_types])
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(c.rotary_dim)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def tensor_plan(c: Qwen38Config) -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]]:
    """(GGUF name, torch-order shape, ggml type) of every tensor, in the order the model loads them: Q8_0
    matrices, F32 small tensors (as llama.cpp's quantizer leaves them)."""
    parts = [("token_embd", None)] + [(p, i) for i in range(c.num_layers) for p in layer_parts(c, i)]
    parts += [("output_norm", None), ("output", None)]
    T = gguf.GGMLQuantizationType
    return [(gguf_tensor_name(p, i), expected_shape(c, p), T.F32 if p in SMALL_PARTS else T.Q8_0) for p, i in parts]


def q8_0_pool(rng: np.random.Generator) -> np.ndarray:
    """POOL_BLOCKS Q8_0 blocks as bytes: random int8 quants, fp16 scales of a realistic size (4e-4 to 6e-4)."""
    blocks = rng.integers(-127, 128, (POOL_BLOCKS, Q8_BLOCK_BYTES), dtype=np.int8).view(np.uint8)
    blocks[:, :2] = (rng.random(POOL_BLOCKS, dtype=np.float32) * 2e-4 + 4e-4).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(-1)


def small_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Finite float32 values of each kind's range: ssm_a negative, norms near 1."""
    if name.endswith("ssm_a"):
        return -np.exp(rng.random(shape, dtype=np.float32) * 4 - 3)
    if "ssm_dt" in name or "ssm_conv1d" in name:
        return rng.random(shape, dtype=np.float32) - 0.5
    return (1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def write_checkpoint(path: pathlib.Path, config: Qwen38Config, vocabulary, seed: int = 0) -> None:
    """The GGUF of tensor_plan(config) with `vocabulary`, one tensor in memory at a time; the disk must keep
    DISK_MARGIN_BYTES free after it."""
    plan = tensor_plan(config)
    nbytes = sum(_gguf_nbytes(shape, kind) for _, shape, kind in plan)
    tmp = path.with_suffix(".partial")
    for stale in (path, tmp):  # an outdated or half-written file is replaced, not kept beside the new one
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < nbytes + DISK_MARGIN_BYTES:
        raise SystemExit(f"{path.parent}: {free / 1e9:.1f} GB free, the benchmark file needs {nbytes / 1e9:.1f} GB "
                         f"+ {DISK_MARGIN_BYTES / 1e9:.1f} GB margin (--path picks another folder)")
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name("qwen38-load-benchmark")
    add_model_metadata(writer, config)
    add_tokenizer_metadata(writer, *vocabulary)
    for name, shape, kind in plan:
        if kind == gguf.GGMLQuantizationType.Q8_0:  # given as its bytes per row, as the converter does
            byte_shape = (shape[0], shape[1] // Q8_BLOCK * Q8_BLOCK_BYTES)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _gguf_nbytes(shape, kind), raw_dtype=kind)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), _gguf_nbytes(shape, kind), raw_dtype=kind)
    rng = np.random.default_rng(seed)
    pool = q8_0_pool(rng)
    writer.write_header_to_file(path=tmp)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape, kind in plan:
        if kind == gguf.GGMLQuantizationType.Q8_0:
            writer.write_tensor_data(np.resize(pool, _gguf_nbytes(shape, kind)))
        else:
            writer.write_tensor_data(small_tensor(name, shape, rng))
    writer.close()
    os.replace(tmp, path)  # a killed write leaves a .partial file, never a truncated benchmark file


def _gguf_nbytes(shape: tuple[int, ...], kind) -> int:
    block, type_bytes = gguf.GGML_QUANT_SIZES[kind]
    return int(np.prod(shape)) // block * type_bytes


def checkpoint_file(folder: pathlib.Path, config: Qwen38Config, vocabulary, name: str) -> tuple[pathlib.Path, bool]:
    """(the benchmark file, whether it was written now): reused while its header is valid and holds this
    plan's tensors and vocabulary."""
    path = folder / name
    if path.is_file():
        try:
            header = read_header(str(path))
            directory = [(t.name, tuple(reversed(t.dims)), t.ggml_type) for t in header.tensors]
            if directory == tensor_plan(config) and header.metadata.get("tokenizer.ggml.tokens") == vocabulary[0]:
                return path, False
        except CheckpointError as e:  # a leftover of an interrupted or older run
            print(f"{path}: rewriting ({e})")
    folder.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, config, vocabulary)
    return path, True


# ---- probes ----------------------------------------------------------------------------------------------

def page_cache_read(path: pathlib.Path) -> dict:
    """The file read from the page cache as the loader reads it (READ_THREADS threads, reads of PIECE_BYTES)
    into one reused buffer per thread: the ceiling of the loader's reads, with no device in the way."""
    size = path.stat().st_size
    share = -(-size // READ_THREADS)

    def read_range(start: int) -> None:
        buffer = memoryview(bytearray(PIECE_BYTES))
        with open(path, "rb", buffering=0) as f:
            for position in range(start, min(start + share, size), PIECE_BYTES):
                os.preadv(f.fileno(), [buffer[: min(PIECE_BYTES, size - position)]], position)

    start = time.perf_counter()
    with ThreadPoolExecutor(READ_THREADS) as pool:
        list(pool.map(read_range, range(0, size, share)))
    seconds = time.perf_counter() - start
    return dict(seconds=seconds, bytes=size, gbps=size / seconds / 1e9, threads=READ_THREADS)


def mmap_sum(path: pathlib.Path) -> dict:
    """One thread streaming the memory-mapped file (numpy sums of 64 MB chunks as uint64 words) over its first
    MMAP_PROBE_BYTES: the single-stream figure of a loader that maps the file, as llama.cpp does."""
    size = min(path.stat().st_size, MMAP_PROBE_BYTES) // 8 * 8
    chunk = 64 << 20
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        words = np.frombuffer(data, np.uint64, size // 8)
        start = time.perf_counter()
        for i in range(0, words.size, chunk // 8):
            words[i : i + chunk // 8].sum()
        seconds = time.perf_counter() - start
        del words  # the mapping cannot close while numpy holds it
    return dict(seconds=seconds, bytes=size, gbps=size / seconds / 1e9)


def pinned_copy() -> dict:
    """A pinned host buffer copied to the device COPY_PROBE_REPEATS times (CUDA events): the link's speed."""
    host = torch.ones(COPY_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(COPY_PROBE_BYTES, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)  # warm
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(COPY_PROBE_REPEATS):
        device.copy_(host, non_blocking=True)
    stop.record()
    stop.synchronize()
    seconds = start.elapsed_time(stop) * 1e-3
    nbytes = COPY_PROBE_BYTES * COPY_PROBE_REPEATS
    return dict(seconds=seconds, bytes=nbytes, gbps=nbytes / seconds / 1e9)


def time_load(path: pathlib.Path, device: str) -> dict:
    """from_pretrained end to end (the command line's progress bar on a terminal), then load_tokenizer."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    model = Qwen38ForCausalLM.from_pretrained(path, device=device, progress=progress_bar("loading", "GB", 1e9, 2))
    if device == "cuda":
        torch.cuda.synchronize()  # from_pretrained waits for its checks already; nothing may be left running
    model_s = time.perf_counter() - start
    start = time.perf_counter()
    tokenizer = load_tokenizer(path)
    tokenizer_s = time.perf_counter() - start
    result = dict(model_s=model_s, tokenizer_s=tokenizer_s, total_s=model_s + tokenizer_s,
                  weight_bytes=model.weight_bytes(), vocab=len(tokenizer))
    if device == "cuda":
        result["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="/tmp", help="folder of the benchmark GGUF (written once, then reused)")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-"
                                       "load.json; --small writes none by default)")
    parser.add_argument("--repeats", type=int, default=2, help="loads to time")
    parser.add_argument("--small", action="store_true", help="a tiny shape on the CPU (a dry run of this code)")
    args = parser.parse_args(argv)
    device = "cpu" if args.small else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.load needs a CUDA GPU (--small runs it on the CPU at a tiny shape)")
    config = SMALL if args.small else QWEN38_27B
    vocabulary = real_size_vocabulary(SMALL_VOCAB_TOKENS, SMALL_VOCAB_MERGES) if args.small else real_size_vocabulary()
    env = env_info()
    name = f"qwen38-load-{'small' if args.small else '27b'}-q8_0.gguf"
    start = time.perf_counter()
    path, written = checkpoint_file(pathlib.Path(args.path), config, vocabulary, name)
    prepare_s = time.perf_counter() - start
    size = path.stat().st_size
    print(f"{path}: {size / 1e9:.2f} GB, {'written' if written else 'reused'} in {prepare_s:.1f} s "
          f"({_filesystem(path)})")
    results = dict(env=env, device=device, file=str(path), file_bytes=size, filesystem=_filesystem(path),
                   written=written, prepare_s=prepare_s, read_threads=READ_THREADS, piece_bytes=PIECE_BYTES)
    results["warm_read"] = page_cache_read(path)  # the first pass may still read the disk
    results["page_cache_read"] = page_cache_read(path)
    results["mmap_sum"] = mmap_sum(path)
    if device == "cuda":
        results["pinned_copy"] = pinned_copy()
    loads = [time_load(path, device) for _ in range(args.repeats)]
    print()
    best = min(loads, key=lambda r: r["total_s"])
    results.update(loads=loads, best=best, gbps=size / best["total_s"] / 1e9,
                   model_gbps=size / best["model_s"] / 1e9)
    results["page_cache_ratio"] = results["gbps"] / results["page_cache_read"]["gbps"]
    results["mmap_ratio"] = results["gbps"] / results["mmap_sum"]["gbps"]
    if device == "cuda":
        results["pinned_copy_ratio"] = results["gbps"] / results["pinned_copy"]["gbps"]
    rows = [dict(what=k, seconds=results[k]["seconds"], GBps=results[k]["gbps"])
            for k in ("warm_read", "page_cache_read", "mmap_sum", "pinned_copy") if k in results]
    rows += [dict(what=f"load {i}", seconds=r["total_s"], GBps=size / r["total_s"] / 1e9, model_s=r["model_s"],
                  tokenizer_s=r["tokenizer_s"]) for i, r in enumerate(loads)]
    print_table(rows, ["what", "seconds", "GBps", "model_s", "tokenizer_s"],
                title=f"load of {size / 1e9:.2f} GB on {env.get('gpu', device)} ({READ_THREADS} read threads)")
    ratios = ", ".join(f"{results[k]:.2f}x the {k.removesuffix('_ratio').replace('_', ' ')} probe"
                       for k in ("page_cache_ratio", "mmap_ratio", "pinned_copy_ratio") if k in results)
    print(f"load + tokenizer: {best['total_s']:.2f} s = {results['gbps']:.2f} GB/s ({best['model_s']:.2f} s weights, "
          f"{best['tokenizer_s']:.2f} s tokenizer); {ratios}")
    write_json(args.json or (None if args.small else default_result_path(env, "load")), results)
    return results


def _filesystem(path: pathlib.Path) -> str:
    """The type of the filesystem holding path (a tmpfs /tmp is RAM, not a disk behind a page cache)."""
    resolved, best = str(path.resolve()), ("", "unknown")
    with open("/proc/mounts") as f:
        for line in f:
            mount, kind = line.split()[1:3]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, kind)
    return f"{best[1]} at {best[0]}"


if __name__ == "__main__":
    main()
