"""Qwen38ForCausalLM: the hybrid GDN + gated-attention stack as an nn.Module, loaded from GGUF or HF."""
from __future__ import annotations

import dataclasses
import pathlib
import time
from dataclasses import dataclass

import torch
from torch import nn

import qwen38_ops

from .arguments import (check_device, check_dtype, check_ids_dtype_holds, check_input_ids, check_logits_to_keep,
                        check_new_token_bounds, check_seed, check_streamer, check_token_count, kept_positions,
                        stop_string_tuple, stop_token_ids)
from .checkpoint import Checkpoint, Q8Tensor, open_checkpoint
from .checkpoint.layout import MTP_PARTS
from .config import ATTENTION, Qwen38Config
from .conversation import Conversation, PrefixCache
from .engine import BatchEngine, BatchStats, Sequence, run_batch, run_to_end
from .errors import NonFiniteLogitsError
from .formats import Activation, lane_format
from .generation import StopCondition, resolve_seed
from .layers import MLP, DecoderLayer, GatedAttention, GatedDeltaNet, embed_into, make_linear
from .mtp import MTPBlock
from .sampling import SamplingConfig, check_logit_bias
from .scratch import Scratch
from .speculative import Speculation
from .state import Qwen38State, StateSnapshot, check_kv_dtype

ops = torch.ops.qwen38

# Prompt tokens per forward pass. Scratch memory grows with it (one layer's buffers: ~0.5 MB per token at
# the 27B shape in the int8 lane, so ~2 GB here); tensor-core GEMM speed saturates far below it
# (benchmarks/prefill.py measures the chunk sizes).
PREFILL_CHUNK = 4096
# The most sequences one generate() call decodes at once (the largest step bucket, engine.BUCKETS); more
# rows wait for a free slot.
BATCH_LIMIT = 64


