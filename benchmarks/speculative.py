"""MTP speculative decoding at the 27B shape: what can be measured honestly with synthetic weights.

    python -m benchmarks.speculative [--model PATH] [--json PATH] [--draft-tokens 3] [--new-tokens 256]
    python -m benchmarks.speculative --batches 1,2,4,8,16 [--drafts perfect|wrong|mtp] [--new-tokens 128]

Synthetic weights give the MTP block ~0 acceptance, so acceptance itself is not measured here. Measured in
ONE run, all through CUDA graphs: plain greedy decode (the baseline, and the token sequence the forced
drafts replay); the verify pass (trunk + final norm + LM head, GDN states kept per token) for T = 1..8
rows against T = 1; one draft step (the MTP block on one row + the LM head + arg-max); the MTP pass over
the verify's rows; whole speculative steps with drafts forced to be right (the mechanics at 100%
acceptance: tok/s and equality with plain greedy), forced to be wrong (0%: fixed k and adaptive k); and
tok/s as a function of mean tokens per step, 1 .. k+1, labelled a projection (the step time is fixed by
the graph, only the tokens it emits vary).

With --batches, instead, many sequences at once (issue 22): at each B, B sequences of random 64-token prompts
decoded together through the batch engine's graphs, all admitted before the clock starts, first with the plain
step, then with the MTP step over the same B slots (B*(k+1) verify rows a step), in the same run: aggregate
decode tok/s, mean tokens a step per sequence, ms a step, and whether every sequence's tokens are plain greedy's.
--drafts: forced right (perfect: 100% acceptance, k fixed), forced wrong (0%, k fixed; adaptive k would fall to
plain steps) or the MTP block's own (adaptive k; ~0 acceptance on synthetic weights).
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.decode import build_model, fill_caches, kernel_split
from benchmarks.ops.common import default_result_path, env_info, print_table, read_probe_result, time_graph, write_json
from qwen38_model.engine import BatchEngine, Sequence, run_batch, run_to_end
from qwen38_model.generation import StopCondition
from qwen38_model.sampling import SamplingConfig
from qwen38_model.scratch import Scratch
from qwen38_model.speculative import MAX_DRAFT_TOKENS, Speculation, head_rows

CONTEXT = 512  # the KV rows every timed pass attends over (a short chat's context)


def time_verify(model, state, rows: int) -> float:
    """Seconds of one verify of `rows` tokens: trunk (GDN states per token when rows > 1), final norm, head."""
    scratch = Scratch(model.device)
    ids = torch.ones(rows, dtype=torch.int32, device=model.device)
    positions = torch.arange(CONTEXT, CONTEXT + rows, dtype=torch.int32, device=model.device)

    def verify(_):
        residual, delta = model.trunk(ids, positions, state, scratch, keep_token_states=rows > 1)
        model.lm_head(model.final_norm(residual, delta, scratch), scratch)

    return time_graph(verify, calls=4, replays=5)["median_s"]


def time_mtp(model, state, rows: int, head: bool, draft_vocab: int | None = None) -> float:
    """Seconds of the MTP block over `rows` rows (with head: + LM head + arg-max on one row: a draft step;
    draft_vocab: over the head's first rows only)."""
    scratch = Scratch(model.device)
    hidden = torch.randn(rows, model.config.hidden_size, device=model.device)
    ids = torch.ones(rows, dtype=torch.int32, device=model.device)
    positions = torch.arange(CONTEXT, CONTEXT + rows, dtype=torch.int32, device=model.device)
    token = torch.zeros((), dtype=torch.int64, device=model.device)
    lm_head = head_rows(model.lm_head, draft_vocab) if draft_vocab else model.lm_head

    def step(_):
        act = model.mtp(hidden, ids, positions, state.mtp_cache, scratch)
        if head:
            torch.argmax(lm_head(act, scratch)[0], out=token)

    return time_graph(step, calls=8, replays=5)["median_s"]


def plain_greedy(model, prompt: torch.Tensor, new_tokens: int, kv_dtype) -> tuple[list[int], float]:
    engine = BatchEngine(model, 1, prompt.shape[0] + new_tokens + 64, kv_dtype, use_graph=True)
    seq = Sequence(prompt, SamplingConfig(), 0, new_tokens, StopCondition(frozenset()))
    run_batch(engine, [seq], chunk_size=4096)
    del engine
    return seq.tokens, seq.stats.decode_tok_s


def speculative_run(model, prompt, new_tokens, kv_dtype, k, forced: torch.Tensor, adaptive: bool,
                    draft_vocab: int | None = None):
    # Room for the timing and profiling replays after the run (each consumes up to k + 1 positions).
    speculation = Speculation(k, draft_vocab, adaptive=adaptive, forced_drafts=True)
    engine = BatchEngine(model, 1, prompt.shape[0] + new_tokens + 24 * (k + 1), kv_dtype, use_graph=True,
                         speculation=speculation)
    engine.mtp.forced[0, : forced.shape[0]].copy_(forced)
    seq = Sequence(prompt, SamplingConfig(), 0, new_tokens, StopCondition(frozenset()))
    run_batch(engine, [seq], chunk_size=4096)
    stats = seq.stats
    # The step's graphs' own time, replayed back to back (what a step costs whatever it emits).
    replay = mtp_step_replay(engine, 1, k)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(12):
        replay()
    stop.record()
    stop.synchronize()
    step_s = start.elapsed_time(stop) * 1e-3 / 12
    result = dict(tokens=seq.tokens, decode_tok_s=stats.decode_tok_s, tokens_per_step=stats.tokens_per_step,
                  steps=stats.steps, drafted=stats.drafted, accepted=stats.accepted, step_s=step_s,
                  capture_s=stats.capture_s, kernel_split_ms=kernel_split(replay, steps=4))
    del engine, replay
    torch.cuda.empty_cache()
    return result


def mtp_step_replay(engine: BatchEngine, rows: int, k: int):
    """One MTP step of k drafts over slots 0..rows-1 as MTPStep.launch replays it (the drafts and verify, each
    slot's greedy selection, the rollback), every slot selecting: their graphs captured, a sequence admitted in
    each slot."""
    verify, finish = engine.mtp.graphs[(rows, k)]
    selects = [engine.mtp.select_graphs[(slot, SamplingConfig())][k] for slot in range(rows)]

    def replay():
        verify.replay()
        for select in selects:
            select.replay()
        finish.replay()

    return replay


def random_prompts(model, count: int, length: int, seed: int) -> list[torch.Tensor]:
    """`count` prompts of `length` random token ids, on the model's device, the same for the same seed."""
    g = torch.Generator(model.device).manual_seed(seed)
    V = model.config.vocab_size
    return [torch.randint(0, V, (length,), dtype=torch.int32, device=model.device, generator=g) for _ in range(count)]


def perfect_drafts(prompts: list, tokens: list) -> list[torch.Tensor]:
    """Each prompt followed by its plain greedy tokens: the forced draft row (indexed by position) that makes
    every draft of a greedy sequence right."""
    return [torch.cat([p, torch.tensor(t, dtype=torch.int32, device=p.device)]) for p, t in zip(prompts, tokens)]


def admit_all(engine: BatchEngine, prompts: list, new_tokens: int, forced: list | None = None) -> list[Sequence]:
    """Every prompt admitted (greedy, new_tokens tokens each) into the slots 0.. of an engine whose graphs are
    captured, its launches drained; forced: each sequence's forced draft row."""
    sequences = [Sequence(p, SamplingConfig(), 0, new_tokens, StopCondition(frozenset())) for p in prompts]
    for j, seq in enumerate(sequences):
        run_to_end(engine.admit(seq, 4096))
        if forced is not None:
            engine.mtp.forced[seq.slot, : forced[j].shape[0]].copy_(forced[j])
    engine.drain()
    return sequences


def decode_batch(engine: BatchEngine, prompts: list, new_tokens: int, forced: list | None = None) -> dict:
    """Every prompt admitted into the engine (its graphs captured first), then decoded to new_tokens tokens each,
    timed from the first step to the last token read; forced: each sequence's forced draft row."""
    engine.capture(engine.buckets[: engine.buckets.index(engine.bucket(len(prompts))) + 1])
    sequences = admit_all(engine, prompts, new_tokens, forced)
    torch.cuda.synchronize()
    steps, clock = 0, time.perf_counter()
    while any(engine.active):
        engine.step()
        steps += 1
        engine.read(wait=False)
    engine.drain()
    wall = time.perf_counter() - clock
    decoded = sum(len(seq.tokens) - 1 for seq in sequences)  # the first of each is the prefill's
    return dict(tokens=[seq.tokens for seq in sequences], tok_s=decoded / wall, step_ms=wall / steps * 1e3,
                steps=steps, tokens_per_step=decoded / steps / len(sequences), wall_s=wall)


def batch_table(model, batches: list[int], k: int, new_tokens: int, kv_dtype, drafts: str) -> dict:
    """Plain and MTP steps at each B (decode_batch), the MTP engine's drafts as --drafts says."""
    V, results, rows = model.config.vocab_size, {}, []
    max_seq_len = 64 + new_tokens + 8
    for b in batches:
        prompts = random_prompts(model, b, 64, seed=b)
        engine = BatchEngine(model, b, max_seq_len, kv_dtype, use_graph=True)
        plain = decode_batch(engine, prompts, new_tokens)
        del engine
        forced = None
        if drafts != "mtp":
            forced = perfect_drafts(prompts, plain["tokens"])
            forced = forced if drafts == "perfect" else [(f + 1) % V for f in forced]
        speculation = Speculation(k, adaptive=drafts == "mtp", forced_drafts=forced is not None)
        engine = BatchEngine(model, b, max_seq_len, kv_dtype, use_graph=True, speculation=speculation)
        mtp = decode_batch(engine, prompts, new_tokens, forced)
        del engine
        torch.cuda.empty_cache()
        identical = mtp.pop("tokens") == plain.pop("tokens")
        results[f"B{b}"] = dict(plain=plain, mtp=mtp, identical_to_plain=identical, vs_plain=mtp["tok_s"] / plain["tok_s"])
        rows.append(dict(B=b, plain_tok_s=plain["tok_s"], mtp_tok_s=mtp["tok_s"], vs_plain=mtp["tok_s"] / plain["tok_s"],
                         tokens_per_step=mtp["tokens_per_step"], plain_ms=plain["step_ms"], mtp_ms=mtp["step_ms"],
                         identical=identical))
    print_table(rows, ["B", "plain_tok_s", "mtp_tok_s", "vs_plain", "tokens_per_step", "plain_ms", "mtp_ms", "identical"],
                title=f"B sequences at once, plain vs MTP (k = {k}, drafts {drafts}), {new_tokens} new tokens each")
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint with the MTP block instead of the synthetic 27B shape")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-speculative.json)")
    parser.add_argument("--draft-tokens", type=int, default=3, help="k of the forced-draft runs")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=32768, help="the reduced draft vocabulary measured beside the full one")
    parser.add_argument("--kv-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--batches", help="B values (e.g. 1,2,4,8,16): plain vs MTP steps over B sequences instead")
    parser.add_argument("--drafts", choices=["perfect", "wrong", "mtp"], default="perfect",
                        help="with --batches: forced right or wrong drafts (k fixed), or the MTP block's (adaptive k)")
    args = parser.parse_args(argv)
    k, kv_dtype = args.draft_tokens, getattr(torch, args.kv_dtype)
    env = env_info()
    results = dict(env=env, read_probe=read_probe_result(), draft_tokens=k, kv_dtype=args.kv_dtype)
    model = build_model(args.model, "int8", mtp=True)
    V = model.config.vocab_size
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        results.update(new_tokens=args.new_tokens, drafts=args.drafts,
                       batches=batch_table(model, batches, k, args.new_tokens, kv_dtype, args.drafts))
        write_json(args.json or default_result_path(env, "speculative-batch"), results)
        return results

    state = model.new_state(CONTEXT + 64, kv_dtype)
    state.keep_token_states(8)
    fill_caches(state, CONTEXT)
    verify_s = {rows: time_verify(model, state, rows) for rows in range(1, 9)}
    results["verify_ms"] = {rows: s * 1e3 for rows, s in verify_s.items()}
    results["verify_vs_t1"] = {rows: s / verify_s[1] for rows, s in verify_s.items()}
    results["draft_step_ms"] = time_mtp(model, state, 1, head=True) * 1e3
    results["draft_vocab"] = args.draft_vocab
    results["draft_step_reduced_vocab_ms"] = time_mtp(model, state, 1, head=True, draft_vocab=args.draft_vocab) * 1e3
    results["mtp_pass_ms"] = {rows: time_mtp(model, state, rows, head=False) * 1e3
                              for rows in sorted({1, k + 1, MAX_DRAFT_TOKENS + 1})}
    del state
    torch.cuda.empty_cache()

    prompt = random_prompts(model, 1, 64, seed=0)[0]
    plain_tokens, plain_tok_s = plain_greedy(model, prompt, args.new_tokens, kv_dtype)
    results["plain_tok_s"] = plain_tok_s
    right = perfect_drafts([prompt], [plain_tokens])[0]
    wrong = (right + 1) % V
    runs = {}
    for name, forced, adaptive, vocab in (("perfect", right, False, None), ("zero_fixed_k", wrong, False, None),
                                          ("zero_adaptive", wrong, True, None),
                                          (f"perfect_draft_vocab_{args.draft_vocab}", right, False, args.draft_vocab)):
        clock = time.perf_counter()
        r = speculative_run(model, prompt, args.new_tokens, kv_dtype, k, forced, adaptive, vocab)
        r["identical_to_plain"] = r.pop("tokens") == plain_tokens
        r["vs_plain"] = r["decode_tok_s"] / plain_tok_s
        r["wall_s"] = time.perf_counter() - clock
        runs[name] = r
    results["runs"] = runs
    step_s = runs["perfect"]["step_s"]
    results["projection_tok_s"] = {f"{m:.1f}": m / step_s for m in [1 + 0.5 * i for i in range(2 * k + 1)]}
    reduced_step_s = runs[f"perfect_draft_vocab_{args.draft_vocab}"]["step_s"]
    results["projection_3.2_tok_s"] = {"full_head": 3.2 / step_s, f"draft_vocab_{args.draft_vocab}": 3.2 / reduced_step_s}
    results["projection_note"] = ("projection: mean tokens per step / the measured k-draft step time; real "
                                  "acceptance depends on the checkpoint and the text")

    rows = [dict(test=f"verify T={t}", ms=v, vs_t1=results["verify_vs_t1"][t]) for t, v in results["verify_ms"].items()]
    rows += [dict(test="draft step (MTP 1 row + head)", ms=results["draft_step_ms"], vs_t1=results["draft_step_ms"] / results["verify_ms"][1])]
    rows += [dict(test=f"draft step, head over {args.draft_vocab} ids", ms=results["draft_step_reduced_vocab_ms"],
                  vs_t1=results["draft_step_reduced_vocab_ms"] / results["verify_ms"][1])]
    rows += [dict(test=f"MTP pass {r} rows", ms=v, vs_t1=v / results["verify_ms"][1]) for r, v in results["mtp_pass_ms"].items()]
    print_table(rows, ["test", "ms", "vs_t1"], title=f"speculative parts on {env.get('gpu')} (context {CONTEXT})")
    print_table([dict(run=n, tok_s=r["decode_tok_s"], vs_plain=r["vs_plain"], tokens_per_step=r["tokens_per_step"],
                      step_ms=r["step_s"] * 1e3, identical=r["identical_to_plain"]) for n, r in runs.items()],
                ["run", "tok_s", "vs_plain", "tokens_per_step", "step_ms", "identical"],
                title=f"k = {k}, plain greedy {plain_tok_s:.1f} tok/s")
    print(f"perfect k={k} step, GPU time per part (profiler):", runs["perfect"]["kernel_split_ms"])
    print("projection at 3.2 tokens a step:", {n: round(v, 1) for n, v in results["projection_3.2_tok_s"].items()})
    print("projection (tok/s at mean tokens per step):",
          ", ".join(f"{m}: {v:.0f}" for m, v in results["projection_tok_s"].items()))
    write_json(args.json or default_result_path(env, "speculative"), results)
    return results


if __name__ == "__main__":
    main()
