// argmax_advance: token[0] = argmax(logits[V]) with the LOWEST index among ties, position[0] += 1, both on
// the device so a captured decode graph can feed the next step without a host round trip; and the sampler's
// bookkeeping, which otherwise takes several small torch launches a token.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace qwen38 {

// The sampler's bookkeeping of a step, done by the same launch (each pointer may be null): seen[token] and
// generated[token] set (bool [V]), num_generated[0] += 1, nonfinite[0] set when some logit is NaN or infinite
// (the caller passes it only when logits are the model's raw logits).
struct SamplerBooks {
  bool* seen = nullptr;
  bool* generated = nullptr;
  int32_t* num_generated = nullptr;
  bool* nonfinite = nullptr;
};

// NaN ranks above every number (torch.argmax's rule), so a NaN anywhere returns the first NaN's index: a
// broken step shows up as a fixed token rather than as an arbitrary finite one. +0.0 and -0.0 tie.
// logits may have any alignment (a row of a [T, V] tensor); V >= 1.
struct ArgmaxAdvanceArgs {
  const float* logits = nullptr;  // [V]
  int V = 0;
  int32_t* token = nullptr;     // [1]
  int32_t* position = nullptr;  // [1]
  SamplerBooks books;
};
// On `stream`, without PDL (the kernel has no griddepcontrol.wait: pdl.cuh).
cudaError_t argmax_advance_launch(const ArgmaxAdvanceArgs& args, cudaStream_t stream);

}  // namespace qwen38
