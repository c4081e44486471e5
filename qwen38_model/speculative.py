"""MTP speculative decoding: the model's MTP block drafts k tokens, one pass of the trunk over the k+1
tokens [pending, d_1..d_k] verifies them, and the state keeps the longest accepted prefix. A whole step
(draft, verify, accept, rollback, token and position advance) is one captured CUDA graph per draft count k;
the host reads the accepted tokens a few steps behind, as in plain decode.

One step, with p = tokens the trunk has consumed and x_p the pending token (chosen, not yet consumed):
1. The MTP block over the previous verify's rows, teacher-forced: row i pairs the trunk's normed hidden at
   position p0+i with the token that followed it, at position p0+i (vLLM's convention). This fills the
   block's KV cache for every accepted position; the row of the last accepted token gives draft d_1.
   Rows past the accepted ones write MTP KV rows past the sequence's end, overwritten before any read.
2. k-1 single-row MTP steps on the block's own normed output give d_2..d_k.
3. The trunk over [x_p, d_1..d_k] at positions p..p+k, keeping each GDN layer's state after every token.
4. select_speculative: the target tokens t_0..t_a (greedy: exactly plain greedy's; sampling: rejection
   sampling that keeps the target distribution), then the GDN states after token a, p += a + 1.

Every row of the verify is computed in the decode step's float order (attention: the same splits; the
GEMV: T < 8 rows share weight loads but not arithmetic; GDN: sequential per token), so greedy output is
plain greedy output token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .formats import Activation
from .generation import GenerationStats, StopCondition, check_run, keep_only
from .layers import INT_GEMM_MIN_ROWS, DenseLinear, Q8Linear
from .sampling import SamplerState, SamplingConfig, select_next_token, select_speculative
from .scratch import Scratch
from .state import StateSnapshot

# The verify's k+1 rows must stay on the GEMV (the int8 GEMM from INT_GEMM_MIN_ROWS rows sums in another
# order, which would break greedy equality with plain decode).
MAX_DRAFT_TOKENS = INT_GEMM_MIN_ROWS - 2
READ_BEHIND = 4  # steps in flight before the host waits for the oldest one's tokens

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


class SpeculativeEngine:
    """Static buffers and captured step graphs (one per draft count k in 0..k_max and sampling config) for
    one sequence of up to max_seq_len tokens. forced_drafts: drafts are read from self.forced (a token
    sequence indexed by position) instead of the MTP block's argmax, which still runs: the test harness for
    0%, partial and 100% acceptance, and the benchmark's perfect draft."""

    def __init__(self, model, max_seq_len: int, kv_dtype, use_graph: bool | None, num_draft_tokens: int,
                 forced_drafts: bool = False, draft_vocab_size: int | None = None):
        if model.mtp is None:
            raise ValueError(f"speculative='mtp' needs a checkpoint with the MTP block ({model.config.source} has "
                             "none: a GGUF converted with --no-mtp, or an HF folder without mtp.* tensors)")
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], found {num_draft_tokens}")
        vocab = model.config.vocab_size
        if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size must be in [1, {vocab}], found {draft_vocab_size}")
        self.model = model
        self.device = model.device
        self.k_max = num_draft_tokens
        self.draft_vocab_size = draft_vocab_size
        self.draft_head = model.lm_head if draft_vocab_size in (None, vocab) else head_rows(model.lm_head, draft_vocab_size)
        rows = num_draft_tokens + 1
        self.max_seq_len = max_seq_len
        self.kv_dtype = kv_dtype
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        # Steps in flight may run past the last token read: room for them, and for the MTP pass's rows.
        capacity = max_seq_len + (READ_BEHIND + 3) * rows
        self.state = model.new_state(capacity, kv_dtype, spare_rows=capacity - max_seq_len)
        self.state.keep_token_states(rows)
        dev, D = self.device, model.config.hidden_size

        def ints(n, fill=0):
            return torch.full((n,), fill, dtype=torch.int32, device=dev)

        self.base = self.state.device_position  # p: tokens consumed = the pending token's position
        self.num_accepted = ints(1)  # a of the last verify
        # The last verify's t_0..t_a, -1 past a (the MTP pass clamps them; the trunk reads only t_a). Zeros, a
        # valid id, until the first step: a capture's warm-up runs before any prefill (warm_up).
        self.tokens = ints(rows)
        self.hidden = torch.zeros(rows, D, device=dev)  # the last verify's normed trunk hidden rows
        self.drafts = ints(num_draft_tokens)
        self.verify_ids = ints(rows)
        self.row_index = torch.arange(rows, dtype=torch.int32, device=dev)
        self.dummy_position = ints(1)  # select_next_token advances a position; the engine keeps its own
        self.forced = ints(capacity + rows) if forced_drafts else None
        self.sampler = SamplerState.empty(model.config.vocab_size, dev)
        # A Scratch per row count: the MTP pass (rows), the drafts (1), each verify (k + 1). Buffers are
        # allocated by the warm-up before any capture and never again (frozen).
        self.scratch = {name: Scratch(dev) for name in ("mtp_pass", "draft")}
        self.scratch.update({k: Scratch(dev) for k in range(rows)})
        self.graphs: dict[tuple[SamplingConfig, int], torch.cuda.CUDAGraph] = {}
        self.read_ahead = READ_BEHIND if self.use_graph else 0

    # --- the step ------------------------------------------------------------------------------------
    def step(self, k: int, cfg: SamplingConfig) -> None:
        m, state = self.model, self.state
        first = self.base - self.num_accepted - 1  # the previous verify's first position
        act = m.mtp(self.hidden, self.tokens.clamp(min=0), first + self.row_index, state.mtp_cache,
                    self.scratch["mtp_pass"])
        if k > 0:
            self._draft(act, k)
        torch.index_select(self.tokens, 0, self.num_accepted, out=self.verify_ids[:1])  # x_p = t_a
        self.verify_ids[1 : k + 1].copy_(self.drafts[:k])
        scratch = self.scratch[k]
        positions = self.base + self.row_index[: k + 1]
        residual, delta = m.trunk(self.verify_ids[: k + 1], positions, state, scratch, keep_token_states=k > 0)
        normed = m.final_norm(residual, delta, scratch)
        self.hidden[: k + 1].copy_(normed.x)
        logits = m.lm_head(normed, scratch)
        self.tokens.fill_(-1)
        if k > 0:
            select_speculative(logits, self.drafts[:k], self.sampler, cfg, self.tokens[: k + 1], self.num_accepted)
            state.accept(self.num_accepted.long())
        else:
            select_next_token(logits[0], self.sampler, cfg, self.tokens[:1], self.dummy_position)
            self.num_accepted.zero_()
        self.base.add_(self.num_accepted + 1)

    def _draft(self, act: Activation, k: int) -> None:
        """d_1 from the MTP pass's row a (the last accepted token), then d_2..d_k from single-row steps."""
        m, scratch = self.model, self.scratch["draft"]
        row = Activation(act.format, *(None if t is None else scratch.empty("mtp_row", name, (1, *t.shape[1:]), t.dtype)
                                       for name, t in zip(("x", "q", "q_lo", "d"), act.outs())))
        for src, dst in zip(act.outs(), row.outs()):
            if src is not None:
                torch.index_select(src, 0, self.num_accepted, out=dst)
        best = scratch.empty("mtp_row", "argmax", (), torch.int64)
        for j in range(k):
            torch.argmax(self.draft_head(row, scratch)[0], out=best)
            self.drafts[j : j + 1].copy_(best)
            if j + 1 < k:
                row = m.mtp(row.x, self.drafts[j : j + 1], self.base + j, self.state.mtp_cache, scratch)
        if self.forced is not None:
            positions = (self.base + self.row_index[1 : k + 1]).long()
            torch.index_select(self.forced, 0, positions, out=self.drafts[:k])

    # --- graphs --------------------------------------------------------------------------------------
    def capture(self, cfg: SamplingConfig, draft_counts) -> None:
        """Capture the step for cfg and each k (once each). Must run before reset(): the warm-up steps
        write the state. The warm-up allocates every scratch buffer, then the scratches are frozen."""
        todo = [k for k in draft_counts if (cfg, k) not in self.graphs]
        if not todo:
            return
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for k in todo:
                self.warm_up(k, cfg)
        stream.wait_stream(side)
        for k in todo:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step(k, cfg)
            self.graphs[(cfg, k)] = graph
        for scratch in self.scratch.values():
            scratch.freeze()

    def warm_up(self, k: int, cfg: SamplingConfig) -> None:
        """The step run once before its capture (eagerly: it allocates the scratch buffers), on inputs set
        here to valid values whatever the engine holds (a fresh engine, or one after a generation): the ids
        it embeds in [0, vocab), every position inside the caches. An invalid id here was a device-side
        assert in the first capture (issue 20). It writes the state: reset() must follow."""
        # The MTP pass starts one row before the verify: at base 1 that row is position 0, not -1.
        self.base.fill_(1)
        self.num_accepted.zero_()
        self.tokens.zero_()  # the pending token x_p = tokens[num_accepted]; the MTP pass's ids
        self.step(k, cfg)

    # --- a generation ----------------------------------------------------------------------------------
    def reset(self, history: torch.Tensor, seed: int, cfg: SamplingConfig, start: StateSnapshot | None = None) -> None:
        """Empty state, or `start` copied into the state's own tensors (the graphs keep their addresses); the
        sampler sees the whole history either way, so the output is the same as from scratch."""
        if start is None:
            self.state.clear()
        else:
            self.state.restore(start)
        self.sampler.reset(history, seed, cfg.eos_token_ids)

    def prefill(self, history: torch.Tensor, cfg: SamplingConfig, chunk_size: int, progress=None) -> None:
        """The prompt (history past the state's position) through the model's chunked prefill, the MTP block
        over every prompt row but the last (pairs (h_t, x_{t+1})), and t_0 from the last row's logits. The
        last row's pair (h_{n-1}, t_0) is left to the first step's MTP pass, as if a verify had accepted 0."""
        m, state = self.model, self.state
        prompt = history[state.position:]
        total = prompt.shape[0]
        positions = state.reserve(total)

        def mtp_pairs(normed: Activation, begin: int, end: int, scratch: Scratch) -> None:
            rows = end - begin - (end == total)  # rows whose next token is in the prompt
            if rows > 0:
                m.mtp(normed.x[:rows], prompt[begin + 1 : begin + 1 + rows], positions[begin : begin + rows],
                      state.mtp_cache, scratch)
            if end == total:
                self.hidden[0].copy_(normed.x[-1])

        logits = m.prefill(prompt, positions, state, logits_to_keep=1, chunk_size=chunk_size, progress=progress,
                           on_hidden=mtp_pairs)
        self.tokens.fill_(-1)
        select_next_token(logits[0], self.sampler, cfg, self.tokens[:1], self.dummy_position)
        self.num_accepted.zero_()


