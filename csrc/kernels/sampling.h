// argmax_advance: token[0] = argmax(logits[V]) with the LOWEST index among ties, position[0] += 1, both on
// the device so a captured decode graph can feed the next step without a host round trip.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace qwen38 {

// NaN ranks above every number (torch.argmax's rule), so a NaN anywhere returns the first NaN's index: a
// broken step shows up as a fixed token rather than as an arbitrary finite one. +0.0 and -0.0 tie.
// logits may have any alignment (a row of a [T, V] tensor); V >= 1.
cudaError_t argmax_advance(const float* logits, int V, int32_t* token, int32_t* position, cudaStream_t stream);

}  // namespace qwen38
