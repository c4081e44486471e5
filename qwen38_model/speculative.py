"""MTP speculative decoding, the engine's MTP step: the model's MTP block drafts k tokens for every active slot,
one pass of the trunk over each slot's k+1 tokens [pending, d_1..d_k] verifies them (B slots: B*(k+1) rows), and
each slot's state keeps its own longest accepted prefix. engine.BatchEngine launches a step as three parts, each a
captured CUDA graph: the drafts and the verify (per bucket B and draft count k), each selecting slot's acceptance
(per slot, sampling config and k: each sequence samples with its own parameters and seed), and the rollback (per
B and k); it reads the accepted tokens a few steps behind as it reads plain steps, and picks one k for all slots
from what it read (DraftPolicy: the acceptance pooled over the slots, each bucket's step times).

One step, per slot b with p = tokens the trunk has consumed and x_p the pending token (chosen, not yet consumed),
the state's MTP part as the MTP rule leaves it (state.py: pairs up to p-2 in the block's cache, h_{p-1} carried):
1. The MTP rule for x_p: the block over the pair (h_{p-1}, x_p) at position p-1 (vLLM's convention); its
   output gives draft d_1. (One row a slot: the ops' batched-rows mode.)
2. k-1 single-row MTP steps on the block's own normed output give d_2..d_k (their KV rows, at p.., are
   rewritten by step 5 before any read).
3. The trunk over [x_p, d_1..d_k] at positions p..p+k, keeping each GDN layer's state after every token: k+1
   consecutive rows a slot, each slot on its own caches and states (slots.SlotStates.rows(B, tokens=k+1)).
4. select_speculative on the slot's k+1 logits rows: the target tokens t_0..t_a (greedy: exactly plain
   greedy's; sampling: rejection sampling that keeps the target distribution); p += a + 1. Only slots whose
   sequence has tokens left to launch select; the others' positions stay where they are (inside the cache).
5. Every slot's GDN states after its token a (one copy for all slots and layers), and the MTP rule for the
   accepted drafts: the pairs (h_{p+i}, t_i) at p+i (rows past a write positions past the sequence's end,
   rewritten before any read), h_{p+a} carried.
With k = 0 this is the plain step (engine.BatchEngine.run_rows) of B rows.

Every row of the verify is computed in the decode step's float order (attention: the same splits; the Q8_0
GEMV: each row the bits of a one-row call, in a rowwise scratch at any row count; GDN: sequential per token), so
greedy output is plain greedy output token for token, whatever else is in the batch.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .generation import GenerationStats
from .layers import INT_GEMM_MIN_ROWS, DenseLinear, Q8Linear
from .sampling import SamplingConfig, select_next_token, select_speculative
from .scratch import Scratch
from .state import KVCache

# A slot's k+1 verify rows: gdn_step and the shared cache's same attention split take up to 8 tokens of a
# sequence, and a scratch that is not rowwise (batch_invariant=False) keeps one slot's rows on the GEMV below
# INT_GEMM_MIN_ROWS (the int8 GEMM sums in another order, which would break greedy equality with plain decode).
MAX_DRAFT_TOKENS = INT_GEMM_MIN_ROWS - 2
SELECT_CONFIGS_PER_SLOT = 4  # sampling configs whose selection graphs a slot keeps (engine.SELECT_GRAPHS_PER_SLOT)

# The adaptive draft length (host side, from what is read back): expected tokens per step over the step's
# time. Step times are measured as the run goes (CUDA events around each step), per bucket of slots; until a
# draft count has been timed there, its time is this prior, in units of a k = 0 step, scaled by the bucket's
# steps timed so far. The prior is the H200 at the 27B shape: a pass over T rows costs ROW_COST(T) passes of one
# row (VERIFY_COST up to 7 rows: benchmarks/speculative.py, 90fbad6; from 8 the rows kernel's token matrices,
# NOTES "The rows kernel, round 3", linear in between), a draft step DRAFT_COST (the 248320-row head dominates
# it) of a pass over its rows.
VERIFY_COST = (1.0, 1.14, 1.33, 1.41, 1.77, 1.87, 2.14)
ROWS_KERNEL_COST = ((8, 1.97), (16, 3.06), (32, 5.71), (64, 11.2))
DRAFT_COST = 0.056
PROBE_EVERY = 8  # at k = 0 nothing is drafted, so every PROBE_EVERY-th step drafts one token to keep measuring
DECAY = 0.9  # weight of the past in the running acceptance and step-time estimates


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits when each draft is accepted with probability alpha, independently, until the
    first rejection: 1 + alpha + ... + alpha^k."""
    return sum(alpha**i for i in range(k + 1))


