"""Choosing the next token on the device: HF's logits processors, then a counter-based sample; and the
speculative form, which selects up to k+1 tokens from the verify pass's logits at once.

Everything here is torch ops on device tensors with no host synchronisation, so it runs inside the
captured decode graph. The order is transformers' (generation/utils.py, _get_logits_processor):
[logit bias], repetition penalty, [frequency penalty, presence penalty], min_new_tokens, then, when sampling,
temperature, top-k, top-p, min-p. The bracketed ones are not transformers processors; they follow vLLM /
OpenAI: logit_bias adds a per-sequence bias [V] to the raw logits before any processor (SamplerState.bias,
written by set_logit_bias outside the graph; the config only says whether the sequence has one, so graphs
are not captured per bias map), frequency_penalty subtracts the penalty times each token's count among the
generated tokens (SamplerState.counts) and presence_penalty the penalty once from every token generated so
far, beside the repetition penalty in vLLM's order (repetition, frequency, presence).

With cfg.logprobs the selection also writes the chosen token's log-probability and the TOP_LOGPROBS most
likely tokens with theirs into the state's logprob buffers: log_softmax of the raw logits, before any
processor (vLLM's default logprobs_mode "raw_logprobs"), computed on the device inside the same graph.

With cfg.token_mask (constrained decoding: a grammar's allowed tokens, structured.py) the tokens the state's
bitmask does not allow get -inf right after the logit bias, so every processor after it sees them removed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ops = torch.ops.qwen38
MASK32 = 0xFFFFFFFF
# select_speculative's accept uniforms take the step counters with bit 31 set: a stream disjoint from the
# token noise's (step counters stay below 2^31), so accepting and drawing at one step are independent.
ACCEPT_STREAM = 1 << 31
TOP_LOGPROBS = 20  # alternatives a cfg.logprobs selection writes (OpenAI's most: chat top_logprobs <= 20)


@dataclass(frozen=True)
class SamplingConfig:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50  # transformers' default; 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    frequency_penalty: float = 0.0
    logit_bias: bool = False  # whether the sequence's SamplerState.bias is added (the map is not in the config)
    logprobs: bool = False  # whether the selection writes the state's logprob buffers
    token_mask: bool = False  # whether only the tokens SamplerState.token_mask allows may be chosen

    def __post_init__(self):
        for name in ("do_sample", "logit_bias", "logprobs", "token_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, found {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, found {value!r}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, found {self.temperature}")
        if not self.temperature >= 0:  # greedy ignores it, but a negative one is a caller's mistake all the same
            raise ValueError(f"temperature must be >= 0 (> 0 when sampling), found {self.temperature}")
        for name in ("top_k", "min_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, found {value!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], found {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, found {self.repetition_penalty}")


@dataclass
class SamplerState:
    """Device tensors the processors read and the selection updates, fixed for a graph's lifetime."""

    seen: torch.Tensor  # bool [V]: prompt + generated tokens (repetition penalty)
    generated: torch.Tensor  # bool [V]: generated tokens (presence penalty)
    eos: torch.Tensor  # bool [V]: the stop tokens min_new_tokens holds back
    num_generated: torch.Tensor  # int32 [1]
    seed: torch.Tensor  # int64 [1]
    nonfinite: torch.Tensor  # bool [1]: some selection since reset() saw NaN or infinite logits
    # int32 [V]: how often each token was generated (frequency penalty; counted only by selections whose
    # config has one: a sequence's config is fixed from its reset on)
    counts: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # float32 [V]: the logit bias (read only when cfg.logit_bias)
    # Written by cfg.logprobs selections: the chosen token's log-probability (float32 [1]), the TOP_LOGPROBS
    # most likely ids (int32 [TOP_LOGPROBS], most likely first; min(V, TOP_LOGPROBS) written) and theirs.
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    # int32 [ceil(V / 32)]: bit t % 32 of word t // 32 set where token t is allowed (llguidance's bitmask; read
    # only when cfg.token_mask; the host writes it before each selection)
    token_mask: torch.Tensor | None = None

    @staticmethod
    def empty(vocab_size: int, device) -> "SamplerState":
        def mask():
            return torch.zeros(vocab_size, dtype=torch.bool, device=device)

        return SamplerState(mask(), mask(), mask(), torch.zeros(1, dtype=torch.int32, device=device),
                            torch.zeros(1, dtype=torch.int64, device=device),
                            torch.zeros(1, dtype=torch.bool, device=device),
                            torch.zeros(vocab_size, dtype=torch.int32, device=device),
                            torch.zeros(vocab_size, dtype=torch.float32, device=device),
                            torch.zeros(1, dtype=torch.float32, device=device),
                            torch.zeros(TOP_LOGPROBS, dtype=torch.int32, device=device),
                            torch.zeros(TOP_LOGPROBS, dtype=torch.float32, device=device),
                            torch.full((mask_words(vocab_size),), -1, dtype=torch.int32, device=device))

    def reset(self, prompt: torch.Tensor, seed: int, eos_token_ids=()) -> None:
        """Host-to-device writes happen here, outside the captured step (a capture may not copy from host).
        The logit bias is left as it is: set_logit_bias writes it (before or after the reset)."""
        self.seen.zero_()
        self.seen[prompt.long()] = True
        self.generated.zero_()
        self.counts.zero_()
        self.eos.zero_()
        self.eos[list(eos_token_ids)] = True
        self.num_generated.zero_()
        self.seed.fill_(seed & MASK32)
        self.nonfinite.zero_()

    def set_logit_bias(self, logit_bias: dict[int, float] | None) -> None:
        """The bias a cfg.logit_bias selection adds to the logits: logit_bias[id] for each id, 0 elsewhere (a
        host-to-device write: outside the captured step). Ids are checked by check_logit_bias."""
        self.bias.zero_()
        if logit_bias:
            ids = torch.tensor(list(logit_bias), dtype=torch.long)
            self.bias[ids.to(self.bias.device)] = torch.tensor(list(logit_bias.values()), dtype=torch.float32,
                                                               device=self.bias.device)


