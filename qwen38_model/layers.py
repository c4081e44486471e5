"""The hybrid stack's modules: the linears (Q8Linear, DenseLinear), GatedDeltaNet, GatedAttention, MLP,
DecoderLayer. Every computation is a torch.ops.qwen38 call (a CUDA kernel on the GPU, the reference elsewhere).

Formats are decided at load: make_linear picks a linear's type from its loaded weight, each linear reads one
activation format (input_format), and the module that produces a linear's input is told that format when it
is built, so forward() never asks (formats.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import qwen38_ops.ops  # noqa: F401  (registers torch.ops.qwen38.*)
from qwen38_ops.attention import SAME_SPLIT_TOKENS, workspace_numel
from qwen38_ops.attention_prefill import workspace_numel as prefill_workspace_numel
from qwen38_ops.gdn_step import MAX_TOKENS as GDN_STEP_MAX_TOKENS

from .checkpoint import Q8Tensor
from .config import Qwen38Config
from .formats import QK, ActFormat, Activation, lane_format
from .scratch import Scratch
from .state import GDNState, KVCache

ops = torch.ops.qwen38

# From this many rows a Q8_0 projection runs as a GEMM instead of the GEMV (which shares each weight load
# among its rows, up to 8 in one pass in the int lanes): the int lanes on int8 tensor cores (q8_0_gemm_*),
# the f32 lane as dequantize-then-cuBLAS float32 (exact, the lane's contract). Measured on the H200 over all
# trunk matrices (benchmarks/ops/bench_q8_gemm.py, a208644, the GEMV's earlier 2-or-4-row form): int8 GEMV
# 14.3 ms at T = 4 and 25.2 at T = 8, GEMM 22.8 and 23.1; f32 GEMV 177 ms at T = 32 and 350 at T = 64,
# dequantize + cuBLAS 240 and 247.
INT_GEMM_MIN_ROWS = 8
F32_GEMM_MIN_ROWS = 48
# Rows up to which a GDN layer runs the fused gdn_step (all it takes); above, conv, gates,
# recurrence and gated norm as four ops. Measured at the 27B shape on the H200 (bench_gdn, 6a1f2f8, us a layer,
# with per-token states from T = 2): gdn_step 7.71 / 9.74 / 11.4 / 13.1 / 15.0 / 16.7 / 18.5 / 20.4 at T = 1..8,
# the four ops 9.06 / 11.8 / 13.5 / 15.4 / 17.4 / 19.3 / 21.4 / 23.5. (With one block per value head, 818aa4d,
# gdn_step fell behind from 3 rows; two blocks a head, f5e03b0, win at every T.)
GDN_STEP_ROWS = GDN_STEP_MAX_TOKENS
# The f32 lane dequantizes this many weight rows at a time (bounded scratch: 8192 x 17408 floats = 570 MB).
DEQUANTIZE_ROWS = 8192


class Q8Linear(nn.Module):
    """y = x W^T over a Q8_0 weight (int8 quants [N, K], fp16 scales [N, K/QK]), its input in one activation
    lane: our GEMV, or our GEMM for prompt-sized row counts. The lane's product is chosen here, once.
    scratch_role names its output buffer, shared by the same projection of every layer."""

    def __init__(self, weight: Q8Tensor, lane: ActFormat, scratch_role: str):
        super().__init__()
        if not isinstance(weight, Q8Tensor):
            raise TypeError(f"{scratch_role}: Q8Linear takes a Q8Tensor, found {type(weight).__name__} "
                            "(make_linear picks the linear of a weight)")
        rows, cols = weight.q.shape
        if weight.q.dtype != torch.int8 or cols % QK or tuple(weight.d.shape) != (rows, cols // QK):
            raise ValueError(f"{scratch_role}: a Q8_0 weight is int8 quants [N, K] (K a multiple of {QK}) and "
                             f"scales [N, K/{QK}], found quants {tuple(weight.q.shape)} {weight.q.dtype} and scales "
                             f"{tuple(weight.d.shape)}")
        self.scratch_role = scratch_role
        self.input_format = lane_format(lane)
        self.out_features, self.in_features = rows, cols
        self.register_buffer("weight_q", weight.q)
        self.register_buffer("weight_d", weight.d)
        self._product = {ActFormat.F32: self._f32_lane, ActFormat.INT8: self._int8_lane,
                         ActFormat.INT8X2: self._int8x2_lane}[self.input_format]

    def forward(self, act: Activation, scratch: Scratch) -> torch.Tensor:
        out = scratch.empty(self, "out", (act.x.shape[0], self.out_features))
        self._product(act, out, scratch)
        return out

    def _gemm(self, rows: int, scratch: Scratch) -> bool:
        """Whether the int lanes run the GEMM: from INT_GEMM_MIN_ROWS rows, when its 64-wide stage fits K,
        except in a rowwise scratch (a batched decode step: the GEMM sums a row in another order than the
        GEMV, so a row's bits would depend on the batch size)."""
        return rows >= INT_GEMM_MIN_ROWS and self.in_features % 64 == 0 and not scratch.rowwise

    def _f32_lane(self, act: Activation, out: torch.Tensor, scratch: Scratch) -> None:
        if act.x.shape[0] >= F32_GEMM_MIN_ROWS and out.is_cuda and not scratch.rowwise:
            self._dequantized_matmul(act.x, out, scratch)
        else:
            ops.q8_0_gemv(act.x, self.weight_q, self.weight_d, out)

    def _int8_lane(self, act: Activation, out: torch.Tensor, scratch: Scratch) -> None:
        op = ops.q8_0_gemm_int8 if self._gemm(act.x.shape[0], scratch) else ops.q8_0_gemv_int8
        op(act.q, act.d, self.weight_q, self.weight_d, out)

    def _int8x2_lane(self, act: Activation, out: torch.Tensor, scratch: Scratch) -> None:
        op = ops.q8_0_gemm_int8x2 if self._gemm(act.x.shape[0], scratch) else ops.q8_0_gemv_int8x2
        op(act.q, act.q_lo, act.d, self.weight_q, self.weight_d, out)

    def _dequantized_matmul(self, x: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> None:
        """The f32 lane's contract, literally: dequantize to float32, float32 cuBLAS GEMM (no TF32 unless
        the user enabled it globally), DEQUANTIZE_ROWS weight rows at a time."""
        for n0 in range(0, self.out_features, DEQUANTIZE_ROWS):
            n1 = min(n0 + DEQUANTIZE_ROWS, self.out_features)
            w = scratch.empty("f32_lane", "dequantized", (n1 - n0, self.in_features))
            w.copy_(self.weight_q[n0:n1])
            w.view(n1 - n0, -1, QK).mul_(self.weight_d[n0:n1, :, None])
            y = scratch.empty("f32_lane", "dequantized_out", (x.shape[0], n1 - n0))
            torch.mm(x, w.t(), out=y)
            out[:, n0:n1].copy_(y)

    def first_rows(self, rows: int, scratch_role: str) -> Q8Linear:
        """The linear of this one's first `rows` output rows, over views of its weights (no copy), same lane."""
        return Q8Linear(Q8Tensor(self.weight_q[:rows], self.weight_d[:rows]), self.input_format, scratch_role)


class DenseLinear(nn.Module):
    """y = x W^T over a dense weight (float32/bfloat16/float16), from the float32 activation: cuBLAS in the
    weight's dtype on the GPU, float64 on the CPU. scratch_role names its output buffer, as for Q8Linear."""

    input_format = ActFormat.F32

    def __init__(self, weight: torch.Tensor, scratch_role: str):
        super().__init__()
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{scratch_role}: DenseLinear takes a dense tensor, found {type(weight).__name__} "
                            "(make_linear picks the linear of a weight)")
        self.scratch_role = scratch_role
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)

    def forward(self, act: Activation, scratch: Scratch) -> torch.Tensor:
        x = act.x
        out = scratch.empty(self, "out", (x.shape[0], self.out_features))
        if self.weight.device.type == "cpu":
            # CPU BLAS picks different kernels for one row and for many, so float32 prefill and decode
            # would disagree by float32 rounding per layer; float64 accumulation makes every row's
            # result independent of T (and the CPU path a reference).
            out.copy_(F.linear(x.double(), self.weight.double()))
            return out
        # cuBLAS in the weight's dtype, into fixed buffers (the decode graph replays on them).
        x_w = scratch.empty(self, "x_w", x.shape, self.weight.dtype)
        y_w = scratch.empty(self, "y_w", out.shape, self.weight.dtype)
        x_w.copy_(x)
        torch.mm(x_w, self.weight.t(), out=y_w)
        out.copy_(y_w)
        return out

    def first_rows(self, rows: int, scratch_role: str) -> DenseLinear:
        """The linear of this one's first `rows` output rows, over a view of its weight (no copy)."""
        return DenseLinear(self.weight[:rows], scratch_role)


