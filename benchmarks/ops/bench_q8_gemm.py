"""Q8_0 GEMM (q8_0_gemm_int8) at the 27B trunk shapes against the tensor-core peaks of this run, and the
GEMV/GEMM crossover for small T (the verify and short-prompt sizes).

    python -m benchmarks.ops.bench_q8_gemm [--json PATH] [--profile]

Also the f32 lane's crossover (GEMV vs dequantize + cuBLAS float32). Peaks: torch._int_mm and bf16 torch.mm on the same shapes, in the fast layout (b = W.t() of a row-major
[N, K] weight: prefill-ceilings.md's layout trap). Our GEMM is timed as the dispatch picks it (q8_gemm_int8),
with each kernel forced (QWEN38_Q8_GEMM_KERNEL: mma = the mma.sync kernel at its default tile, wgmma and
wgmma_iadd = the sm_90a kernel's two accumulator resets at its default tile; NaN where the build or device lacks
them), wgmma at each of its tiles, the two-word lane's mma and wgmma, and the mma.sync kernel at each compiled tile
(QWEN38_Q8_GEMM_TILE alone). --profile runs the GEMM
once at T = 4096 on 34816 x 5120 and exits, for a profiler, with the kernel the environment picks
(`QWEN38_Q8_GEMM_KERNEL=wgmma ncu --clock-control none -k regex:q8_0_gemm python3 -m benchmarks.ops.bench_q8_gemm
--profile`).
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_model.checkpoint import Q8Tensor
from qwen38_model.config import ATTENTION, GDN
from qwen38_model.layers import Q8Linear
from qwen38_model.scratch import Scratch

from .common import env_info, print_table, write_json

ops = torch.ops.qwen38


def trunk_shapes(config) -> list[tuple[int, int, int]]:
    """(N, K, count) of every Q8_0 matrix of the trunk (the LM head runs on one row in prefill)."""
    c = config
    n_gdn, n_attn = c.layer_types.count(GDN), c.layer_types.count(ATTENTION)
    qkvz = 2 * c.linear_num_key_heads * c.linear_key_head_dim + 2 * c.linear_value_dim
    qgkv = 2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim
    return [(qkvz, c.hidden_size, n_gdn), (2 * c.linear_num_value_heads, c.hidden_size, n_gdn),
            (c.hidden_size, c.linear_value_dim, n_gdn), (qgkv, c.hidden_size, n_attn),
            (c.hidden_size, c.num_attention_heads * c.head_dim, n_attn),
            (2 * c.intermediate_size, c.hidden_size, c.num_layers), (c.hidden_size, c.intermediate_size, c.num_layers)]


def median_time(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e-3)
    return statistics.median(times)


def random_q8(N, K):
    return (torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
            (torch.rand(N, K // 32, device="cuda") * 4e-4 + 2e-4).half())


def with_env(fn, **env: str) -> float:
    """median_time(fn) with the environment variables set (the GEMM reads them at every call); NaN where the
    launch refuses them (the wgmma kernels on a build or device without sm_90a)."""
    os.environ.update(env)
    try:
        return median_time(fn)
    except RuntimeError:
        return float("nan")
    finally:
        for name in env:
            del os.environ[name]


KERNELS = ("mma", "wgmma", "wgmma_iadd")


def matrix_table(config, lengths=(512, 4096)) -> tuple[list[dict], dict]:
    """Per shape and T: seconds of torch._int_mm, bf16 torch.mm and our GEMM (default dispatch, each kernel
    forced, the two-word lane, each mma.sync tile); trunk totals."""
    rows, totals = [], {}
    for T in lengths:
        total = dict(int_mm=0.0, bf16_mm=0.0, q8_gemm_int8=0.0, **{k: 0.0 for k in KERNELS}, wgmma64=0.0,
                     wgmma128=0.0, x2_mma=0.0, x2_wgmma=0.0, tile32=0.0, tile64=0.0, tile128=0.0)
        for N, K, count in trunk_shapes(config):
            w8, wd = random_q8(N, K)
            x8 = torch.randint(-127, 128, (T, K), dtype=torch.int8, device="cuda")
            x8_lo = torch.randint(-64, 65, (T, K), dtype=torch.int8, device="cuda")
            xd = torch.rand(T, K // 32, device="cuda") * 0.01
            wb, xb = torch.randn(N, K, device="cuda").bfloat16(), torch.randn(T, K, device="cuda").bfloat16()
            out = torch.empty(T, N, device="cuda")
            int8 = lambda: ops.q8_0_gemm_int8(x8, xd, w8, wd, out)  # noqa: E731
            int8x2 = lambda: ops.q8_0_gemm_int8x2(x8, x8_lo, xd, w8, wd, out)  # noqa: E731
            t = dict(
                int_mm=median_time(lambda: torch._int_mm(x8, w8.t())) if N % 8 == 0 else float("nan"),
                bf16_mm=median_time(lambda: torch.mm(xb, wb.t())),
                q8_gemm_int8=median_time(int8),
                **{k: with_env(int8, QWEN38_Q8_GEMM_KERNEL=k) for k in KERNELS},
                **{f"wgmma{tile}": with_env(int8, QWEN38_Q8_GEMM_KERNEL="wgmma", QWEN38_Q8_GEMM_TILE=tile)
                   for tile in ("64", "128")},  # the wgmma kernel's tiles (its default picks by wave count)
                x2_mma=with_env(int8x2, QWEN38_Q8_GEMM_KERNEL="mma"),
                x2_wgmma=with_env(int8x2, QWEN38_Q8_GEMM_KERNEL="wgmma"))
            for tile in ("32", "64", "128"):  # every compiled mma.sync tile (its default picks by wave count)
                t[f"tile{tile}"] = with_env(int8, QWEN38_Q8_GEMM_TILE=tile)
            flop = 2 * T * N * K
            for k in total:  # int_mm has no N % 8 != 0 form: bf16 stands in there; a missing kernel stays NaN
                total[k] += (t[k] if t[k] == t[k] or k != "int_mm" else t["bf16_mm"]) * count
            rows.append(dict(T=T, N=N, K=K, count=count, **{f"{k}_tops": flop / v / 1e12 for k, v in t.items()},
                             gemm_of_int_mm=t["int_mm"] / t["q8_gemm_int8"], wgmma_of_int_mm=t["int_mm"] / t["wgmma"]))
        totals[T] = {k: dict(s=v, tok_s=T / v) for k, v in total.items()}
        totals[T]["gemm_of_int_mm"] = total["int_mm"] / total["q8_gemm_int8"]
    torch.cuda.empty_cache()
    return rows, totals


def small_t_table(config, tokens=(1, 2, 4, 8, 16, 32), copies: int = 3) -> list[dict]:
    """Trunk matrix time per token count for the GEMV and the GEMM (int8 lane): where the GEMM starts.
    Each shape's time is the mean over `copies` weight copies called in turn, so no weight is L2-resident
    when it is read (5120 x 6144 is 31 MB: alone it would stay in the 60 MB L2)."""
    rows = []
    mats = [([random_q8(N, K) for _ in range(copies)], count) for N, K, count in trunk_shapes(config)]
    for T in tokens:
        row = dict(T=T)
        for name, op in (("gemv", ops.q8_0_gemv_int8), ("gemm", ops.q8_0_gemm_int8)):
            total = 0.0
            for weights, count in mats:
                N, K = weights[0][0].shape
                x8 = torch.randint(-127, 128, (T, K), dtype=torch.int8, device="cuda")
                xd = torch.rand(T, K // 32, device="cuda") * 0.01
                out = torch.empty(T, N, device="cuda")

                def calls():
                    for w8, wd in weights:
                        op(x8, xd, w8, wd, out)

                total += median_time(calls) / copies * count
            row[f"{name}_ms"] = total * 1e3
        rows.append(row)
    t1 = rows[0]["gemv_ms"]
    for row in rows:
        row["gemv_of_t1"] = row["gemv_ms"] / t1
        row["gemm_of_t1"] = row["gemm_ms"] / t1
    torch.cuda.empty_cache()
    return rows



def f32_crossover_table(config, tokens=(16, 32, 64, 128, 256)) -> list[dict]:
    """The f32 lane's two T-row paths over the trunk matrices: the GEMV (4 rows per weight pass) and the
    model's dequantize-then-cuBLAS float32 GEMM (Q8Linear._dequantized_matmul)."""
    rows = []
    mats = [(random_q8(N, K), count) for N, K, count in trunk_shapes(config)]
    for T in tokens:
        row = dict(T=T, gemv_ms=0.0, dequant_mm_ms=0.0)
        for (w8, wd), count in mats:
            N, K = w8.shape
            x = torch.randn(T, K, device="cuda")
            out = torch.empty(T, N, device="cuda")
            linear, scratch = Q8Linear(Q8Tensor(w8, wd), "f32", "bench"), Scratch("cuda")
            row["gemv_ms"] += median_time(lambda: ops.q8_0_gemv(x, w8, wd, out)) * count * 1e3
            row["dequant_mm_ms"] += median_time(lambda: linear._dequantized_matmul(x, out, scratch)) * count * 1e3
        rows.append(row)
    torch.cuda.empty_cache()
    return rows


