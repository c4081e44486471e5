"""Many sequences at once: continuous batching over the slots of one SlotStates.

A sequence takes a free slot, is prefilled there on its own (the model's chunked prefill on the slot's
Qwen38State, in chunks the caller interleaves with decode steps), then decodes with every other active
sequence in one step over the rows 0..B-1 of the smallest captured bucket B that covers the highest active
slot. It leaves its slot when the host reads its stop; sequences join and leave between steps, and no graph
is recaptured for that:
- the step graph of a bucket (the model's `run` over B rows, rowwise scratch) is captured once, while no
  sequence is active (its warm-up writes the slots' states), and serves any set of sequences below B;
- the next-token selection is a graph per (slot, sampling config): select_next_token on that slot's row of
  the logits, the slot's own sampler state, token and position, so every sequence samples with its own
  parameters and seed. Rows of free slots, and of sequences that have all their tokens launched, run in
  the step but select nothing: their position stays where it is (inside the cache), their state is junk
  that the next prefill into the slot clears.
Each row gets the bits of a one-row call in every op (slots.py, Scratch.rowwise), and each sequence's
selection is its own: a sequence's tokens are the same whatever else is in the batch and whenever it joined.

The host never waits for a step before launching the next: each launch copies the tokens (and the error
flags) into pinned memory, read READ_BEHIND launches later, as in single-sequence decode. A sequence whose
config asks for logprobs (cfg.logprobs) has its selection write the chosen token's log-probability and the
TOP_LOGPROBS alternatives into its slot's rows of device buffers (sampling.write_logprobs: raw logits, before
any processor), copied in the same ring, only by launches that selected such a sequence; a logit bias
(cfg.logit_bias, the map in Sequence.logit_bias) is written into the slot's sampler at admission.

A constrained sequence (Sequence.constraint, cfg.token_mask: structured output) cannot be read behind: the
tokens its next selection may choose depend on the token just chosen. So while one is active, each step
launches the model's run, then waits for every launch before it (the previous step's tokens, read while the
GPU runs this step's layers), advances the constraint by its token, writes the allowed-token bitmask into the
slot's device row and only then launches the selections. The other sequences' tokens are read as soon, not
READ_BEHIND launches late: their tokens do not change, only the host's lead over the GPU (one step instead
of READ_BEHIND) while a constrained sequence decodes.

The step is pluggable: the plain step above, or (speculation: speculative.MTPStep) the MTP step, which drafts
k tokens for every slot below the bucket with the model's MTP block and verifies them in one pass of the trunk
over each slot's k+1 rows (B*(k+1) in all), one k for all slots; its graphs are the drafts and verify, and the
rollback, per (bucket, k), captured by capture() as the plain step's are, between them each selecting slot's
acceptance, a graph per (slot, sampling config, k) captured at its admission. Either way a launch leaves in
`emitted` the tokens each slot's row chose (1, or the MTP step's a+1) and in `accepted` how many beyond the
first; the ring copies both and read() hands each sequence its tokens. Both steps, like every
prefill, advance a state's MTP part by the MTP rule (state.py), so a snapshot of either drafts as well.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from .generation import GenerationStats, StopCondition, keep_only
from .sampling import TOP_LOGPROBS, SamplerState, SamplingConfig, check_logit_bias, mask_words, select_next_token
from .scratch import Scratch
from .slots import SlotStates
from .speculative import MTPStep, Speculation, SpeculativeStats
from .state import BAD_POSITION, BAD_TOKEN, Qwen38State, StateSnapshot

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # step graphs by row count; the engine's max_batch is always one
READ_BEHIND = 4  # launches in flight before the host waits for the oldest one's tokens
# Selection graphs kept per slot (least recently used evicted): a server's clients may send any sampling
# settings, and each graph holds its capture's memory.
SELECT_GRAPHS_PER_SLOT = 4


@dataclass
class TokenLogprobs:
    """A token's log-probability under the raw logits it was chosen from, and the most likely tokens' (id,
    log-probability), most likely first (min(V, TOP_LOGPROBS) of them)."""

    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    """One generation: history int32 [T] on the engine's device (the whole sequence so far), its sampling
    config and seed, and how it stops. start: a snapshot of the history's first start.position tokens
    (restored instead of prefilled). keep_state: at the end, `snapshot` holds the state after history + the
    new tokens but the last (what a conversation or a prefix cache continues); snapshot_prompt: also
    `prompt_snapshot`, the state at the end of the history. breaks: positions inside the history (message
    boundaries) at which the prefill also snapshots the state, into break_snapshots (each a prefix a prefix
    cache can restore). on_token(token): called as each token is read;
    with cfg.logprobs on_token(token, TokenLogprobs), and `logprobs` holds them in order. logit_bias: the
    {token id: bias} map cfg.logit_bias says there is (added to the raw logits before every processor).
    constraint: with cfg.token_mask, what the tokens must match (structured.TokenConstraint): fill(row) writes
    the allowed tokens' bitmask (int32 [ceil(V / 32)], on the host) for the next token, advance(token) consumes
    one (False: rejected, error() says why), complete() says whether it is done (the sequence then stops, as at
    an end token)."""

    history: torch.Tensor
    cfg: SamplingConfig
    seed: int
    max_new_tokens: int
    stop: StopCondition
    start: StateSnapshot | None = None
    keep_state: bool = False
    snapshot_prompt: bool = False
    on_token: object = None
    logit_bias: dict[int, float] | None = None
    constraint: object = None
    breaks: tuple[int, ...] = ()  # history positions where the prefill ends a chunk and snapshots the state
    # History positions where the prefill also ends a chunk, without a snapshot (a chat's message starts): a prefix
    # restored from a cache was prefilled in chunks that ended at its own request's boundaries, so every prompt
    # holding it must end chunks there too for the rest to get the float order of a full prefill (chunk_ends).
    splits: tuple[int, ...] = ()
    # With a start holding the whole history (samples of one prompt sharing its prefill): the logits of its last
    # token, float32 [V], which the first token is selected from.
    start_logits: torch.Tensor | None = None
    # Filled by the engine.
    slot: int = -1
    # Tokens selected on the device so far (the prefill's, then one per step); with the MTP step a lower bound
    # (one per step launched), raised to the true count as each step is read.
    launched: int = 0
    done: bool = False
    error: Exception | None = None
    nonfinite: bool = False
    stats: GenerationStats = field(default_factory=GenerationStats)
    snapshot: StateSnapshot | None = None
    prompt_snapshot: StateSnapshot | None = None
    prompt_logits: torch.Tensor | None = None  # with prompt_snapshot: the history's last logits, float32 [V]
    break_snapshots: list[StateSnapshot] = field(default_factory=list)  # the states at `breaks` passed
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # with cfg.logprobs: one per token read
    _mark: tuple | None = None
    _steps: int = 0  # steps whose rows included this sequence (each consumes its pending token)
    # MTP steps whose rows included this sequence but that selected nothing for it (it had launched all its tokens):
    # each fed junk into its recurrent states without moving its position.
    _idle_steps: int = 0
    _admitted_at: float = 0.0
    _first_token_at: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.stop.tokens


class BatchEngine:
    def __init__(self, model, max_batch: int, max_seq_len: int, kv_dtype: torch.dtype, use_graph: bool | None = None,
                 name: str = "max_seq_len", batch_invariant: bool = True, speculation: Speculation | None = None):
        """batch_invariant: every row of a step gets the bits of a one-row call (Scratch.rowwise: the Q8_0 GEMV
        at every row count, in passes of 8 rows from 9). False: the int8 tensor-core GEMM from 8 rows, which
        sums a row in another order than the GEMV, so a sequence's tokens may change when its batch crosses 8
        rows; faster from 16 rows (benchmarks/batch.py measures both). speculation: the MTP step instead of the
        plain one (speculative.MTPStep), over all max_batch slots."""
        self.model = model
        self.speculation = speculation
        self.batch_invariant = batch_invariant
        self.device = model.device
        self.max_batch, self.max_seq_len, self.kv_dtype = max_batch, max_seq_len, kv_dtype
        self.use_graph = self.device.type == "cuda" if use_graph is None else use_graph
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        mtp = model.mtp is not None  # every state then holds the block's part (state.py's MTP rule)
        # The MTP step: its k+1 verify rows, and room past max_seq_len for steps in flight beyond the last token
        # read (each writes up to k+1 positions).
        self.mtp = None if speculation is None else MTPStep(model, max_batch, speculation)
        rows = 1 if self.mtp is None else self.mtp.rows
        spare = 0 if self.mtp is None else (READ_BEHIND + 3) * rows
        self.slots = SlotStates(model.config, max_batch, max_seq_len + spare, self.device, kv_dtype, name, mtp, spare)
        self.buckets = tuple(b for b in BUCKETS if b < max_batch) + (max_batch,)
        vocab = model.config.vocab_size
        # What each slot's row chose at the last launch (column 0 the plain step's token, the pending one the next
        # step consumes), and the MTP step's count past the first: its pending token is emitted[s, accepted[s]].
        self.emitted = torch.zeros(max_batch, rows, dtype=torch.int32, device=self.device)
        self.accepted = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self.tokens = self.emitted[:, 0]
        self.nonfinite = torch.zeros(max_batch, dtype=torch.bool, device=self.device)
        self.logits = torch.zeros(max_batch, vocab, device=self.device)  # every bucket's step writes its rows here
        # Each slot's logprob outputs (cfg.logprobs selections write them; the ring copies them).
        self.logprob = torch.zeros(max_batch, device=self.device)
        self.top_ids = torch.zeros(max_batch, TOP_LOGPROBS, dtype=torch.int32, device=self.device)
        self.top_logprobs = torch.zeros(max_batch, TOP_LOGPROBS, device=self.device)
        # Each slot's allowed-token bitmask (cfg.token_mask selections read it), written from its host row; a
        # host row is refilled only once its last copy is done (mask_copied: the event after it).
        self.token_masks = torch.full((max_batch, mask_words(vocab)), -1, dtype=torch.int32, device=self.device)
        self.host_masks = torch.full((max_batch, mask_words(vocab)), -1, dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        self.mask_copied: list[torch.cuda.Event | None] = [None] * max_batch
        self.samplers = [self._sampler(vocab, s) for s in range(max_batch)]
        self.scratch = {b: Scratch(self.device, rowwise=batch_invariant) for b in self.buckets}
        self.step_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.select_graphs: OrderedDict[tuple[int, SamplingConfig], torch.cuda.CUDAGraph] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None  # the selections' temporaries
        self.active: list[Sequence | None] = [None] * max_batch
        self.read_ahead = READ_BEHIND if self.use_graph else 0
        on_gpu = self.device.type == "cuda"
        ring = self.read_ahead + 2  # an admission and a step may both launch before the host reads
        # Per launch: the tokens (and the MTP step's counts), the error flags and the samplers' non-finite flags
        # of every slot.
        self.host_tokens = torch.zeros(ring, max_batch, rows, dtype=torch.int32, pin_memory=on_gpu)
        self.host_accepted = torch.zeros(ring, max_batch, dtype=torch.int32, pin_memory=on_gpu)
        self.host_flags = torch.zeros(ring, max_batch, dtype=torch.int32, pin_memory=on_gpu)
        self.host_nonfinite = torch.zeros(ring, max_batch, dtype=torch.bool, pin_memory=on_gpu)
        # And the logprob outputs, copied only by launches that selected a sequence asking for them.
        self.host_logprob = torch.zeros(ring, max_batch, pin_memory=on_gpu)
        self.host_top_ids = torch.zeros(ring, max_batch, TOP_LOGPROBS, dtype=torch.int32, pin_memory=on_gpu)
        self.host_top_logprobs = torch.zeros(ring, max_batch, TOP_LOGPROBS, pin_memory=on_gpu)
        # (ring index, event, [(slot, sequence)], the MTP step's (k, bucket, start event) or None) in launch order
        self.launches: deque = deque()
        self.next_ring = 0
        self._finished: list[Sequence] = []  # finished while a launch waited for a ring entry (_record)
        # Where a sequence is prefilled before it moves into its slot (admit says why).
        self.staging = Qwen38State(model.config, max_seq_len, self.device, kv_dtype, mtp=mtp)
        if self.mtp is not None:
            self.mtp.bind(self)

    def _sampler(self, vocab: int, slot: int | None = None) -> SamplerState:
        """A sampler state; a slot's writes its non-finite flag and logprob outputs into the engine's rows
        (the ring copies them), a throwaway one (slot None: a capture's warm-up) into its own."""
        s = SamplerState.empty(vocab, self.device)
        if slot is not None:
            s.nonfinite = self.nonfinite[slot : slot + 1]
            s.logprob = self.logprob[slot : slot + 1]
            s.top_ids, s.top_logprobs = self.top_ids[slot], self.top_logprobs[slot]
            s.token_mask = self.token_masks[slot]
        return s

    # --- graphs --------------------------------------------------------------------------------------------
    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def run_rows(self, rows: int) -> None:
        """The plain step's model pass over rows 0..rows-1 (slot b's pending token at its position), logits into
        self.logits; with the MTP block, each row's pair by the MTP rule (state.py)."""
        m, s, scratch = self.model, self.slots, self.scratch[rows]
        batch = s.rows(rows)
        residual, delta = m.trunk(self.tokens[:rows], s.positions[:rows], batch, scratch)
        normed = m.final_norm(residual, delta, scratch)
        if batch.mtp_cache is not None:
            m.mtp_pairs(batch.mtp_hidden, self.tokens[:rows], s.positions[:rows], batch.mtp_cache, scratch)
            batch.mtp_hidden.copy_(normed.x)
        self.logits[:rows].copy_(m.lm_head(normed, scratch))

    def graph(self, run, warm_up) -> torch.cuda.CUDAGraph:
        """The one capture of every graph the engine replays (step, selection, MTP step): warm_up() eagerly (it
        allocates every scratch buffer the capture then finds, on inputs that are valid whatever the engine
        holds), then run() captured, both on a side stream, the graph's temporaries in the engine's pool (graphs
        replay one after another on one stream, so they may share it). capture_begin/end, not torch.cuda.graph's
        context, which would synchronize the device and empty the cache: a selection graph is captured while
        other sequences decode."""
        stream = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            warm_up()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            try:
                run()
            finally:
                graph.capture_end()
        stream.wait_stream(side)
        return graph

    def capture(self, buckets=None) -> None:
        """Capture the step of each bucket (default: all) not captured yet: the plain step, or the MTP step's
        drafts-and-verify and rollback for every draft count. The warm-up steps write the states of the slots
        they cover, so no sequence may be active. (The MTP step's selections are per sampling config: admit()
        captures them.)"""
        if self.mtp is not None:
            todo = [b for b in (buckets or self.buckets) if not self.mtp.captured(b)]
        else:
            todo = [b for b in (buckets or self.buckets) if b not in self.step_graphs]
        if not todo or not self.use_graph:
            return
        if any(self.active):
            raise RuntimeError("step graphs are captured while no sequence is active (the warm-up writes the slots)")
        if self.mtp is not None:
            for b in todo:
                self.mtp.capture(b)
            self.slots.flags.zero_()
            return

        def warm_up():
            # Valid inputs for the warm-up: token 0 at position 1 (the MTP rule's pair then sits at 0).
            self.tokens.zero_()
            self.slots.positions.fill_(1)
            self.run_rows(b)

        for b in todo:
            self.step_graphs[b] = self.graph(lambda: self.run_rows(b), warm_up)
            self.scratch[b].freeze()
        self.slots.flags.zero_()

    def select(self, slot: int, cfg: SamplingConfig) -> None:
        """Slot's next token from its logits row, its position advanced: a replay once captured."""
        if not self.use_graph:
            self._select(slot, cfg)
            return
        graph = self.select_graphs.get((slot, cfg))
        if graph is None:
            graph = self._capture_select(slot, cfg)
        self.select_graphs.move_to_end((slot, cfg))
        graph.replay()

    def _select(self, slot: int, cfg: SamplingConfig, sampler=None, token=None, position=None) -> None:
        select_next_token(self.logits[slot], sampler or self.samplers[slot], cfg,
                          self.tokens[slot : slot + 1] if token is None else token,
                          self.slots.positions[slot : slot + 1] if position is None else position)

    def _capture_select(self, slot: int, cfg: SamplingConfig) -> torch.cuda.CUDAGraph:
        # Warmed up on a throwaway sampler, token and position: it must not advance the slot's.
        dummy = self._sampler(self.model.config.vocab_size)
        zero = torch.zeros(1, dtype=torch.int32, device=self.device)
        graph = self.graph(lambda: self._select(slot, cfg),
                           lambda: self._select(slot, cfg, dummy, zero, torch.zeros_like(zero)))
        mine = [key for key in self.select_graphs if key[0] == slot]
        if len(mine) >= SELECT_GRAPHS_PER_SLOT:
            # Replays already launched keep their graph's executable alive until the device is done with it
            # (graph destruction waits); the pool's memory is reused by the next capture.
            torch.cuda.current_stream(self.device).synchronize()
            del self.select_graphs[mine[0]]
        self.select_graphs[(slot, cfg)] = graph
        return graph

    # --- sequences -----------------------------------------------------------------------------------------
    def free_slots(self) -> int:
        return sum(seq is None for seq in self.active)

    def check(self, seq: Sequence):
        """A ValueError for a sequence the engine cannot take; returns its checked logit bias (or None)."""
        total = seq.history.shape[0] + seq.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"context overflow: {seq.history.shape[0]} prompt tokens + max_new_tokens "
                             f"{seq.max_new_tokens} > max_seq_len {self.max_seq_len}")
        length = seq.history.shape[0]
        if seq.start_logits is not None:
            if seq.start is None or seq.start.position != length:
                raise ValueError(f"start_logits go with a start snapshot of the whole history ({length} tokens)")
        elif seq.start is not None and seq.start.position >= length:
            raise ValueError(f"the start snapshot holds {seq.start.position} tokens: the history ({length}) must "
                             "extend it by at least one token to prefill")
        bias = check_logit_bias(seq.logit_bias, self.model.config.vocab_size)
        if (bias is not None) != seq.cfg.logit_bias:
            raise ValueError("a sequence's logit_bias map and its config's logit_bias flag go together: "
                             f"found a {'map' if bias else 'no map'} with cfg.logit_bias={seq.cfg.logit_bias}")
        if (seq.constraint is not None) != seq.cfg.token_mask:
            raise ValueError("a sequence's constraint and its config's token_mask flag go together: found "
                             f"{'a' if seq.constraint is not None else 'no'} constraint with "
                             f"cfg.token_mask={seq.cfg.token_mask}")
        if self.mtp is not None and (seq.cfg.logprobs or seq.cfg.token_mask):
            raise ValueError("the MTP step reports no logprobs and takes no token mask (speculative decoding: plain "
                             "decode for logprobs and structured output)")
        return bias

    def admit(self, seq: Sequence, chunk_size: int, progress=None):
        """Prefill seq, one chunk of chunk_size tokens per next() of this generator (the caller runs decode
        steps in between), then move it into the lowest free slot with its first token selected: it
        decodes with the others from the next step on. The prefill runs in a staging state of its own, not
        in the slot: a step between two chunks runs every row of its bucket, the slot's among them."""
        bias = self.check(seq)
        if not self.free_slots():
            raise RuntimeError("no free slot: admit a sequence when free_slots() > 0")
        seq._admitted_at = time.perf_counter()
        staging = self._staging_at(seq.start)
        stats = GenerationStats if self.mtp is None else SpeculativeStats
        seq.stats = stats(prompt_tokens=seq.history.shape[0] - staging.position, graph=self.use_graph)
        logits = yield from self._prefill(staging, seq.history, chunk_size, seq.breaks, seq.break_snapshots, progress,
                                          seq.splits)
        if logits is None:  # start holds the whole history
            logits = seq.start_logits[None]
        slot = self.active.index(None)
        if self.mtp is not None:
            self.mtp.admit(seq, slot)
        seq.slot, self.active[slot] = slot, seq
        state = self.slots.slot(slot)
        state.bad_position.zero_()
        state.restore(staging.snapshot(clone=False))
        self.samplers[slot].reset(seq.history, seq.seed, seq.cfg.eos_token_ids)
        if bias is not None:
            self.samplers[slot].set_logit_bias(bias)
        self.logits[slot].copy_(logits[0])
        self.accepted[slot].zero_()  # the pending token is the one selected here, emitted[slot, 0]
        state.device_position.fill_(state.position - 1)
        if seq.constraint is not None:
            self._load_mask(slot, seq)
        self._select(slot, seq.cfg)  # eager: a selection outside the steps' graphs, as generation.py's prefill
        seq.launched = 1
        if seq.keep_state:
            seq._mark = state.mark()
        if seq.snapshot_prompt:
            seq.prompt_snapshot, seq.prompt_logits = state.snapshot(), logits[0].clone()
        self._record([(slot, seq)])

    def step(self) -> None:
        """One decode step over every active sequence (a no-op with none)."""
        top = max((s for s, seq in enumerate(self.active) if seq is not None), default=-1)
        if top < 0:
            return
        rows = self.bucket(top + 1)
        if self.mtp is not None:
            self._mtp_step(rows)
            return
        if not self.use_graph:
            self.run_rows(rows)
        elif rows in self.step_graphs:
            self.step_graphs[rows].replay()
        else:
            raise RuntimeError(f"no step graph for {rows} rows: capture() every bucket needed before admitting")
        for seq in self.active[:rows]:
            if seq is not None:
                seq._steps += 1
        if any(seq is not None and seq.constraint is not None for seq in self.active):
            while self.launches:  # (a sequence that ends here leaves its slot: it selects nothing below)
                self._finished.extend(self.read(wait=True))
        selected = []
        for slot, seq in enumerate(self.active[:rows]):
            if seq is not None and seq.launched < seq.max_new_tokens:
                if seq.constraint is not None:
                    self._load_mask(slot, seq)
                self.select(slot, seq.cfg)
                seq.launched += 1
                selected.append((slot, seq))
        self._record(selected)

    def _mtp_step(self, rows: int) -> None:
        """The MTP step over rows 0..rows-1, selecting for every sequence with tokens left to launch. Its tokens are
        read behind like the plain step's (no constrained sequence runs with it: check). With none left to launch
        there is no step: what is in flight is read instead (no later launch would push it past read_ahead)."""
        selecting = [(slot, seq) for slot, seq in enumerate(self.active[:rows])
                     if seq is not None and seq.launched < seq.max_new_tokens]
        if not selecting:
            while self.launches:
                self._finished.extend(self.read(wait=True))
            return
        start = None
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        k = self.mtp.launch(rows, selecting, self.use_graph)
        for seq in self.active[:rows]:
            if seq is not None:
                seq._steps += 1
                seq._idle_steps += seq.launched >= seq.max_new_tokens
        for _, seq in selecting:
            seq.launched += 1
        self._record(selecting, (k, rows, start))

    def _load_mask(self, slot: int, seq: Sequence) -> None:
        """The tokens seq's constraint allows next (every token it selected read and consumed) into the slot's
        device bitmask, before its selection."""
        if self.mask_copied[slot] is not None:
            self.mask_copied[slot].synchronize()  # (done long ago as a rule: a step has passed since)
        seq.constraint.fill(self.host_masks[slot])
        self.token_masks[slot].copy_(self.host_masks[slot], non_blocking=True)
        if self.device.type == "cuda":
            self.mask_copied[slot] = torch.cuda.Event()
            self.mask_copied[slot].record()

    def _record(self, selected: list, mtp_step: tuple | None = None) -> None:
        """The launch just made (an MTP step's with its (k, bucket, start event)) into the ring."""
        if len(self.launches) == self.host_tokens.shape[0]:
            self._finished.extend(self.read(wait=True))  # never overwrite a launch's tokens before they are read
        i = self.next_ring
        self.next_ring = (i + 1) % self.host_tokens.shape[0]
        self.host_tokens[i].copy_(self.emitted, non_blocking=True)
        if self.mtp is not None:
            self.host_accepted[i].copy_(self.accepted, non_blocking=True)
        self.host_flags[i].copy_(self.slots.flags, non_blocking=True)
        self.host_nonfinite[i].copy_(self.nonfinite, non_blocking=True)
        if any(seq.cfg.logprobs for _, seq in selected):
            self.host_logprob[i].copy_(self.logprob, non_blocking=True)
            self.host_top_ids[i].copy_(self.top_ids, non_blocking=True)
            self.host_top_logprobs[i].copy_(self.top_logprobs, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=self.mtp is not None)  # the draft policy times MTP steps
            event.record()
        self.launches.append((i, event, selected, mtp_step))

    def read(self, wait: bool) -> list[Sequence]:
        """Read the launches whose tokens have arrived (all in flight beyond read_ahead, and with wait=True the
        oldest at least); returns the sequences that finished (since the last call)."""
        finished, self._finished = self._finished, []
        while self.launches:
            i, event, selected, mtp_step = self.launches[0]
            must = wait or len(self.launches) > self.read_ahead
            if not must and (event is None or not event.query()):  # (the CPU: read_ahead 0, every launch is due)
                break
            if event is not None:
                event.synchronize()
            self.launches.popleft()
            counts = []  # the MTP step's (sequence, accepted drafts)
            for slot, seq in selected:
                if seq.done:
                    continue
                accepted = 0
                if mtp_step is not None:
                    accepted = int(self.host_accepted[i, slot])
                    counts.append((seq, accepted))
                    seq.launched += accepted
                tokens = self.host_tokens[i, slot, : accepted + 1].tolist()
                if self._deliver(seq, tokens, int(self.host_flags[i, slot]), bool(self.host_nonfinite[i, slot]),
                                 self._logprobs(i, slot) if seq.cfg.logprobs else None):
                    self._finish(seq)
                    finished.append(seq)
            if mtp_step is not None:
                k, rows, start = mtp_step
                self.mtp.read(k, rows, counts, start, event)
            wait = False
        return finished

    def _logprobs(self, i: int, slot: int) -> TokenLogprobs:
        k = min(TOP_LOGPROBS, self.model.config.vocab_size)
        return TokenLogprobs(float(self.host_logprob[i, slot]),
                             list(zip(self.host_top_ids[i, slot, :k].tolist(), self.host_top_logprobs[i, slot, :k].tolist())))

    def _deliver(self, seq: Sequence, tokens: list[int], flag: int, nonfinite: bool,
                 logprobs: TokenLogprobs | None = None) -> bool:
        """The tokens one launch chose for seq, read (with its logprobs when seq asks for them: one token a
        launch then); whether seq is done."""
        if flag:
            seq.error = RuntimeError(flag_message(flag, self.model.config.vocab_size, self.max_seq_len))
            return True
        seq.nonfinite |= nonfinite
        if not seq.tokens:  # the prefill's token: time to first token
            seq._first_token_at = time.perf_counter()
            seq.stats.prefill_s = seq._first_token_at - seq._admitted_at
        for token in tokens:
            if self._take(seq, token, logprobs):
                return True
        return False

    def _take(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> bool:
        """One token of seq; whether seq is done."""
        done = seq.stop.done(token) or len(seq.tokens) >= seq.max_new_tokens
        if seq.constraint is not None and not seq.constraint.advance(token):
            seq.error = RuntimeError(f"the sequence's constraint rejected token {token}, which its mask allowed: "
                                     f"{seq.constraint.error()}")
            return True
        done = done or (seq.constraint is not None and seq.constraint.complete())
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.on_token is not None:
            if logprobs is None:
                seq.on_token(token)
            else:
                seq.on_token(token, logprobs)
        return done

    def _finish(self, seq: Sequence) -> None:
        seq.done = True
        seq.stats.new_tokens = len(seq.tokens)
        seq.stats.decode_s = time.perf_counter() - seq._first_token_at if seq.tokens else 0.0
        if seq.keep_state and seq.error is None:
            state = self.slots.slot(seq.slot)
            # The state is exact when it consumed the reply's tokens but the last and nothing else. Each plain
            # step consumed its row's token (a row that selected nothing, its token again: only the count of
            # steps tells); each MTP step that selected for it moved the position by what it consumed, and one
            # that did not (idle) changed its recurrent states all the same.
            if self.mtp is not None:
                consumed = state.sync_position() - seq.history.shape[0] + seq._idle_steps
            else:
                consumed = seq._steps
            if consumed == len(seq.tokens) - 1:
                state.sync_position()
            else:
                # Steps past the stop (read-behind), and steps with nothing left to select, fed junk into the
                # slot's recurrent states: back to the prompt's end, then the reply's tokens but the last.
                keep_only(self.model, state, seq._mark, seq.tokens[:-1])
            seq.snapshot = state.snapshot()
        seq._mark = None
        self.release(seq)

    def _prefill(self, state, history: torch.Tensor, chunk_size: int, breaks=(), snapshots=None, progress=None,
                 splits=()):
        """history past state.position into state, in chunk_ends' chunks (at breaks and splits too), yielding
        after each chunk but the last; returns the last chunk's logits [1, V] (None with nothing to prefill). The
        state at each break passed is appended to snapshots; progress(done, total) after each chunk."""
        first, total = state.position, history.shape[0]
        logits = None
        ends = chunk_ends(first, total, chunk_size, (*breaks, *splits)) if first < total else []
        for begin, end in zip([first] + ends[:-1], ends):
            # Reserved chunk by chunk (capacity is the caller's to check): a break's snapshot holds `end` tokens.
            logits = self.model.prefill(history[begin:end], state.reserve(end - begin), state, logits_to_keep=1)
            if end in breaks:
                snapshots.append(state.snapshot())
            if progress is not None:
                progress(end - first, total - first)
            if end < total:
                yield
        return logits

    def share_prompt(self, history: torch.Tensor, start: StateSnapshot | None, chunk_size: int, splits=()):
        """The state after the whole of history and its last token's logits [V], for several sequences to start
        from (Sequence.start and start_logits: samples of one prompt): from start (a snapshot of a proper
        prefix, or None), prefilled in the staging state in the chunks an admission would use, so each
        sequence is bitwise the one admitted alone. A generator, one chunk per next(), like admit(); no
        admission may run meanwhile (both use the staging state). splits: as Sequence.splits."""
        staging = self._staging_at(start)
        logits = yield from self._prefill(staging, history, chunk_size, splits=splits)
        return staging.snapshot(), logits[0].clone()

    def _staging_at(self, start: StateSnapshot | None) -> Qwen38State:
        """The staging state, emptied, or restored to start."""
        if start is None:
            self.staging.clear()
        else:
            self.staging.restore(start)
        return self.staging

    def extend(self, start: StateSnapshot, history: torch.Tensor, chunk_size: int, splits=()) -> StateSnapshot:
        """The state after history (int32, on the device) from start, a snapshot of its prefix: prefilled in a
        free slot's state (junk until an admission fills it; rows of free slots select nothing) in the chunks an
        admission would use, between steps. What a prefix cache keeps for the next turn of a conversation
        whose history is rendered anew (server: the reply as the chat template renders it back)."""
        if not self.free_slots():
            raise RuntimeError("extend() prefills in a free slot's state: none is free")
        state = self.slots.slot(self.active.index(None))
        state.restore(start)
        run_to_end(self._prefill(state, history, chunk_size, splits=splits))
        return state.snapshot()

    def release(self, seq: Sequence) -> None:
        """Free seq's slot (done or cancelled): its row runs on in the steps and selects nothing."""
        seq.done = True
        if 0 <= seq.slot < self.max_batch and self.active[seq.slot] is seq:
            self.active[seq.slot] = None

    def drain(self) -> None:
        """Wait for every launch and drop what is still to be read (after the last sequence finished)."""
        self.read(wait=True)
        while self.launches:
            self.read(wait=True)


def run_to_end(generator):
    """A generator of admit()'s kind driven without interleaving: its return value."""
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value


def chunk_ends(first: int, total: int, chunk_size: int, breaks=()) -> list[int]:
    """Where the prefill of history[first:total] ends its chunks: at every multiple of chunk_size and at every
    break, counted from the start of the history, not from `first`. So the chunks a position falls in depend on
    the history alone, not on the snapshot the prefill starts from: a prefix restored from a cache and the same
    prefix prefilled give the rest of the prompt the same float order (a chunk's attention split and GDN chunk
    loop depend on its extent)."""
    ends = set(range((first // chunk_size + 1) * chunk_size, total, chunk_size))
    ends.update(b for b in breaks if first < b < total)
    return sorted(ends) + [total]


def flag_message(flag: int, vocab_size: int, max_seq_len: int) -> str:
    problems = []
    if flag & BAD_TOKEN:
        problems.append(f"embedded a token id outside the vocabulary [0, {vocab_size}) (its row is NaN)")
    if flag & BAD_POSITION:
        problems.append(f"ran at a position outside the KV cache (0..{max_seq_len - 1}): its attention output is wrong")
    return f"a step {' and '.join(problems or [f'set the error flag to {flag}'])}"


@dataclass
class BatchStats:
    """A batched generation's statistics: each sequence's (its prefill_s is its time to first token from its
    admission) and the aggregate over the whole call's wall time."""

    sequences: list[GenerationStats]
    wall_s: float

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.sequences)

    @property
    def new_tokens(self) -> int:
        return sum(s.new_tokens for s in self.sequences)

    @property
    def tok_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    # With the MTP step (every sequence's stats a SpeculativeStats): the drafts of all sequences, and those accepted.
    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.sequences if isinstance(s, SpeculativeStats))

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.sequences if isinstance(s, SpeculativeStats))

    def __str__(self) -> str:
        text = (f"{len(self.sequences)} sequences: {self.prompt_tokens} prompt tokens, {self.new_tokens} new tokens in "
                f"{self.wall_s:.3f} s, {self.tok_s:.1f} tok/s aggregate")
        if any(isinstance(s, SpeculativeStats) for s in self.sequences):
            rate = f"{self.accepted / self.drafted:.1%}" if self.drafted else "n/a"
            text += f" | speculative (MTP): {self.accepted}/{self.drafted} drafts accepted ({rate})"
        return text


def run_batch(engine: BatchEngine, sequences: list[Sequence], chunk_size: int, progress=None) -> None:
    """Every sequence to its end: admitted as slots free up (each prefill in chunks, decode steps of the
    others in between), decoded together. Raises the first sequence's error, if any. progress: optional
    callable(tokens_done, tokens_total) of each prefill."""
    clock = time.perf_counter()
    engine.capture(engine.buckets[: engine.buckets.index(engine.bucket(min(len(sequences), engine.max_batch))) + 1])
    capture_s = time.perf_counter() - clock
    waiting = deque(sequences)
    prefilling = None
    while waiting or prefilling is not None or any(engine.active):
        if prefilling is None and waiting and engine.free_slots():
            prefilling = engine.admit(waiting.popleft(), chunk_size, progress)
        if prefilling is not None:
            try:
                next(prefilling)
            except StopIteration:
                prefilling = None
        engine.step()
        engine.read(wait=False)
    engine.drain()
    for seq in sequences:
        seq.stats.capture_s += capture_s  # (an MTP step's graphs are captured at its admission)
        if seq.error is not None:
            raise seq.error