def make_linear(weight: torch.Tensor | Q8Tensor, lane: ActFormat, scratch_role: str) -> Q8Linear | DenseLinear:
    """The linear of a loaded weight, typed by the weight's format: a Q8_0 matrix reads the model's activation
    lane, a dense one float32 whatever the lane. A new weight format is a class above and a branch here."""
    if isinstance(weight, Q8Tensor):
        return Q8Linear(weight, lane, scratch_role)
    return DenseLinear(weight, scratch_role)


def embed_into(owner: nn.Module, ids: torch.Tensor, out: torch.Tensor,
               bad_token: torch.Tensor | None = None) -> torch.Tensor:
    """out float32 [T, D] <- the rows of ids (int32, on the device) of owner's embedding table: Q8_0
    (embed_q, embed_d buffers) or dense (embed). Both ops check the ids: an id outside the vocabulary is a
    ValueError on the CPU; on the GPU a NaN row and BAD_TOKEN ORed into bad_token (the state's error flag,
    raised by its sync_position). Not torch's index_select: its bounds check is a device-side assert,
    which ends the CUDA context (and in `serve`, the process). On a tensor-parallel rank the table is the
    rank's vocabulary rows, and owner.vocab_parallel (tensor_parallel.VocabShard) looks the ids up."""
    vocab_parallel = getattr(owner, "vocab_parallel", None)
    if vocab_parallel is not None:
        return vocab_parallel.embed_into(owner, ids, out, bad_token)
    return lookup_rows(owner, ids, out, bad_token)


