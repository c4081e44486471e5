"""The int8 Q8_0 GEMV at T = 1 .. 64 rows over one token's 27B matrices: the batched decode step's weight stream.

    python3 -m benchmarks.ops.bench_q8_gemv_rows --json PATH [--rows 1,2,4,8,16,32,64] [--shapes 0,1,...]

Per shape and T: time per launch inside one captured CUDA graph of many launches, weights rotated over >= 1 GiB
of distinct sets (none found in the 60 MB L2), GB/s of weight + scale bytes and its % of the streaming-read probe
of the same process; then the token: each shape's time times its count in the 27B model (48 GDN, 16 attention,
64 FFN layers and the LM head), against the token at T = 1. That is issue 22's measure ("T = 16 <= 1.25x the
T = 1 time over one token's matrices") without building the model; benchmarks/batch.py times the real chain.
QWEN38_Q8_GEMV_ROWS_FROM (read once per process) says from how many rows the rows kernel runs (default 7; 2 shows
it at T = 2 .. 4 too). Every T is timed with each of the rows kernel's forms (QWEN38_Q8_GEMV_ROWS_KERNEL=smem|direct,
read at each call, so set around each capture; rows labelled kernel=...), and the token table is given for each,
against its own T = 1 (the same kernel either way: T = 1 never runs the rows kernel).
"""
from __future__ import annotations

import argparse
import os

import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from benchmarks.ops.bench_q8_gemv import activation, calls_for, rotation, weight_sets
from benchmarks.ops.common import env_info, print_table, read_probe_result, time_graph, write_json

# [N, K], what it is, how many a token reads (27B: 48 GDN layers, 16 attention, 64 FFN).
TOKEN_SHAPES = [
    ((16480, 5120), "GDN q|k|v|z|b|a", 48),
    ((34816, 5120), "FFN gate|up", 64),
    ((14336, 5120), "attn q|gate|k|v", 16),
    ((5120, 6144), "GDN/attn out", 64),
    ((5120, 17408), "FFN down", 64),
    ((248320, 5120), "LM head", 1),
]
ROWS = (1, 2, 4, 8, 16, 32, 64)
KERNELS = ("smem", "direct")


def bench_shape(N, K, probe_gbps, rows_of_x):
    qbytes = N * K + N * (K // 32) * 2
    n_sets = rotation(qbytes)
    sets = weight_sets(N, K, n_sets)
    calls = calls_for(qbytes / (probe_gbps * 1e9), n_sets)
    times = {kernel: {} for kernel in KERNELS}
    for T in rows_of_x:
        x_q, x_d = activation("int8", T, K)
        out = torch.empty(T, N, device="cuda")

        def step(i, x_q=x_q, x_d=x_d, out=out):
            torch.ops.qwen38.q8_0_gemv_int8(x_q, x_d, *sets[i % n_sets], out)

        for kernel in KERNELS:
            os.environ["QWEN38_Q8_GEMV_ROWS_KERNEL"] = kernel  # read at each call: the capture keeps this form
            try:
                times[kernel][T] = time_graph(step, calls)["median_s"]
            finally:
                os.environ.pop("QWEN38_Q8_GEMV_ROWS_KERNEL")
    del sets
    torch.cuda.empty_cache()
    return qbytes, times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts T (1 is always measured)")
    parser.add_argument("--shapes", help="indices into TOKEN_SHAPES (default all)")
    args = parser.parse_args(argv)
    rows_of_x = sorted({1, *(int(t) for t in args.rows.split(","))})
    picked = [TOKEN_SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else TOKEN_SHAPES

    info = env_info()
    info["QWEN38_Q8_GEMV_ROWS_FROM"] = os.environ.get("QWEN38_Q8_GEMV_ROWS_FROM", "")
    print(f"{info.get('gpu')}  torch {info['torch']}  CUDA {info['cuda']}  commit {info['commit']}  {info['date']}")
    probe = read_probe_result()
    gbps = probe["best_gbps"]
    print(f"streaming-read probe: {gbps:.0f} GB/s", flush=True)
    table, token = [], {kernel: {T: 0.0 for T in rows_of_x} for kernel in KERNELS}
    for (N, K), label, count in picked:
        qbytes, times = bench_shape(N, K, gbps, rows_of_x)
        for kernel in KERNELS:
            for T, t in times[kernel].items():
                token[kernel][T] += count * t
                table.append({"shape": f"{N}x{K}", "what": label, "kernel": kernel, "T": T, "us": t * 1e6,
                              "%probe": 100 * qbytes / t / 1e9 / gbps, "x_T1": t / times[kernel][1]})
        print_table([r for r in table if r["shape"] == f"{N}x{K}"],
                    ["shape", "what", "kernel", "T", "us", "%probe", "x_T1"])
    totals = [{"kernel": kernel, "T": T, "token_ms": t * 1e3, "x_T1": t / token[kernel][1], "rows_per_ms": T / (t * 1e3)}
              for kernel in KERNELS for T, t in token[kernel].items()]
    for kernel in KERNELS:
        print_table([r for r in totals if r["kernel"] == kernel], ["kernel", "T", "token_ms", "x_T1", "rows_per_ms"],
                    title=f"kernel={kernel}: the token's matrices (each shape times its count), against T = 1")
    write_json(args.json, {"env": info, "read_probe": probe, "shapes": table, "token": totals})


if __name__ == "__main__":
    main()
