"""Q8_0 GEMV at the 27B decode shapes: every activation lane at T = 1, 2, 3, 4, 5, 8; PDL off and every compiled config.

    python3 -m benchmarks.ops.bench_q8_gemv --json PATH [--no-sweep]

Per (shape, lane, T): time per launch inside one captured CUDA graph of many launches (as decode runs it;
T > 1 is the speculative verify's k + 1 rows: x_T1 near 1 means the T rows cost one weight pass),
weights rotated over >= 1 GiB of distinct sets per shape (a set comes round again only after 17x the 60 MB
L2 has streamed past: no launch finds its weights in L2), the achieved GB/s of weight + scale bytes, its
% of the streaming-read probe measured in the same process, the time over the same lane's T = 1 time, and
torch's own bf16 matmul at the same shape and T (the in-run peer; it reads 2 bytes per weight against
Q8_0's 1.0625, so its time ratio is the number to compare, not its GB/s).

Also a decode-like pair, add_rms_norm (+ int8 quant) -> GEMV, to show what PDL buys between a producer and
its GEMV: the GEMV's first weight loads overlap the norm.

QWEN38_PDL and QWEN38_Q8_GEMV_CONFIG are read once per process (a captured graph keeps what it was captured
with), so PDL off and each compiled config run in a child process of this script (at T = 1), each with its
own probe; the parent's rows say what the default config and PDL on give, and what the variants gave.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from benchmarks.ops.common import env_info, print_table, read_probe_result, time_graph, write_json

ops = torch.ops.qwen38

SHAPES_27B = [  # [N, K] and what they are in the 27B model
    ((16384, 5120), "GDN q|k|v|z"),
    ((34816, 5120), "FFN gate|up"),
    ((14336, 5120), "attn q|gate|k|v"),
    ((5120, 6144), "GDN/attn out"),
    ((5120, 17408), "FFN down"),
    ((248320, 5120), "LM head"),
]
# trip,parts: the configs compiled in csrc/kernels/q8_gemv.h (QWEN38_Q8_GEMV_CONFIGS)
CONFIGS = ["2,1", "2,4", "1,1", "1,4"]
LANES = ["int8", "int8x2", "f32"]
ROWS = (1, 2, 3, 4, 5, 8)
ROTATION_BYTES = 1 << 30
MIN_GRAPH_SECONDS = 2e-3
_REPO = pathlib.Path(__file__).resolve().parents[2]


def weight_sets(N, K, count, dtype=None):
    """`count` distinct random weight sets: Q8_0 (int8 quants, fp16 scales), or one dense `dtype` tensor."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    if dtype is not None:
        return [torch.randn(N, K, generator=g, device="cuda", dtype=dtype) for _ in range(count)]
    sets = []
    for _ in range(count):
        q = torch.randint(-127, 128, (N, K), generator=g, device="cuda", dtype=torch.int8)
        d = (torch.rand(N, K // 32, generator=g, device="cuda") * 0.01).half()
        sets.append((q, d))
    return sets


def rotation(nbytes):
    """Sets of `nbytes` each that make >= ROTATION_BYTES (two at least: no launch reads the set before it)."""
    return max(2, math.ceil(ROTATION_BYTES / nbytes))


def activation(lane, T, K):
    g = torch.Generator(device="cuda").manual_seed(K)
    if lane == "f32":
        return (torch.randn(T, K, generator=g, device="cuda"),)
    x_q = torch.randint(-127, 128, (T, K), generator=g, device="cuda", dtype=torch.int8)
    x_d = (torch.rand(T, K // 32, generator=g, device="cuda") * 0.05).half().float()
    if lane == "int8":
        return x_q, x_d
    return x_q, torch.randint(-64, 65, (T, K), generator=g, device="cuda", dtype=torch.int8), x_d


def op_for(lane):
    return {"f32": ops.q8_0_gemv, "int8": ops.q8_0_gemv_int8, "int8x2": ops.q8_0_gemv_int8x2}[lane]


def calls_for(seconds_per_call, sets):
    reps = max(1, math.ceil(MIN_GRAPH_SECONDS / seconds_per_call / sets))
    return reps * sets


def bench_shape(N, K, label, probe_gbps, rows_of_x, with_torch):
    """One row per (lane, T): the GEMV in a graph over the rotated sets; with_torch adds torch's bf16 matmul."""
    qbytes = N * K + N * (K // 32) * 2
    n_sets = rotation(qbytes)
    sets = weight_sets(N, K, n_sets)
    calls = calls_for(qbytes / (probe_gbps * 1e9), n_sets)
    rows = []
    for lane in LANES:
        for T in rows_of_x:
            act = activation(lane, T, K)
            out = torch.empty(T, N, device="cuda")
            op = op_for(lane)

            def step(i, act=act, op=op, out=out):
                op(*act, *sets[i % n_sets], out)

            t = time_graph(step, calls)
            gbps = qbytes / t["median_s"] / 1e9
            rows.append({"shape": f"{N}x{K}", "what": label, "lane": lane, "T": T, "us": t["median_s"] * 1e6,
                         "us_min": t["min_s"] * 1e6, "GB/s": gbps, "%probe": 100 * gbps / probe_gbps,
                         "weight_sets": n_sets})
    one_row = {r["lane"]: r["us"] for r in rows if r["T"] == 1}
    for r in rows:
        r["x_T1"] = r["us"] / one_row[r["lane"]] if r["lane"] in one_row else float("nan")
    del sets
    torch.cuda.empty_cache()
    if with_torch:
        bench_torch_bf16(N, K, probe_gbps, rows)
    return rows


def bench_torch_bf16(N, K, probe_gbps, rows):
    """torch's bf16 matmul (= F.linear into a fixed buffer) at the same shape and T, same rotation."""
    bbytes = N * K * 2
    n_sets = rotation(bbytes)
    sets = weight_sets(N, K, n_sets, dtype=torch.bfloat16)
    calls = calls_for(bbytes / (probe_gbps * 1e9), n_sets)
    for T in sorted({r["T"] for r in rows}):
        xb = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        outb = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)

        def step(i, xb=xb, outb=outb):
            torch.matmul(xb, sets[i % n_sets].t(), out=outb)

        t = time_graph(step, calls)
        for r in rows:
            if r["T"] == T:
                r["torch_bf16_us"] = t["median_s"] * 1e6
                r["torch_bf16_%probe"] = 100 * bbytes / t["median_s"] / 1e9 / probe_gbps
                r["speedup_vs_torch"] = r["torch_bf16_us"] / r["us"]
    del sets
    torch.cuda.empty_cache()


def bench_norm_then_gemv(probe_gbps):
    """add_rms_norm (+int8 quant) -> int8 GEMV [16384, 5120], as a layer entry runs it, and the GEMV alone."""
    N, K = 16384, 5120
    qbytes = N * K + N * (K // 32) * 2
    n_sets = rotation(qbytes)
    sets = weight_sets(N, K, n_sets)
    res = torch.randn(1, K, device="cuda")
    x = torch.randn(1, K, device="cuda") * 1e-3  # keeps the residual stream bounded over many replays
    w = torch.rand(K, device="cuda") + 0.5
    n = torch.empty(1, K, device="cuda")
    q = torch.empty(1, K, device="cuda", dtype=torch.int8)
    d = torch.empty(1, K // 32, device="cuda")
    out = torch.empty(1, N, device="cuda")

    def pair(i):
        ops.add_rms_norm(res, x, w, 1e-6, n, q, None, d)
        ops.q8_0_gemv_int8(q, d, *sets[i % n_sets], out)

    def gemv_only(i):
        ops.q8_0_gemv_int8(q, d, *sets[i % n_sets], out)

    calls = calls_for(qbytes / (probe_gbps * 1e9), n_sets)
    result = {name: time_graph(fn, calls)["median_s"] * 1e6 for name, fn in (("pair_us", pair),
                                                                               ("gemv_us", gemv_only))}
    del sets
    torch.cuda.empty_cache()
    return result


def measure(rows_of_x, with_torch):
    """Everything, with the config and PDL setting this process has: the probe first, then every shape."""
    probe = read_probe_result()
    gbps = probe["best_gbps"]
    print(f"streaming-read probe: {gbps:.0f} GB/s (best of {len(probe['configs'])} grid shapes, "
          f"{probe['size_bytes'] / 2**30:.0f} GiB)", flush=True)
    rows = []
    for (N, K), label in SHAPES_27B:
        shape_rows = bench_shape(N, K, label, gbps, rows_of_x, with_torch)
        print_table(shape_rows, ["shape", "what", "lane", "T", "us", "GB/s", "%probe", "x_T1"])
        rows += shape_rows
    return {"read_probe": probe, "gemv": rows, "norm_then_gemv": bench_norm_then_gemv(gbps)}


def run_variant(env):
    """measure() at T = 1 in a child process with `env` added to the environment (its own probe)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "variant.json"
        cmd = [sys.executable, "-m", "benchmarks.ops.bench_q8_gemv", "--variant", "--json", str(path)]
        print(f"variant {env}: {' '.join(cmd[1:])}", flush=True)
        done = subprocess.run(cmd, cwd=_REPO, env={**os.environ, **env}, capture_output=True, text=True)
        if done.returncode != 0:
            return {"env": env, "error": (done.stdout + done.stderr)[-2000:]}
        return {"env": env, **json.loads(path.read_text())}


def summarize(rows, variants):
    """Adds to each T = 1 row: the time with PDL off, every variant's time and % of its own probe, the best."""
    for r in rows:
        if r["T"] != 1:
            continue
        r["variants"] = []
        for v in variants:
            match = [o for o in v.get("gemv", []) if (o["shape"], o["lane"], o["T"]) == (r["shape"], r["lane"], 1)]
            if match:
                r["variants"].append({**v["env"], "us": match[0]["us"], "%probe": match[0]["%probe"]})
        r["us_noPDL"] = next((v["us"] for v in r["variants"] if v.get("QWEN38_PDL") == "0"), float("nan"))
        best = min(r["variants"], key=lambda v: v["us"], default=None)
        if best is not None and best["us"] < r["us"]:
            r.update(best_cfg=best.get("QWEN38_Q8_GEMV_CONFIG", "noPDL"), best_us=best["us"],
                     **{"best_%probe": best["%probe"]})
        else:
            r.update(best_cfg="default", best_us=r["us"], **{"best_%probe": r["%probe"]})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--no-sweep", action="store_true", help="PDL off as the only variant (no config sweep)")
    parser.add_argument("--variant", action="store_true",
                        help="internal: measure T = 1 only, with the environment as given, for the parent run")
    args = parser.parse_args()

    if args.variant:
        result = measure(rows_of_x=(1,), with_torch=False)
        pathlib.Path(args.json).write_text(json.dumps(result))
        return

    info = env_info()
    print(f"{info.get('gpu')}  torch {info['torch']}  CUDA {info['cuda']}  commit {info['commit']}  {info['date']}")
    result = measure(rows_of_x=ROWS, with_torch=True)
    envs = [{"QWEN38_PDL": "0"}] + ([] if args.no_sweep else [{"QWEN38_Q8_GEMV_CONFIG": c} for c in CONFIGS])
    variants = [run_variant(env) for env in envs]
    summarize(result["gemv"], variants)
    for v in variants:
        if "error" in v:
            print(f"variant {v['env']} failed:\n{v['error']}", flush=True)
    print("add_rms_norm(int8) -> int8 GEMV 16384x5120, us per pair / per GEMV alone (PDL on):",
          {k: round(t, 2) for k, t in result["norm_then_gemv"].items()},
          "| PDL off:", next((v.get("norm_then_gemv") for v in variants if v["env"] == {"QWEN38_PDL": "0"}), None),
          flush=True)
    print_table(result["gemv"], ["shape", "what", "lane", "T", "us", "GB/s", "%probe", "x_T1", "us_noPDL",
                                 "best_cfg", "best_us", "best_%probe", "torch_bf16_us", "speedup_vs_torch"],
                title="Q8_0 GEMV, default config, PDL on (graph of many launches, weights rotated over >= 1 GiB)")
    write_json(args.json, {"env": info, **result, "variants": variants})


if __name__ == "__main__":
    main()