def profile_once() -> None:
    w8, wd = random_q8(34816, 5120)
    x8 = torch.randint(-127, 128, (4096, 5120), dtype=torch.int8, device="cuda")
    xd = torch.rand(4096, 5120 // 32, device="cuda") * 0.01
    out = torch.empty(4096, 34816, device="cuda")
    ops.q8_0_gemm_int8(x8, xd, w8, wd, out)
    torch.cuda.synchronize()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--profile", action="store_true", help="one GEMM call for a profiler, then exit")
    args = parser.parse_args(argv)
    if args.profile:
        profile_once()
        return {}
    from benchmarks.decode import QWEN38_27B

    rows, totals = matrix_table(QWEN38_27B)
    small = small_t_table(QWEN38_27B)
    print_table(rows, ["T", "N", "K", "count", "int_mm_tops", "bf16_mm_tops", "q8_gemm_int8_tops", "mma_tops",
                       "wgmma_tops", "wgmma_iadd_tops", "wgmma64_tops", "wgmma128_tops", "x2_mma_tops",
                       "x2_wgmma_tops", "tile32_tops", "tile64_tops", "tile128_tops", "gemm_of_int_mm",
                       "wgmma_of_int_mm"],
                title="trunk matrices: TOPS (peak probes vs our Q8_0 GEMM)")
    for T, tot in totals.items():
        print(f"T={T}: trunk matrices alone: int_mm {tot['int_mm']['tok_s']:.0f} tok/s, bf16 mm "
              f"{tot['bf16_mm']['tok_s']:.0f}, our int8 GEMM {tot['q8_gemm_int8']['tok_s']:.0f} "
              f"({tot['gemm_of_int_mm']:.1%} of int_mm; mma {tot['mma']['tok_s']:.0f}, wgmma "
              f"{tot['wgmma']['tok_s']:.0f}, wgmma_iadd {tot['wgmma_iadd']['tok_s']:.0f}; two-word mma "
              f"{tot['x2_mma']['tok_s']:.0f}, wgmma {tot['x2_wgmma']['tok_s']:.0f})")
    print_table(small, ["T", "gemv_ms", "gemm_ms", "gemv_of_t1", "gemm_of_t1"],
                title="small T: trunk matrices, int8 lane (ms per call of every matrix)")
    f32 = f32_crossover_table(QWEN38_27B)
    print_table(f32, ["T", "gemv_ms", "dequant_mm_ms"], title="f32 lane: trunk matrices, GEMV vs dequantize + cuBLAS")
    results = dict(env=env_info(), matrices=rows, trunk_matrices=totals, small_t=small, f32_crossover=f32)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
