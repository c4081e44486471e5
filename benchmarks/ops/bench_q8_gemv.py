"""Q8_0 GEMV at the 27B decode shapes: every activation lane, every compiled config, PDL on and off.

    python3 -m benchmarks.ops.bench_q8_gemv --json PATH [--no-sweep]

Per (shape, lane): time per launch inside one captured CUDA graph of many launches (as decode runs it),
weights rotated over enough sets that nothing is L2-resident (>= 4 sets and >= 4x the 60 MB L2), the
achieved GB/s of weight + scale bytes, its ratio over the streaming-read probe measured in the same run,
and the ratio over torch's own bf16 F.linear at the same shape (the in-run peer; it reads 2 bytes per
weight against Q8_0's 1.0625, so its time ratio is the number to compare, not its GB/s).

Also a decode-like pair, add_rms_norm (+ int8 quant) -> GEMV, to show what PDL buys between a producer and
its GEMV: the GEMV's first weight loads overlap the norm.
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

import qwen38_ops  # noqa: F401  (registers torch.ops.qwen38.*)
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
# pieces,split,rows: the configs compiled in csrc/kernels/q8_gemv.h (QWEN38_Q8_GEMV_CONFIGS)
CONFIGS = ["4,1,2", "4,4,1", "8,1,1", "16,1,1", "8,2,1", "4,2,2", "2,1,4"]
LANES = ["int8", "int8x2", "f32"]
L2_BYTES = 60e6
MIN_GRAPH_SECONDS = 2e-3


class env_vars:
    """Set environment variables the bindings read at each call (config, PDL) for one measurement."""

    def __init__(self, **values):
        self.values = {k: v for k, v in values.items()}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        for k, v in self.values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def weight_sets(N, K, count):
    g = torch.Generator(device="cuda").manual_seed(N + K)
    sets = []
    for _ in range(count):
        q = torch.randint(-127, 128, (N, K), generator=g, device="cuda", dtype=torch.int8)
        d = (torch.rand(N, K // 32, generator=g, device="cuda") * 0.01).half()
        sets.append((q, d))
    return sets


def activation(lane, K):
    g = torch.Generator(device="cuda").manual_seed(K)
    if lane == "f32":
        return (torch.randn(1, K, generator=g, device="cuda"),)
    x_q = torch.randint(-127, 128, (1, K), generator=g, device="cuda", dtype=torch.int8)
    x_d = torch.rand(1, K // 32, generator=g, device="cuda") * 0.05
    if lane == "int8":
        return x_q, x_d
    return x_q, torch.randint(-64, 65, (1, K), generator=g, device="cuda", dtype=torch.int8), x_d


def op_for(lane):
    return {"f32": ops.q8_0_gemv, "int8": ops.q8_0_gemv_int8, "int8x2": ops.q8_0_gemv_int8x2}[lane]


def calls_for(seconds_per_call, sets):
    reps = max(1, math.ceil(MIN_GRAPH_SECONDS / seconds_per_call / sets))
    return reps * sets


def bench_shape(N, K, label, probe_gbps, sweep):
    qbytes = N * K + N * (K // 32) * 2
    n_sets = max(4, math.ceil(4 * L2_BYTES / qbytes))
    sets = weight_sets(N, K, n_sets)
    out = torch.empty(1, N, device="cuda")
    calls = calls_for(qbytes / (probe_gbps * 1e9), n_sets)
    rows = []

    for lane in LANES:
        act = activation(lane, K)
        op = op_for(lane)

        def step(i, act=act, op=op):
            op(*act, *sets[i % n_sets], out)

        variants = [(None, "1"), (None, "0")] + ([(c, "1") for c in CONFIGS] if sweep else [])
        results = []
        for config, pdl in variants:
            with env_vars(QWEN38_Q8_GEMV_CONFIG=config, QWEN38_PDL=pdl):
                try:
                    t = time_graph(step, calls)
                except RuntimeError as e:  # a config the build does not have: record, keep going
                    results.append({"config": config, "pdl": pdl, "error": str(e)[:200]})
                    continue
            results.append({"config": config or "default", "pdl": pdl == "1", "us": t["median_s"] * 1e6,
                            "us_min": t["min_s"] * 1e6, "gbps": qbytes / t["median_s"] / 1e9,
                            "of_probe": qbytes / t["median_s"] / 1e9 / probe_gbps})
        ok = [r for r in results if "us" in r]
        row = {"shape": f"{N}x{K}", "what": label, "lane": lane, "variants": results}
        if ok:
            defaults = [r for r in ok if r["config"] == "default"]
            default = next((r for r in defaults if r["pdl"]), defaults[0] if defaults else ok[0])
            best = min(ok, key=lambda r: r["us"])
            row.update({"us": default["us"], "GB/s": default["gbps"], "%probe": 100 * default["of_probe"],
                        "us_noPDL": next((r["us"] for r in defaults if not r["pdl"]), float("nan")),
                        "best_cfg": f"{best['config']}{'' if best['pdl'] else ' noPDL'}", "best_us": best["us"],
                        "best_%probe": 100 * best["of_probe"]})
        rows.append(row)

    # torch's bf16 F.linear at the same shape, same rotation discipline (its own bytes: 2 per weight).
    del sets
    torch.cuda.empty_cache()
    bbytes = N * K * 2
    n_bsets = max(4, math.ceil(4 * L2_BYTES / bbytes))
    g = torch.Generator(device="cuda").manual_seed(1)
    bsets = [torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(n_bsets)]
    xb = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    outb = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)

    def torch_step(i):
        torch.matmul(xb, bsets[i % n_bsets].t(), out=outb)  # = F.linear(xb, W) written into a fixed buffer

    assert torch.equal(F.linear(xb, bsets[0]), xb @ bsets[0].t())
    t = time_graph(torch_step, calls_for(bbytes / (probe_gbps * 1e9), n_bsets))
    torch_us = t["median_s"] * 1e6
    for r in rows:
        r["torch_bf16_us"] = torch_us
        r["torch_bf16_%probe"] = 100 * bbytes / t["median_s"] / 1e9 / probe_gbps
        r["speedup_vs_torch"] = torch_us / r["us"] if "us" in r else float("nan")
    del bsets
    torch.cuda.empty_cache()
    return rows


def bench_norm_then_gemv(probe_gbps):
    """add_rms_norm (+int8 quant) -> int8 GEMV [16384, 5120], as a layer entry runs it; PDL on vs off."""
    N, K = 16384, 5120
    qbytes = N * K + N * (K // 32) * 2
    n_sets = max(4, math.ceil(4 * L2_BYTES / qbytes))
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
    result = {}
    for pdl in ("1", "0"):
        with env_vars(QWEN38_PDL=pdl):
            for name, fn in (("pair", pair), ("gemv", gemv_only)):
                try:
                    result[f"{name}_us_pdl{pdl}"] = time_graph(fn, calls)["median_s"] * 1e6
                except RuntimeError as e:
                    result[f"{name}_error_pdl{pdl}"] = str(e)[:200]
    del sets
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--no-sweep", action="store_true", help="only the default config (PDL on and off)")
    args = parser.parse_args()

    info = env_info()
    probe = read_probe_result()
    gbps = probe["best_gbps"]
    print(f"{info.get('gpu')}  torch {info['torch']}  CUDA {info['cuda']}  commit {info['commit']}  {info['date']}")
    print(f"streaming-read probe: {gbps:.0f} GB/s (best of {len(probe['configs'])} grid shapes, "
          f"{probe['size_bytes'] / 2**30:.0f} GiB)\n", flush=True)

    rows = []
    for (N, K), label in SHAPES_27B:
        rows += bench_shape(N, K, label, gbps, sweep=not args.no_sweep)
        print_table(rows[-len(LANES):], ["shape", "what", "lane", "us", "GB/s", "%probe", "us_noPDL", "best_cfg",
                                         "best_us", "best_%probe", "torch_bf16_us", "speedup_vs_torch"])
    pair = bench_norm_then_gemv(gbps)
    print("add_rms_norm(int8) -> int8 GEMV 16384x5120, us per pair / per GEMV alone:",
          {k: round(v, 2) if isinstance(v, float) else v for k, v in pair.items()}, flush=True)

    print_table(rows, ["shape", "what", "lane", "us", "GB/s", "%probe", "us_noPDL", "best_cfg", "best_us",
                       "best_%probe", "torch_bf16_us", "torch_bf16_%probe", "speedup_vs_torch"],
                title="Q8_0 GEMV, T = 1, default config, PDL on (graph of many launches, weights rotated)")
    write_json(args.json, {"env": info, "read_probe": probe, "gemv": rows, "norm_then_gemv": pair})


if __name__ == "__main__":
    main()
