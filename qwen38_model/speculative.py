"""MTP speculative decoding, the engine's MTP step: the model's MTP block drafts k tokens, one pass of the
trunk over the k+1 tokens [pending, d_1..d_k] verifies them, and the state keeps the longest accepted
prefix. A whole step (draft, verify, accept, rollback, token and position advance) is one captured CUDA
graph per draft count k and sampling config; engine.BatchEngine launches it, reads the accepted tokens a few
steps behind as it reads plain steps, and picks k from what it read (DraftPolicy).

One step, with p = tokens the trunk has consumed and x_p the pending token (chosen, not yet consumed), the
state's MTP part as the MTP rule leaves it (state.py: pairs up to p-2 in the block's cache, h_{p-1} carried):
1. The MTP rule for x_p: the block over the pair (h_{p-1}, x_p) at position p-1 (vLLM's convention); its
   output gives draft d_1.
2. k-1 single-row MTP steps on the block's own normed output give d_2..d_k (their KV rows, at p.., are
   rewritten by step 5 before any read).
3. The trunk over [x_p, d_1..d_k] at positions p..p+k, keeping each GDN layer's state after every token.
4. select_speculative: the target tokens t_0..t_a (greedy: exactly plain greedy's; sampling: rejection
   sampling that keeps the target distribution), then the GDN states after token a.
5. The MTP rule for the accepted drafts: the pairs (h_{p+i}, t_i) at p+i (rows past a write positions past
   the sequence's end, rewritten before any read), h_{p+a} carried; p += a + 1.
With k = 0 this is the plain step (engine.BatchEngine.run_rows) of one row.

Every row of the verify is computed in the decode step's float order (attention: the same splits; the
GEMV: T < 8 rows share weight loads but not arithmetic; GDN: sequential per token), so greedy output is
plain greedy output token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .formats import Activation
from .generation import GenerationStats
from .layers import INT_GEMM_MIN_ROWS, DenseLinear, Q8Linear
from .sampling import SamplingConfig, select_next_token, select_speculative
from .scratch import Scratch

# The verify's k+1 rows must stay on the GEMV (the int8 GEMM from INT_GEMM_MIN_ROWS rows sums in another
# order, which would break greedy equality with plain decode).
MAX_DRAFT_TOKENS = INT_GEMM_MIN_ROWS - 2

# The adaptive draft length (host side, from what is read back): expected tokens per step over the step's
# time. Step times are measured as the run goes (CUDA events between consecutive replays); until a draft
# count has been timed, its time is this prior, in units of a k = 0 step, scaled by the steps timed so far.
# The prior is the H200 at the 27B shape (benchmarks/speculative.py, 90fbad6): a verify of T rows costs
# VERIFY_COST[T - 1] plain passes, a draft step DRAFT_COST (the 248320-row head dominates it).
VERIFY_COST = (1.0, 1.14, 1.33, 1.41, 1.77, 1.87, 2.14)
DRAFT_COST = 0.056
PROBE_EVERY = 8  # at k = 0 nothing is drafted, so every PROBE_EVERY-th step drafts one token to keep measuring
DECAY = 0.9  # weight of the past in the running acceptance and step-time estimates


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits when each draft is accepted with probability alpha, independently, until the
    first rejection: 1 + alpha + ... + alpha^k."""
    return sum(alpha**i for i in range(k + 1))


def prior_step_cost(k: int) -> float:
    return VERIFY_COST[k] + k * DRAFT_COST


def best_draft_count(alpha: float, step_cost) -> int:
    """The k maximising expected tokens per unit of time; step_cost: a list of k_max + 1 times."""
    return max(range(len(step_cost)), key=lambda k: expected_tokens(alpha, k) / step_cost[k])