def run_speculative(engine: SpeculativeEngine, history: torch.Tensor, cfg: SamplingConfig, max_new_tokens: int,
                    seed: int, stop: StopCondition, chunk_size: int, streamer=None, prefill_progress=None,
                    start: StateSnapshot | None = None, keep_state: bool = False, snapshot_prompt: bool = False,
                    adaptive: bool = True) -> tuple[list[int], SpeculativeStats, StateSnapshot | None]:
    """run_generation's contract (generation.py) with speculative steps: each replay emits 1..k+1 tokens."""
    check_run(engine, history, max_new_tokens, start)
    policy = DraftPolicy(engine.k_max, adaptive)
    draft_counts = range(engine.k_max + 1) if adaptive else (engine.k_max,)
    stats = SpeculativeStats(prompt_tokens=history.shape[0] - (start.position if start else 0), graph=engine.use_graph)
    if engine.use_graph:
        clock = time.perf_counter()
        engine.capture(cfg, draft_counts)
        stats.capture_s = time.perf_counter() - clock

        def replay(k: int) -> None:
            engine.graphs[(cfg, k)].replay()
    else:
        def replay(k: int) -> None:
            engine.step(k, cfg)
    engine.reset(history, seed, cfg, start)
    on_gpu = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    rows = engine.k_max + 1
    slots = engine.read_ahead + 2  # the event of the step before the one read is still needed (its time)
    host = torch.empty(slots, rows + 1, dtype=torch.int32, pin_memory=on_gpu)  # tokens, then a
    events: list[torch.cuda.Event | None] = [None] * slots

    def launch_copy(i: int) -> None:
        host[i % slots, :rows].copy_(engine.tokens, non_blocking=True)
        host[i % slots, rows:].copy_(engine.num_accepted, non_blocking=True)
        if on_gpu:
            events[i % slots] = torch.cuda.Event(enable_timing=True)
            events[i % slots].record()

    def step_seconds(i: int) -> float | None:
        """GPU time between the events of launches i-1 and i: step i's time while the host keeps the GPU
        fed (it launches ahead), an overestimate when it does not."""
        return events[(i - 1) % slots].elapsed_time(events[i % slots]) * 1e-3 if on_gpu and i > 1 else None

    sync()
    clock = time.perf_counter()
    engine.prefill(history, cfg, chunk_size, prefill_progress)
    rewind_mark = engine.state.mark() if keep_state else None
    after_prefill = engine.state.snapshot() if snapshot_prompt else None
    launch_copy(0)
    sync()
    stats.prefill_s = time.perf_counter() - clock
    clock = time.perf_counter()
    drafts_of = [0]  # k of each launch (launch 0 is the prefill)
    launched, read, done = 1, 0, False
    while not done:
        # The host must not overwrite a slot before reading it: at most `slots` launches outstanding.
        while launched <= read + engine.read_ahead and len(stop.tokens) + (launched - read) <= max_new_tokens:
            k = policy.next_k()
            replay(k)
            drafts_of.append(k)
            launch_copy(launched)
            launched += 1
        if read == launched:
            break
        if on_gpu:
            events[read % slots].synchronize()
        a = int(host[read % slots, rows])
        k = drafts_of[read]
        if read > 0:
            policy.record(k, a, step_seconds(read))
            stats.steps += 1
            stats.drafted += k
            stats.accepted += a
        for token in host[read % slots, : a + 1].tolist():
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if stop.done(token) or len(stop.tokens) == max_new_tokens:
                done = True
                break
        read += 1
    sync()
    stats.decode_s = time.perf_counter() - clock
    stats.new_tokens = len(stop.tokens)
    engine.state.sync_position()  # steps past a stop included
    if rewind_mark is not None and engine.state.position != history.shape[0] + len(stop.tokens) - 1:
        keep_only(engine.model, engine.state, rewind_mark, stop.tokens[:-1])  # as plain decode does
    return stop.tokens, stats, after_prefill
