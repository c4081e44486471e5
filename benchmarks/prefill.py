"""Prompt processing (prefill) of the Qwen3.8-27B shape on one GPU, against the tensor-core peaks of this run.

    python -m benchmarks.prefill [--model PATH] [--json PATH] [--lengths 128,512,2048,8192,32768]
                                 [--lanes int8,int8x2,f32] [--chunks 2048,4096,8192]
    torchrun --nproc-per-node 2 -m benchmarks.prefill --tensor-parallel 2 [--lengths ...]

Measured in ONE run (synthetic Q8_0 weights made on the GPU unless --model): the tensor-core peaks of
torch._int_mm and bf16 torch.mm on the trunk's matrix shapes at T = 512 and 4096 (the fast column-major
layout, prefill-ceilings.md); our Q8_0 GEMM on the same shapes; GEMV vs GEMM for small T (the verify
sizes); ppN tok/s and time to first token for each length (from an empty state, KV bf16); a per-part
split at pp512 and pp4096 (GEMMs, GDN core, attention core, other); the other activation lanes at pp512;
the prefill chunk size; decode tg128 on the same model (it must not regress); peak memory per length.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.decode import (QWEN38_27B, build_model, one_row_engine, tensor_parallel_versus_one,
                               time_steps)
from benchmarks.ops.bench_q8_gemm import matrix_table, small_t_table
from benchmarks.ops.common import default_result_path, env_info, print_table, write_json
from qwen38_model import layers as model_layers
from qwen38_model.layers import DenseLinear, GatedAttention, GatedDeltaNet, Q8Linear
from qwen38_model.sampling import SamplingConfig
from qwen38_model.tensor_parallel import init_tensor_parallel


def time_prefill(model, length: int, reps: int, chunk: int | None = None) -> dict:
    """Seconds for model.prefill of `length` tokens from an empty state (median of reps), peak memory."""
    ids = torch.randint(0, model.config.vocab_size, (length,), dtype=torch.int32, device="cuda")
    kwargs = {} if chunk is None else dict(chunk_size=chunk)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        state = model.new_state(length + 1, torch.bfloat16)
        positions = state.reserve(length)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.prefill(ids, positions, state, logits_to_keep=1, **kwargs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del state
    t = statistics.median(times)
    return dict(seconds=t, tok_s=length / t, ttft_s=t, peak_gb=torch.cuda.max_memory_allocated() / 1e9)


def part_split(model, length: int) -> dict:
    """Milliseconds of one prefill by part, from CUDA events around modules: every Q8_0 projection
    (GEMMs), the GDN and attention mixers without their projections, the rest (embedding, norms, SwiGLU,
    head)."""
    marks = []
    handles = []
    for module in model.modules():
        if isinstance(module, (Q8Linear, DenseLinear)):
            kind = "gemm"
        elif isinstance(module, GatedDeltaNet):
            kind = "gdn_mixer"
        elif isinstance(module, GatedAttention):
            kind = "attention_mixer"
        else:
            continue

        def pre(mod, args, kind=kind):
            marks.append([kind, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), mod])
            marks[-1][1].record()

        def post(mod, args, out, kind=kind):
            for m in reversed(marks):
                if m[3] is mod:
                    m[2].record()
                    break

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    ids = torch.randint(0, model.config.vocab_size, (length,), dtype=torch.int32, device="cuda")
    state = model.new_state(length + 1, torch.bfloat16)
    positions = state.reserve(length)
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    model.prefill(ids, positions, state, logits_to_keep=1)
    stop.record()
    torch.cuda.synchronize()
    for h in handles:
        h.remove()
    split = dict(gemm=0.0, gdn_mixer=0.0, attention_mixer=0.0, gemm_in_gdn=0.0, gemm_in_attention=0.0)
    for kind, a, b, mod in marks:
        ms = a.elapsed_time(b)
        split[kind] += ms
        if kind == "gemm" and mod.scratch_role.startswith("gdn."):
            split["gemm_in_gdn"] += ms
        elif kind == "gemm" and mod.scratch_role.startswith("attn."):
            split["gemm_in_attention"] += ms
    total = start.elapsed_time(stop)
    result = dict(total=total, gemm=split["gemm"], gdn_core=split["gdn_mixer"] - split["gemm_in_gdn"],
                  attention_core=split["attention_mixer"] - split["gemm_in_attention"])
    result["other"] = total - result["gemm"] - result["gdn_core"] - result["attention_core"]
    return {k: round(v, 3) for k, v in result.items()}


def decode_tg128(model) -> float:
    engine, replay, _ = one_row_engine(model, 512, torch.bfloat16, SamplingConfig())
    t = time_steps(engine, replay, 128, 0)
    del engine, replay
    torch.cuda.empty_cache()
    return 1 / t


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-prefill.json)")
    parser.add_argument("--lengths", default="128,512,2048,4096,8192,32768", help="prompt lengths in tokens, "
                        "comma-separated: ppN for each (default: %(default)s)")
    parser.add_argument("--lanes", default="int8,int8x2,f32", help="Q8_0 activation lanes, comma-separated: the first "
                        "runs every length, the others pp512 (default: %(default)s)")
    parser.add_argument("--chunks", default="2048,4096,8192", help="prefill chunk sizes in tokens, "
                        "comma-separated, compared at the longest length (default: %(default)s)")
    parser.add_argument("--no-matrices", action="store_true", help="skip the per-shape GEMM table")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="under torchrun --nproc-per-node N: ppN of each length at TP = N and, in the same run, at "
                        "TP = 1 on rank 0's GPU, the first lane only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.prefill needs a CUDA GPU")
    if args.tensor_parallel > 1:
        return tensor_parallel_main(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    lanes = args.lanes.split(",")
    env = env_info()
    results = dict(env=env, lengths={}, lanes={})

    if not args.no_matrices:
        rows, totals = matrix_table(QWEN38_27B)
        results["matrices"], results["trunk_matrices"] = rows, totals
        results["small_t"] = small_t_table(QWEN38_27B)
        for T, tot in totals.items():
            print(f"T={T}: trunk matrices alone: int_mm {tot['int_mm']['tok_s']:.0f} tok/s, bf16 mm "
                  f"{tot['bf16_mm']['tok_s']:.0f}, our int8 GEMM {tot['q8_gemm_int8']['tok_s']:.0f} "
                  f"({tot['gemm_of_int_mm']:.1%} of int_mm; per shape: benchmarks.ops.bench_q8_gemm)")
        print_table(results["small_t"], ["T", "gemv_ms", "gemm_ms", "gemv_of_t1", "gemm_of_t1"],
                    title="small T: trunk matrices, int8 lane (ms per call of every matrix)")

    start = time.perf_counter()
    model = build_model(args.model, lanes[0])
    results["load_s"] = time.perf_counter() - start
    results["weights_gb"] = model.weight_bytes() / 1e9

    time_prefill(model, 512, 1)  # warm-up: first launches, cuBLAS handles, allocator
    table = []
    for length in lengths:
        r = time_prefill(model, length, reps=3 if length <= 4096 else 1)
        results["lengths"][f"pp{length}"] = r
        table.append(dict(lane=lanes[0], test=f"pp{length}", tok_s=r["tok_s"], ttft_s=r["ttft_s"], peak_gb=r["peak_gb"]))
    for length in sorted({512, min(4096, max(lengths))}):
        results[f"split_pp{length}_ms"] = part_split(model, length)
        print(f"split pp{length} (ms): {results[f'split_pp{length}_ms']}")
    longest = max(lengths)
    results["chunks"] = {}
    for chunk in [int(x) for x in args.chunks.split(",") if x]:
        r = time_prefill(model, longest, 1, chunk)
        results["chunks"][chunk] = r
        table.append(dict(lane=lanes[0], test=f"pp{longest} chunk {chunk}", tok_s=r["tok_s"], ttft_s=r["ttft_s"],
                          peak_gb=r["peak_gb"]))
    results["tg128_tok_s"] = decode_tg128(model)
    for lane in lanes[1:]:
        model = None  # a model's lane is fixed when it is built: a model per lane, one at a time
        torch.cuda.empty_cache()
        model = build_model(args.model, lane)
        r = time_prefill(model, 512, 3)
        results["lanes"][lane] = dict(pp512=r)
        table.append(dict(lane=lane, test="pp512", tok_s=r["tok_s"], ttft_s=r["ttft_s"], peak_gb=r["peak_gb"]))
    results["pp512_tok_s"] = results["lengths"].get("pp512", {}).get("tok_s")
    results["pp4096_tok_s"] = results["lengths"].get("pp4096", {}).get("tok_s")
    results["thresholds"] = dict(int_gemm_min_rows=model_layers.INT_GEMM_MIN_ROWS,
                                 f32_gemm_min_rows=model_layers.F32_GEMM_MIN_ROWS)
    results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    print_table(table, ["lane", "test", "tok_s", "ttft_s", "peak_gb"], title=f"prefill on {env.get('gpu')} (KV bf16)")
    print(f"decode tg128 ({lanes[0]}, same model, same run): {results['tg128_tok_s']:.1f} tok/s; "
          f"weights {results['weights_gb']:.1f} GB; build {results['load_s']:.1f} s")
    write_json(args.json or default_result_path(env, "prefill"), results)
    return results


def tensor_parallel_main(args) -> dict:
    """--tensor-parallel N: ppN of each length, the first lane, at TP = N and 1 (tensor_parallel_versus_one).
    Rank 0 prints and writes the results."""
    size = args.tensor_parallel
    init_tensor_parallel(size)
    lengths = [int(x) for x in args.lengths.split(",")]
    lane = args.lanes.split(",")[0]
    env = env_info()

    def measure(model) -> dict:
        time_prefill(model, 512, 1)  # warm-up: first launches, cuBLAS handles, allocator
        return {f"pp{n}": time_prefill(model, n, reps=3 if n <= 4096 else 1) for n in lengths}

    many, one = tensor_parallel_versus_one(args.model, lane, size, measure)
    results = dict(env=env, lane=lane, tensor_parallel=size, **{f"tp{size}": many, "tp1": one})
    if one is not None:
        results["speedup"] = {f"pp{n}": many[f"pp{n}"]["tok_s"] / one[f"pp{n}"]["tok_s"] for n in lengths}
        rows = [dict(test=f"pp{n}", tp1_tok_s=one[f"pp{n}"]["tok_s"], **{f"tp{size}_tok_s": many[f"pp{n}"]["tok_s"]},
                     speedup=results["speedup"][f"pp{n}"]) for n in lengths]
        print_table(rows, ["test", "tp1_tok_s", f"tp{size}_tok_s", "speedup"],
                    title=f"prefill at TP = {size} vs 1 on {env.get('gpu')} ({lane}, KV bf16)")
        write_json(args.json or default_result_path(env, f"prefill-tp{size}"), results)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
