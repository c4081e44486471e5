"""Many sequences at once on one GPU: aggregate decode tok/s of the batch engine at B = 1 .. 64 rows.

    python -m benchmarks.batch [--model PATH] [--json PATH] [--batches 1,2,4,8,16,32,64] [--contexts 512,4096]
                               [--mtp-batches 1,8]

Without --model the 27B shape with synthetic Q8_0 weights (benchmarks/decode.py), with the MTP block (as the
real checkpoint has it) unless --mtp-batches is empty: every plain step then also runs the block's MTP rule (its
pair of the step's token: one more attention layer and eh_proj), as the real checkpoint's plain steps do, and the
token's matrices below include the block's. Measured in ONE run:
- the streaming-read probe (the roofline);
- per B and context, in both modes of the engine (batch_invariant: the GEMV at every B; else the GEMM
  from 8 rows): the engine's step as it runs in serving (the bucket's step graph, then each row's
  greedy selection graph), caches and states filled synthetically at that depth: seconds a step,
  aggregate and per-sequence tok/s, bytes a step must move (the weights once, each row's GDN state read and
  written, its KV rows) and their rate over the probe; at the first context, the step graph's GPU time by part
  and kernel (decode.kernel_split, the profiler over replays);
- the token's Q8_0 GEMVs alone at T = 1 .. 64 rows (the rowwise form the batched step runs: every row
  the bits of a T = 1 call), each against T = 1, beside the int8 tensor-core GEMM at the same T (the
  prefill's kernel, which does not keep a row's bits across T);
- at each B of --mtp-batches and k = 1 .. 4 drafts, the MTP step (speculative decoding; invariant mode, context
  512) as the engine replays it: the drafts and the B*(k+1)-row verify, each slot's greedy acceptance, the
  rollback. B random prompts of 512 tokens are admitted (prefilled) with their drafts forced to the tokens plain
  greedy chose after them (benchmarks/speculative.py), so every draft is accepted (tokens_per_step, counted from
  the positions the steps advanced, says k + 1 if so); the context grows by k + 1 a step over the 3 x 8 timed
  steps (to 632 at k = 4). Per (B, k): ms a step, the step over the plain step at that B and context 512 (the
  first item's, invariant mode), and the aggregate tok/s projected at 3.28 (thinking off) and 2.52 (thinking on)
  tokens a step, issue 22's figures for the real checkpoint's MTP: B * min(tokens, k + 1) / the step's seconds
  (k drafts emit at most k + 1 tokens). A projection, not a measurement of acceptance: the step computes every
  row whatever is accepted, so its time is the same, only its tokens vary;
- end to end: generate() on B random prompts of 128 tokens, 64 new tokens each, every row through the
  whole engine (prefill included), its aggregate tok/s.
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.decode import TIMING_RUNS, build_model, fill_caches, kernel_split, median_step_s, q8_linears
from benchmarks.ops.common import default_result_path, env_info, print_table, read_probe_result, time_graph, write_json
from benchmarks.speculative import CONTEXT, admit_all, decode_batch, mtp_step_replay, perfect_drafts, random_prompts
from qwen38_model.config import GDN
from qwen38_model.engine import BatchEngine
from qwen38_model.sampling import SamplingConfig
from qwen38_model.speculative import Speculation

STEPS = 32
MTP_STEPS = 8  # MTP steps a timing run: few, as each moves the context on by k + 1 tokens
DRAFT_COUNTS = range(1, 5)
# Mean tokens an MTP step emits on the real checkpoint (issue 22), with thinking off and on: the projections.
TOKENS_A_STEP = {"thinking_off": 3.28, "thinking_on": 2.52}


def step_bytes(model, rows: int, context: int, kv_bytes: int) -> int:
    """What a step over `rows` sequences at `context` tokens must move: every matrix once, and per row its GDN
    recurrent and conv states read and written and its KV rows read."""
    c = model.config
    matrices = sum(m.weight_q.numel() + 2 * m.weight_d.numel() for m in q8_linears(model))
    n_gdn = c.layer_types.count(GDN)
    gdn = n_gdn * 2 * 4 * (c.linear_num_value_heads * c.linear_value_head_dim * c.linear_key_head_dim
                           + (c.conv_kernel - 1) * c.conv_dim)
    kv = (c.num_layers - n_gdn) * 2 * context * c.num_key_value_heads * c.head_dim * kv_bytes
    return matrices + rows * (gdn + kv)


def time_engine_step(engine: BatchEngine, rows: int, context: int) -> float:
    """Seconds per step over `rows` active rows at `context` (median of TIMING_RUNS runs of STEPS steps)."""
    cfg = SamplingConfig()

    def prepare():
        for s in range(rows):
            fill_caches(engine.slots.slot(s), context)
        engine.slots.positions.fill_(context)
        engine.tokens.fill_(1)

    def step():
        engine.step_graphs[rows].replay()
        for s in range(rows):
            engine.select(s, cfg)

    return median_step_s(step, STEPS, prepare)


def projected_tok_s(rows: int, k: int, tokens_a_step: float, step_s: float) -> float:
    """Aggregate tok/s of MTP steps of k drafts over `rows` sequences, each emitting tokens_a_step tokens a step
    (at most k + 1), a step taking step_s seconds."""
    return rows * min(tokens_a_step, k + 1) / step_s


def mtp_steps(model, batches: list[int], plain_step_s: dict) -> tuple[dict, list]:
    """The MTP step at each B and k in DRAFT_COUNTS (the module's docstring says how); plain_step_s: the plain
    step's seconds at each B, context CONTEXT. Returns the results by "B{b}_k{k}" and the table's rows."""
    # Plain greedy tokens for the forced drafts of every timed step (each moves on by k + 1), and room after them.
    new_tokens = TIMING_RUNS * MTP_STEPS * (DRAFT_COUNTS[-1] + 1) + 8
    max_seq_len = CONTEXT + new_tokens + 8
    results, rows = {}, []
    for b in batches:
        prompts = random_prompts(model, b, CONTEXT, seed=b)
        engine = BatchEngine(model, b, max_seq_len, torch.bfloat16, use_graph=True)
        forced = perfect_drafts(prompts, decode_batch(engine, prompts, new_tokens)["tokens"])
        del engine
        for k in DRAFT_COUNTS:
            engine = BatchEngine(model, b, max_seq_len, torch.bfloat16, use_graph=True,
                                 speculation=Speculation(k, adaptive=False, forced_drafts=True))
            engine.capture((b,))
            admit_all(engine, prompts, new_tokens, forced)
            start = engine.slots.positions[:b].clone()
            step_s = median_step_s(mtp_step_replay(engine, b, k), MTP_STEPS)
            tokens = (engine.slots.positions[:b] - start).sum().item() / (b * TIMING_RUNS * MTP_STEPS)
            del engine
            gc.collect()  # the engine and its MTP step refer to each other: only a collection frees their memory
            torch.cuda.empty_cache()
            projected = {name: projected_tok_s(b, k, t, step_s) for name, t in TOKENS_A_STEP.items()}
            results[f"B{b}_k{k}"] = dict(step_ms=step_s * 1e3, plain_step_ms=plain_step_s[b] * 1e3,
                                         vs_plain_step=step_s / plain_step_s[b], tokens_per_step=tokens,
                                         projected_tok_s=projected)
            rows.append(dict(B=b, k=k, step_ms=step_s * 1e3, vs_plain=step_s / plain_step_s[b], tokens_per_step=tokens,
                             **{f"tok_s_{TOKENS_A_STEP[n]}": v for n, v in projected.items()}))
    return results, rows


def gemv_rows(model, rows: int) -> dict:
    """The token's Q8_0 matrices at `rows` rows (int8 lane): the GEMV (rowwise) and the GEMM, each in one graph."""
    linears = q8_linears(model)
    widths = {m.in_features for m in linears}
    x_q = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8, device="cuda") for k in widths}
    x_d = {k: (torch.rand(rows, k // 32, device="cuda") * 0.01).half().float() for k in widths}
    outs = [torch.empty(rows, m.out_features, device="cuda") for m in linears]
    ops = torch.ops.qwen38

    def chain(op):
        def token(_):
            for m, out in zip(linears, outs):
                op(x_q[m.in_features], x_d[m.in_features], m.weight_q, m.weight_d, out)
        return time_graph(token, 1)["median_s"]

    result = dict(gemv_s=chain(ops.q8_0_gemv_int8))
    if rows >= 8:
        result["gemm_s"] = chain(ops.q8_0_gemm_int8)
    return result


def end_to_end(model, rows: int, max_seq_len: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, model.config.vocab_size, (rows, 128), generator=g)
    model.generate(ids, max_new_tokens=4, max_seq_len=max_seq_len, eos_token_id=[])  # graphs captured
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=64, max_seq_len=max_seq_len, eos_token_id=[])
    wall = time.perf_counter() - start
    stats = model.last_generation_stats
    return dict(wall_s=wall, new_tokens=stats.new_tokens, tok_s=stats.new_tokens / wall)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-batch.json)")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64",
                        help="row counts, comma-separated (default: %(default)s)")
    parser.add_argument("--contexts", default="512,4096",
                        help="cache depths in tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--mtp-batches", default="1,8", metavar="BATCHES",
                        help="row counts, comma-separated, of the MTP step at k = 1..4 (each among the batches; "
                             "empty for none) (default: %(default)s)")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    mtp_batches = [int(b) for b in args.mtp_batches.split(",")] if args.mtp_batches else []
    if mtp_batches and (not set(mtp_batches) <= set(batches) or CONTEXT not in contexts):
        parser.error(f"--mtp-batches {args.mtp_batches}: each must be among --batches and --contexts must hold "
                     f"{CONTEXT} (the MTP step is compared with the plain step there)")
    env = env_info()
    probe = read_probe_result()
    roofline = probe["best_gbps"]
    model = build_model(args.model, "int8", mtp=bool(mtp_batches))
    results = dict(env=env, read_probe=probe, steps=STEPS, kv_dtype="bfloat16", mtp_block=model.mtp is not None,
                   engine={}, gemv={}, end_to_end={})
    rows = []
    max_seq_len = max(contexts) + STEPS * 3 + 8
    for invariant in (True, False):
        engine = BatchEngine(model, max(batches), max_seq_len, torch.bfloat16, use_graph=True,
                             batch_invariant=invariant)
        measured = [b for b in batches if invariant or b >= 8]  # below 8 rows both modes run the GEMV
        start = time.perf_counter()
        engine.capture(tuple(b for b in engine.buckets if b in measured))
        results[f"capture_s_invariant_{invariant}"] = time.perf_counter() - start
        for b in measured:
            for context in contexts:
                t = time_engine_step(engine, b, context)
                moved = step_bytes(model, b, context + STEPS // 2, 2)
                r = dict(step_s=t, tok_s=b / t, per_sequence_tok_s=1 / t, bytes=moved,
                         probe_ratio=moved / t / 1e9 / roofline)
                results["engine"][f"{'invariant' if invariant else 'gemm'}_B{b}_ctx{context}"] = r
                if context == contexts[0]:  # where a step's time goes, by part (the step graph alone)
                    r["split"] = kernel_split(engine.step_graphs[b].replay)
                    print(f"B = {b} ({'invariant' if invariant else 'gemm'}): step graph, critical-path ms by part "
                          f"{r['split']['critical_ms']}, span {r['split']['span_ms']} ms")
                rows.append(dict(mode="invariant" if invariant else "gemm", B=b, context=context, tok_s=b / t,
                                 per_seq=1 / t, ms=t * 1e3, GBps=moved / t / 1e9, probe=r["probe_ratio"]))
        results["memory_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        del engine
        torch.cuda.empty_cache()
    print_table(rows, ["mode", "B", "context", "tok_s", "per_seq", "ms", "GBps", "probe"],
                title=f"batch decode step on {env.get('gpu')} (read probe {roofline:.0f} GB/s, int8 lane, bf16 KV)")
    if mtp_batches:
        plain_step_s = {b: results["engine"][f"invariant_B{b}_ctx{CONTEXT}"]["step_s"] for b in mtp_batches}
        results["mtp"], rows = mtp_steps(model, mtp_batches, plain_step_s)
        print_table(rows, ["B", "k", "step_ms", "vs_plain", "tokens_per_step",
                           *(f"tok_s_{t}" for t in TOKENS_A_STEP.values())],
                    title=f"MTP step of k drafts, forced right (invariant, context {CONTEXT}); vs_plain: over the "
                          "plain step; tok_s at 3.28 (thinking off) and 2.52 (thinking on) tokens a step, at most k + 1")
    base = None
    rows = []
    for t in sorted({1, *batches}):
        r = gemv_rows(model, t)
        base = base or r["gemv_s"]
        r["gemv_vs_t1"] = r["gemv_s"] / base
        if "gemm_s" in r:
            r["gemm_vs_t1"] = r["gemm_s"] / base
        results["gemv"][f"T{t}"] = r
        rows.append(dict(T=t, gemv_ms=r["gemv_s"] * 1e3, gemv_x=r["gemv_vs_t1"], gemm_ms=r.get("gemm_s", 0) * 1e3,
                         gemm_x=r.get("gemm_vs_t1", 0.0)))
    print_table(rows, ["T", "gemv_ms", "gemv_x", "gemm_ms", "gemm_x"],
                title="the token's Q8_0 matrices at T rows (int8 lane), against the GEMV at T = 1")
    rows = []
    for b in batches:
        r = end_to_end(model, b, 128 + 64 + 8)
        results["end_to_end"][f"B{b}"] = r
        rows.append(dict(B=b, tok_s=r["tok_s"], wall_s=r["wall_s"]))
    print_table(rows, ["B", "tok_s", "wall_s"], title="generate(): B prompts of 128 tokens, 64 new tokens each")
    results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    write_json(args.json or default_result_path(env, "batch"), results)
    return results


if __name__ == "__main__":
    main()