class DraftPolicy:
    """The draft count of each step from what the host reads back: the running per-draft acceptance (a step
    that accepted a of k drafts saw a acceptances and, if a < k, one rejection) and the running time of a
    step of each k."""

    def __init__(self, k_max: int, adaptive: bool):
        self.k_max = k_max
        self.adaptive = adaptive
        self.accepted = 1.0  # optimistic prior: start by drafting k_max
        self.trials = 1.0
        self.steps = 0
        self.seconds: list[float | None] = [None] * (k_max + 1)  # running step time per k, once timed

    def record(self, k: int, a: int, seconds: float | None) -> None:
        if k > 0:
            self.accepted = DECAY * self.accepted + a
            self.trials = DECAY * self.trials + a + (a < k)
        if seconds is not None:
            old = self.seconds[k]
            self.seconds[k] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def step_cost(self) -> list[float]:
        timed = [(t, prior_step_cost(k)) for k, t in enumerate(self.seconds) if t is not None]
        unit = sum(t for t, _ in timed) / sum(c for _, c in timed) if timed else 1.0
        return [t if t is not None else prior_step_cost(k) * unit for k, t in enumerate(self.seconds)]

    def next_k(self) -> int:
        self.steps += 1
        if not self.adaptive:
            return self.k_max
        k = best_draft_count(self.accepted / self.trials, self.step_cost())
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
    MTPStep.forced (a token sequence indexed by position) instead of the MTP block's argmax, which still runs:
    the test harness for 0%, partial and 100% acceptance, and the benchmark's perfect draft."""

    num_draft_tokens: int = 3
    draft_vocab_size: int | None = None
    adaptive: bool = True
    forced_drafts: bool = False


