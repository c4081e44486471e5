"""Gated DeltaNet ops at the 27B shape (Hk=16, Hv=48, dk=dv=128, C=10240), rotating over 48 layers'
states so nothing measured is L2-resident (48 x 6.3 MB of recurrent state = 302 MB read+written, against
the H200's 60 MB L2). pdl=1|0: with and without programmatic dependent launch (csrc/kernels/pdl.cuh).
QWEN38_PDL is read once per process, so a run measures the setting it started with (every row says which):
run again with QWEN38_PDL=0 for the figures without PDL.

Three sections. Decode (T = 1, 4, 16): the figures below. Prefill (T = 8, 32, 512, 4096): each op of the
GDN core (conv, gates, recurrent, and the three in model order) as one layer would run it on a prompt
chunk of T tokens, graph-replayed over the 48 layers' states; us_per_token = us_per_layer / T, the number
to hold against prefill's ~1.3 us per token per layer for the whole GDN core (b6f1a55, pp4096). From T = 8
gdn_recurrent runs a chunked kernel (threshold in csrc/cuda_bindings/gdn.cpp): at this shape the tensor-core
one (kernel=mma, gdn_chunk_mma.cu, 32-token chunks; the default from 32 tokens), and the float32 one
(kernel=fp32, gdn_prefill.cu, 16-token chunks); the recurrence and the three ops are timed with each, in the
same run (ms_48_layers = us_per_layer x 48 / 1000: the whole model's GDN core on that chunk); at T = 512 and
4096 also the recurrence with each of the tensor-core kernel's block sizes (kernel=mma rows=64|32|16, the
QWEN38_GDN_MMA_ROWS; skipped on a build without it). The T = 8 row
against the decode rows at T = 1 and 4 (token by token) places the threshold. Verify (T = 1..8):
gdn_recurrent as speculative decoding's verify runs it, with token_states (the per-token kernel for any T,
writing T x 3.1 MB more a layer; a buffer per layer, so those writes reach memory as the model's would) and
without (T = 8 runs the tensor-core chunked kernel); bytes = the state read and written once plus the token
states written.

The recurrent step is memory-bound: it reads and writes the float32 state once (48*128*128*4 B = 3.1 MB
each way per layer). Its figure of merit is state bytes (read + written) per second over the streaming
read probe; the target is >= 60% (the earlier implementation: 4.9 us a layer, 28%). conv and gates move
a few hundred KB and are launch/latency-bound: reported as time per layer.

gdn_step (the fused decode step): per layer at T = 1..8 (token_states from T = 2, as a speculative verify
runs it), against the four ops it replaces (gdn_conv, gdn_gates, gdn_recurrent with the same token_states,
gated_rms_norm with the int8 lane), both graph-replayed over 48 layers' states; and the whole GDN mixer of
a decode token with its Q8_0 GEMVs (int8 lane, 48 layers of synthetic weights: 5.9 GB, nothing
L2-resident): before, q|k|v|z GEMV + b|a GEMV + the four ops + out GEMV; after, the q|k|v|z|b|a GEMV +
gdn_step + out GEMV. Each row counts the kernels one layer launches, from the profiler over a replay of
that layer captured in a graph (graph_kernel_count): per decode token that is 48 x the difference.

Run: python3 -m benchmarks.ops.bench_gdn --json PATH
"""
from __future__ import annotations

import contextlib
import os

import torch

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.reference import gdn as ref

from .common import (capture_graph, env_info, kernel_records, parse_args_and_probe, print_table, time_eager, time_graph,
                     write_json)

ops = torch.ops.qwen38

HK, HV, DK, DV, TAPS = 16, 48, 128, 128, 4
C = 2 * HK * DK + HV * DV
LAYERS = 48
PREFILL_TOKENS = (8, 32, 512, 4096)
PREFILL_REPLAYS = 3  # a T = 4096 replay of the per-token recurrence: ~0.25 s (252 ms GDN core, b6f1a55)
VERIFY_TOKENS = range(1, 9)  # a verify checks k + 1 <= 8 tokens
PDL = "0" if os.environ.get("QWEN38_PDL", "").startswith("0") else "1"  # pdl.cuh's reading of it
PREFILL_KERNEL_ENV = "QWEN38_GDN_PREFILL"  # =fp32|mma: that prefill kernel where it applies
# QWEN38_GDN_MMA_ROWS=64|32|16 (gdn_chunk_mma.cu), the tensor-core kernel's state rows a
# block; bench_prefill times gdn_recurrent with each at these T, where the build has the knob.
MMA_ROWS_ENV = "QWEN38_GDN_MMA_ROWS"
MMA_ROWS = (64, 32, 16)
MMA_ROWS_TOKENS = (512, 4096)


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


