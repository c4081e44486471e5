// The qwen38 op namespace: every op's schema, once. This file is the contract between the CUDA kernels
// (csrc/kernels + csrc/cuda_bindings, registered for CUDA) and the plain-PyTorch references
// (qwen38_ops/reference, registered in Python under CompositeExplicitAutograd, so every op also runs on
// the CPU and on a GPU whose kernel does not exist yet).
//
// Conventions shared by all ops:
// - Ops write into outputs passed as `Tensor(a!)` and return nothing: graph capture needs fixed buffers.
// - Activations, states and small weights are float32. "Rows" are the leading dimension T (tokens); an
//   input row may be strided as long as its last dimension is contiguous (slices of a fused projection).
// - Optional quantized outputs select the activation lane the next Q8_0 GEMV reads:
//     out_q = None                 -> f32 lane (only `out`)
//     out_q given, out_q_lo = None -> int8 lane: ggml's q8_0 rounding per 32-block, d = amax/127 rounded
//                                     to fp16 (stored in out_d as float32), q = round(x / d)
//     out_q and out_q_lo given     -> two-word int8 lane: s = amax/127 (f32), t = x/s, q = clamp(round(t)),
//                                     q_lo = round((t - q) * 127); value = s * (q + q_lo / 127)
//   out_q/out_q_lo are int8 [T, K], out_d float32 [T, K/32].
// - Q8_0 weights are int8 quants [N, K] + fp16 block scales [N, K/32] (32 values along K per scale).
#include <torch/library.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>

#include <cstdint>
#include <string>

#include "kernels/op_limits.h"

namespace {

// The kernels' limits and constants that Python needs (kernels/op_limits.h), by name; every value is a list
// (one element for a scalar; q8_0_gemv_configs: trip, parts of each compiled config in turn).
c10::Dict<std::string, c10::List<int64_t>> limits() {
  c10::Dict<std::string, c10::List<int64_t>> d;
  auto one = [&](const char* name, int64_t v) { d.insert(name, c10::List<int64_t>({v})); };
  one("quant_block", qwen38::kQuantBlock);
  one("attention_splits", qwen38::kAttentionSplits);
  one("attention_same_split_tokens", qwen38::kAttentionSameSplitTokens);
  one("attention_prefill_rows", qwen38::kAttentionPrefillRows);
  one("attention_prefill_target_blocks", qwen38::kAttentionPrefillTargetBlocks);
  one("attention_prefill_max_splits", qwen38::kAttentionPrefillMaxSplits);
  one("gdn_step_max_tokens", qwen38::kGdnStepMaxTokens);
  one("bad_position_flag", qwen38::kBadPositionFlag);
  one("bad_token_flag", qwen38::kBadTokenFlag);
  c10::List<int64_t> configs;
#define QWEN38_LIMITS_CONFIG(TRIP, PARTS) \
  configs.push_back(TRIP);                \
  configs.push_back(PARTS);
  QWEN38_Q8_GEMV_CONFIGS(QWEN38_LIMITS_CONFIG)
#undef QWEN38_LIMITS_CONFIG
  d.insert("q8_0_gemv_configs", configs);
  return d;
}

}  // namespace

