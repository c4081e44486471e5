"""One sequence in a BatchEngine, prefilled and ready to step by hand: what the tests of the decode step's
graph (replay vs eager, restore into the captured state, bad inputs reaching a replay) drive."""
import torch

from qwen38_model.engine import BatchEngine, Sequence
from qwen38_model.generation import StopCondition
from qwen38_model.model import PREFILL_CHUNK


def one_sequence(model, prompt: torch.Tensor, cfg, max_seq_len: int, kv_dtype, use_graph: bool, seed: int = 0):
    """(engine, step): the engine holds prompt (int32 on the model's device) prefilled in slot 0 with its first
    token selected; step() runs one decode step as the engine does (the step graph and the slot's selection
    graph replayed, or both eagerly), its logits in engine.logits[0]."""
    engine = BatchEngine(model, 1, max_seq_len, kv_dtype, use_graph=use_graph)
    engine.capture()
    seq = Sequence(prompt, cfg, seed, max_seq_len - prompt.shape[0], StopCondition(frozenset()))
    for _ in engine.admit(seq, PREFILL_CHUNK):
        pass

    def step() -> None:
        if use_graph:
            engine.step_graphs[1].replay()
        else:
            engine.run_rows(1)
        engine.select(0, cfg)

    return engine, step