@contextlib.contextmanager
def prefill_kernel_env(value: str | None, rows: int | None = None):
    """QWEN38_GDN_PREFILL set to value and QWEN38_GDN_MMA_ROWS to rows (None: unset) inside the block: the launcher
    reads both at each launch, so a graph captured inside runs that kernel."""
    saved = {name: os.environ.pop(name, None) for name in (PREFILL_KERNEL_ENV, MMA_ROWS_ENV)}
    for name, setting in ((PREFILL_KERNEL_ENV, value), (MMA_ROWS_ENV, rows)):
        if setting is not None:
            os.environ[name] = str(setting)
    try:
        yield
    finally:
        for name, setting in saved.items():
            os.environ.pop(name, None)
            if setting is not None:
                os.environ[name] = setting


def recurrent_kernel(fn) -> str:
    """Which gdn_recurrent kernel fn() runs: mma (gdn_chunk_mma.cu), fp32 (gdn_prefill.cu) or per-token (gdn.cu)."""
    names = kernels_run_by(fn)
    for kernel, label in (("gdn_prefill_mma_kernel", "mma"), ("gdn_prefill_kernel", "fp32"),
                          ("gdn_recurrent_kernel", "per-token")):
        if kernel in names:
            return label
    raise AssertionError(f"no gdn_recurrent kernel among {names}")


def bench_prefill() -> list[dict]:
    """Per op and per layer, the GDN core on a prompt chunk of T tokens (graph-replayed, 48 layers' states); the
    recurrence and the three ops once with the default kernel and once with the float32 one forced."""
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

        runs = [("gdn_conv", conv, None), ("gdn_gates", gates, None)]
        runs += [(name, fn, forced) for forced in ("mma", "fp32")
                 for name, fn in (("gdn_recurrent", recurrent), ("conv+gates+recurrent", layer))]
        for name, fn, forced in runs:
            with prefill_kernel_env(forced):
                kernel = recurrent_kernel(lambda: recurrent(0)) if fn in (recurrent, layer) else ""
                t = time_graph(fn, LAYERS, replays=PREFILL_REPLAYS, warmup=1)["median_s"]
            rows.append(dict(op=name, T=num_tokens, kernel=kernel, mode="graph", pdl=PDL, us_per_layer=t * 1e6,
                             us_per_token=t * 1e6 / num_tokens, ms_48_layers=t * 1e3 * LAYERS))
        if num_tokens in MMA_ROWS_TOKENS:
            for block_rows in MMA_ROWS:
                with prefill_kernel_env("mma", block_rows):
                    # the instance's name says whether this build reads the knob
                    if f"gdn_prefill_mma_kernel<{block_rows}>" not in kernels_run_by(lambda: recurrent(0)):
                        break
                    t = time_graph(recurrent, LAYERS, replays=PREFILL_REPLAYS, warmup=1)["median_s"]
                rows.append(dict(op="gdn_recurrent", T=num_tokens, kernel=f"mma rows={block_rows}", mode="graph",
                                 pdl=PDL, us_per_layer=t * 1e6, us_per_token=t * 1e6 / num_tokens,
                                 ms_48_layers=t * 1e3 * LAYERS))
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
            kernel = recurrent_kernel(lambda: recurrent(0))
            rows.append(dict(op="gdn_recurrent", T=num_tokens, token_states=with_states, kernel=kernel, mode="graph",
                             pdl=PDL, us_per_layer=t * 1e6, bytes_per_layer=nbytes, gbps=nbytes / t / 1e9,
                             ratio_vs_read_probe=nbytes / t / 1e9 / probe_gbps))
        del L, token_states
        torch.cuda.empty_cache()
    return rows


def graph_kernel_count(fn) -> int:
    """Kernels fn() launches, counted as the profiler's CUDA kernel records over one replay of fn captured in
    a CUDA graph (what a decode graph runs; copies and memsets are not kernels and not counted)."""
    return sum(count for _, count, _ in kernel_records(capture_graph(fn).replay))


