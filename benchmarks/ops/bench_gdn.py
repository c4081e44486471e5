"""Gated DeltaNet ops at the 27B shape (Hk=16, Hv=48, dk=dv=128, C=10240), rotating over 48 layers'
states so nothing measured is L2-resident (48 x 6.3 MB of recurrent state = 302 MB read+written, against
the H200's 60 MB L2). pdl=1|0: with and without programmatic dependent launch (csrc/kernels/pdl.cuh).
QWEN38_PDL is read once per process, so a run measures the setting it started with (every row says which):
run again with QWEN38_PDL=0 for the figures without PDL.

Three sections. Decode (T = 1, 4, 16): the figures below. Prefill (T = 8, 32, 512, 4096): each op of the
GDN core (conv, gates, recurrent, and the three in model order) as one layer would run it on a prompt
chunk of T tokens, graph-replayed over the 48 layers' states; us_per_token = us_per_layer / T, the number
to hold against prefill's ~1.3 us per token per layer for the whole GDN core (b6f1a55, pp4096). From T = 8
gdn_recurrent runs the chunked kernel (threshold in csrc/cuda_bindings/gdn.cpp; one chunk costs about the
same for any T <= 16): its T = 8 row against the decode rows at T = 1 and 4 (token by token) places the
threshold. Verify (T = 1..8): gdn_recurrent as speculative decoding's verify runs it, with token_states
(the per-token kernel for any T, writing T x 3.1 MB more a layer; a buffer per layer, so those writes
reach memory as the model's would) and without (T = 8 runs the chunked kernel); bytes = the state read
and written once plus the token states written.

The recurrent step is memory-bound: it reads and writes the float32 state once (48*128*128*4 B = 3.1 MB
each way per layer). Its figure of merit is state bytes (read + written) per second over the streaming
read probe; the target is >= 60% (the earlier implementation: 4.9 us a layer, 28%). conv and gates move
a few hundred KB and are launch/latency-bound: reported as time per layer.

Run: python3 -m benchmarks.ops.bench_gdn --json PATH
"""
from __future__ import annotations

import os

import torch

import qwen38_ops  # noqa: F401
from qwen38_ops.reference import gdn as ref

from .common import env_info, parse_args_and_probe, print_table, time_eager, time_graph, write_json

ops = torch.ops.qwen38

HK, HV, DK, DV, TAPS = 16, 48, 128, 128, 4
C = 2 * HK * DK + HV * DV
LAYERS = 48
PREFILL_TOKENS = (8, 32, 512, 4096)
PREFILL_REPLAYS = 3  # a T = 4096 replay of the per-token recurrence: ~0.25 s (252 ms GDN core, b6f1a55)
VERIFY_TOKENS = range(1, 9)  # a verify checks k + 1 <= 8 tokens
PDL = "0" if os.environ.get("QWEN38_PDL", "").startswith("0") else "1"  # pdl.cuh's reading of it


def make_layers(num_tokens: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(HV, DV, DK, device="cuda", generator=g) * 0.1 for _ in range(LAYERS)]
    conv_states = [torch.randn(TAPS - 1, C, device="cuda", generator=g) for _ in range(LAYERS)]
    conv_weights = [torch.randn(C, TAPS, device="cuda", generator=g) * 0.5 for _ in range(LAYERS)]
    qkv = torch.randn(num_tokens, C, device="cuda", generator=g)
    conv_out = torch.empty_like(qkv)
    ops.gdn_conv(qkv, conv_states[0].clone(), conv_weights[0], HK, DK, conv_out)  # unit-norm q, k heads
    ba = torch.randn(num_tokens, 2 * HV, device="cuda", generator=g)
    a_neg = -torch.exp(torch.randn(HV, device="cuda", generator=g) - 2)
    dt_bias = torch.randn(HV, device="cuda", generator=g)
    beta = torch.empty(num_tokens, HV, device="cuda")
    decay = torch.empty(num_tokens, HV, device="cuda")
    ops.gdn_gates(ba, a_neg, dt_bias, beta, decay)
    out = torch.empty(num_tokens, HV, DV, device="cuda")
    return dict(states=states, conv_states=conv_states, conv_weights=conv_weights, qkv=qkv, conv_out=conv_out,
                ba=ba, a_neg=a_neg, dt_bias=dt_bias, beta=beta, decay=decay, out=out)


def bench_prefill() -> list[dict]:
    """Per op and per layer, the GDN core on a prompt chunk of T tokens (graph-replayed, 48 layers' states)."""
    rows = []
    for num_tokens in PREFILL_TOKENS:
        L = make_layers(num_tokens)

        def conv(i):
            ops.gdn_conv(L["qkv"], L["conv_states"][i % LAYERS], L["conv_weights"][i % LAYERS], HK, DK, L["conv_out"])

        def gates(i):
            ops.gdn_gates(L["ba"], L["a_neg"], L["dt_bias"], L["beta"], L["decay"])

        def recurrent(i):
            ops.gdn_recurrent(L["conv_out"], L["beta"], L["decay"], L["states"][i % LAYERS], L["out"])

        def layer(i):
            conv(i)
            gates(i)
            recurrent(i)

        for name, fn in (("gdn_conv", conv), ("gdn_gates", gates), ("gdn_recurrent", recurrent),
                         ("conv+gates+recurrent", layer)):
            t = time_graph(fn, LAYERS, replays=PREFILL_REPLAYS, warmup=1)["median_s"]
            rows.append(dict(op=name, T=num_tokens, mode="graph", pdl=PDL, us_per_layer=t * 1e6,
                             us_per_token=t * 1e6 / num_tokens))
        del L
        torch.cuda.empty_cache()
    return rows


