"""The server's scheduler: one thread that owns the BatchEngine and runs all the model work. Requests (Jobs)
join the running batch as slots free up, in arrival order, their prompts prefilled in chunks between decode
steps; each sequence samples with its own settings and seed; tokens go back to the request's event loop as
they are read; a request cancelled (its client gone) frees its slot at the next iteration. With
--speculative the engine's step is the MTP step (speculative.py), over its slots all the same."""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from .arguments import SEED_LIMIT
from .conversation import PrefixCache
from .engine import Sequence
from .errors import NonFiniteLogitsError
from .generation import StopCondition
from .sampling import SamplingConfig
from .state import StateSnapshot, available_memory, state_bytes


class Cancelled(Exception):
    """The request was cancelled (the client is gone): what its coroutine gets."""


# Prompt tokens of a joining sequence prefilled between two decode steps. One thread runs both, so the
# decoding streams wait for each chunk: at the 27B shape (README, prompt processing) a 512-token chunk takes
# ~0.14 s (3567 tok/s) where the default 4096-token chunk takes ~1 s (4061 tok/s), so the others' token gap
# while a long prompt joins stays ~0.15 s instead of ~1 s, for ~12% of the joining prompt's prefill speed.
PREFILL_INTERLEAVE = 512
# --max-batch's default: the slots that fit beside the prefix cache and this headroom (the larger of the
# two) of the memory left after the weights, at most the largest step bucket (engine.BUCKETS) on CUDA; on
# the CPU a few (the reference ops run row by row: more rows only share the weight reads).
HEADROOM_FRACTION, HEADROOM_BYTES = 0.1, 1 << 30
DEFAULT_BATCH_LIMIT, CPU_BATCH_LIMIT = 64, 4


@dataclass(eq=False)
class Job:
    """One request as the scheduler runs it: n sequences (choices) of one prompt. What the scheduler thread
    tells the request's coroutine arrives in `events`: (i, token) for choice i's next token ((i, (token,
    TokenLogprobs)) when the request asks for logprobs), (i, None) once sequence i has ended, (-1, exception)
    when the request failed or was cancelled."""

    ids: list[int]
    kwargs: dict  # Server.generation_kwargs
    cfg: SamplingConfig
    seed: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    started: bool = False  # its first sequence began its prefill
    ended: bool = False  # every sequence is out of the engine (done, stopped or dropped)
    cached: int | None = None  # prompt tokens restored from the prefix cache, known once admitted
    logprobs: int | None = None  # the alternatives per token a request asking for logprobs wants (0..20)
    breaks: tuple[int, ...] = ()  # message boundaries in ids (Server.message_breaks): cached as they are passed
    # A chat: the token that starts each message (the template's, e.g. <|im_start|>), or None: the prefill ends a
    # chunk before each (engine.Sequence.splits), in this prompt and in the next turn's extend.
    message_start: int | None = None
    # A chat: content -> the token ids of the history with the reply as the template renders it back (the next
    # turn's prefix), or None; the state there is cached instead of the state after the raw reply.
    next_turn: object = None
    constraints: list | None = None  # response_format: each choice's structured.TokenConstraint
    # The scheduler thread's own:
    admitted: int = 0  # choices whose admission has begun (they are admitted in order)
    sequences: list = field(default_factory=list)  # engine.Sequence per choice, as each is admitted
    done: set = field(default_factory=set)  # choices whose sequence is out of the engine
    start: StateSnapshot | None = None  # n > 1: the state after the prompt, shared, and its last logits
    start_logits: torch.Tensor | None = None
    prefilled: int = 0  # n > 1: the tokens that shared prefill ran

    @property
    def n(self) -> int:
        return self.kwargs["n"]

    def push(self, i: int, value) -> None:
        """From the scheduler thread: into the request's queue on its event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (i, value))
        except RuntimeError:  # the event loop is closed (the server shut down): nobody listens any more
            pass

    def push_token(self, i: int, token: int, logprobs=None) -> None:
        """A sequence's on_token: its token, with its TokenLogprobs when the sequence asks for them."""
        self.push(i, token if logprobs is None else (token, logprobs))


