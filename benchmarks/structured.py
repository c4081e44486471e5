"""Structured output's cost per token: N tokens decoded by the batch engine with a JSON schema's constraint
(llguidance's mask filled on the host after each token, copied to the device, applied in the selection graph;
the engine waits for each constrained token before the next selection) against the same decode unconstrained.

    python -m benchmarks.structured [--model PATH] [--tokens 128] [--batch 1] [--json PATH]
    python -m benchmarks.structured --tiny   # the built-in model on the CPU: a smoke test, its figures mean nothing

Without --model the 27B shape with synthetic Q8_0 weights (benchmarks/decode.py) and the built-in model's
tokenizer (501 tokens; the mask still covers the 27B's vocabulary): its mask-fill figure is that small
vocabulary's, a checkpoint's own tokenizer (--model) gives the real one. Measured in one run, each mode twice
(the first captures its selection graphs), the second reported: ms per decode step (a sequence's decode time
over its tokens after the first), ms per token of the mask fill alone, and the constrained/unconstrained ratio.
The schema (an array of at least 2N strings) keeps every constrained sequence going for all N tokens."""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.ops.common import add_tiny_flag, default_result_path, env_info, parse_with_tiny, write_json
from qwen38_model.engine import BatchEngine, Sequence, run_batch
from qwen38_model.generation import StopCondition
from qwen38_model.sampling import SamplingConfig
from qwen38_model.structured import JsonConstraints

PROMPT_TOKENS = 64
TINY = dict(tokens=12, batch=2)


class TimedConstraint:
    """A constraint whose mask fills are timed."""

    def __init__(self, constraint):
        self.constraint, self.fill_s, self.fills = constraint, 0.0, 0

    def fill(self, row: torch.Tensor) -> None:
        start = time.perf_counter()
        self.constraint.fill(row)
        self.fill_s += time.perf_counter() - start
        self.fills += 1

    def advance(self, token: int) -> bool:
        return self.constraint.advance(token)

    def complete(self) -> bool:
        return self.constraint.complete()

    def error(self) -> str:
        return self.constraint.error()


def decode(engine: BatchEngine, prompt: torch.Tensor, tokens: int, batch: int, constraints=None) -> dict:
    """batch sequences of `tokens` greedy tokens after prompt (each constrained when constraints are given):
    ms per decode step and, constrained, ms per mask fill."""
    cfg = SamplingConfig(token_mask=constraints is not None)
    sequences = [Sequence(prompt, cfg, 0, tokens, StopCondition(frozenset()),
                          constraint=constraints[i] if constraints else None) for i in range(batch)]
    run_batch(engine, sequences, chunk_size=PROMPT_TOKENS)
    for seq in sequences:
        if len(seq.tokens) != tokens:
            raise RuntimeError(f"a sequence stopped after {len(seq.tokens)} of {tokens} tokens")
    step_s = max(seq.stats.decode_s for seq in sequences) / (tokens - 1)
    result = {"step_ms": step_s * 1e3}
    if constraints:
        result["fill_ms"] = sum(c.fill_s for c in constraints) / sum(c.fills for c in constraints) * 1e3
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a real checkpoint (and its tokenizer) instead of the synthetic 27B shape")
    parser.add_argument("--tokens", type=int, default=128, help="tokens each sequence decodes (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--json", help="write the results here (default benchmarks/results/<date>-<gpu>-<commit>-"
                                       "structured.json; with --tiny: nowhere)")
    add_tiny_flag(parser, TINY)
    args = parse_with_tiny(parser, argv, TINY)
    if args.tokens < 2 or args.batch < 1:
        raise SystemExit("--tokens must be >= 2 and --batch >= 1")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("benchmarks.structured needs a CUDA GPU (or --tiny)")

    from qwen38_model.default_model import default_model_path
    from qwen38_model.model import default_kv_dtype
    from qwen38_model.tokenizer import load_tokenizer

    if args.tiny:
        from qwen38_model import Qwen38ForCausalLM

        model = Qwen38ForCausalLM.from_pretrained(args.model or default_model_path(), device="cpu")
    else:
        from benchmarks.decode import build_model

        model = build_model(args.model, "int8")
    tokenizer = load_tokenizer(args.model or default_model_path())
    vocab = model.config.vocab_size
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 2 * args.tokens}  # more than fit
    json_constraints = JsonConstraints(tokenizer, vocab, tuple(tokenizer.eos_token_ids))
    grammar = json_constraints.grammar(schema)
    engine = BatchEngine(model, args.batch, PROMPT_TOKENS + args.tokens, default_kv_dtype(model.device))
    prompt = torch.randint(0, min(len(tokenizer), vocab), (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0),
                           dtype=torch.int32).to(model.device)
    with torch.no_grad():
        runs = {}
        for mode in ("unconstrained", "constrained"):
            for _ in range(2):  # the second run is reported: the first captured the mode's selection graphs
                constraints = [TimedConstraint(json_constraints.constraint(grammar)) for _ in range(args.batch)] \
                    if mode == "constrained" else None
                runs[mode] = decode(engine, prompt, args.tokens, args.batch, constraints)
    results = dict(env=env_info(), model=args.model or ("built-in default (tiny)" if args.tiny else
                                                       "synthetic 27B shape, the built-in tokenizer"),
                   tiny=args.tiny, device=str(model.device), vocab_size=vocab, tokenizer_size=len(tokenizer),
                   tokens=args.tokens, batch=args.batch, schema=schema, **runs,
                   constrained_over_unconstrained=runs["constrained"]["step_ms"] / runs["unconstrained"]["step_ms"])
    where = f"{results['env'].get('gpu', 'cpu')}{', tiny: figures mean nothing' if args.tiny else ''}"
    print(f"structured output, {args.batch} x {args.tokens} tokens ({where}): step "
          f"{runs['unconstrained']['step_ms']:.3f} ms unconstrained, {runs['constrained']['step_ms']:.3f} ms "
          f"constrained ({results['constrained_over_unconstrained']:.2f}x), mask fill "
          f"{runs['constrained']['fill_ms']:.3f} ms a token")
    write_json(args.json or (None if args.tiny else default_result_path(results["env"], "structured")), results)
    return results


if __name__ == "__main__":
    main()