Z, BA = HV * DV, 2 * HV  # z width, b|a width
X_WIDTH = C + Z + BA  # the fused projection's row: [q | k | v | z | b | a]


def make_step_layers(num_tokens: int, token_states: bool) -> dict:
    """48 layers' GDN states (and per-token state buffers), one fused-projection row block, the norm's int8
    lane buffers, and the op sequence's intermediates."""
    g = torch.Generator(device="cuda").manual_seed(1)
    L = dict(states=[torch.randn(HV, DV, DK, device="cuda", generator=g) * 0.1 for _ in range(LAYERS)],
             conv_states=[torch.randn(TAPS - 1, C, device="cuda", generator=g) for _ in range(LAYERS)],
             conv_weights=[torch.randn(C, TAPS, device="cuda", generator=g) * 0.5 for _ in range(LAYERS)],
             x=torch.randn(num_tokens, X_WIDTH, device="cuda", generator=g),
             a_neg=-torch.exp(torch.randn(HV, device="cuda", generator=g) - 2),
             dt_bias=torch.randn(HV, device="cuda", generator=g),
             norm_weight=1 + 0.1 * torch.randn(DV, device="cuda", generator=g),
             conv=torch.empty(num_tokens, C, device="cuda"), beta=torch.empty(num_tokens, HV, device="cuda"),
             decay=torch.empty(num_tokens, HV, device="cuda"), core=torch.empty(num_tokens, HV, DV, device="cuda"),
             out=torch.empty(num_tokens, Z, device="cuda"),
             out_q=torch.empty(num_tokens, Z, dtype=torch.int8, device="cuda"),
             out_d=torch.empty(num_tokens, Z // 32, device="cuda"), conv_tokens=[None] * LAYERS, tokens=[None] * LAYERS)
    if token_states:
        L["conv_tokens"] = [torch.empty(num_tokens, TAPS - 1, C, device="cuda") for _ in range(LAYERS)]
        L["tokens"] = [torch.empty(num_tokens, HV, DV, DK, device="cuda") for _ in range(LAYERS)]
    return L


def op_sequence(L: dict, i: int, x: torch.Tensor) -> None:
    """What GatedDeltaNet ran before gdn_step, on layer i % 48's states (x: [q|k|v|z|b|a] rows)."""
    j = i % LAYERS
    ops.gdn_conv(x[:, :C], L["conv_states"][j], L["conv_weights"][j], HK, DK, L["conv"], L["conv_tokens"][j])
    ops.gdn_gates(x[:, C + Z :], L["a_neg"], L["dt_bias"], L["beta"], L["decay"])
    ops.gdn_recurrent(L["conv"], L["beta"], L["decay"], L["states"][j], L["core"], L["tokens"][j])
    ops.gated_rms_norm(L["core"].view(x.shape[0], -1), x[:, C : C + Z], L["norm_weight"], 1e-6, L["out"], L["out_q"],
                       None, L["out_d"])


def fused_step(L: dict, i: int, x: torch.Tensor) -> None:
    j = i % LAYERS
    ops.gdn_step(x, L["conv_weights"][j], L["a_neg"], L["dt_bias"], L["norm_weight"], 1e-6, L["conv_states"][j],
                 L["states"][j], L["out"], L["out_q"], None, L["out_d"], L["conv_tokens"][j], L["tokens"][j])


def bench_step(probe_gbps: float) -> list[dict]:
    """gdn_step against the four ops it fuses, per layer (graph over 48 layers' states), T = 1..8."""
    rows = []
    state_bytes = HV * DV * DK * 4
    for num_tokens in VERIFY_TOKENS:
        with_states = num_tokens > 1
        L = make_step_layers(num_tokens, with_states)
        for name, fn in (("conv+gates+recurrent+gated_rms_norm", op_sequence), ("gdn_step", fused_step)):
            t = time_graph(lambda i: fn(L, i, L["x"]), LAYERS)["median_s"]
            nbytes = (2 + (num_tokens if with_states else 0)) * state_bytes
            rows.append(dict(op=name, T=num_tokens, token_states=with_states, mode="graph", pdl=PDL,
                             us_per_layer=t * 1e6, kernels_per_layer=graph_kernel_count(lambda: fn(L, 0, L["x"])),
                             gbps=nbytes / t / 1e9, ratio_vs_read_probe=nbytes / t / 1e9 / probe_gbps))
        del L
        torch.cuda.empty_cache()
    return rows


def bench_mixer() -> list[dict]:
    """One decode token's GDN mixer with its Q8_0 GEMVs in the int8 lane, before and after gdn_step (48
    layers of synthetic weights, graph-replayed); per-token figures are 48 x the per-layer ones."""
    D = 5120
    g = torch.Generator(device="cuda").manual_seed(2)

    def q8(rows, cols):
        q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, device="cuda", generator=g)
        return q, (torch.rand(rows, cols // 32, device="cuda", generator=g) * 4e-4 + 2e-4).half()

    qkvzba = [q8(X_WIDTH, D) for _ in range(LAYERS)]  # the fused matrix; before: rows [:C+Z] and [C+Z:] apart
    out_proj = [q8(D, Z) for _ in range(LAYERS)]
    x_q = torch.randint(-127, 128, (1, D), dtype=torch.int8, device="cuda", generator=g)
    x_d = torch.full((1, D // 32), 1 / 127, device="cuda")
    L = make_step_layers(1, False)
    y = torch.empty(1, X_WIDTH, device="cuda")
    ba = torch.empty(1, BA, device="cuda")
    delta = torch.empty(1, D, device="cuda")

    def before(i):
        wq, wd = qkvzba[i % LAYERS]
        qkvz = y[:, : C + Z]
        ops.q8_0_gemv_int8(x_q, x_d, wq[: C + Z], wd[: C + Z], qkvz)
        ops.q8_0_gemv_int8(x_q, x_d, wq[C + Z :], wd[C + Z :], ba)
        j = i % LAYERS
        ops.gdn_conv(qkvz[:, :C], L["conv_states"][j], L["conv_weights"][j], HK, DK, L["conv"])
        ops.gdn_gates(ba, L["a_neg"], L["dt_bias"], L["beta"], L["decay"])
        ops.gdn_recurrent(L["conv"], L["beta"], L["decay"], L["states"][j], L["core"])
        ops.gated_rms_norm(L["core"].view(1, -1), qkvz[:, C:], L["norm_weight"], 1e-6, L["out"], L["out_q"], None,
                           L["out_d"])
        ops.q8_0_gemv_int8(L["out_q"], L["out_d"], *out_proj[i % LAYERS], delta)

    def after(i):
        ops.q8_0_gemv_int8(x_q, x_d, *qkvzba[i % LAYERS], y)
        fused_step(L, i, y)
        ops.q8_0_gemv_int8(L["out_q"], L["out_d"], *out_proj[i % LAYERS], delta)

    rows = []
    for name, fn in (("before: qkvz, ba GEMVs + 4 ops + out GEMV", before),
                     ("after: qkvzba GEMV + gdn_step + out GEMV", after)):
        t = time_graph(fn, LAYERS)["median_s"]
        kernels = graph_kernel_count(lambda: fn(0))
        rows.append(dict(op=name, T=1, mode="graph", pdl=PDL, us_per_layer=t * 1e6, kernels_per_layer=kernels,
                         ms_per_token_48_layers=t * LAYERS * 1e3, kernels_per_token_48_layers=kernels * LAYERS))
    del qkvzba, out_proj, L
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
    step = bench_step(probe["best_gbps"])
    print_table(step, ["op", "T", "token_states", "us_per_layer", "kernels_per_layer", "ratio_vs_read_probe"],
                title=f"gdn_step vs the op sequence at the 27B shape, per layer (graph over {LAYERS} layers' states)")
    mixer = bench_mixer()
    print_table(mixer, ["op", "us_per_layer", "kernels_per_layer", "ms_per_token_48_layers",
                        "kernels_per_token_48_layers"],
                title="the GDN mixer of a decode token (int8 lane), before and after gdn_step")
    prefill = bench_prefill()
    print_table(prefill, ["op", "T", "kernel", "us_per_layer", "us_per_token", "ms_48_layers"],
                title=f"gdn prefill at the 27B shape, per layer (graph over {LAYERS} layers' states)")
    write_json(args.json, dict(env=env_info(), read_probe=probe, shape=dict(Hk=HK, Hv=HV, dk=DK, dv=DV, C=C),
                               layers=LAYERS, results=rows, verify=verify, step=step, mixer=mixer, prefill=prefill))


if __name__ == "__main__":
    main()