def mask_words(vocab_size: int) -> int:
    """The int32 words of a token bitmask over vocab_size tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(token_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A token bitmask int32 [ceil(V / 32)] as bool [V] (token t: bit t % 32 of word t // 32)."""
    bits = torch.arange(32, dtype=torch.int32, device=token_mask.device)
    return ((token_mask[:, None] >> bits) & 1).view(-1)[:vocab_size].bool()


def check_logit_bias(logit_bias, vocab_size: int) -> dict[int, float] | None:
    """A logit bias map {token id: bias} checked (ids integers in [0, vocab_size), biases finite numbers), as a
    plain dict of ints to floats; None or an empty map is None (no bias). Anything else is a ValueError."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, found {type(logit_bias).__name__}")
    out = {}
    for key, value in logit_bias.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < vocab_size:
            raise ValueError(f"logit_bias: token id {key!r} is outside the vocabulary [0, {vocab_size})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias[{key}] must be a finite number, found {value!r}")
        out[key] = float(value)
    return out or None


def process_logits(logits: torch.Tensor, s: SamplerState, cfg: SamplingConfig) -> torch.Tensor:
    """logits float32 [V] -> the processed scores transformers would sample from (or take the argmax of).
    Also rows: logits [R, V] with a state whose seen/generated are [R, V] and num_generated [R, 1], each
    row processed alone (what select_speculative uses; counts [R, V] too, bias [V] for every row)."""
    scores = logits
    if cfg.logit_bias:
        scores = scores + s.bias
    if cfg.token_mask:
        scores = scores.masked_fill(~allowed_tokens(s.token_mask, scores.shape[-1]), float("-inf"))
    if cfg.repetition_penalty != 1.0:
        penalized = torch.where(scores < 0, scores * cfg.repetition_penalty, scores / cfg.repetition_penalty)
        scores = torch.where(s.seen, penalized, scores)
    if cfg.frequency_penalty != 0.0:
        scores = scores - cfg.frequency_penalty * s.counts.to(scores.dtype)
    if cfg.presence_penalty != 0.0:
        scores = scores - cfg.presence_penalty * s.generated.to(scores.dtype)
    if cfg.min_new_tokens > 0 and cfg.eos_token_ids:
        scores = scores.masked_fill(s.eos & (s.num_generated < cfg.min_new_tokens), float("-inf"))
    if not cfg.do_sample:
        return scores
    if cfg.temperature != 1.0:
        scores = scores / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(scores, min(cfg.top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_scores, order = torch.sort(scores)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - cfg.top_p
        drop_sorted[..., -1:].fill_(False)  # the most likely token always stays
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    if cfg.min_p > 0.0:
        # transformers sorts to keep at least one token; the most likely one can never fall under
        # min_p * its own probability, so the plain comparison is the same filter.
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < cfg.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return scores


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit integer finaliser (two multiply-xorshift rounds); int64 arithmetic with values kept under
    # 2^32 so every product fits and no platform's overflow behaviour matters.
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & MASK32
    return (x >> 16) ^ x


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): a hash of (seed, step, index). Reproducible for a seed,
    different per step, the same on CPU and GPU, and free of host round trips. counter [1] gives [n];
    counter [R, 1] gives [R, n], one step per row."""
    key = _mix32((_mix32(counter.long() & MASK32) ^ seed) & MASK32)
    index = torch.arange(n, device=seed.device, dtype=torch.int64)
    bits = _mix32(_mix32((index ^ key) & MASK32) ^ key)
    return ((bits >> 8).to(torch.float32) + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1


def select_next_token(logits: torch.Tensor, s: SamplerState, cfg: SamplingConfig, token: torch.Tensor,
                      position: torch.Tensor) -> None:
    """token <- argmax (greedy) or a sample (Gumbel-max) of the processed logits; position += 1.
    A NaN or infinite logit sets s.nonfinite, for generate() to report after the run without a host sync per
    step. The bookkeeping rides on argmax_advance's launch; so does the finiteness check when the scores are
    the raw logits (greedy without penalties, the common decode step). The frequency penalty's counts and
    cfg.logprobs' buffers are plain torch ops after it (on the device, no host sync)."""
    scores = process_logits(logits, s, cfg)
    raw = scores is logits
    if not raw:
        s.nonfinite.logical_or_(~torch.isfinite(logits).all())
    if cfg.do_sample:
        u = uniform_noise(s.seed, s.num_generated, scores.shape[-1])
        scores = scores - torch.log(-torch.log(u))
    ops.argmax_advance(scores.contiguous(), token, position, s.seen, s.generated, s.num_generated,
                       s.nonfinite if raw else None)
    chosen = token.long().view(1)
    if cfg.frequency_penalty != 0.0:
        s.counts.index_add_(0, chosen, torch.ones(1, dtype=s.counts.dtype, device=s.counts.device))
    if cfg.logprobs:
        write_logprobs(logits, chosen, s)


def write_logprobs(logits: torch.Tensor, chosen: torch.Tensor, s: SamplerState) -> None:
    """The raw logits' log-softmax at chosen (int64 [1]) into s.logprob, its min(V, TOP_LOGPROBS) largest
    (most likely first) with their ids into s.top_logprobs, s.top_ids."""
    logprobs = torch.log_softmax(logits.float(), -1)
    s.logprob.copy_(logprobs.index_select(0, chosen))
    k = min(TOP_LOGPROBS, logprobs.shape[-1])
    top = torch.topk(logprobs, k)
    s.top_logprobs[:k].copy_(top.values)
    s.top_ids[:k].copy_(top.indices)


def _with_drafts(mask: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """mask bool [V], drafts int64 [k] -> bool [k+1, V]: row i is mask with d_1..d_i (drafts[:i]) added."""
    k = drafts.shape[0]
    steps = torch.arange(k + 1, device=mask.device)
    earlier = steps[:k][None, :] < steps[:, None]  # [i, j]: d_{j+1} comes before row i
    same = drafts[:, None] == drafts[None, :]
    # scatter_ keeps an arbitrary one of repeated indices, so every entry of a token writes the same value:
    # set in mask, or the token of some draft before the row.
    value = mask.index_select(0, drafts)[None, :] | (earlier[:, :, None] & same[None]).any(1)
    return mask.expand(k + 1, -1).clone().scatter_(1, drafts.expand(k + 1, k), value)


def _with_draft_counts(counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """counts int32 [V], drafts int64 [k] -> int32 [k+1, V]: row i is counts with d_1..d_i counted once more."""
    k = drafts.shape[0]
    steps = torch.arange(k + 1, device=counts.device)
    earlier = (steps[:k][None, :] < steps[:, None]).to(counts.dtype)  # [i, j]: d_{j+1} comes before row i
    return counts.expand(k + 1, -1).clone().scatter_add_(1, drafts.expand(k + 1, k), earlier)


def _draft_rows(s: SamplerState, drafts: torch.Tensor, cfg: SamplingConfig) -> SamplerState:
    """The state row i of the verify logits is processed with: as if d_1..d_i had been generated."""
    steps = torch.arange(drafts.shape[0] + 1, device=drafts.device)
    counts = _with_draft_counts(s.counts, drafts) if cfg.frequency_penalty != 0.0 else s.counts
    return SamplerState(_with_drafts(s.seen, drafts), _with_drafts(s.generated, drafts), s.eos,
                        (s.num_generated + steps)[:, None], s.seed, s.nonfinite, counts, s.bias)


def select_speculative(logits: torch.Tensor, drafts: torch.Tensor, s: SamplerState, cfg: SamplingConfig,
                       tokens: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Accept a prefix of the drafts d_1..d_k and select the token after it, from the verify pass's logits
    float32 [k+1, V] (row i: the distribution after d_i, d_0 the last token). tokens int32 [k+1] <- t_0..t_a
    then -1; num_accepted int32 [1] <- a (0..k); s advanced by the a+1 emitted tokens.

    Greedy: t_i = argmax of row i, a = the number of leading drafts equal to them: token for token what
    select_next_token gives step by step. Sampling: d_{i+1} is accepted with probability p_i(d_{i+1})
    (p_i = softmax of processed row i); at the first rejection t_a is drawn from p_a without d_{a+1}, after
    k acceptances from p_k. That is speculative sampling for a point-mass draft (the residual max(p - q, 0)
    is p without the draft): each token follows the target distribution exactly. The draw is
    select_next_token's (Gumbel-max on the noise of the same step), so drafts of probability 0 or 1 change
    no token of plain sampling.

    cfg.logit_bias and cfg.frequency_penalty apply to every row as select_next_token applies them (row i's
    counts include d_1..d_i); cfg.logprobs writes nothing here (the speculative path reports no logprobs).

    Device tensors only, no host synchronisation: it runs inside a captured graph."""
    k = drafts.shape[0]
    if logits.dim() != 2 or logits.shape[0] != k + 1 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [{k + 1}, V] for {k} drafts, found {logits.dtype} "
                         f"{list(logits.shape)}")
    for name, tensor, size in (("drafts", drafts, k), ("tokens", tokens, k + 1),
                               ("num_accepted", num_accepted, 1)):
        if tensor.dtype != torch.int32 or tensor.shape != (size,):
            raise ValueError(f"{name} must be int32 [{size}], found {tensor.dtype} {list(tensor.shape)}")
    draft = drafts.long()
    rows = _draft_rows(s, draft, cfg)
    scores = process_logits(logits, rows, cfg)
    steps = torch.arange(k + 1, device=logits.device)
    if cfg.do_sample:
        p_draft = torch.exp(scores[:k].gather(1, draft[:, None])[:, 0] - torch.logsumexp(scores[:k], -1))
        u = uniform_noise(s.seed, rows.num_generated[:k] + ACCEPT_STREAM, 1)[:, 0]
        accepted = (u < p_draft).int().cumprod(0).sum()
        # The draft after row a, taken out of the draw unless all k were accepted (then index 0, kept).
        padded = torch.cat([draft, draft.new_zeros(1)])
        removed = padded.index_select(0, accepted.view(1)).view(1, 1)  # never a host read of the index
        row = scores.index_select(0, accepted.view(1))
        row = row.scatter(1, removed, torch.where(accepted < k, float("-inf"), row.gather(1, removed)))
        noise = uniform_noise(s.seed, s.num_generated + accepted, row.shape[-1])
        sampled = torch.argmax(row[0] - torch.log(-torch.log(noise)))
        emitted = torch.where(steps < accepted, padded, torch.where(steps == accepted, sampled, -1))
    else:
        best = scores.argmax(-1)  # the first maximal index, as argmax_advance
        accepted = (draft == best[:k]).int().cumprod(0).sum()
        emitted = torch.where(steps <= accepted, best, -1)
    tokens.copy_(emitted)
    num_accepted.copy_(accepted)
    # Only rows 0..a chose a token: a NaN in a row after a rejection is never seen by the output.
    s.nonfinite.logical_or_((~torch.isfinite(logits.sum(-1)) & (steps <= accepted)).any())
    kept = torch.where(steps <= accepted, emitted, emitted[0])  # t_0 stands in for the -1 entries
    s.seen.index_fill_(0, kept, True)
    s.generated.index_fill_(0, kept, True)
    if cfg.frequency_penalty != 0.0:
        s.counts.index_add_(0, kept, (steps <= accepted).to(s.counts.dtype))
    s.num_generated.add_(accepted + 1)
