"""Gated attention ops at the 27B shape (Hq=24, Hkv=4, hd=256, rotary 64), decode (T=1).

attention: context 1k, 8k, 32k with a bfloat16 and a float32 KV cache, rotating over 16 layers' caches
(as the model does; 16 x 2 x ctx x 4 x 256 x 2|4 B >> the 60 MB L2). Figure of merit: KV bytes read per
second over the streaming-read probe. qk_norm_rope_store and the output gate are latency-bound (a few
tens of KB): reported as time per layer. Baseline: torch SDPA (enable_gqa) over the same bf16 cache. With the
bf16 cache also attention + attn_output_gate against attention_gated (the gate in the combine), per layer.

Run: python3 -m benchmarks.ops.bench_attention --json PATH
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.attention import workspace_numel

from .common import env_info, parse_args_and_probe, print_table, time_eager, time_graph, write_json

ops = torch.ops.qwen38

HQ, HKV, HD, ROT, THETA, EPS = 24, 4, 256, 64, 1e7, 1e-6
LAYERS = 16
CONTEXTS = (1024, 8192, 32768)


def bench_attention(probe_gbps: float) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HQ, HD, device="cuda", generator=g)
    out = torch.empty(1, HQ, HD, device="cuda")
    workspace = torch.empty(workspace_numel(1, HQ, HD), device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        for ctx in CONTEXTS:
            caches = [(torch.randn(ctx, HKV, HD, device="cuda", generator=g).to(dtype),
                       torch.randn(ctx, HKV, HD, device="cuda", generator=g).to(dtype)) for _ in range(LAYERS)]
            positions = torch.full((1,), ctx - 1, dtype=torch.int32, device="cuda")
            kv_bytes = 2 * ctx * HKV * HD * caches[0][0].element_size()

            def attention(i):
                k, v = caches[i % LAYERS]
                ops.attention(q, k, v, positions, HD**-0.5, out, workspace)

            t = time_graph(attention, LAYERS)["median_s"]
            gbps = kv_bytes / t / 1e9
            name = f"attention {str(dtype).replace('torch.', '')}"
            rows.append(dict(op=name, ctx=ctx, us_per_layer=t * 1e6, kv_bytes=kv_bytes, gbps=gbps,
                             ratio_vs_read_probe=gbps / probe_gbps))
            if dtype == torch.bfloat16:
                rows.append(sdpa_baseline(q, caches, ctx, kv_bytes, probe_gbps))
                rows.extend(gated_rows(q, caches, positions, ctx, workspace))
            del caches
            torch.cuda.empty_cache()
    return rows


def gated_rows(q, caches, positions, ctx, workspace) -> list[dict]:
    """attention then attn_output_gate (int8 lane), against attention_gated (the gate in the combine): the
    decode step's two launches against its one."""
    g = torch.Generator(device="cuda").manual_seed(2)
    qgkv = torch.randn(1, 2 * HQ * HD + 2 * HKV * HD, device="cuda", generator=g)
    attn = torch.empty(1, HQ, HD, device="cuda")
    outs = (torch.empty(1, HQ * HD, device="cuda"), torch.empty(1, HQ * HD, dtype=torch.int8, device="cuda"), None,
            torch.empty(1, HQ * HD // 32, device="cuda"))

    def separate(i):
        k, v = caches[i % LAYERS]
        ops.attention(q, k, v, positions, HD**-0.5, attn, workspace)
        ops.attn_output_gate(attn, qgkv, *outs)

    def fused(i):
        k, v = caches[i % LAYERS]
        ops.attention_gated(q, k, v, positions, HD**-0.5, qgkv, workspace, *outs)

    return [dict(op=name, ctx=ctx, us_per_layer=time_graph(step, LAYERS)["median_s"] * 1e6)
            for name, step in (("attention + attn_output_gate int8", separate), ("attention_gated int8", fused))]


def sdpa_baseline(q, caches, ctx, kv_bytes, probe_gbps) -> dict:
    """torch's fused attention over the same cache (views [1, Hkv, ctx, hd], GQA by enable_gqa)."""
    qb = q.to(torch.bfloat16).reshape(1, HQ, 1, HD)

    def sdpa(i):
        k, v = caches[i % LAYERS]
        F.scaled_dot_product_attention(qb, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], enable_gqa=True)

    row = dict(op="torch SDPA bf16 (baseline)", ctx=ctx, kv_bytes=kv_bytes)
    try:
        t = time_eager(sdpa, LAYERS)["median_s"]
        row.update(us_per_layer=t * 1e6, gbps=kv_bytes / t / 1e9, ratio_vs_read_probe=kv_bytes / t / 1e9 / probe_gbps)
    except Exception as exc:  # a torch without enable_gqa or a backend refusing the strides
        row.update(error=f"{type(exc).__name__}: {exc}"[:200])
    return row


def bench_small_ops() -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    width = 2 * HQ * HD + 2 * HKV * HD
    qgkv = torch.randn(1, width, device="cuda", generator=g)
    q_norm = 1 + 0.1 * torch.randn(HD, device="cuda", generator=g)
    k_norm = 1 + 0.1 * torch.randn(HD, device="cuda", generator=g)
    positions = torch.full((1,), 4000, dtype=torch.int32, device="cuda")
    q_out = torch.empty(1, HQ, HD, device="cuda")
    caches = [(torch.zeros(8192, HKV, HD, device="cuda", dtype=torch.bfloat16),
               torch.zeros(8192, HKV, HD, device="cuda", dtype=torch.bfloat16)) for _ in range(LAYERS)]

    def store(i):
        k, v = caches[i % LAYERS]
        ops.attn_qk_norm_rope_store(qgkv, q_norm, k_norm, positions, EPS, THETA, ROT, q_out, k, v)

    t = time_graph(store, LAYERS)["median_s"]
    rows.append(dict(op="attn_qk_norm_rope_store (bf16 cache)", us_per_layer=t * 1e6))

    attn = torch.randn(1, HQ, HD, device="cuda", generator=g)
    out = torch.empty(1, HQ * HD, device="cuda")
    out_q = torch.empty(1, HQ * HD, dtype=torch.int8, device="cuda")
    out_q_lo = torch.empty_like(out_q)
    out_d = torch.empty(1, HQ * HD // 32, device="cuda")
    lanes = (("f32", (None, None, None)), ("int8", (out_q, None, out_d)), ("int8x2", (out_q, out_q_lo, out_d)))
    for lane, extra in lanes:
        def gate(i, extra=extra):
            ops.attn_output_gate(attn, qgkv, out, *extra)

        rows.append(dict(op=f"attn_output_gate ({lane})", us_per_layer=time_graph(gate, LAYERS)["median_s"] * 1e6))
    return rows


def main() -> None:
    args, probe = parse_args_and_probe(__doc__)
    rows = bench_attention(probe["best_gbps"])
    print_table(rows, ["op", "ctx", "us_per_layer", "gbps", "ratio_vs_read_probe"],
                title=f"attention decode (T=1) at the 27B shape, rotating over {LAYERS} layers' caches (CUDA graph)")
    small = bench_small_ops()
    print_table(small, ["op", "us_per_layer"], title="latency-bound attention ops (CUDA graph of 16 launches)")
    write_json(args.json, dict(env=env_info(), read_probe=probe, shape=dict(Hq=HQ, Hkv=HKV, hd=HD, rotary_dim=ROT),
                               layers=LAYERS, attention=rows, small_ops=small))


if __name__ == "__main__":
    main()
