// Gated DeltaNet prefill: the delta-rule recurrence of gdn_recurrent over T tokens in chunks of
// kGdnPrefillChunk, the float32 state continued from and written back in place. Same inputs, outputs and
// layouts as gdn_recurrent_launch (gdn.h), less the per-token states; exact in float32 (no reduced-precision
// products). The host launcher takes gdn_recurrent's Args and a stream; it launches asynchronously (with PDL when
// pdl_enabled(): pdl.cuh) and returns the launch's cudaError_t.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "gdn.h"  // GdnRecurrentArgs

namespace qwen38 {

// Tokens per chunk: one pass over the state serves this many tokens.
constexpr int kGdnPrefillChunk = 16;
// Largest dk (the state row's register share is dk / 8 floats a lane).
constexpr int kGdnPrefillMaxHeadKDim = 256;
// Largest number of value heads per key head (ceil(Hv / Hk)): a block holds that many heads' rows.
constexpr int kGdnPrefillMaxGroup = 4;

// Whether gdn_prefill_launch takes these arguments; otherwise gdn_recurrent_launch (token by token) does.
// Needs no token_states, dk % 4 == 0 and dk <= kGdnPrefillMaxHeadKDim, ceil(Hv / Hk) <= kGdnPrefillMaxGroup, and
// 16-byte aligned q/k rows and state rows (qkv and state 16-byte aligned, qkv's row stride a multiple of 4).
bool gdn_prefill_supported(const GdnRecurrentArgs& args);

// gdn_recurrent's arguments: qkv [T, 2*Hk*dk + Hv*dv] (row stride qkv_row_stride), beta, decay [T, Hv]
// contiguous, state [Hv, dv, dk] in place, out [T, Hv, dv] contiguous. Value head h reads key head h % Hk.
// gdn_prefill_supported() must hold.
cudaError_t gdn_prefill_launch(const GdnRecurrentArgs& args, cudaStream_t stream);

}  // namespace qwen38