def lookup_rows(owner: nn.Module, ids: torch.Tensor, out: torch.Tensor, bad_token: torch.Tensor | None) -> torch.Tensor:
    """embed_into's lookup in owner's own table, ids indexing its rows."""
    if hasattr(owner, "embed_q"):
        ops.q8_0_embedding(ids, owner.embed_q, owner.embed_d, out, bad_token)
    else:
        ops.embedding(ids, owner.embed, out, bad_token)
    return out


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Qwen38Config, w: dict, lane: ActFormat):
        super().__init__()
        self.config = config
        self.qkvz = make_linear(w["qkvz"], lane, "gdn.qkvz")  # rows [q | k | v | z | b (beta) | a (decay)]
        self.out_proj = make_linear(w["ssm_out"], lane, "gdn.out")
        self.input_format = self.qkvz.input_format  # what it reads: the layer's input norm writes it
        self.normed_format = self.out_proj.input_format  # what the gated norm writes
        self.register_buffer("conv_weight", w["ssm_conv1d"])
        self.register_buffer("a_neg", w["ssm_a"])
        self.register_buffer("dt_bias", w["ssm_dt"])
        self.register_buffer("norm_weight", w["ssm_norm"])

    def forward(self, act: Activation, state: GDNState, positions: torch.Tensor, scratch: Scratch,
                keep_token_states: bool = False) -> torch.Tensor:
        """keep_token_states: also write the state after each token into state.token_conv/token_recurrent."""
        c = self.config
        rows = act.x.shape[0]
        token_conv = state.token_conv[:rows] if keep_token_states else None
        token_recurrent = state.token_recurrent[:rows] if keep_token_states else None
        x = self.qkvz(act, scratch)
        out = scratch.activation(self, "normed", rows, c.linear_value_dim, self.normed_format)
        # gdn_step and the op sequence below give the same bits for up to GDN_STEP_ROWS rows (both recur token
        # by token there); gdn_step is one launch instead of four. A batched state (slots.SlotStates.rows:
        # recurrent [B, Hv, dv, dk]) is B sequences of rows / B tokens each (one: a decode step, any B; up to
        # GDN_STEP_ROWS: a speculative verify): gdn_step's batched-rows mode.
        if rows <= GDN_STEP_ROWS or state.recurrent.dim() == 4:
            ops.gdn_step(x, self.conv_weight, self.a_neg, self.dt_bias, self.norm_weight, c.rms_norm_eps, state.conv,
                         state.recurrent, *out.outs(), token_conv, token_recurrent)
            return self.out_proj(out, scratch)
        z_end = c.conv_dim + c.linear_value_dim
        conv = scratch.empty(self, "conv", (rows, c.conv_dim))
        ops.gdn_conv(x[:, : c.conv_dim], state.conv, self.conv_weight, c.linear_num_key_heads,
                     c.linear_key_head_dim, conv, token_conv)
        beta = scratch.empty(self, "beta", (rows, c.linear_num_value_heads))
        decay = scratch.empty(self, "decay", (rows, c.linear_num_value_heads))
        ops.gdn_gates(x[:, z_end:], self.a_neg, self.dt_bias, beta, decay)
        core = scratch.empty(self, "core", (rows, c.linear_num_value_heads, c.linear_value_head_dim))
        ops.gdn_recurrent(conv, beta, decay, state.recurrent, core, token_recurrent)
        ops.gated_rms_norm(core.view(rows, -1), x[:, c.conv_dim : z_end], self.norm_weight, c.rms_norm_eps,
                           *out.outs())
        return self.out_proj(out, scratch)


