"""The GEMV-input producers at the 27B decode shapes (T = 1): D = 5120, F = 17408, 48 heads of 128.

    python3 -m benchmarks.ops.bench_norm_quant --json PATH

These are latency-bound (tens of KB each), so the figure is the time per launch inside one captured CUDA
graph of many back-to-back launches of the same op, in each output lane (f32 only, + int8, + two-word),
with PDL on and off. The inputs stay L2-resident, as in decode where the previous kernel just wrote them.
In-run peer: torch's own F.rms_norm / F.silu(g) * u in the same kind of graph (f32 out only).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from benchmarks.ops.bench_q8_gemv import env_vars
from benchmarks.ops.common import env_info, print_table, time_graph, write_json

ops = torch.ops.qwen38
D, FF, HEADS, DV = 5120, 17408, 48, 128
EPS = 1e-6
CALLS = 200


def lane_buffers(lane, width):
    if lane == "f32":
        return None, None, None
    q = torch.empty(1, width, device="cuda", dtype=torch.int8)
    lo = torch.empty_like(q) if lane == "int8x2" else None
    return q, lo, torch.empty(1, width // 32, device="cuda")


def cases():
    x = torch.randn(1, D, device="cuda")
    res = torch.randn(1, D, device="cuda")
    small = torch.randn(1, D, device="cuda") * 1e-4  # residual += small stays bounded over many replays
    w = torch.rand(D, device="cuda") + 0.5
    gate_up = torch.randn(1, 2 * FF, device="cuda")
    h = torch.randn(1, FF, device="cuda")
    g_x, g_z = torch.randn(1, HEADS * DV, device="cuda"), torch.randn(1, HEADS * DV, device="cuda")
    g_w = torch.rand(DV, device="cuda") + 0.5
    out_d, out_f, out_g = (torch.empty(1, n, device="cuda") for n in (D, FF, HEADS * DV))
    for lane in ("f32", "int8", "int8x2"):
        qd, qf, qg = lane_buffers(lane, D), lane_buffers(lane, FF), lane_buffers(lane, HEADS * DV)
        yield "rms_norm", D, lane, lambda qd=qd: ops.rms_norm(x, w, EPS, out_d, *qd)
        yield "add_rms_norm", D, lane, lambda qd=qd: ops.add_rms_norm(res, small, w, EPS, out_d, *qd)
        yield "silu_mul", FF, lane, lambda qf=qf: ops.silu_mul(gate_up, out_f, *qf)
        yield "gated_rms_norm", HEADS * DV, lane, lambda qg=qg: ops.gated_rms_norm(g_x, g_z, g_w, EPS, out_g, *qg)
        if lane != "f32":
            yield "quantize_act", FF, lane, lambda qf=qf: ops.quantize_act(h, qf[0], qf[1], qf[2])
    yield "torch F.rms_norm", D, "f32", lambda: F.rms_norm(x, (D,), w, EPS)
    yield "torch silu(g)*u", FF, "f32", lambda: F.silu(gate_up[:, :FF]) * gate_up[:, FF:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    info = env_info()
    print(f"{info.get('gpu')}  torch {info['torch']}  CUDA {info['cuda']}  commit {info['commit']}  {info['date']}")
    rows = []
    for name, width, lane, fn in cases():
        row = {"op": name, "width": width, "lane": lane}
        for pdl in ("1", "0"):
            with env_vars(QWEN38_PDL=pdl):
                try:
                    row[f"us_pdl{pdl}"] = time_graph(lambda i: fn(), CALLS)["median_s"] * 1e6
                except RuntimeError as e:
                    row[f"error_pdl{pdl}"] = str(e)[:200]
        rows.append(row)
    print_table(rows, ["op", "width", "lane", "us_pdl1", "us_pdl0"],
                title=f"producers, T = 1: us per launch in a graph of {CALLS} launches (PDL on / off)")
    write_json(args.json, {"env": info, "producers": rows, "calls_per_graph": CALLS})


if __name__ == "__main__":
    main()
