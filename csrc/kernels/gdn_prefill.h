// Gated DeltaNet prefill: the delta-rule recurrence of gdn_recurrent over T tokens in chunks, the float32 state
// continued from and written back in place. Same inputs, outputs and layouts as gdn_recurrent_launch (gdn.h), less
// the per-token states; float32 error. Two kernels behind one launcher: at dk = 128 and dv % 64 == 0 (the 27B
// shape) from 32 tokens the tensor-core one (gdn_chunk_mma.cu: 3xTF32 mma.sync over chunks of
// kGdnPrefillMmaChunk), otherwise float32 FMAs (gdn_prefill.cu: chunks of kGdnPrefillChunk).
// QWEN38_GDN_PREFILL=fp32 or =mma in the environment (read at each launch) runs that one wherever it applies: both
// measurable in one process. The host launcher takes
// gdn_recurrent's Args and a stream; it launches asynchronously (with PDL when pdl_enabled(): pdl.cuh) and
// returns the launch's cudaError_t.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "gdn.h"  // GdnRecurrentArgs

namespace qwen38 {

// Tokens per chunk of the float32 kernel: one pass over the state serves this many tokens.
constexpr int kGdnPrefillChunk = 16;
// Tokens per chunk of the tensor-core kernel.
constexpr int kGdnPrefillMmaChunk = 32;
// Largest dk (the state row's register share is dk / 8 floats a lane).
constexpr int kGdnPrefillMaxHeadKDim = 256;
// Largest number of value heads per key head (ceil(Hv / Hk)): a block holds that many heads' rows.
constexpr int kGdnPrefillMaxGroup = 4;

// Whether gdn_prefill_launch takes these arguments; otherwise gdn_recurrent_launch (token by token) does.
// Needs no token_states and 16-byte aligned q/k rows and state rows (qkv and state 16-byte aligned, qkv's row
// stride a multiple of 4), and either the tensor-core kernel's dk = 128, dv % 64 == 0
// (gdn_prefill_mma_supported) or the float32 kernel's dk % 4 == 0, dk <= kGdnPrefillMaxHeadKDim and
// ceil(Hv / Hk) <= kGdnPrefillMaxGroup.
bool gdn_prefill_supported(const GdnRecurrentArgs& args);
bool gdn_prefill_mma_supported(const GdnRecurrentArgs& args);

// gdn_recurrent's arguments: qkv [T, 2*Hk*dk + Hv*dv] (row stride qkv_row_stride), beta, decay [T, Hv]
// contiguous, state [Hv, dv, dk] in place, out [T, Hv, dv] contiguous. Value head h reads key head h % Hk.
// gdn_prefill_supported() must hold.
cudaError_t gdn_prefill_launch(const GdnRecurrentArgs& args, cudaStream_t stream);
// The tensor-core kernel alone (gdn_chunk_mma.cu); gdn_prefill_mma_supported() must hold.
cudaError_t gdn_prefill_mma_launch(const GdnRecurrentArgs& args, cudaStream_t stream);

}  // namespace qwen38