class GatedAttention(nn.Module):
    def __init__(self, config: Qwen38Config, w: dict, lane: ActFormat):
        super().__init__()
        self.config = config
        self.qgkv = make_linear(w["qgkv"], lane, "attn.qgkv")  # rows [query_0 | gate_0 | ... | k | v]
        self.o_proj = make_linear(w["attn_output"], lane, "attn.out")
        self.input_format = self.qgkv.input_format  # what it reads: the layer's input norm writes it
        self.gated_format = self.o_proj.input_format  # what the output gate writes
        self.register_buffer("q_norm", w["attn_q_norm"])
        self.register_buffer("k_norm", w["attn_k_norm"])

    def forward(self, act: Activation, cache: KVCache, positions: torch.Tensor, scratch: Scratch,
                keep_token_states: bool = False) -> torch.Tensor:
        """keep_token_states needs nothing here: KV rows are indexed by position, rows past the sequence's
        end are never read, so any prefix of a step is kept by the position alone."""
        c = self.config
        rows = act.x.shape[0]
        qgkv = self.qgkv(act, scratch)
        q = scratch.empty(self, "q", (rows, c.num_attention_heads, c.head_dim))
        ops.attn_qk_norm_rope_store(qgkv, self.q_norm, self.k_norm, positions, c.rms_norm_eps, c.rope_theta,
                                    c.rotary_dim, q, cache.k, cache.v, cache.bad_position)
        out = scratch.activation(self, "gated", rows, c.num_attention_heads * c.head_dim, self.gated_format)
        batched = cache.k.dim() == 4  # slots.SlotStates.rows: rows / B consecutive rows a sequence, its own cache
        if rows > SAME_SPLIT_TOKENS and not batched:  # a prompt chunk: flash attention on tensor cores, then the gate
            attn = scratch.empty(self, "attn", q.shape)
            workspace = scratch.empty(self, "prefill_workspace", (prefill_workspace_numel(
                rows, c.num_attention_heads, c.num_key_value_heads, c.head_dim),))
            ops.attention_prefill(q, cache.k, cache.v, positions, c.head_dim**-0.5, attn, workspace)
            ops.attn_output_gate(attn, qgkv, *out.outs())
        else:  # a decode step or a verify: split-K, each row in the decode step's float order, gate in the combine
            workspace = scratch.empty(self, "workspace", (workspace_numel(rows, c.num_attention_heads, c.head_dim,
                                                                          batched),))
            ops.attention_gated(q, cache.k, cache.v, positions, c.head_dim**-0.5, qgkv, workspace, *out.outs())
        return self.o_proj(out, scratch)


class MLP(nn.Module):
    def __init__(self, config: Qwen38Config, w: dict, lane: ActFormat):
        super().__init__()
        self.gate_up = make_linear(w["gate_up"], lane, "mlp.gate_up")  # rows [gate | up]
        self.down = make_linear(w["ffn_down"], lane, "mlp.down")
        self.input_format = self.gate_up.input_format  # what it reads: the layer's post-mixer norm writes it
        self.hidden_format = self.down.input_format  # what silu_mul writes

    def forward(self, act: Activation, scratch: Scratch) -> torch.Tensor:
        hidden = scratch.activation(self, "hidden", act.x.shape[0], self.down.in_features, self.hidden_format)
        ops.silu_mul(self.gate_up(act, scratch), *hidden.outs())
        return self.down(hidden, scratch)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. The residual add of the previous block is fused into this block's norm
    (add_rms_norm), so the stream is read and written once per norm."""

    def __init__(self, config: Qwen38Config, mixer: nn.Module, mlp: MLP, w: dict):
        super().__init__()
        self.mixer = mixer
        self.mlp = mlp
        self.register_buffer("input_norm", w["attn_norm"])
        self.register_buffer("post_norm", w["post_attention_norm"])
        self.eps = config.rms_norm_eps
        self.mixer_in_format = mixer.input_format  # what the input norm writes
        self.mlp_in_format = mlp.input_format  # what the post-mixer norm writes
        # Tensor parallelism (tensor_parallel.py) sets it: sums, in place across the ranks, the mixer's and the
        # MLP's outputs, each a rank's partial sum (their last matrices are row-parallel).
        self.reduce = None

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None, state, positions,
                scratch: Scratch, keep_token_states: bool = False) -> torch.Tensor:
        rows, width = residual.shape
        act = scratch.activation(self, "mixer_in", rows, width, self.mixer_in_format)
        if delta is None:
            ops.rms_norm(residual, self.input_norm, self.eps, *act.outs())
        else:
            ops.add_rms_norm(residual, delta, self.input_norm, self.eps, *act.outs())
        delta = self.mixer(act, state, positions, scratch, keep_token_states)
        if self.reduce is not None:
            self.reduce(delta)
        act = scratch.activation(self, "mlp_in", rows, width, self.mlp_in_format)
        ops.add_rms_norm(residual, delta, self.post_norm, self.eps, *act.outs())
        delta = self.mlp(act, scratch)
        if self.reduce is not None:
            self.reduce(delta)
        return delta