def row_cost(rows: int) -> float:
    """The prior's time of a pass over `rows` rows, in passes of one row."""
    if rows <= len(VERIFY_COST):
        return VERIFY_COST[rows - 1]
    points = [(len(VERIFY_COST), VERIFY_COST[-1]), *ROWS_KERNEL_COST]
    for (r0, c0), (r1, c1) in zip(points, points[1:]):
        if rows <= r1:
            return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)
    last_rows, last_cost = points[-1]
    return last_cost * rows / last_rows


def prior_step_cost(k: int, slots: int = 1) -> float:
    """A step of k drafts over `slots` slots, in k = 0 steps of as many slots."""
    return row_cost(slots * (k + 1)) / row_cost(slots) + k * DRAFT_COST


def best_draft_count(alpha: float, step_cost) -> int:
    """The k maximising expected tokens per unit of time; step_cost: a list of k_max + 1 times."""
    return max(range(len(step_cost)), key=lambda k: expected_tokens(alpha, k) / step_cost[k])


class DraftPolicy:
    """The draft count of each step from what the host reads back: the running per-draft acceptance, pooled over
    the slots (a slot's step that accepted a of k drafts saw a acceptances and, if a < k, one rejection), and the
    running time of a step of each k over each bucket of `slots` slots (one k for every slot of a step: their
    rows share the verify's pass)."""

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max = k_max
        self.adaptive = adaptive
        self.accepted = 1.0  # optimistic prior: start by drafting k_max
        self.trials = 1.0
        self.steps = 0
        self.seconds: dict[int, list[float | None]] = {}  # per bucket: running step time per k, once timed

    def record(self, k: int, a: int, seconds: float | None, slots: int = 1) -> None:
        """One slot's step of k drafts that accepted a; seconds: the step's time (once a step, with any slot)."""
        if k > 0:
            self.accepted = DECAY * self.accepted + a
            self.trials = DECAY * self.trials + a + (a < k)
        if seconds is not None:
            times = self.seconds.setdefault(slots, [None] * (self.k_max + 1))
            old = times[k]
            times[k] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def step_cost(self, slots: int = 1) -> list[float]:
        times = self.seconds.get(slots, [None] * (self.k_max + 1))
        timed = [(t, prior_step_cost(k, slots)) for k, t in enumerate(times) if t is not None]
        unit = sum(t for t, _ in timed) / sum(c for _, c in timed) if timed else 1.0
        return [t if t is not None else prior_step_cost(k, slots) * unit for k, t in enumerate(times)]

    def next_k(self, slots: int = 1) -> int:
        self.steps += 1
        if not self.adaptive:
            return self.k_max
        k = best_draft_count(self.accepted / self.trials, self.step_cost(slots))
        return 1 if k == 0 and self.steps % PROBE_EVERY == 0 else k


@dataclass
class SpeculativeStats(GenerationStats):
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_step(self) -> float:
        return (self.new_tokens - 1) / self.steps if self.steps else 0.0

    def __str__(self) -> str:
        rate = f"{self.accepted / self.drafted:.1%}" if self.drafted else "n/a"
        return (f"{super().__str__()} | speculative (MTP): {self.steps} steps, {self.tokens_per_step:.2f} "
                f"tokens/step, {self.accepted}/{self.drafted} drafts accepted ({rate})")


def head_rows(lm_head: Q8Linear | DenseLinear, rows: int) -> Q8Linear | DenseLinear:
    """The LM head's first `rows` rows, a linear of its type and input format over views of its weights (no
    copy): a draft head over a reduced vocabulary, reading the MTP block's output as the head does. Token ids
    of byte-level BPE vocabularies are in merge order, so low ids are the frequent tokens; drafts are never
    outside it, while the verify still scores the whole vocabulary."""
    return lm_head.first_rows(rows, "mtp.draft_head")


@dataclass(frozen=True)
class Speculation:
    """What the MTP step drafts: up to num_draft_tokens tokens a step, the count adapting to the acceptance
    seen (DraftPolicy; adaptive=False: always num_draft_tokens), from token ids below draft_vocab_size (None:
    the whole vocabulary; the verify scores it all either way). forced_drafts: the drafts are read from
    MTPStep.forced (a token sequence a slot, indexed by position) instead of the MTP block's argmax, which still
    runs: the test harness for 0%, partial and 100% acceptance, and the benchmark's perfect draft."""

    num_draft_tokens: int = 3
    draft_vocab_size: int | None = None
    adaptive: bool = True
    forced_drafts: bool = False