class Scheduler:
    """The one thread that runs the model: continuous batching on one BatchEngine. Jobs are submitted from the
    event loop; the thread admits their sequences into free slots in arrival order (one prefill chunk of a
    joining sequence between two decode steps), steps every active sequence at once, hands each token to its
    job as it is read, fills the prefix cache as sequences finish, releases the slots of stopped or cancelled
    ones at its next iteration, and sleeps while there is nothing to do."""

    def __init__(self, model, engine, cache: PrefixCache, tokenizer, max_queue: int):
        self.model, self.engine, self.cache, self.tokenizer = model, engine, cache, tokenizer
        self.max_batch, self.max_queue = engine.max_batch, max_queue
        self.eos = tuple(model.config.eos_token_ids)
        self.cond = threading.Condition()
        # Under cond (the event loop's side):
        self.inbox: deque[Job] = deque()
        self.stops: list[tuple[Job, int | None]] = []  # (job, choice) to stop, (job, None) to cancel
        self.claimed = 0  # sequences submitted and not out of the engine yet
        self.waiting = self.running = 0  # requests not started / started and not ended (the /metrics gauges)
        self.stopping = False
        self.cache_state = (0, 0, 0)  # the prefix cache's device bytes, host bytes, entries: read on the event loop
        # The scheduler thread's own:
        self.queue: deque[Job] = deque()  # jobs with sequences still to admit, in arrival order
        self.admitting: tuple | None = None  # (job, choice, generator): the sequence being prefilled
        self.owners: dict[int, tuple[Job, int]] = {}  # id(sequence) -> its job and choice
        self.jobs: set[Job] = set()  # every job taken in and not ended
        self.thread = threading.Thread(target=self.run, name="qwen38-scheduler", daemon=True)

    # --- the event loop's side ----------------------------------------------------------------------------
    def has_room(self, n: int) -> bool:
        """Whether n more sequences leave at most max_queue waiting for a slot."""
        with self.cond:
            return self.claimed + n - self.max_batch <= self.max_queue

    def submit(self, job: Job) -> None:
        with self.cond:
            self.claimed += job.n
            self.waiting += 1
            self.inbox.append(job)
            self.cond.notify()

    def stop(self, job: Job, choice: int) -> None:
        """The reply saw choice's stop: its slot is freed at the next iteration (a no-op once it has ended)."""
        with self.cond:
            self.stops.append((job, choice))
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone (or the reply is complete): whatever of job is still running is dropped."""
        with self.cond:
            job.cancelled = True
            self.stops.append((job, None))
            self.cond.notify()

    def start(self) -> None:
        self.thread.start()

    def close(self, timeout: float = 30) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # --- the scheduler thread -----------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.queue) or self.admitting is not None or any(self.engine.active)

    def run(self) -> None:
        # Grad mode and the current CUDA device are per thread: as generate() runs (no_grad), on the model's device.
        device = self.model.device if isinstance(getattr(self.model, "device", None), torch.device) else None
        on_cuda = device is not None and device.type == "cuda"
        with torch.no_grad(), torch.cuda.device(device) if on_cuda else contextlib.nullcontext():
            self.serve()

    def serve(self) -> None:
        while True:
            with self.cond:
                while not (self.stopping or self.inbox or self.stops or self.busy()):
                    self.cond.wait()  # nothing to run: sleep until a request (or a stop) comes
                if self.stopping:
                    return
                self.queue.extend(self.inbox)
                self.jobs.update(self.inbox)
                self.inbox.clear()
                stops, self.stops = self.stops, []
            try:
                for job, choice in stops:
                    if choice is None:
                        self.abandon(job, Cancelled())
                    else:
                        self.stop_choice(job, choice)
                self.tick()
            except Exception as e:  # a fault of the scheduler itself: every request in it fails, serving goes on
                for job in list(self.jobs):
                    self.abandon(job, e)

    def tick(self) -> None:
        """One iteration: a prefill chunk of the sequence joining (the next waiting one, when a slot is free),
        one decode step of every active sequence, their tokens read."""
        engine = self.engine
        if self.admitting is None and self.queue and engine.free_slots():
            job = self.queue[0]
            i = job.admitted
            job.admitted += 1
            if i == 0:
                job.started = True
                with self.cond:
                    self.waiting -= 1
                    self.running += 1
            if i + 1 == job.n:
                self.queue.popleft()
            self.admitting = (job, i, self.admission(job, i))
        if self.admitting is not None:
            job, i, admission = self.admitting
            try:
                next(admission)
            except StopIteration:
                self.admitting = None
                if i == 0:
                    job.cached = len(job.ids) - job.prefilled - job.sequences[0].stats.prompt_tokens
            except Exception as e:  # this request's fault (or its prefill's): the others go on
                self.admitting = None
                self.abandon(job, e)
        try:
            engine.step()
            finished = engine.read(wait=not engine.use_graph)
        except Exception as e:  # a step runs every row: all the active sequences' tokens are in doubt
            for job in {id(j): j for j, _ in self.owners.values()}.values():
                self.abandon(job, e)
            return
        for seq in finished:
            self.finished(seq)
        if self.admitting is None and not any(engine.active):
            engine.drain()  # the launches still in flight belong to sequences already done

    def admission(self, job: Job, i: int):
        """Choice i of job into a slot, one prefill chunk per next(); for n > 1 the first also prefills the
        shared prompt."""
        if i == 0 and job.n > 1:
            yield from self.share_prompt(job)
        start, start_logits = (job.start, job.start_logits) if job.n > 1 else (self.cache.whole(job.ids) or
                                                                                (self.cache.longest(job.ids), None))
        seq = Sequence(torch.tensor(job.ids, dtype=torch.int32, device=self.engine.device), job.cfg,
                       (job.seed + i) % SEED_LIMIT, job.kwargs["max_new_tokens"],
                       StopCondition(frozenset(self.eos), tuple(job.kwargs.get("stop_strings") or ()), self.tokenizer),
                       start=start, start_logits=start_logits,
                       keep_state=job.next_turn is None,
                       snapshot_prompt=i == 0, on_token=partial(job.push_token, i),
                       logit_bias=job.kwargs.get("logit_bias"), breaks=job.breaks if job.n == 1 else (),
                       splits=message_starts(job.ids, job.message_start),
                       constraint=job.constraints[i] if job.constraints else None)
        job.sequences.append(seq)
        self.owners[id(seq)] = (job, i)
        for _ in self.engine.admit(seq, PREFILL_INTERLEAVE):
            self.cache_breaks(job, seq)
            yield
        self.cache_breaks(job, seq)

    def cache_breaks(self, job: Job, seq: Sequence) -> None:
        """The states at the message boundaries (and strides) the prefill has passed go into the prefix cache now,
        under its budget: held by the sequence until its end they were up to 7 states per slot beside it, which
        the slots' memory did not count."""
        for snapshot in seq.break_snapshots:
            self.cache.put(job.ids[: snapshot.position], snapshot)
        seq.break_snapshots.clear()  # (the engine's prefill appends to this list)

    def share_prompt(self, job: Job):
        """The state after the prompt and its last logits, for the n sequences of job to start from (as
        generate(num_return_sequences=) shares it): from the prefix cache's longest prefix, the rest prefilled
        in the engine's staging state (no admission is under way: it is free), one chunk per next()."""
        whole = self.cache.whole(job.ids)
        if whole is not None:  # the same prompt again: nothing to prefill
            job.start, job.start_logits = whole
            return
        cached = self.cache.longest(job.ids)  # a proper prefix
        ids = torch.tensor(job.ids, dtype=torch.int32, device=self.engine.device)
        job.start, job.start_logits = yield from self.engine.share_prompt(ids, cached, PREFILL_INTERLEAVE,
                                                                          message_starts(job.ids, job.message_start))
        job.prefilled = len(job.ids) - (cached.position if cached is not None else 0)

    def finished(self, seq: Sequence) -> None:
        """seq ended in the engine (its stop, max_tokens or an error): the prefix cache gets the states at the
        end of its prompt and of its reply, as generate(prefix_cache=) puts them."""
        job, i = self.owners.pop(id(seq))
        if seq.error is not None:
            self.abandon(job, seq.error)
            return
        if seq.nonfinite:
            self.abandon(job, NonFiniteLogitsError("the model produced NaN or infinite logits during this generation: "
                                                   "the tokens are meaningless"))
            return
        if seq.prompt_snapshot is not None:
            self.cache.put(job.ids, seq.prompt_snapshot, seq.prompt_logits)
        if seq.snapshot is not None:
            self.cache.put(job.ids + seq.tokens, seq.snapshot)
        if job.next_turn is not None and i == 0:
            self.cache_next_turn(job, seq)
        self.cache_state = (self.cache.nbytes, self.cache.host_nbytes, len(self.cache.entries))
        seq.prompt_snapshot, seq.prompt_logits, seq.snapshot = None, None, None
        self.sequence_ended(job, i)
        job.push(i, None)

    def cache_next_turn(self, job: Job, seq: Sequence) -> None:
        """A chat's reply, rendered back by the template as the next turn will render it (Qwen's drops the
        thinking), prefilled from the state at the end of the prompt's last message (cached as the prefill passed
        it; nothing when the cache has let it go since): the next turn of the chat then restores all of its
        history but its new message. One prefill of the reply's content, in place of the re-prefill of the raw
        reply the state after it would need (read-behind steps ran past its end)."""
        base = self.cache.at(job.ids[: max(job.breaks)]) if job.breaks else None
        ids = job.next_turn(self.tokenizer.decode(seq.tokens, skip_special_tokens=True)) if base else None
        if ids is None or len(ids) <= base.position or ids[: base.position] != job.ids[: base.position]:
            return
        history = torch.tensor(ids, dtype=torch.int32, device=self.engine.device)
        self.cache.put(ids, self.engine.extend(base, history, PREFILL_INTERLEAVE, message_starts(ids, job.message_start)))

    def stop_choice(self, job: Job, i: int) -> None:
        """The reply saw choice i's stop before the engine did (a stop string it decodes otherwise): its slot
        is freed; the reply has its text, so nothing is cached of it. (Once the engine has ended it, its end was
        pushed already.)"""
        if job.ended or i in job.done or i >= len(job.sequences):  # (the reply has tokens of admitted ones only)
            return
        self.release(job, i)
        self.sequence_ended(job, i)
        job.push(i, None)

    def release(self, job: Job, i: int) -> None:
        seq = job.sequences[i]
        self.owners.pop(id(seq), None)
        self.engine.release(seq)

    def sequence_ended(self, job: Job, i: int) -> None:
        job.done.add(i)
        with self.cond:
            self.claimed -= 1
            if len(job.done) == job.n:
                self.end_job(job)

    def end_job(self, job: Job) -> None:
        """(under cond, in the scheduler thread) job's counts out of the gauges: before its last event is pushed,
        so that a client that has its answer sees /metrics without it."""
        job.ended = True
        self.jobs.discard(job)
        if job.started:
            self.running -= 1
        else:
            self.waiting -= 1

    def abandon(self, job: Job, reason: Exception) -> None:
        """Every sequence of job still running is released, the rest never admitted; the request gets reason."""
        if job.ended:
            return
        if self.admitting is not None and self.admitting[0] is job:
            self.admitting[2].close()  # mid-prefill: the staging state is cleared by the next admission
            self.admitting = None
        if job in self.queue:
            self.queue.remove(job)
        left = [i for i in range(job.n) if i not in job.done]
        for i in left:
            if i < len(job.sequences):
                self.release(job, i)
        job.done.update(left)
        with self.cond:
            self.claimed -= len(left)
            self.end_job(job)
        job.push(-1, reason)