class MTPStep:
    """The MTP step of a BatchEngine (BatchEngine(speculation=...)): its buffers and its graphs, one per
    (sampling config, k), over slot 0. Its rows are one slot's k+1 verify rows. The CUDA ops take B rows of B
    slots (the plain step's batched-rows mode of attention and gdn_step) or T rows of one sequence (this
    verify), not B slots x T rows: the step serves one sequence, and more than one MTP slot needs [B, T]
    kernels. (The CPU reference ops would run more, but not through the code CUDA would run.)"""

    def __init__(self, model, max_batch: int, speculation: Speculation):
        if model.mtp is None:
            raise ValueError(f"speculative='mtp' needs a checkpoint with the MTP block ({model.config.source} has "
                             "none: a GGUF converted with --no-mtp, or an HF folder without mtp.* tensors)")
        if max_batch != 1:
            raise ValueError(f"speculative decoding runs one sequence at a time: max_batch must be 1, found {max_batch} "
                             "(several MTP slots need attention and gdn_step kernels over B slots x T verify rows)")
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
        self.drafts = torch.zeros(k_max, dtype=torch.int32, device=dev)
        self.verify_ids = torch.zeros(self.rows, dtype=torch.int32, device=dev)
        self.row_index = torch.arange(self.rows, dtype=torch.int32, device=dev)
        self.dummy_position = torch.zeros(1, dtype=torch.int32, device=dev)  # select_next_token advances one
        # A Scratch per row count: the pending token's pair (1 row), the drafts (1), each verify (k + 1, with
        # step 5's k pairs). Buffers are allocated by the warm-ups and never again (frozen).
        self.scratch = {name: Scratch(dev) for name in ("pair", "draft")}
        self.scratch.update({k: Scratch(dev) for k in range(self.rows)})
        self.graphs: dict[tuple[SamplingConfig, int], torch.cuda.CUDAGraph] = {}
        self.policy: DraftPolicy | None = None  # the admitted sequence's (admit)

    def bind(self, engine) -> None:
        """The engine's tensors the step reads and writes: slot 0's state (its GDN layers keep per-token states
        for the verify), token row, accepted count, sampler."""
        self.engine = engine
        self.state = engine.slots.slot(0)
        self.state.keep_token_states(self.rows)
        self.forced = None
        if self.speculation.forced_drafts:
            self.forced = torch.zeros(self.state.max_seq_len + self.rows, dtype=torch.int32, device=engine.device)

    # --- the step ------------------------------------------------------------------------------------
    def step(self, k: int, cfg: SamplingConfig) -> None:
        m, e, state = self.model, self.engine, self.state
        base = state.device_position  # p: the pending token's position
        row, accepted = e.emitted[0], e.accepted[:1]  # the last step's t_0..t_a and a
        torch.index_select(row, 0, accepted, out=self.verify_ids[:1])  # x_p = t_a
        act = m.mtp_pairs(state.mtp_hidden, self.verify_ids[:1], base, state.mtp_cache, self.scratch["pair"])
        if k > 0:
            self._draft(act, k)
        self.verify_ids[1 : k + 1].copy_(self.drafts[:k])
        scratch = self.scratch[k]
        positions = base + self.row_index[: k + 1]
        residual, delta = m.trunk(self.verify_ids[: k + 1], positions, state, scratch, keep_token_states=k > 0)
        normed = m.final_norm(residual, delta, scratch)
        logits = m.lm_head(normed, scratch)
        sampler = e.samplers[0]
        if k > 0:
            select_speculative(logits, self.drafts[:k], sampler, cfg, row[: k + 1], accepted)
            state.accept(accepted.long())
            m.mtp_pairs(normed.x[:k], row[:k].clamp(min=0), positions[1:], state.mtp_cache, scratch)  # -1 past a
        else:
            select_next_token(logits[0], sampler, cfg, row[:1], self.dummy_position)
            accepted.zero_()
        torch.index_select(normed.x, 0, accepted, out=state.mtp_hidden)  # h of the last token consumed
        base.add_(accepted + 1)

    def _draft(self, act: Activation, k: int) -> None:
        """d_1 from the pending token's pair, then d_2..d_k from single-row steps."""
        m, scratch, base = self.model, self.scratch["draft"], self.state.device_position
        row = act
        best = scratch.empty("mtp_row", "argmax", (), torch.int64)
        for j in range(k):
            torch.argmax(self.draft_head(row, scratch)[0], out=best)
            self.drafts[j : j + 1].copy_(best)
            if j + 1 < k:
                row = m.mtp(row.x, self.drafts[j : j + 1], base + j, self.state.mtp_cache, scratch)
        if self.forced is not None:
            positions = (base + self.row_index[1 : k + 1]).long()
            torch.index_select(self.forced, 0, positions, out=self.drafts[:k])

    def warm_up(self, k: int, cfg: SamplingConfig) -> None:
        """The step run once before its capture (eagerly: it allocates the scratch buffers), on inputs set
        here to valid values whatever the engine holds (a fresh engine, or one after a generation): the ids
        it embeds in [0, vocab), every position inside the caches (the pending token's pair at 0, not -1). An
        invalid id here was a device-side assert in the first capture (issue 20). It writes slot 0: an
        admission follows."""
        self.state.device_position.fill_(1)
        self.engine.accepted.zero_()
        self.engine.emitted.zero_()  # the pending token emitted[0, accepted[0]]
        self.step(k, cfg)

    # --- the engine's side -----------------------------------------------------------------------------
    def admit(self, seq) -> None:
        """A sequence is moving into slot 0: a fresh draft policy, and its config's graphs captured (CUDA)."""
        self.policy = DraftPolicy(self.k_max, self.speculation.adaptive)
        todo = [k for k in self.draft_counts if (seq.cfg, k) not in self.graphs]
        if not self.engine.use_graph or not todo:
            return
        clock = time.perf_counter()
        for k in todo:
            self.graphs[(seq.cfg, k)] = self.engine.graph(lambda: self.step(k, seq.cfg), lambda: self.warm_up(k, seq.cfg))
        for scratch in self.scratch.values():
            scratch.freeze()
        self.engine.slots.flags.zero_()
        seq.stats.capture_s = time.perf_counter() - clock

    def launch(self, seq, use_graph: bool) -> int:
        """One step of seq's (k from the policy); returns k."""
        k = self.policy.next_k()
        if use_graph:
            self.graphs[(seq.cfg, k)].replay()
        else:
            self.step(k, seq.cfg)
        return k

    def read(self, seq, k: int, a: int, previous, event) -> None:
        """A step of seq read back: a of its k drafts accepted. previous, event: the CUDA events of the step
        read before it (None if it was not a step) and of this one; the GPU time between them is this step's
        while the host keeps the GPU fed (it launches ahead), an overestimate when it does not."""
        seconds = previous.elapsed_time(event) * 1e-3 if previous is not None and event is not None else None
        self.policy.record(k, a, seconds)
        seq.stats.steps += 1
        seq.stats.drafted += k
        seq.stats.accepted += a
