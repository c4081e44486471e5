"""attention_prefill at the 27B shape (Hq=24, Hkv=4, hd=256): causal prompt attention over the KV cache.

Cases: a prompt of T = 512, 2048, 8192 tokens from position 0, and a 512-token chunk at position 32256
(32k context), each with a bfloat16 and a float32 cache. Prefill attention is compute-bound; the figure of
merit is TFLOP/s counting 4 * T * ctx_avg * hd * Hq (two matmuls, 2 flops a multiply-add, ctx_avg = the mean
number of cache rows a query sees). In the same run, the peers:
- torch SDPA, flash backend, bf16 q/k/v with K/V repeat_interleave'd to Hq heads (materialized outside the
  timing), is_causal from position 0 and a lower-right causal mask for the chunk;
- qwen38 `attention` (the split-K decode kernel on CUDA cores), the op prefill used before this one.

Few rows over a long cache (issue 13: a 101-token turn after a 16k or 32k history): the split-K path the op
takes at T = 101 (6 splits) against the unsplit path in the same run. The unsplit path is reached by shape:
the same 101 tokens padded to the smallest T that runs unsplit (353 rows at 27B), the padding rows at
position -1 (they see no cache row, so their blocks take no tile), which is the work and the grid of the
unsplit kernel at T = 101. Rotating over 16 layers' caches (as the model does; >= 2 GB, far past the 60 MB
L2). Figures: TFLOP/s as above, and the K and V bytes of the context read once per call over the streaming-read
probe of this process (% of the cache-read roofline; these calls do ~600 FLOP a cache byte, so they are
compute-bound and the percentage stays well below 100).

Run: python3 -m benchmarks.ops.bench_attention_prefill --json PATH
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.attention import workspace_numel
from qwen38_ops.attention_prefill import num_splits
from qwen38_ops.attention_prefill import workspace_numel as prefill_workspace_numel

from .common import env_info, parse_args_and_probe, print_table, time_eager, write_json

ops = torch.ops.qwen38

HQ, HKV, HD = 24, 4, 256
CASES = ((512, 0), (2048, 0), (8192, 0), (512, 32256))  # (T, first position)
CALLS, REPLAYS = 3, 5
FEW_ROWS, HISTORIES, LAYERS = 101, (16384, 32768), 16


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
        prefill_ws = torch.empty(prefill_workspace_numel(T, HQ, HKV, HD), device="cuda")
        rows.append(timed_row("qwen38 attention_prefill",
                              lambda: ops.attention_prefill(q, kc, vc, positions, scale, out, prefill_ws),
                              T, first, name))
        workspace = torch.empty(workspace_numel(T, HQ, HD), device="cuda")
        rows.append(timed_row("qwen38 attention (split-K decode kernel)",
                              lambda: ops.attention(q, kc, vc, positions, scale, out, workspace), T, first, name))
        del kc, vc, workspace, prefill_ws
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


def unsplit_rows(T: int) -> int:
    """The smallest row count from T up that the op runs unsplit at the 27B shape."""
    while num_splits(T, HQ, HKV) > 1:
        T += 1
    return T


def bench_few_rows(history: int, probe_gbps: float) -> list[dict]:
    """T = FEW_ROWS tokens at positions history.. over LAYERS rotating caches: split vs unsplit, both dtypes."""
    T, padded = FEW_ROWS, unsplit_rows(FEW_ROWS)
    ctx = history + T
    g = torch.Generator(device="cuda").manual_seed(history)
    q = torch.zeros(padded, HQ, HD, device="cuda")
    q[:T] = torch.randn(T, HQ, HD, device="cuda", generator=g)
    positions = torch.full((padded,), -1, dtype=torch.int32, device="cuda")  # padding rows see no cache row
    positions[:T] = torch.arange(history, ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    workspace = torch.empty(prefill_workspace_numel(T, HQ, HKV, HD), device="cuda")
    scale = HD**-0.5
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        caches = [(torch.randn(ctx, HKV, HD, device="cuda", generator=g).to(dtype),
                   torch.randn(ctx, HKV, HD, device="cuda", generator=g).to(dtype)) for _ in range(LAYERS)]
        kv_bytes = 2 * ctx * HKV * HD * caches[0][0].element_size()
        name = str(dtype).replace("torch.", "")

        def split(i):
            k, v = caches[i % LAYERS]
            ops.attention_prefill(q[:T], k, v, positions[:T], scale, out[:T], workspace)

        def unsplit(i):
            k, v = caches[i % LAYERS]
            ops.attention_prefill(q, k, v, positions, scale, out, workspace[:0])

        for op, fn, rows_launched in (("split-K", split, T), (f"unsplit (T padded to {padded})", unsplit, padded)):
            t = time_eager(fn, LAYERS, replays=REPLAYS)["median_s"]
            gbps = kv_bytes / t / 1e9
            rows.append(dict(op=f"qwen38 attention_prefill {op}", cache=name, T=T, first=history,
                             splits=num_splits(rows_launched, HQ, HKV), ms=t * 1e3, tflops=flops(T, history) / t / 1e12,
                             kv_gbps=gbps, pct_of_read_probe=100 * gbps / probe_gbps))
        rows[-2]["speedup"] = rows[-1]["ms"] / rows[-2]["ms"]
        del caches
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    args, probe = parse_args_and_probe(__doc__)
    rows = [row for T, first in CASES for row in bench_case(T, first)]
    print_table(rows, ["op", "cache", "T", "first", "ms", "tflops", "vs_sdpa", "error"],
                title=f"attention prefill at the 27B shape (Hq={HQ}, Hkv={HKV}, hd={HD}), eager, median of "
                      f"{REPLAYS} x {CALLS} calls")
    few = [row for history in HISTORIES for row in bench_few_rows(history, probe["best_gbps"])]
    print_table(few, ["op", "cache", "T", "first", "splits", "ms", "tflops", "kv_gbps", "pct_of_read_probe", "speedup"],
                title=f"T = {FEW_ROWS} over a long cache, {LAYERS} layers' caches rotated, eager, median of "
                      f"{REPLAYS} x {LAYERS} calls (speedup: split-K over unsplit)")
    write_json(args.json, dict(env=env_info(), read_probe=probe, shape=dict(Hq=HQ, Hkv=HKV, hd=HD), cases=CASES,
                               rows=rows, few_rows=few))


if __name__ == "__main__":
    main()
