"""attention_prefill at the 27B shape (Hq=24, Hkv=4, hd=256): causal prompt attention over the KV cache.

Cases: a prompt of T = 512, 2048, 8192 tokens from position 0, and a 512-token chunk at position 32256
(32k context), each with a bfloat16 and a float32 cache. Prefill attention is compute-bound; the figure of
merit is TFLOP/s counting 4 * T * ctx_avg * hd * Hq (two matmuls, 2 flops a multiply-add, ctx_avg = the mean
number of cache rows a query sees). In the same run, the peers:
- torch SDPA, flash backend, bf16 q/k/v with K/V repeat_interleave'd to Hq heads (materialized outside the
  timing), is_causal from position 0 and a lower-right causal mask for the chunk;
- qwen38 `attention` (the split-K decode kernel on CUDA cores), the op prefill used before this one.

Run: python3 -m benchmarks.ops.bench_attention_prefill --json PATH
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import qwen38_ops  # noqa: F401
from qwen38_ops.attention import workspace_numel

from .common import env_info, print_table, time_eager, write_json

ops = torch.ops.qwen38

HQ, HKV, HD = 24, 4, 256
CASES = ((512, 0), (2048, 0), (8192, 0), (512, 32256))  # (T, first position)
CALLS, REPLAYS = 3, 5


def flops(T: int, first: int) -> float:
    ctx_avg = first + (T + 1) / 2  # query t sees first + t + 1 rows
    return 4 * T * ctx_avg * HD * HQ


def timed_row(name: str, fn, T: int, first: int, cache: str) -> dict:
    row = dict(op=name, cache=cache, T=T, first=first)
    try:
        t = time_eager(lambda i: fn(), CALLS, replays=REPLAYS)["median_s"]
        row.update(ms=t * 1e3, tflops=flops(T, first) / t / 1e12)
    except Exception as exc:  # a backend refusing the shape or the mask
        row.update(error=f"{type(exc).__name__}: {exc}"[:200])
    return row


def bench_case(T: int, first: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(T + first)
    ctx = first + T
    q = torch.randn(T, HQ, HD, device="cuda", generator=g)
    k = torch.randn(ctx, HKV, HD, device="cuda", generator=g)
    v = torch.randn(ctx, HKV, HD, device="cuda", generator=g)
    positions = torch.arange(first, ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    scale = HD**-0.5
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        kc, vc = k.to(dtype), v.to(dtype)
        name = str(dtype).replace("torch.", "")
        rows.append(timed_row("qwen38 attention_prefill", lambda: ops.attention_prefill(q, kc, vc, positions, scale, out),
                              T, first, name))
        workspace = torch.empty(workspace_numel(T, HQ, HD), device="cuda")
        rows.append(timed_row("qwen38 attention (split-K decode kernel)",
                              lambda: ops.attention(q, kc, vc, positions, scale, out, workspace), T, first, name))
        del kc, vc, workspace
    rows.append(sdpa_row(q, k, v, T, first))
    del q, k, v
    torch.cuda.empty_cache()
    base = {r["cache"]: r for r in rows if r["op"].startswith("torch") and "ms" in r}
    for r in rows:
        if "ms" in r and "bfloat16" in base:
            r["vs_sdpa"] = base["bfloat16"]["ms"] / r["ms"]
    return rows


def sdpa_row(q, k, v, T: int, first: int) -> dict:
    qb = q.to(torch.bfloat16).transpose(0, 1)[None]  # [1, Hq, T, hd]
    kb = k.to(torch.bfloat16).repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]  # [1, Hq, ctx, hd]
    vb = v.to(torch.bfloat16).repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)[None]
    mask = None if first == 0 else causal_lower_right(T, first + T)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            if mask is None:
                F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
            else:
                F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask)

    return timed_row("torch SDPA flash bf16 (baseline)", sdpa, T, first, "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    rows = [row for T, first in CASES for row in bench_case(T, first)]
    print_table(rows, ["op", "cache", "T", "first", "ms", "tflops", "vs_sdpa", "error"],
                title=f"attention prefill at the 27B shape (Hq={HQ}, Hkv={HKV}, hd={HD}), eager, median of "
                      f"{REPLAYS} x {CALLS} calls")
    write_json(args.json, dict(env=env_info(), shape=dict(Hq=HQ, Hkv=HKV, hd=HD), cases=CASES, rows=rows))


if __name__ == "__main__":
    main()