def default_max_batch(model, max_context: int, kv_dtype: torch.dtype, cache_bytes: int, token_states: int = 0) -> int:
    """As many slots of max_context tokens as the device's available memory holds beside the prefix cache's
    budget and some headroom (scratch, graphs), at most DEFAULT_BATCH_LIMIT (on the CPU CPU_BATCH_LIMIT: the
    reference ops gain nothing from many rows). A slot counts its state, and what each active sequence holds
    besides for the prefix cache: the snapshot at its prompt's end (at most a state) and the mark its reply is
    rewound to (the GDN states); the states at its message boundaries go into the cache as the prefill passes
    them (Scheduler.cache_breaks), under its budget. One more state than the slots is the engine's staging
    state, where a sequence is prefilled before it moves into its slot. With an MTP block each state holds its
    cache too. token_states: the GDN states a slot keeps per verify token (speculative decoding: k + 1)."""
    limit = DEFAULT_BATCH_LIMIT if model.device.type == "cuda" else CPU_BATCH_LIMIT
    available = available_memory(model.device)
    if available is None:
        return limit
    budget = available - cache_bytes - max(int(available * HEADROOM_FRACTION), HEADROOM_BYTES)
    mtp = model.mtp is not None
    state = state_bytes(model.config, max_context, kv_dtype, mtp=mtp)
    gdn_states = state_bytes(model.config, 0, kv_dtype, mtp=False)  # a slot's conv and recurrent states
    per_slot = 2 * state + state_bytes(model.config, 0, kv_dtype, mtp=mtp) + token_states * gdn_states
    return max(1, min(limit, (budget - state) // per_slot))


def message_starts(ids: list[int], token: int | None) -> tuple[int, ...]:
    """The positions of `token` (a chat template's message start) in ids, past the first: where a chat's prefill
    ends its chunks whatever is cached. A function of the ids alone, so the prefill of every prompt that holds a
    restored prefix ended chunks at the same places as the requests that cached it (each chunked at its own
    message boundaries, which are message starts: Server.message_breaks), and a restored prefix leaves the rest
    of the prompt the float order of a full prefill (engine.chunk_ends)."""
    return () if token is None else tuple(i for i, t in enumerate(ids) if t == token and i > 0)