class MTPStep:
    """The MTP step of a BatchEngine (BatchEngine(speculation=...)) over its slots: its buffers and its graphs
    (per bucket and k: the drafts and verify, the rollback; per slot, sampling config and k: the selection).
    Slot b's verify rows are rows b*(k+1) .. b*(k+1)+k of the bucket's B*(k+1)."""

    def __init__(self, model, max_batch: int, speculation: Speculation):
        if model.mtp is None:
            raise ValueError(f"speculative='mtp' needs a checkpoint with the MTP block ({model.config.source} has "
                             "none: a GGUF converted with --no-mtp, or an HF folder without mtp.* tensors)")
        k_max, vocab = speculation.num_draft_tokens, model.config.vocab_size
        if isinstance(k_max, bool) or not isinstance(k_max, int) or not 1 <= k_max <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], found {k_max}")
        draft_vocab = speculation.draft_vocab_size
        if draft_vocab is not None and not 1 <= draft_vocab <= vocab:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab}], found {draft_vocab}")
        self.model, self.speculation, self.k_max, self.rows = model, speculation, k_max, k_max + 1
        self.draft_counts = range(k_max + 1) if speculation.adaptive else (k_max,)
        self.draft_head = model.lm_head if draft_vocab in (None, vocab) else head_rows(model.lm_head, draft_vocab)
        dev = model.device
        self.drafts = torch.zeros(k_max, max_batch, dtype=torch.int32, device=dev)  # drafts[j, b]: slot b's d_{j+1}
        self.pending = torch.zeros(max_batch, dtype=torch.int32, device=dev)  # each slot's x_p
        # The verify's ids and positions, slot b's k+1 at b*(k+1) .. (the first B*(k+1) of max_batch*rows).
        self.verify_ids = torch.zeros(max_batch * self.rows, dtype=torch.int32, device=dev)
        self.verify_positions = torch.zeros(max_batch * self.rows, dtype=torch.int32, device=dev)
        # A flag a row for the ops of the verify (and of step 5's pairs), ORed into the slots' flags at the end.
        self.verify_flags = torch.zeros(max_batch * self.rows, dtype=torch.int32, device=dev)
        self.pair_flags = torch.zeros(max_batch * k_max, dtype=torch.int32, device=dev)
        self.row_index = torch.arange(self.rows, dtype=torch.int32, device=dev)
        self.slot_index = torch.arange(max_batch, dtype=torch.int64, device=dev)
        # Each slot's verify logits [rows, V], at fixed addresses whatever the bucket: the selections read them;
        # and the verify's normed hidden rows, which step 5 reads.
        self.logits = torch.zeros(max_batch, self.rows, vocab, device=dev)
        self.hidden = torch.zeros(max_batch * self.rows, model.config.hidden_size, device=dev)
        # A Scratch per bucket for the pending tokens' pairs (B rows) and the drafts (B rows), and per (bucket, k)
        # for the verify (B*(k+1) rows, with step 5's B*k pairs). Buffers are allocated by the warm-ups and never
        # again (frozen).
        self.scratch: dict = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self.select_graphs: OrderedDict = OrderedDict()  # (slot, cfg) -> {k: graph}, least recently used first
        self.policy = DraftPolicy(k_max, speculation.adaptive)

    def bind(self, engine) -> None:
        """The engine's tensors the step reads and writes: the slots' states (their GDN layers keep per-token
        states for the verify), token rows, accepted counts, samplers."""
        self.engine = engine
        engine.slots.keep_token_states(self.rows)
        self.forced = None
        if self.speculation.forced_drafts:
            self.forced = torch.zeros(engine.max_batch, engine.slots.max_seq_len + self.rows, dtype=torch.int32,
                                      device=engine.device)

    def _scratch(self, key) -> Scratch:
        if key not in self.scratch:
            self.scratch[key] = Scratch(self.model.device, rowwise=self.engine.batch_invariant)
        return self.scratch[key]

    # --- the step's parts -----------------------------------------------------------------------------
    def verify(self, rows: int, k: int) -> None:
        """Steps 1-3 over slots 0..rows-1: each slot's pending token's pair, its drafts, the trunk over its k+1
        tokens; the logits into self.logits[:rows, :k+1]."""
        m, e, T = self.model, self.engine, k + 1
        batch = e.slots.rows(rows)
        base = e.slots.positions[:rows]  # p: each slot's pending token's position
        pending = self.pending[:rows]
        torch.gather(e.emitted[:rows], 1, e.accepted[:rows, None].long(), out=pending[:, None])  # x_p = t_a
        e.accepted[:rows].zero_()  # a slot that selects nothing this step accepts its token 0 (step 5)
        ids = self.verify_ids[: rows * T].view(rows, T)
        ids[:, 0].copy_(pending)
        act = m.mtp_pairs(batch.mtp_hidden, pending, base, batch.mtp_cache, self._scratch(("pair", rows)))
        if k > 0:
            self._draft(act, rows, k, batch.mtp_cache)
            ids[:, 1:].copy_(self.drafts[:k, :rows].t())
        positions = self.verify_positions[: rows * T]
        positions.view(rows, T).copy_(base[:, None] + self.row_index[:T])
        flags = self.verify_flags[: rows * T]
        flags.zero_()
        scratch = self._scratch((rows, k))
        residual, delta = m.trunk(ids.view(-1), positions, e.slots.rows(rows, T, flags), scratch,
                                  keep_token_states=k > 0)
        normed = m.final_norm(residual, delta, scratch)
        self.hidden[: rows * T].copy_(normed.x)
        self.logits[:rows, :T].copy_(m.lm_head(normed, scratch).view(rows, T, -1))

    def _draft(self, act, rows: int, k: int, cache: KVCache) -> None:
        """Each slot's d_1 from its pending token's pair, then d_2..d_k from single-row steps."""
        m, scratch, base = self.model, self._scratch(("draft", rows)), self.engine.slots.positions[:rows]
        best = scratch.empty("mtp_row", "argmax", (rows,), torch.int64)
        row = act
        for j in range(k):
            torch.argmax(self.draft_head(row, scratch), dim=1, out=best)
            self.drafts[j, :rows].copy_(best)
            if j + 1 < k:
                row = m.mtp(row.x, self.drafts[j, :rows], base + j, cache, scratch)
        if self.forced is not None:
            positions = (base[:, None] + self.row_index[1 : k + 1]).long()
            self.drafts[:k, :rows].copy_(torch.gather(self.forced[:rows], 1, positions).t())

    def select(self, slot: int, k: int, cfg: SamplingConfig, sampler=None, tokens=None, accepted=None,
               position=None) -> None:
        """Step 4 for one slot: its tokens t_0..t_a into emitted[slot], a into accepted[slot], its position
        advanced by a + 1 (the engine's; a capture's warm-up passes throwaway ones)."""
        e = self.engine
        sampler = sampler or e.samplers[slot]
        tokens = e.emitted[slot, : k + 1] if tokens is None else tokens
        position = e.slots.positions[slot : slot + 1] if position is None else position
        if k == 0:
            select_next_token(self.logits[slot, 0], sampler, cfg, tokens[:1], position)
            return
        accepted = e.accepted[slot : slot + 1] if accepted is None else accepted
        select_speculative(self.logits[slot, : k + 1], self.drafts[:k, slot], sampler, cfg, tokens, accepted)
        position.add_(accepted + 1)

    def finish(self, rows: int, k: int) -> None:
        """Step 5 over slots 0..rows-1: each slot's GDN states after its token a, the pairs of its accepted
        drafts, its hidden carry h_{p+a}; the rows' flags into the slots'."""
        m, e, T = self.model, self.engine, k + 1
        normed = self.hidden[: rows * T]
        batch = e.slots.rows(rows)
        last = self.slot_index[:rows] * T + e.accepted[:rows].long()  # each slot's row of its token a
        if k > 0:
            e.slots.accept(last)
            scratch = self._scratch((rows, k))
            hidden = scratch.empty("mtp_step", "pair_hidden", (rows * k, m.config.hidden_size))
            hidden.view(rows, k, -1).copy_(normed.view(rows, T, -1)[:, :k])
            ids = scratch.empty("mtp_step", "pair_ids", (rows * k,), torch.int32)
            ids.view(rows, k).copy_(e.emitted[:rows, :k].clamp(min=0))  # -1 past a
            positions = scratch.empty("mtp_step", "pair_positions", (rows * k,), torch.int32)
            positions.view(rows, k).copy_(self.verify_positions[: rows * T].view(rows, T)[:, 1:])
            flags = self.pair_flags[: rows * k]
            flags.zero_()
            m.mtp_pairs(hidden, ids, positions, KVCache(batch.mtp_cache.k, batch.mtp_cache.v, flags), scratch)
            e.slots.fold_flags(flags.view(rows, k))
        torch.index_select(normed, 0, last, out=batch.mtp_hidden)
        e.slots.fold_flags(self.verify_flags[: rows * T].view(rows, T))

    def warm_up(self, rows: int, k: int) -> None:
        """The verify run once before its capture (eagerly: it allocates the scratch buffers), on inputs set here
        to valid values whatever the engine holds (a fresh engine, or one after a generation): the ids it embeds
        in [0, vocab), every position inside the caches (the pending token's pair at 0, not -1). An invalid id
        here was a device-side assert in the first capture (issue 20). It writes the slots: no sequence may be
        active."""
        e = self.engine
        e.slots.positions[:rows].fill_(1)
        e.accepted[:rows].zero_()
        e.emitted[:rows].zero_()  # the pending token emitted[b, accepted[b]]
        self.verify(rows, k)

    # --- the engine's side -----------------------------------------------------------------------------
    def captured(self, rows: int) -> bool:
        return all((rows, k) in self.graphs for k in self.draft_counts)

    def capture(self, rows: int) -> None:
        """The graphs of a bucket for every draft count (no sequence active: the warm-ups write the slots)."""
        graph = self.engine.graph
        for k in self.draft_counts:
            self.graphs[(rows, k)] = (graph(lambda: self.verify(rows, k), lambda: self.warm_up(rows, k)),
                                      graph(lambda: self.finish(rows, k), lambda: self.finish(rows, k)))
        for key in (("pair", rows), ("draft", rows), *((rows, k) for k in self.draft_counts)):
            self._scratch(key).freeze()

    def admit(self, seq, slot: int) -> None:
        """A sequence is moving into slot: its config's selection graphs captured (CUDA; at most
        SELECT_CONFIGS_PER_SLOT configs a slot, the least recently used dropped); into an engine with no active
        sequence, a fresh draft policy (so that one sequence's steps, and its sampled tokens, do not depend on
        what ran before it)."""
        if not any(self.engine.active):
            self.policy = DraftPolicy(self.k_max, self.speculation.adaptive)
        if not self.engine.use_graph or (slot, seq.cfg) in self.select_graphs:
            return
        clock = time.perf_counter()
        mine = [key for key in self.select_graphs if key[0] == slot]
        if len(mine) >= SELECT_CONFIGS_PER_SLOT:
            torch.cuda.current_stream(self.model.device).synchronize()  # replays in flight keep their graphs alive
            del self.select_graphs[mine[0]]
        self.select_graphs[(slot, seq.cfg)] = {k: self._capture_select(slot, k, seq.cfg) for k in self.draft_counts}
        seq.stats.capture_s = time.perf_counter() - clock

    def _capture_select(self, slot: int, k: int, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        # Warmed up on a throwaway sampler, tokens, count and position: it must not advance the slot's.
        e, dev = self.engine, self.model.device
        dummy = e._sampler(self.model.config.vocab_size)
        tokens = torch.zeros(k + 1, dtype=torch.int32, device=dev)
        accepted, position = torch.zeros(1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev)
        return e.graph(lambda: self.select(slot, k, cfg), lambda: self.select(slot, k, cfg, dummy, tokens, accepted,
                                                                               position))

    def launch(self, rows: int, selecting: list, use_graph: bool) -> int:
        """One step over slots 0..rows-1, k from the policy, selecting for the (slot, sequence) pairs given;
        returns k."""
        k = self.policy.next_k(rows)
        if not use_graph:
            self.verify(rows, k)
            for slot, seq in selecting:
                self.select(slot, k, seq.cfg)
            self.finish(rows, k)
            return k
        if not self.captured(rows):
            raise RuntimeError(f"no MTP step graphs for {rows} rows: capture() every bucket needed before admitting")
        verify, finish = self.graphs[(rows, k)]
        verify.replay()
        for slot, seq in selecting:
            self.select_graphs.move_to_end((slot, seq.cfg))
            self.select_graphs[(slot, seq.cfg)][k].replay()
        finish.replay()
        return k

    def read(self, k: int, rows: int, accepted: list, start, end) -> None:
        """A step read back: each (sequence, a) of its selecting slots, a of k drafts accepted. start, end: CUDA
        events around the step (None on the CPU), its time."""
        seconds = start.elapsed_time(end) * 1e-3 if start is not None and end is not None else None
        for seq, a in accepted:
            self.policy.record(k, a, seconds, rows)
            seconds = None  # the step's time counts once
            seq.stats.steps += 1
            seq.stats.drafted += k
            seq.stats.accepted += a