def default_kv_dtype(device: torch.device) -> torch.dtype:
    """The KV cache's dtype when none is asked for: bfloat16 on CUDA, as every speed figure is measured
    (it halves the KV traffic at long context; llama.cpp defaults to f16, vLLM to the model's dtype), and
    float32 on the CPU, where the reference ops are the exactness lane and speed is not the point."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32

# Matrices that read the same activation are concatenated at load so one GEMV serves them. The GDN b|a
# rows (2*Hv = 96 at the 27B shape, a whole launch for 1 MB on their own) ride on the q|k|v|z matrix.
FUSED_GROUPS = {
    "qkvz": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
    "qgkv": ("attn_q", "attn_k", "attn_v"),
    "gate_up": ("ffn_gate", "ffn_up"),
}
GDN_SINGLE = ("ssm_out", "ssm_conv1d", "ssm_a", "ssm_dt", "ssm_norm")
ATTENTION_SINGLE = ("attn_output", "attn_q_norm", "attn_k_norm")
COMMON_SINGLE = ("attn_norm", "post_attention_norm", "ffn_down")


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # float32 [B, T', V]
    state: Qwen38State | None = None
    mtp_logits: torch.Tensor | None = None  # float32 [B, T'-1, V] with return_mtp_logits


class Qwen38ForCausalLM(nn.Module):
    def __init__(self, config: Qwen38Config, checkpoint: Checkpoint, device, dtype, quantize, lane):
        super().__init__()
        self.config = config
        self.lane = lane_format(lane)

        def load(part, layer=None):
            return checkpoint.load(part, layer, device, dtype, quantize)

        embed = load("token_embd")
        if isinstance(embed, Q8Tensor):
            self.register_buffer("embed_q", embed.q)
            self.register_buffer("embed_d", embed.d)
        else:
            self.register_buffer("embed", embed)
        self.layers = nn.ModuleList(self._load_layer(checkpoint, i, device, dtype, quantize)
                                    for i in range(config.num_layers))
        self.register_buffer("norm", load("output_norm"))
        self.lm_head = make_linear(load("output"), self.lane, "lm_head")
        # The final norm feeds the head and the MTP block; the block reads only the float32 hidden, which
        # every format holds, so the head's format is the norm's.
        self.final_norm_format = self.lm_head.input_format
        # The MTP block (checkpoint layer num_layers) shares the embedding and the head; None without one.
        self.mtp = None
        if config.num_mtp_layers:
            w = self._layer_weights(checkpoint, config.num_layers, True, device, dtype, quantize)
            self.mtp = MTPBlock(config, w, embed, self.lane, self.lm_head.input_format)

    def _layer_weights(self, checkpoint: Checkpoint, i: int, attention: bool, device, dtype, quantize) -> dict:
        """Layer i's weights by part (fused groups concatenated); the MTP layer adds its MTP_PARTS."""
        groups = ("qgkv", "gate_up") if attention else ("qkvz", "gate_up")
        singles = COMMON_SINGLE + (ATTENTION_SINGLE if attention else GDN_SINGLE)
        if i >= self.config.num_layers:
            singles += MTP_PARTS
        w = {g: checkpoint.load_fused(FUSED_GROUPS[g], i, device, dtype, quantize) for g in groups}
        w.update({p: checkpoint.load(p, i, device, dtype, quantize) for p in singles})
        return w

    def _load_layer(self, checkpoint: Checkpoint, i: int, device, dtype, quantize) -> DecoderLayer:
        attention = self.config.layer_types[i] == ATTENTION
        w = self._layer_weights(checkpoint, i, attention, device, dtype, quantize)
        mixer = (GatedAttention if attention else GatedDeltaNet)(self.config, w, self.lane)
        return DecoderLayer(self.config, mixer, MLP(self.config, w, self.lane), w)

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, device=None, dtype: torch.dtype | None = None,
                        quantize: str | None = None, lane: str = "int8", progress=None) -> "Qwen38ForCausalLM":
        """path: a .gguf file or an HF folder. device: default CUDA when available. dtype: storage and
        compute dtype of dense large matrices (default float32 on CPU, bfloat16 on CUDA); activations,
        states and small weights are float32 always. quantize="q8_0": quantize dense matrices at load
        exactly as llama.cpp's converter does. lane: activation lane of the Q8_0 GEMVs: "int8" (default:
        llama.cpp's q8_0 activation rounding, the fastest), "int8x2" (two int8 words), "f32" (exact
        dequantize-then-matmul); benchmarks/NOTES.md has the measurements behind the default.
        progress: optional callable(bytes_read, bytes_total), called as tensors arrive. Split over N ranks under
        torchrun: TensorParallelCausalLM.from_pretrained(path, tensor_parallel=N, ...)."""
        device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda" and not torch.cuda.is_available():
            why = f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device={str(device)!r} but {why} (device='cpu' runs the plain-PyTorch reference ops)")
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        check_dtype(dtype)
        if quantize not in (None, "q8_0"):
            raise ValueError(f"quantize must be None or 'q8_0', found {quantize!r}")
        if device.type == "cuda":
            qwen38_ops.warn_if_no_cuda_kernels()
        checkpoint = open_checkpoint(path, progress)
        with torch.no_grad(), checkpoint.loading():
            model = cls(checkpoint.config, checkpoint, device, dtype, quantize, lane)
        return model.eval()

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def new_state(self, max_seq_len: int, kv_dtype: torch.dtype | None = None) -> Qwen38State:
        """A state for one sequence; with the MTP block, it holds the block's KV cache too (advanced by the MTP
        rule, state.py). kv_dtype: default default_kv_dtype(the model's device)."""
        return Qwen38State(self.config, max_seq_len, self.device, kv_dtype or default_kv_dtype(self.device),
                           mtp=self.mtp is not None)

    def embed_tokens(self, ids: torch.Tensor, scratch: Scratch, bad_token: torch.Tensor | None = None) -> torch.Tensor:
        """ids int32 [T] on the model's device (read by the kernel: no host round trip); bad_token: the flag
        an id outside the vocabulary raises on the GPU (embed_into)."""
        return embed_into(self, ids, scratch.empty(self, "residual", (ids.shape[0], self.config.hidden_size)),
                          bad_token)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, state: Qwen38State | None = None,
                logits_to_keep: int = 0, return_mtp_logits: bool = False,
                attention_mask: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids [B, T]. With a state, the tokens continue it (B must be 1) and the state advances;
        without one, each row is an independent sequence. logits_to_keep=k > 0 keeps the last k rows.
        attention_mask [B, T] of 0 and 1 (transformers' padding, left or right): each row runs only its kept
        tokens, as if alone (its logits are that row's run by itself, at the kept positions; padded
        positions get zeros).
        return_mtp_logits: also out.mtp_logits float32 [B, T-1, V] (the last k rows with logits_to_keep=k):
        row t is the MTP block's logits for token t+2, from the normed hidden at t and token t+1, at
        position t (teacher-forced). A state of a model with the block keeps the block's cache in step with
        every call (the pair that straddles two calls included)."""
        check_input_ids(input_ids, self.config.vocab_size)
        check_logits_to_keep(logits_to_keep)
        if not isinstance(return_mtp_logits, bool):
            raise ValueError(f"return_mtp_logits must be True or False, found {return_mtp_logits!r:.40}")
        if input_ids.shape[0] != 1 and state is not None:
            raise ValueError(f"a state holds one sequence; input_ids has batch {input_ids.shape[0]}")
        if attention_mask is not None:
            if state is not None or return_mtp_logits:
                raise ValueError("attention_mask is for independent rows: not with a state or return_mtp_logits")
            return self._forward_padded(input_ids, attention_mask, logits_to_keep)
        if return_mtp_logits and self.mtp is None:
            raise ValueError(f"return_mtp_logits=True but {self.config.source or 'this checkpoint'} has no MTP block "
                             "(a GGUF converted with --no-mtp, or an HF folder without mtp.* tensors)")
        logits, mtp_logits = [], []
        for ids in input_ids.to(self.device, torch.int32):
            # A state of its own for this call only: float32 KV whatever the device (no speed at stake; the
            # logits of model(ids) are the exact ones on every device), with the MTP block's part only when its
            # logits are asked for.
            seq_state = state or Qwen38State(self.config, ids.shape[0], self.device, torch.float32,
                                             mtp=return_mtp_logits)
            mtp_rows = [] if return_mtp_logits else None
            logits.append(self.prefill(ids, seq_state.reserve(ids.shape[0]), seq_state, logits_to_keep,
                                       mtp_logits=mtp_rows))
            if return_mtp_logits:
                mtp_logits.append(torch.cat(mtp_rows) if mtp_rows else
                                  torch.empty(0, self.config.vocab_size, device=self.device))
        return CausalLMOutput(torch.stack(logits), state, torch.stack(mtp_logits) if return_mtp_logits else None)

    def _forward_padded(self, input_ids: torch.Tensor, attention_mask, logits_to_keep: int) -> CausalLMOutput:
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.config.vocab_size, device=self.device)
        for b, kept in enumerate(kept_positions(attention_mask, input_ids)):
            ids = input_ids[b, kept[0] : kept[-1] + 1].to(self.device, torch.int32)
            state = Qwen38State(self.config, ids.shape[0], self.device, torch.float32)
            logits[b, kept[0] : kept[-1] + 1] = self.prefill(ids, state.reserve(ids.shape[0]), state)
        if 0 < logits_to_keep < length:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutput(logits)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, state: Qwen38State, logits_to_keep: int = 0,
                chunk_size: int = PREFILL_CHUNK, progress=None, mtp_logits: list | None = None) -> torch.Tensor:
        """The stack over a prompt in chunks of chunk_size tokens, so scratch memory is bounded by the chunk
        whatever the prompt length; returns the logits of the last logits_to_keep rows (0: all). positions:
        state.reserve(len(ids))'s. A state with the MTP block's part advances it by the MTP rule (state.py)
        chunk by chunk; mtp_logits: a list the block's logits of the pairs of ids[1:] are appended to, [rows, V]
        per chunk (the last logits_to_keep pairs only, with logits_to_keep > 0; never the pair of ids[0] with
        the hidden of a previous call). progress: optional callable(tokens_done, tokens_total), called after
        each chunk."""
        total = ids.shape[0]
        first_kept = total - (logits_to_keep if 0 < logits_to_keep < total else total)
        first_kept_pair = total - (logits_to_keep if 0 < logits_to_keep < total - 1 else total - 1)  # an index of ids
        carried = state.position > total  # the state held tokens before these: h of the last waits in mtp_hidden
        scratch = Scratch(self.device)
        logits = []
        for start in range(0, total, chunk_size):
            end = min(start + chunk_size, total)
            residual, delta = self.trunk(ids[start:end], positions[start:end], state, scratch)
            if state.mtp_cache is None:
                act = self.final_norm(residual, delta, scratch, end - max(start, first_kept)) if end > first_kept else None
            else:
                normed = self.final_norm(residual, delta, scratch)
                h = normed.x
                if start > 0 or carried:  # the chunk's first token pairs with the hidden before it
                    before, first = torch.cat([state.mtp_hidden, h[:-1]]), start
                else:  # the sequence's first token has none
                    before, first = h[:-1], 1
                if before.shape[0]:
                    pairs = self.mtp_pairs(before, ids[first:end], positions[first:end], state.mtp_cache, scratch)
                    skip = first_kept_pair - first  # >= 1 from the straddling pair (ids[0]'s): never returned
                    if mtp_logits is not None and skip < before.shape[0]:
                        mtp_logits.append(self.lm_head(pairs.rows_from(max(skip, 0)), scratch).clone())
                state.mtp_hidden.copy_(h[-1:])
                act = normed.rows_from(max(first_kept - start, 0)) if end > first_kept else None
            if act is not None:
                rows = self.lm_head(act, scratch)
                logits.append(rows if end == total else rows.clone())  # scratch is reused by the next chunk
            if progress is not None:
                progress(end, total)
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def mtp_pairs(self, before: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, cache, scratch: Scratch):
        """The MTP rule's work (state.py) for tokens ids just consumed at positions: the block over each token's
        pair with the trunk's normed hidden before it (before float32 [T, D]), at the position before it, into
        cache (one sequence's, or [B, ...] for B rows that are B sequences). Returns the block's output: row t
        drafts the token after ids[t]. (A free slot's row sits at position 0 or more: its pair at 0 is junk.)"""
        return self.mtp(before, ids, (positions - 1).clamp(min=0), cache, scratch)

    def trunk(self, ids, positions, state: Qwen38State, scratch: Scratch,
              keep_token_states: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding and every layer; returns the residual stream and the last layer's output, whose sum
        the final norm takes. keep_token_states: the GDN layers also write their state after each token
        (state.keep_token_states() made the buffers; a speculative verify keeps any prefix with accept())."""
        residual = self.embed_tokens(ids, scratch, state.bad_position)  # the state's one error flag
        delta = None
        for layer, layer_state in zip(self.layers, state.layers):
            delta = layer(residual, delta, layer_state, positions, scratch, keep_token_states)
        return residual, delta

    def final_norm(self, residual, delta, scratch: Scratch, rows: int = 0) -> Activation:
        """The final norm (residual += delta, then RMSNorm) over the last `rows` rows (0: all): the normed
        hidden, float32 act.x [rows, D], in the lm_head's input format (the MTP block's `hidden` input)."""
        if 0 < rows < residual.shape[0]:
            residual, delta = residual[-rows:], delta[-rows:]
        act = scratch.activation(self, "final_norm", *residual.shape, self.final_norm_format)
        ops.add_rms_norm(residual, delta, self.norm, self.config.rms_norm_eps, *act.outs())
        return act

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, min_new_tokens: int = 0,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 50, top_p: float = 1.0,
                 min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 seed: int | None = None, generator: torch.Generator | None = None,
                 eos_token_id: int | list[int] | None = None, stop_strings: str | list[str] | None = None,
                 tokenizer=None, streamer=None, max_seq_len: int | None = None,
                 kv_dtype: torch.dtype | None = None, use_graph: bool | None = None,
                 prefill_progress=None, conversation: Conversation | None = None,
                 prefix_cache: PrefixCache | None = None, speculative: str | None = None,
                 num_draft_tokens: int = 3, draft_vocab_size: int | None = None,
                 attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None,
                 num_return_sequences: int = 1, frequency_penalty: float = 0.0,
                 logit_bias: dict[int, float] | None = None) -> torch.Tensor:
        """transformers' generate(): returns prompt + new ids [B, T + n] (stop token included). B > 1 rows,
        padded as attention_mask says (left or right), or num_return_sequences > 1 samples of each row,
        decode together (engine.BatchEngine: see _generate_batch); the rest of this is about one sequence. Sampling is reproducible for a seed (or a torch.Generator to draw one from). eos_token_id
        defaults to the checkpoint's; stop_strings need the tokenizer. On CUDA each step is a graph replay
        (use_graph=False for eager launches); statistics of the last call are in self.last_generation_stats.
        kv_dtype: the KV cache's dtype, default default_kv_dtype(the model's device).
        prefill_progress: optional callable(tokens_done, tokens_total), called after each prompt chunk of
        PREFILL_CHUNK tokens (a progress bar for long prompts). Bad arguments are ValueErrors; NaN or
        infinite logits at any step raise NonFiniteLogitsError once the run ends.
        conversation: input_ids continue its history; only the tokens its state has not consumed are
        prefilled, and it is updated with the new tokens and state. prefix_cache: the longest cached prefix
        of the history is restored instead of prefilled, and the states at the end of the prompt and at the
        end are cached. Either way the output is that of the whole history from scratch (self.last_generation_stats.prompt_tokens counts
        the tokens prefilled). speculative="mtp": the checkpoint's MTP block drafts up to num_draft_tokens
        tokens per step and one pass verifies them (greedy: the same tokens as without; sampling: the same
        distribution); the draft count adapts to the acceptance seen so far. It takes B > 1 rows too (each row
        drafts from its own history; one draft count a step for all: _generate_batch). draft_vocab_size=n: drafts only
        from token ids below n (a cheaper draft head; the verify still scores every token).
        frequency_penalty (vLLM / OpenAI): subtract it times each token's count among the generated tokens.
        logit_bias {token id: bias}: added to the logits before every processor (vLLM / OpenAI)."""
        check_input_ids(input_ids, self.config.vocab_size)
        bias = check_logit_bias(logit_bias, self.config.vocab_size)
        check_ids_dtype_holds(input_ids.dtype, self.config.vocab_size)
        check_token_count("num_return_sequences", num_return_sequences, 1)
        if speculative not in (None, "mtp"):
            raise ValueError(f"speculative must be None or 'mtp', found {speculative!r}")
        speculation = Speculation(num_draft_tokens, draft_vocab_size) if speculative else None
        if input_ids.shape[0] > 1 or num_return_sequences > 1 or attention_mask is not None:
            for name, value in (("streamer", streamer), ("conversation", conversation),
                                ("prefix_cache", prefix_cache)):
                if value is not None:
                    raise ValueError(f"{name} is for one sequence; with {input_ids.shape[0]} rows x "
                                     f"num_return_sequences {num_return_sequences} (or an attention_mask) pass none")
            return self._generate_batch(
                input_ids, attention_mask, pad_token_id, num_return_sequences, max_new_tokens, max_seq_len, kv_dtype,
                use_graph, seed, generator, eos_token_id, stop_strings, tokenizer, prefill_progress,
                SamplingConfig(do_sample, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                               min_new_tokens, frequency_penalty=frequency_penalty, logit_bias=bias is not None),
                logit_bias=bias, speculation=speculation)
        check_token_count("max_new_tokens", max_new_tokens, 1)
        if max_seq_len is not None:
            check_token_count("max_seq_len", max_seq_len, 1)
        check_new_token_bounds(min_new_tokens, max_new_tokens)
        check_seed(seed)
        check_streamer(streamer)
        eos = stop_token_ids(eos_token_id, self.config.eos_token_ids, self.config.vocab_size)
        stops = stop_string_tuple(stop_strings, tokenizer)
        cfg = SamplingConfig(do_sample, temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                             min_new_tokens, eos, frequency_penalty=frequency_penalty, logit_bias=bias is not None)
        history = (conversation.tokens if conversation is not None else []) + input_ids[0].tolist()
        start = self._start_snapshot(history, conversation, prefix_cache)
        needed, limit = len(history) + max_new_tokens, self.config.max_position_embeddings
        if needed > limit:
            raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the model's context of {limit}")
        size = max_seq_len or min(max(needed, 4096), limit)
        kv_dtype = kv_dtype or default_kv_dtype(self.device)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        keep_state = conversation is not None or prefix_cache is not None
        ids = torch.tensor(history, dtype=torch.int32, device=self.device)
        stop = StopCondition(frozenset(eos), stops, tokenizer)
        seed = resolve_seed(seed, generator)
        on_token = None if streamer is None else (lambda token: streamer.put(torch.tensor([token])))
        seq = Sequence(ids, cfg, seed, max_new_tokens, stop, start=start, keep_state=keep_state,
                       snapshot_prompt=prefix_cache is not None, on_token=on_token, logit_bias=bias)
        engine = self._batch_engine(1, size, kv_dtype, use_graph, exact=max_seq_len is not None, speculation=speculation)
        run_batch(engine, [seq], PREFILL_CHUNK, prefill_progress)
        tokens, self.last_generation_stats = seq.tokens, seq.stats
        prompt_snapshot, snapshot, nonfinite = seq.prompt_snapshot, seq.snapshot, seq.nonfinite
        if conversation is not None:
            conversation.tokens, conversation.snapshot = history + tokens, snapshot
        if prefix_cache is not None:
            # The prompt's end too: a request that re-renders this one's reply differently (a chat template
            # that drops the thinking, another tokenization) still shares the prompt.
            prefix_cache.put(history, prompt_snapshot)
            prefix_cache.put(history + tokens, snapshot)
        if streamer is not None:
            streamer.end()
        if nonfinite:
            raise NonFiniteLogitsError("the model produced NaN or infinite logits during this generation: the tokens "
                                       "are meaningless (checkpoint weights are checked at load; this is an overflow "
                                       "in the computation)")
        new = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)

    def _generate_batch(self, input_ids, attention_mask, pad_token_id, num_return_sequences: int, max_new_tokens: int,
                        max_seq_len, kv_dtype, use_graph, seed, generator, eos_token_id, stop_strings, tokenizer,
                        prefill_progress, cfg: SamplingConfig, logit_bias=None,
                        speculation: Speculation | None = None) -> torch.Tensor:
        """generate() for B rows x num_return_sequences samples: every sequence in a slot of one BatchEngine,
        decoded together; row b's sample i (sequence j = b * num_return_sequences + i) samples with seed
        seed + j. The samples of a row share its prompt's state and last logits, prefilled once. Per-row
        stopping; rows that stop early are padded with pad_token_id (default the first eos id) after their stop
        token, as transformers pads. self.last_generation_stats: a BatchStats (per sequence and in total).
        speculation: the engine's MTP step drafts and verifies for every slot (greedy: each row's tokens are its
        plain greedy ones). One draft count serves all slots of a step and adapts to the acceptance pooled over
        them, so a sampled row follows the model's distribution but may draw other tokens than its solo run
        (which drafts as its own acceptance says)."""
        check_token_count("max_new_tokens", max_new_tokens, 1)
        check_new_token_bounds(cfg.min_new_tokens, max_new_tokens)
        check_seed(seed)
        if max_seq_len is not None:
            check_token_count("max_seq_len", max_seq_len, 1)
        if kv_dtype is not None:
            check_kv_dtype(kv_dtype)
        eos = stop_token_ids(eos_token_id, self.config.eos_token_ids, self.config.vocab_size)
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
        elif isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
            raise ValueError(f"pad_token_id must be an integer, found {pad_token_id!r}")
        stops = stop_string_tuple(stop_strings, tokenizer)
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
        base_seed = resolve_seed(seed, generator)
        kept = kept_positions(attention_mask, input_ids)
        prompts = [input_ids[b, k[0] : k[-1] + 1].to(self.device, torch.int32) for b, k in enumerate(kept)]
        longest = max(p.shape[0] for p in prompts) + max_new_tokens
        limit = self.config.max_position_embeddings
        if longest > limit:
            raise ValueError(f"prompt + max_new_tokens = {longest} exceeds the model's context of {limit}")
        kv_dtype = kv_dtype or default_kv_dtype(self.device)
        count = len(prompts) * num_return_sequences
        engine = self._batch_engine(min(count, BATCH_LIMIT), max_seq_len or longest, kv_dtype, use_graph,
                                    exact=max_seq_len is not None, speculation=speculation)
        sequences = []
        for b, prompt in enumerate(prompts):
            start, start_logits = (run_to_end(engine.share_prompt(prompt, None, PREFILL_CHUNK))
                                   if num_return_sequences > 1 else (None, None))
            for i in range(num_return_sequences):
                j = b * num_return_sequences + i
                sequences.append(Sequence(prompt, cfg, (base_seed + j) & 0x7FFFFFFF, max_new_tokens,
                                          StopCondition(frozenset(eos), stops, tokenizer), start=start,
                                          logit_bias=logit_bias, start_logits=start_logits))
        clock = time.perf_counter()
        run_batch(engine, sequences, PREFILL_CHUNK, prefill_progress)
        self.last_generation_stats = BatchStats([seq.stats for seq in sequences], time.perf_counter() - clock)
        if any(seq.nonfinite for seq in sequences):
            raise NonFiniteLogitsError("the model produced NaN or infinite logits during this generation: the tokens "
                                       "are meaningless")
        width = max(len(seq.tokens) for seq in sequences)
        out = torch.full((count, input_ids.shape[1] + width), pad_token_id, dtype=input_ids.dtype)
        out[:, : input_ids.shape[1]] = input_ids.cpu().repeat_interleave(num_return_sequences, 0)
        for j, seq in enumerate(sequences):
            out[j, input_ids.shape[1] : input_ids.shape[1] + len(seq.tokens)] = torch.tensor(seq.tokens)
        return out.to(input_ids.device)

    def _batch_engine(self, max_batch: int, max_seq_len: int, kv_dtype, use_graph, exact: bool,
                      speculation: Speculation | None = None) -> BatchEngine:
        """The model's one engine (self._engine), kept between calls while it fits (its graphs are captured
        once); exact: the caller asked for max_seq_len (generate()'s max_seq_len: the KV cache size).
        speculation: its step drafts with the MTP block, or None (plain decode)."""
        engine = getattr(self, "_engine", None)
        if (engine is None or engine.max_batch < max_batch or engine.max_seq_len < max_seq_len
                or (exact and engine.max_seq_len != max_seq_len) or engine.speculation != speculation
                or engine.kv_dtype != kv_dtype or (use_graph is not None and engine.use_graph != use_graph)):
            self._engine = engine = None  # free the old buffers before allocating the new ones
            engine = self._engine = BatchEngine(self, max_batch, max_seq_len, kv_dtype, use_graph,
                                                speculation=speculation)
        return engine

    @staticmethod
    def _start_snapshot(history: list[int], conversation: Conversation | None,
                        prefix_cache: PrefixCache | None) -> StateSnapshot | None:
        """The snapshot holding the longest prefix of history: the conversation's or the cache's."""
        start = conversation.snapshot if conversation is not None else None
        cached = prefix_cache.longest(history) if prefix_cache is not None else None
        if cached is not None and (start is None or cached.position > start.position):
            return cached
        return start