def bench(probe_gbps: float) -> list[dict]:
    rows = []
    state_bytes = 2 * HV * DV * DK * 4  # read + written once per call, whatever T
    for num_tokens in (1, 4, 16):
        L = make_layers(num_tokens)

        def recurrent(i):
            ops.gdn_recurrent(L["conv_out"], L["beta"], L["decay"], L["states"][i % LAYERS], L["out"])

        modes = [("graph", time_graph), ("eager", time_eager)]
        for mode, timer in modes if num_tokens == 1 else modes[:1]:
            t = timer(recurrent, LAYERS)["median_s"]
            gbps = state_bytes / t / 1e9
            rows.append(dict(op="gdn_recurrent", T=num_tokens, mode=mode, pdl=PDL, us_per_layer=t * 1e6,
                             bytes_per_layer=state_bytes, gbps=gbps, ratio_vs_read_probe=gbps / probe_gbps))

        if num_tokens == 1:
            def conv(i):
                ops.gdn_conv(L["qkv"], L["conv_states"][i % LAYERS], L["conv_weights"][i % LAYERS], HK, DK,
                             L["conv_out"])

            def gates(i):
                ops.gdn_gates(L["ba"], L["a_neg"], L["dt_bias"], L["beta"], L["decay"])

            def layer(i):  # the three GDN kernels of one layer, in model order
                conv(i)
                gates(i)
                recurrent(i)

            conv_bytes = (2 * num_tokens * C + 2 * (TAPS - 1) * C + C * TAPS) * 4
            for name, fn, nbytes in (("gdn_conv", conv, conv_bytes), ("gdn_gates", gates, None),
                                     ("conv+gates+recurrent", layer, None)):
                t = time_graph(fn, LAYERS)["median_s"]
                row = dict(op=name, T=num_tokens, mode="graph", pdl=PDL, us_per_layer=t * 1e6)
                if nbytes:
                    row.update(bytes_per_layer=nbytes, gbps=nbytes / t / 1e9,
                               ratio_vs_read_probe=nbytes / t / 1e9 / probe_gbps)
                rows.append(row)

            # torch baseline: the reference itself on the GPU (a handful of torch ops per token).
            def reference(i):
                ref.gdn_recurrent(L["conv_out"], L["beta"], L["decay"], L["states"][i % LAYERS], L["out"])

            t = time_eager(reference, LAYERS, replays=3)["median_s"]
            gbps = state_bytes / t / 1e9
            rows.append(dict(op="gdn_recurrent (torch reference)", T=num_tokens, mode="eager",
                             us_per_layer=t * 1e6, bytes_per_layer=state_bytes, gbps=gbps,
                             ratio_vs_read_probe=gbps / probe_gbps))
        del L
        torch.cuda.empty_cache()
    return rows


def kernels_run_by(fn) -> str:
    """The names of the CUDA kernels fn() launches (profiler), space-separated."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.key for e in prof.key_averages())


def bench_verify(probe_gbps: float) -> list[dict]:
    """gdn_recurrent at T = 1..8 with and without token_states (graph-replayed, 48 layers' states and, with
    them, 48 layers' token_states buffers)."""
    rows = []
    state_bytes = HV * DV * DK * 4
    for num_tokens in VERIFY_TOKENS:
        L = make_layers(num_tokens)
        token_states = [torch.empty(num_tokens, HV, DV, DK, device="cuda") for _ in range(LAYERS)]
        for with_states in (False, True):
            def recurrent(i):
                ops.gdn_recurrent(L["conv_out"], L["beta"], L["decay"], L["states"][i % LAYERS], L["out"],
                                  token_states[i % LAYERS] if with_states else None)

            t = time_graph(recurrent, LAYERS)["median_s"]
            nbytes = (2 + (num_tokens if with_states else 0)) * state_bytes
            kernel = "chunked" if "gdn_prefill_kernel" in kernels_run_by(lambda: recurrent(0)) else "per-token"
            rows.append(dict(op="gdn_recurrent", T=num_tokens, token_states=with_states, kernel=kernel, mode="graph",
                             pdl=PDL, us_per_layer=t * 1e6, bytes_per_layer=nbytes, gbps=nbytes / t / 1e9,
                             ratio_vs_read_probe=nbytes / t / 1e9 / probe_gbps))
        del L, token_states
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    args, probe = parse_args_and_probe(__doc__)
    rows = bench(probe["best_gbps"])
    print_table(rows, ["op", "T", "mode", "pdl", "us_per_layer", "gbps", "ratio_vs_read_probe"],
                title=f"gdn decode at the 27B shape, rotating over {LAYERS} layers' states")
    verify = bench_verify(probe["best_gbps"])
    print_table(verify, ["op", "T", "token_states", "kernel", "us_per_layer", "gbps", "ratio_vs_read_probe"],
                title=f"gdn_recurrent verify at the 27B shape, per layer (graph over {LAYERS} layers' states)")
    prefill = bench_prefill()
    print_table(prefill, ["op", "T", "us_per_layer", "us_per_token"],
                title=f"gdn prefill at the 27B shape, per layer (graph over {LAYERS} layers' states)")
    write_json(args.json, dict(env=env_info(), read_probe=probe, shape=dict(Hk=HK, Hv=HV, dk=DK, dv=DV, C=C),
                               layers=LAYERS, results=rows, verify=verify, prefill=prefill))


if __name__ == "__main__":
    main()
