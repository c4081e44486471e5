"""Batch-1 decode of the real Qwen3.8-27B shape on one GPU, against the memory roofline of this run.

    python -m benchmarks.decode [--model PATH] [--json PATH] [--lanes int8,f32,int8x2] [--contexts 4096,32768]
    torchrun --nproc-per-node 2 -m benchmarks.decode --tensor-parallel 2 [--model PATH] [--contexts ...]

Without --model the 27B shape is built with synthetic Q8_0 weights generated on the GPU (random quants,
fp16 scales of a realistic size): memory-bound speed does not depend on the values. Measured in ONE run:
the streaming-read probe (the roofline), tg128 from an empty cache with graph replays and with eager
launches, tok/s at deeper contexts (caches and states filled synthetically), per activation lane, a
per-part GPU time and kernels per token from the profiler over graph replays, memory, capture and build time,
the token's GEMVs alone in one graph (the step as if every small kernel were free), and an in-run peer: the
same token's GEMVs as torch bf16 F.linear calls captured in a graph.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.ops.common import (critical_path_us, default_result_path, env_info, kernel_intervals, print_table,
                                   read_probe_result, time_graph, write_json)
from qwen38_model import Qwen38Config, Qwen38ForCausalLM
from qwen38_model.checkpoint import Checkpoint, Q8Tensor
from qwen38_model.checkpoint.layout import GLOBAL_PARTS, SMALL_PARTS, expected_shape, gguf_tensor_name, layer_parts
from qwen38_model.checkpoint.q8_0 import Q8_BLOCK, Q8_BLOCK_BYTES
from qwen38_model.config import GDN, layer_types_from_interval
from qwen38_model.engine import BatchEngine
from qwen38_model.layers import Q8Linear
from qwen38_model.sampling import SamplingConfig, select_next_token
from qwen38_model.state import KVCache
from qwen38_model.tensor_parallel import TensorParallelCausalLM, all_gather, init_tensor_parallel

QWEN38_27B = Qwen38Config(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408,
    layer_types=layer_types_from_interval(64, 4),
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, rotary_dim=64, rope_theta=1e7,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    conv_kernel=4, rms_norm_eps=1e-6, source="synthetic 27B shape")


class SyntheticQ8Source:
    """A tensor source (qwen38_model.checkpoint.TensorSource) of random Q8_0 matrices made on the GPU, no
    file: every tensor the config describes, GGUF-named in the internal layout, each made as it is read (a
    Checkpoint reads them one at a time, in the model's order)."""

    gguf_layout = True

    def __init__(self, config: Qwen38Config, seed: int = 0):
        self.config, self.path = config, "synthetic"
        self.generator = torch.Generator("cuda").manual_seed(seed)
        tied = config.tie_word_embeddings
        layers = range(config.num_layers + config.num_mtp_layers)
        self.parts = {gguf_tensor_name(p, None): p for p in GLOBAL_PARTS if not (tied and p == "output")}
        self.parts.update({gguf_tensor_name(p, i): p for i in layers for p in layer_parts(config, i)})

    def names(self) -> list[str]:
        return list(self.parts)

    def has(self, name: str) -> bool:
        return name in self.parts

    def full_name(self, name: str) -> str:
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        return expected_shape(self.config, self.parts[name])

    def dtype_name(self, name: str) -> str:
        return "F32" if self.parts[name] in SMALL_PARTS else "Q8_0"

    def nbytes(self, name: str) -> int:
        shape = self.shape(name)
        if self.parts[name] in SMALL_PARTS:
            return 4 * math.prod(shape)  # float32
        return shape[0] * shape[1] // Q8_BLOCK * Q8_BLOCK_BYTES

    def total_bytes(self) -> int:
        return sum(self.nbytes(name) for name in self.parts)

    def read(self, name: str, reader) -> torch.Tensor | Q8Tensor:
        return self.read_rows(name, reader, 0, self.shape(name)[0])

    def read_rows(self, name: str, reader, start: int, stop: int) -> torch.Tensor | Q8Tensor:
        """Rows [start, stop), made as read() makes the whole (a tensor-parallel rank's share: other values)."""
        part, device, g = self.parts[name], reader.device, self.generator
        shape = (stop - start, *self.shape(name)[1:])
        if part not in SMALL_PARTS:
            q = torch.randint(-127, 128, shape, dtype=torch.int8, device=device, generator=g)
            # |w| ~ 127 * d ~ 0.05 at d ~ 4e-4: the spread of real projection weights.
            d = (torch.rand(shape[0], shape[1] // Q8_BLOCK, device=device, generator=g) * 4e-4 + 2e-4).half()
            return Q8Tensor(q, d)
        if part == "ssm_a":
            return -torch.exp(torch.rand(shape, device=device, generator=g) * 4 - 3)
        if part in ("ssm_dt", "ssm_conv1d"):
            return torch.rand(shape, device=device, generator=g) - 0.5
        return 1 + 0.1 * torch.randn(shape, device=device, generator=g)  # norm multipliers


def build_model(path: str | None, lane: str, mtp: bool = False, tensor_parallel: int = 1) -> Qwen38ForCausalLM:
    """The checkpoint at `path` on the GPU, or (None) the 27B shape with synthetic Q8_0 weights; mtp=True:
    with the MTP block (synthetic: one more attention layer, eh_proj and its norms; a checkpoint must have it).
    tensor_parallel=N (under torchrun, init_tensor_parallel done): this rank's TensorParallelCausalLM."""
    cls = Qwen38ForCausalLM if tensor_parallel == 1 else TensorParallelCausalLM
    if path:
        kwargs = {} if tensor_parallel == 1 else dict(tensor_parallel=tensor_parallel)
        model = cls.from_pretrained(path, device="cuda", lane=lane, **kwargs)
        if mtp and model.mtp is None:
            raise ValueError(f"{path} has no MTP block")
    else:
        config = dataclasses.replace(QWEN38_27B, num_mtp_layers=int(mtp))
        checkpoint = Checkpoint(SyntheticQ8Source(config))
        with torch.no_grad(), checkpoint.loading():
            model = cls(config, checkpoint, "cuda", torch.bfloat16, None, lane).eval()
    torch.cuda.synchronize()
    return model


def bytes_per_token(model: Qwen38ForCausalLM, context: int, kv_bytes: int) -> dict:
    """Bytes a decode step must move: every matrix once (the embedding: one row), small weights, the
    GDN state read + written, conv rings, and the KV rows up to the context."""
    c = model.config
    matrices = sum(m.weight_q.numel() + 2 * m.weight_d.numel() for m in q8_linears(model))
    embed_row = c.hidden_size + 2 * (c.hidden_size // 32)
    small = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                if b.dtype == torch.float32)
    n_gdn = c.layer_types.count(GDN)
    n_attn = c.num_layers - n_gdn
    state = n_gdn * 2 * 4 * c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim
    conv = n_gdn * 2 * 4 * (c.conv_kernel - 1) * c.conv_dim
    kv = n_attn * 2 * context * c.num_key_value_heads * c.head_dim * kv_bytes
    return dict(matrices=matrices, embed_row=embed_row, small=small, gdn_state=state, conv=conv, kv=kv,
                total=matrices + embed_row + small + state + conv + kv)


def fill_caches(state, context: int) -> None:
    """Caches (the MTP block's too) and GDN states as if `context` tokens had been processed (values random,
    finite)."""
    for layer in state.layers + ([state.mtp_cache] if state.mtp_cache is not None else []):
        if isinstance(layer, KVCache):
            layer.k[:context].normal_()
            layer.v[:context].normal_()
        else:
            layer.recurrent.normal_(0, 0.01)
            layer.conv.normal_()


def one_row_engine(model, max_seq: int, kv_dtype, cfg: SamplingConfig):
    """(engine, replay, eager_step): a batch engine of one slot with its step graph and slot 0's selection graph
    captured; replay() is one decode step as the engine replays it, eager_step() the same launches eagerly."""
    engine = BatchEngine(model, 1, max_seq, kv_dtype, use_graph=True)
    engine.capture()
    engine.select(0, cfg)  # captures slot 0's selection graph

    def replay() -> None:
        engine.step_graphs[1].replay()
        engine.select(0, cfg)

    def eager_step() -> None:
        engine.run_rows(1)
        select_next_token(engine.logits[0], engine.samplers[0], cfg, engine.tokens[:1], engine.slots.positions[:1])

    return engine, replay, eager_step


def fill_state(engine: BatchEngine, context: int) -> None:
    """Slot 0 as if `context` tokens had been processed, its pending token 1."""
    fill_caches(engine.slots.slot(0), context)
    engine.slots.positions[:1].fill_(context)
    engine.tokens[:1].fill_(1)


TIMING_RUNS = 3  # runs of median_step_s


def median_step_s(run_step, steps: int, prepare=None) -> float:
    """Seconds per run_step() over `steps` calls back to back, CUDA events around them: the median of TIMING_RUNS
    runs, each after prepare() (if given)."""
    times = []
    for _ in range(TIMING_RUNS):
        if prepare is not None:
            prepare()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            run_step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3 / steps)
    return statistics.median(times)


def time_steps(engine: BatchEngine, run_step, steps: int, context: int) -> float:
    """Seconds per decode step over `steps` steps starting at `context` (median of TIMING_RUNS runs)."""
    return median_step_s(run_step, steps, lambda: fill_state(engine, context))


# Kernel name fragments -> the part of a token they belong to (first match wins).
KERNEL_PARTS = (("q8_0_gemv", "gemv"), ("gemm", "gemv"), ("gdn", "gdn_small_ops"), ("attention", "attention"),
                ("qk_norm_rope", "attention"), ("attn_output_gate", "attention"), ("produce_kernel", "produce"),
                ("embedding", "embedding"), ("argmax", "sampling"))


def short_kernel_name(name: str) -> str:
    """The kernel's name with its template arguments, without namespaces and the parameter list: the
    instances of one template (produce_kernel<AddRmsNorm>, <SiluMul>, ..) stay apart."""
    name = name.removeprefix("void ").replace("qwen38::", "").replace("(anonymous namespace)::", "")
    depth = 0
    for i, c in enumerate(name):
        depth += c == "<"
        depth -= c == ">"
        if c == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def kernel_split(replay, steps: int = 8) -> dict:
    """GPU time per part of a token, per kernel, and kernels per token, from the CUDA profiler's kernel records
    over `steps` graph replays (no instrumentation: what the replayed graph runs, not eager launches). Two
    measures: the kernels' own durations (under PDL a kernel's record starts at its launch, before it waits for
    its predecessor, so overlapped time is counted in every kernel that spans it and these add up to more than
    the token), and each kernel's share of the critical path (critical_path_us: overlap counted once, for the
    predecessor; these add up to busy_ms, and span_ms - busy_ms is the GPU idle between kernels)."""
    intervals = kernel_intervals(replay, steps)
    shares = critical_path_us(intervals)
    kernels: dict[str, dict] = {}
    for name, start, end in intervals:
        entry = kernels.setdefault(name, {"ms": 0.0, "critical_ms": shares[name] / steps / 1e3, "launches": 0.0})
        entry["ms"] += (end - start) / steps / 1e3
        entry["launches"] += 1 / steps
    parts: dict[str, float] = {}
    critical: dict[str, float] = {}
    for name, k in kernels.items():
        part = next((part for fragment, part in KERNEL_PARTS if fragment in name), "other")
        parts[part] = parts.get(part, 0.0) + k["ms"]
        critical[part] = critical.get(part, 0.0) + k["critical_ms"]
    result = {k: round(v, 4) for k, v in sorted(parts.items())}
    result["critical_ms"] = {k: round(v, 4) for k, v in sorted(critical.items(), key=lambda kv: -kv[1])}
    result["kernels_total_ms"] = round(sum(parts.values()), 4)
    result["busy_ms"] = round(sum(critical.values()), 4)
    result["span_ms"] = round((intervals[-1][2] - intervals[0][1]) / steps / 1e3, 4) if intervals else 0.0
    result["launches_per_token"] = len(intervals) / steps
    result["kernels"] = {short_kernel_name(name): {key: round(v, 4) for key, v in k.items()}
                         for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["critical_ms"])}
    return result


def q8_linears(model: Qwen38ForCausalLM) -> list[Q8Linear]:
    """The token's Q8_0 matrices, in the model's module order."""
    return [m for m in model.modules() if isinstance(m, Q8Linear)]


def torch_bf16_peer(model: Qwen38ForCausalLM) -> dict:
    """The same token's GEMVs as torch bf16 F.linear (cuBLAS), captured in one graph."""
    shapes = [m.weight_q.shape for m in q8_linears(model)]
    weights = [torch.empty(s, dtype=torch.bfloat16, device="cuda").normal_(0, 0.02) for s in shapes]
    xs = {s[1]: torch.randn(1, s[1], dtype=torch.bfloat16, device="cuda") for s in shapes}
    outs = [torch.empty(1, s[0], dtype=torch.bfloat16, device="cuda") for s in shapes]

    def token():
        for w, o in zip(weights, outs):
            torch.mm(xs[w.shape[1]], w.t(), out=o)

    t = time_graph(lambda _: token(), 1)["median_s"]
    nbytes = sum(w.numel() * 2 for w in weights)
    del weights
    torch.cuda.empty_cache()
    return dict(seconds=t, bytes=nbytes, gbps=nbytes / t / 1e9, tok_s=1 / t)


def gemv_chain(model: Qwen38ForCausalLM, lane: str, probe_gbps: float) -> dict:
    """The token's Q8_0 GEMVs alone, back to back in one graph (PDL between them as in the step), each on a
    fixed activation of its width: the decode step as if every small kernel between them were free, so the
    ceiling of any fusion of the small ops into per-launch GEMVs."""
    linears = q8_linears(model)
    widths = {m.in_features for m in linears}
    x = {k: torch.randn(1, k, device="cuda") for k in widths}
    x_q = {k: torch.randint(-127, 128, (1, k), dtype=torch.int8, device="cuda") for k in widths}
    x_d = {k: (torch.rand(1, k // 32, device="cuda") * 0.01).half().float() for k in widths}  # fp16 values
    outs = [torch.empty(1, m.out_features, device="cuda") for m in linears]
    gemv = torch.ops.qwen38

    def token():
        for m, out in zip(linears, outs):
            k = m.in_features
            if lane == "f32":
                gemv.q8_0_gemv(x[k], m.weight_q, m.weight_d, out)
            elif lane == "int8":
                gemv.q8_0_gemv_int8(x_q[k], x_d[k], m.weight_q, m.weight_d, out)
            else:
                gemv.q8_0_gemv_int8x2(x_q[k], x_q[k], x_d[k], m.weight_q, m.weight_d, out)

    t = time_graph(lambda _: token(), 1)["median_s"]
    nbytes = sum(m.weight_q.numel() + 2 * m.weight_d.numel() for m in linears)
    return dict(seconds=t, launches=len(linears), bytes=nbytes, gbps=nbytes / t / 1e9,
                probe_ratio=nbytes / t / 1e9 / probe_gbps, tok_s=1 / t)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-decode.json)")
    parser.add_argument("--lanes", default="int8,int8x2,f32", help="Q8_0 activation lanes, comma-separated, each "
                        "measured in turn; the summary line is the first's (default: %(default)s)")
    parser.add_argument("--contexts", default="4096,32768", help="cache depths in tokens, comma-separated: "
                        "tok/s decoding at each, beside tg128 from an empty cache (default: %(default)s)")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="KV cache dtype (default: %(default)s)")
    parser.add_argument("--no-peer", action="store_true", help="skip the bf16 F.linear peer (needs ~54 GB)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="under torchrun --nproc-per-node N: tg128 and the contexts at TP = N and, in the same run, "
                        "at TP = 1 on rank 0's GPU, the first lane only, with the collectives' time per token")
    args = parser.parse_args(argv)
    if args.tensor_parallel > 1:
        return tensor_parallel_main(args)
    lanes = args.lanes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtype = getattr(torch, args.kv_dtype)
    env = env_info()
    probe = read_probe_result()
    roofline = probe["best_gbps"]

    start = time.perf_counter()
    model = build_model(args.model, lanes[0])
    load_s = time.perf_counter() - start
    kv_bytes = torch.finfo(kv_dtype).bits // 8
    cfg = SamplingConfig()
    rows, results = [], dict(env=env, read_probe=probe, load_s=load_s, kv_dtype=args.kv_dtype, lanes={})
    max_seq = max(contexts + [128]) + 256
    for lane in lanes:
        if model.lane != lane:  # a model's lane is fixed when it is built: a model per lane, one at a time
            model = None
            torch.cuda.empty_cache()
            model = build_model(args.model, lane)
        t0 = time.perf_counter()
        engine, replay, eager_step = one_row_engine(model, max_seq, kv_dtype, cfg)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t0
        lane_result = dict(capture_s=capture_s)
        for context in [0] + contexts:
            steps = 128 if context == 0 else 32
            t_graph = time_steps(engine, replay, steps, context)
            t_eager = time_steps(engine, eager_step, min(steps, 32), context)
            moved = bytes_per_token(model, context + steps // 2, kv_bytes)["total"]
            name = "tg128" if context == 0 else f"ctx{context}"
            lane_result[name] = dict(graph_s=t_graph, eager_s=t_eager, tok_s=1 / t_graph, eager_tok_s=1 / t_eager,
                                     bytes=moved, gbps=moved / t_graph / 1e9,
                                     roofline_ratio=moved / t_graph / 1e9 / roofline,
                                     graph_speedup=t_eager / t_graph)
            rows.append(dict(lane=lane, test=name, tok_s=1 / t_graph, ms=t_graph * 1e3,
                             GBps=moved / t_graph / 1e9, roofline=moved / t_graph / 1e9 / roofline,
                             eager_tok_s=1 / t_eager, graph_x=t_eager / t_graph))
        fill_state(engine, 0)
        lane_result["kernel_split_ms"] = kernel_split(replay)
        lane_result["gemv_chain"] = gemv_chain(model, lane, roofline)
        lane_result["memory_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        results["lanes"][lane] = lane_result
        del engine, replay, eager_step
        torch.cuda.empty_cache()
    results["bytes_per_token_empty"] = bytes_per_token(model, 64, kv_bytes)
    results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    default = lanes[0]
    results["default_lane"] = default
    results["tg128_tok_s"] = results["lanes"][default]["tg128"]["tok_s"]
    results["tg128_roofline_ratio"] = results["lanes"][default]["tg128"]["roofline_ratio"]
    results["roofline_tok_s"] = roofline * 1e9 / results["lanes"][default]["tg128"]["bytes"]
    if not args.no_peer:
        results["torch_bf16_gemv_peer"] = torch_bf16_peer(model)
    print_table(rows, ["lane", "test", "tok_s", "ms", "GBps", "roofline", "eager_tok_s", "graph_x"],
                title=f"decode on {env.get('gpu')} (read probe {roofline:.0f} GB/s, KV {args.kv_dtype})")
    for lane, r in results["lanes"].items():
        print(f"{lane}: GPU time per part (ms per token, profiler over graph replays) {r['kernel_split_ms']}  "
              f"capture {r['capture_s']:.2f} s")
        c = r["gemv_chain"]
        print(f"{lane}: the token's {c['launches']} GEMVs alone (every small kernel free): {c['seconds'] * 1e3:.2f} ms "
              f"= {c['tok_s']:.1f} tok/s, {c['probe_ratio']:.1%} of the probe; the whole token "
              f"{r['tg128']['graph_s'] * 1e3:.2f} ms")
    if "torch_bf16_gemv_peer" in results:
        p = results["torch_bf16_gemv_peer"]
        print(f"peer: torch bf16 F.linear graph of the same GEMVs: {p['seconds'] * 1e3:.2f} ms "
              f"({p['gbps']:.0f} GB/s, {p['tok_s']:.1f} tok/s)")
    print(f"tg128 ({default}): {results['tg128_tok_s']:.1f} tok/s = {results['tg128_roofline_ratio']:.1%} of the "
          f"roofline ({results['roofline_tok_s']:.1f} tok/s); build {load_s:.1f} s; "
          f"peak memory {results['max_memory_allocated_gb']:.1f} GB")
    write_json(args.json or default_result_path(env, "decode"), results)
    return results


def collectives_per_token(model: TensorParallelCausalLM) -> dict:
    """A decode token's collectives alone, captured in one graph: the embedding's all-reduce, two all-reduces a
    layer (the MTP block's excluded: a plain step) of one hidden row, the head's all-gather of one logits row."""
    c, size = model.config, model.size
    hidden = torch.zeros(1, c.hidden_size, device=model.device)
    part = torch.zeros(1, c.vocab_size // size, device=model.device)
    gathered = torch.zeros(size, c.vocab_size // size, device=model.device)

    def token():
        for _ in range(1 + 2 * c.num_layers):
            dist.all_reduce(hidden)
        all_gather(gathered, part)

    t = time_graph(lambda _: token(), 1)["median_s"]
    return dict(seconds=t, all_reduces=1 + 2 * c.num_layers, all_gathers=1)


def tensor_parallel_versus_one(path: str | None, lane: str, size: int, measure) -> tuple[dict, dict | None]:
    """(measure(model) of this rank's share at TP = size, of the whole model at TP = 1 on rank 0, None on the
    others): every rank builds its share and measures (its graphs replay the collectives in step with the
    others'), frees it, then rank 0 alone builds the whole model on its GPU while the others wait. Under
    torchrun --nproc-per-node size (init_tensor_parallel done); load_s is added to each."""
    start = time.perf_counter()
    model = build_model(path, lane, tensor_parallel=size)
    many = dict(load_s=time.perf_counter() - start, **measure(model))
    del model
    torch.cuda.empty_cache()
    one = None
    if dist.get_rank() == 0:
        start = time.perf_counter()
        model = build_model(path, lane)
        one = dict(load_s=time.perf_counter() - start, **measure(model))
        del model
        torch.cuda.empty_cache()
    dist.barrier()
    return many, one


def tensor_parallel_main(args) -> dict:
    """--tensor-parallel N: tg128 and the contexts, the first lane, at TP = N and 1 (tensor_parallel_versus_one),
    and the TP = N token's collectives alone. Rank 0 prints and writes the results."""
    size = args.tensor_parallel
    init_tensor_parallel(size)
    lane = args.lanes.split(",")[0]
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtype = getattr(torch, args.kv_dtype)
    env = env_info()

    def measure(model) -> dict:
        engine, replay, _ = one_row_engine(model, max(contexts + [128]) + 256, kv_dtype, SamplingConfig())
        out = {}
        for context in [0] + contexts:
            name = "tg128" if context == 0 else f"ctx{context}"
            out[f"{name}_tok_s"] = 1 / time_steps(engine, replay, 128 if context == 0 else 32, context)
        if isinstance(model, TensorParallelCausalLM):
            out["collectives"] = collectives_per_token(model)
        out["memory_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        return out

    many, one = tensor_parallel_versus_one(args.model, lane, size, measure)
    results = dict(env=env, kv_dtype=args.kv_dtype, lane=lane, tensor_parallel=size, **{f"tp{size}": many, "tp1": one})
    if one is not None:
        results["speedup"] = {k: many[k] / one[k] for k in one if k.endswith("_tok_s")}
        rows = [dict(test=k.removesuffix("_tok_s"), tp1_tok_s=one[k], **{f"tp{size}_tok_s": many[k]},
                     speedup=results["speedup"][k]) for k in results["speedup"]]
        print_table(rows, ["test", "tp1_tok_s", f"tp{size}_tok_s", "speedup"],
                    title=f"decode at TP = {size} vs 1 on {env.get('gpu')} ({lane}, KV {args.kv_dtype})")
        c = many["collectives"]
        print(f"collectives of a token alone ({c['all_reduces']} all-reduces, {c['all_gathers']} all-gather): "
              f"{c['seconds'] * 1e6:.0f} us of the TP = {size} token's {1e6 / many['tg128_tok_s']:.0f} us")
        write_json(args.json or default_result_path(env, f"decode-tp{size}"), results)
    dist.destroy_process_group()
    return results

if __name__ == "__main__":
    main()