TORCH_LIBRARY(qwen38, m) {

  // ---- q8_gemv: y = x W^T for Q8_0 W, one op per activation lane (one kernel template behind them).
  // f32 lane: x float32 [T, K] -> out float32 [T, N]; equals dequantize-then-matmul.
  m.def("q8_0_gemv(Tensor x, Tensor weight_q, Tensor weight_d, Tensor(a!) out) -> ()");
  // int8 lane: x_q int8 [T, K], x_d float32 [T, K/32]; per block an exact int32 dot scaled by both scales.
  m.def("q8_0_gemv_int8(Tensor x_q, Tensor x_d, Tensor weight_q, Tensor weight_d, Tensor(a!) out) -> ()");
  // two-word int8 lane: x = x_d * (x_q + x_q_lo / 127) per block.
  m.def("q8_0_gemv_int8x2(Tensor x_q, Tensor x_q_lo, Tensor x_d, Tensor weight_q, Tensor weight_d, "
        "Tensor(a!) out) -> ()");
  // The same two integer lanes as a tensor-core GEMM for prompt-sized T (same arguments and block math; the
  // scaled block sums are added in float32 where the GEMV adds them in double). K % 64 == 0.
  m.def("q8_0_gemm_int8(Tensor x_q, Tensor x_d, Tensor weight_q, Tensor weight_d, Tensor(a!) out) -> ()");
  m.def("q8_0_gemm_int8x2(Tensor x_q, Tensor x_q_lo, Tensor x_d, Tensor weight_q, Tensor weight_d, "
        "Tensor(a!) out) -> ()");

  // ---- norm_quant: producers that emit the next GEMV's activation in the lane it needs.
  // Standalone quantizer of x float32 [T, K] into the int8 (out_q_lo None) or two-word lane.
  m.def("quantize_act(Tensor x, Tensor(a!) out_q, Tensor(b!)? out_q_lo, Tensor(c!) out_d) -> ()");
  // out = x * rsqrt(mean(x^2) + eps) * weight over the last dim; x [T, D], weight [D].
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out, Tensor(b!)? out_q, "
        "Tensor(c!)? out_q_lo, Tensor(d!)? out_d) -> ()");
  // residual += x, then out = rms_norm(residual) (the residual stream stays float32).
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps, Tensor(b!) out, "
        "Tensor(c!)? out_q, Tensor(d!)? out_q_lo, Tensor(e!)? out_d) -> ()");
  // SwiGLU: gate_up [T, 2F] = [gate | up] (the fused gate|up GEMV output); out [T, F] = silu(gate) * up.
  m.def("silu_mul(Tensor gate_up, Tensor(a!) out, Tensor(b!)? out_q, Tensor(c!)? out_q_lo, "
        "Tensor(d!)? out_d) -> ()");
  // GDN output norm: x [T, H*dv] per head of dv: out = rms_norm(x_h) * weight[dv] * silu(z_h); z [T, H*dv].
  // Normalise, weight, THEN gate (the checkpoint's order). weight is used as stored (no 1+w).
  m.def("gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps, Tensor(a!) out, Tensor(b!)? out_q, "
        "Tensor(c!)? out_q_lo, Tensor(d!)? out_d) -> ()");

  // ---- embedding: out[t] = row token[t] of the table as float32 [T, D]; token int32 [T] on the device.
  // An id outside [0, V) gets a NaN row and ORs 2 into bad_token (when given: int32 [1], one flag for the rows,
  // or [T], row t ORing into element t, for batched rows; 2 so that it can share attention's bad_position, which
  // stores 1): the caller reads it at its next sync. The CPU reference raises a ValueError at once instead.
  // Q8_0 table: int8 quants [V, D] + fp16 scales [V, D/32], D % 32 == 0; the row dequantized.
  m.def("q8_0_embedding(Tensor token, Tensor weight_q, Tensor weight_d, Tensor(a!) out, "
        "Tensor(b!)? bad_token=None) -> ()");
  // Dense table: float32, bfloat16 or float16 [V, D]; the row widened to float32 (exact).
  m.def("embedding(Tensor token, Tensor weight, Tensor(a!) out, Tensor(b!)? bad_token=None) -> ()");

  // ---- gdn: Gated DeltaNet mixer. Internal value-head order is ggml's: value head h reads key head h % Hk.
  // Causal depthwise conv over T tokens continuing from conv_state, then SiLU, then L2 norm of each q and
  // k head (1e-6 inside the sqrt of the sum of squares). qkv [T, C] with C = 2*Hk*dk + Hv*dv, channel
  // order [q | k | v]; conv_state float32 [K-1, C], oldest first, updated in place to the last K-1 inputs
  // (pre-activation); conv_weight [C, K], tap K-1 multiplies the newest input. out [T, C].
  // token_conv_states (optional) float32 [T, K-1, C]: the conv state after each token; token t's out and
  // state are bitwise those of T calls of one token.
  m.def("gdn_conv(Tensor qkv, Tensor(a!) conv_state, Tensor conv_weight, int num_k_heads, int head_k_dim, "
        "Tensor(b!) out, Tensor(c!)? token_conv_states=None) -> ()");
  // Both gates from the fused b|a projection ba [T, 2*Hv]: beta = sigmoid(b),
  // decay = exp(a_neg * softplus(a + dt_bias)) with a_neg = -exp(A_log). beta, decay [T, Hv].
  m.def("gdn_gates(Tensor ba, Tensor a_neg, Tensor dt_bias, Tensor(a!) beta, Tensor(b!) decay) -> ()");
  // Delta-rule recurrence over T tokens on state float32 [Hv, dv, dk] (key index fastest), in place.
  // qkv = gdn_conv's out [T, C]. Per token, value head h, key head h % Hk, q scaled by 1/sqrt(dk):
  //   S *= decay; S += beta * (v - S k) k^T; out = S q.   out [T, Hv, dv].
  // token_states (optional) float32 [T, Hv, dv, dk]: the state after each token (token_states[T-1] = the
  // final state); with it, every out and state is bitwise what T calls of one token give (speculative verify).
  m.def("gdn_recurrent(Tensor qkv, Tensor beta, Tensor decay, Tensor(a!) state, Tensor(b!) out, "
        "Tensor(c!)? token_states=None) -> ()");
  // A layer's decode step (T <= 8 tokens) in one op: x [T, C + Hv*dv + 2*Hv] = [q | k | v | z | b | a] (the
  // fused projection) -> gdn_conv(x[:, :C]) -> gdn_gates(x[:, C+Hv*dv:]) -> gdn_recurrent token by token ->
  // gated_rms_norm(core, z = x[:, C:C+Hv*dv], norm_weight, eps) into out [T, Hv*dv] and its optional quantized
  // lane. Sizes from conv_weight [C, K] and state [Hv, dv, dk]; states and token states as those ops'.
  // Token t's every output is bitwise what that sequence gives as a decode step.
  // Batched rows: conv_state [B, K-1, C] and state [B, Hv, dv, dk] with B dividing T make x's rows B sequences of
  // T / B tokens (<= 8 when more than 1) each, sequence b's rows b*T/B .. on conv_state[b], state[b] (token states,
  // when given, [T, ...] in x's row order), each sequence's rows bitwise a call of its tokens alone on its states.
  m.def("gdn_step(Tensor x, Tensor conv_weight, Tensor a_neg, Tensor dt_bias, Tensor norm_weight, float eps, "
        "Tensor(a!) conv_state, Tensor(b!) state, Tensor(c!) out, Tensor(d!)? out_q, Tensor(e!)? out_q_lo, "
        "Tensor(f!)? out_d, Tensor(g!)? token_conv_states=None, Tensor(h!)? token_states=None) -> ()");

  // ---- attention: gated full attention with a KV cache [max_seq, Hkv, hd] (float32 or bfloat16) that the T rows
  // share (T tokens of one sequence), or, in the decode-step ops (attn_qk_norm_rope_store, attention,
  // attention_gated), caches [B, max_seq, Hkv, hd] with B dividing T: batched rows, T / B consecutive rows a
  // sequence with its own cache (one row: its decode step; more: its verify, causal through the positions), each row
  // exactly what a one-row call on its cache gives. The caches' rank picks the mode.
  // qgkv [T, Hq*2*hd + 2*Hkv*hd]: per query head [query hd | gate hd] interleaved, then k, then v.
  // Per token t at position positions[t] (int32, on the device): RMSNorm each q and k head (weights
  // [hd], stored as 1+w), NEOX RoPE on the first rotary_dim dims with frequencies theta^(-2i/rotary_dim);
  // q -> q_out [T, Hq, hd]; k and v stored at row positions[t] of the caches (of row t's cache, batched). A position
  // outside the cache stores nothing and sets bad_position to 1: int32 [1], one flag for all rows, or [T], row t's
  // flag t (either mode), when given; the caller reads it at its next sync.
  m.def("attn_qk_norm_rope_store(Tensor qgkv, Tensor q_norm, Tensor k_norm, Tensor positions, float eps, "
        "float rope_theta, int rotary_dim, Tensor(a!) q_out, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor(d!)? bad_position=None) -> ()");
  // Causal attention of q [T, Hq, hd] over cache rows 0..positions[t] (GQA: query head h reads kv head
  // h / (Hq/Hkv)), softmax in float32 with scale. out [T, Hq, hd]. workspace: float32 scratch for the
  // split-K combine (size from qwen38_ops.attention.workspace_numel, batched=True for [B, ...] caches); contents
  // undefined afterwards.
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, Tensor(a!) out, "
        "Tensor(b!) workspace) -> ()");
  // attention's out for prompts (tensor cores; a bf16 cache rounds q and p to bf16), one cache [max_seq, Hkv, hd]
  // shared by the rows. workspace: float32 scratch
  // for the split-K of few query rows (size from qwen38_ops.attention_prefill.workspace_numel, 0 when unsplit);
  // contents undefined afterwards.
  m.def("attention_prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, "
        "Tensor(a!) out, Tensor(b!) workspace) -> ()");
  // attention, then attn_output_gate applied in the split-K combine: one launch fewer for the decode step and
  // the verify (T <= 8), and for batched rows (any T); each row bitwise the two ops' result.
  m.def("attention_gated(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, float scale, Tensor qgkv, "
        "Tensor(a!) workspace, Tensor(b!) out, Tensor(c!)? out_q, Tensor(d!)? out_q_lo, Tensor(e!)? out_d) -> ()");
  // out [T, Hq*hd] = attn [T, Hq, hd] * sigmoid(gate) with gate read from qgkv's interleaved q|gate rows.
  m.def("attn_output_gate(Tensor attn, Tensor qgkv, Tensor(a!) out, Tensor(b!)? out_q, Tensor(c!)? out_q_lo, "
        "Tensor(d!)? out_d) -> ()");

  // ---- sampling: token[0] = argmax(logits[V]) (lowest index among ties), position[0] += 1; both int32. The
  // sampler's bookkeeping when given: seen[token] = generated[token] = True (bool [V]), num_generated[0] += 1
  // (int32 [1]), nonfinite[0] |= some logit is NaN or infinite (bool [1]).
  m.def("argmax_advance(Tensor logits, Tensor(a!) token, Tensor(b!) position, Tensor(c!)? seen=None, "
        "Tensor(d!)? generated=None, Tensor(e!)? num_generated=None, Tensor(f!)? nonfinite=None) -> ()");

  // ---- limits: the kernels' limits and constants Python needs, {name: [values]} (csrc/kernels/op_limits.h;
  // qwen38_ops.limits reads them once). No tensors: it runs the same in every build, the CPU-only one too.
  m.def("limits() -> Dict(str, int[])", &limits);
}

// `import qwen38_ops._C` loads this library (and with it the registrations above); the module itself is
// empty, all entry points are torch.ops.qwen38.*.
#include <Python.h>
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
