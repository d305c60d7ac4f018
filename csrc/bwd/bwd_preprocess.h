// Backward preprocess, one CTA per (m_block, head, batch): D_i = rowsum(dO_i * O_i) in fp32, LSE converted to the
// log2 domain, and this Q tile's semaphores (one per dQ part) zeroed. The fp32 dQ accumulator is not zeroed: the
// first add into a tile is a plain bulk store in both modes (bwd_dq_writer.h), and the postprocess writes zeros for
// tiles without contributing KV tiles. That saves writing the whole accumulator once per call (about 40% of the
// preprocess time at hdim 128).
// Padded rows (>= seqlen_q) and rows that saw no key in the forward (LSE = -inf) get LSE_log2 = +inf and D = 0, so
// the main loop's exp2(S*scale*log2e - LSE_log2) is exactly 0 for them without a branch. Kernels of RowStats::kGemmInit
// read only the tile's GemmStatLines (bwd_config.h), where such rows take -kNoKeyScore instead of -inf, so for them
// the preprocess writes those instead of the fp32 LSE_log2 and D.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include <cutlass/numeric_conversion.h>

#include "bwd/bwd_config.h"
#include "common/packed_seqs.h"

namespace dash::bwd {

struct PreprocessParams {
  const void* o;
  const void* dout;
  const float* lse;  // (batch, nheads, seqlen_q), natural log
  int64_t o_row, o_head, o_batch;
  int64_t do_row, do_head, do_batch;
  float* lse_log2;  // (batch, nheads, seqlen_q_rounded)
  float* dsum;      // (batch, nheads, seqlen_q_rounded)
  int32_t* semaphores;  // dq_runs runs, num_q_tiles apart (run_tile_index)
  int32_t seqlen_q, seqlen_q_rounded, nheads, num_m_blocks;
  int32_t headdim;  // of o and dout (value_head_dim); may be below kHeadDim (common/head_dims.h)
  // SeqLayout::kPacked: o and dout rows of sequence `batch` from its first row, lse (nheads, total_q).
  PackedSeqs packed;
  // kGemmStats (the main kernel's RowStats::kGemmInit): GemmStatLines (batch, nheads, seqlen_q_rounded / 2), and 1 /
  // the main kernel's scale_log2.
  cutlass::bfloat16_t* gemm_stats;
  float inv_scale_log2;
  // Pieces finished per unit of shift's split tail (bwd_epilogue.h): zeroed by the first CTA.
  int32_t* split_counters;
  int32_t num_split_counters;
  // ScheduleKind::kDynamic's claim counters (schedule/dynamic.h): the unit counter, zeroed by the first CTA, and each
  // Q tile's count of loaded visits, zeroed with its semaphores.
  unsigned long long* unit_counter;
  int32_t* dq_claims;
  int32_t dq_runs;
  int64_t num_q_tiles;
  // Learnable sinks (null: none): the (nheads,) logits, and per Q tile (q_tile_index) the tile's share of d sink,
  // -sum over its rows of exp(sink - lse) * D, summed in a fixed order (sink_grad_kernel adds the shares up).
  const float* sink;
  float* sink_partials;
};

// x as kGemmStatParts bf16 parts, each the rounding of what the previous ones left.
CUTLASS_DEVICE void split_into_parts(float x, cutlass::bfloat16_t* parts) {
#pragma unroll
  for (int i = 0; i < kGemmStatParts; ++i) {
    parts[i] = cutlass::bfloat16_t(x);
    x -= float(parts[i]);
  }
}

constexpr int kPreprocessThreads = 256;

// 16 bytes from `ptr` where `valid`, else zeros (the bit pattern of Element zeros), as one predicated load: with a
// branch around a plain load, the compiler unpacked the loaded values inside the branch and so waited for each load
// before issuing the next.
CUTLASS_DEVICE uint4 load_or_zero(bool valid, const uint4* ptr) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(ptr), "r"(int(valid)));
  return v;
}

template <int kHeadDim, int kBlockM, class Element, SeqLayout kLayout = SeqLayout::kBatched, bool kGemmStats = false>
__global__ void __launch_bounds__(kPreprocessThreads) bwd_preprocess_kernel(const PreprocessParams p) {
  constexpr bool kPacked = kLayout == SeqLayout::kPacked;
  constexpr int kVec = 16 / sizeof(Element);                 // elements per 16-byte load
  constexpr int kThreadsPerRow = kHeadDim / kVec;
  constexpr int kRowsPerPass = kPreprocessThreads / kThreadsPerRow;
  static_assert(kThreadsPerRow <= 32 && kPreprocessThreads % kThreadsPerRow == 0, "row must fit in one warp");
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int64_t bh = int64_t(batch) * p.nheads + head;
  const SeqRows rows = seq_rows<kLayout>(p.packed, batch, p.seqlen_q, 0);
  const int seqlen_q = rows.len_q;
  // Row 0 of this head's sequence in o and dout, and its LSE row.
  const int64_t o_first = kPacked ? int64_t(rows.first_q) * p.o_row : batch * p.o_batch;
  const int64_t do_first = kPacked ? int64_t(rows.first_q) * p.do_row : batch * p.do_batch;
  const float* lse_row = kPacked ? p.lse + int64_t(head) * p.packed.total_q + rows.first_q : p.lse + bh * p.seqlen_q;

  const int64_t tile_index = q_tile_index(batch, head, p.nheads, p.num_m_blocks, m_block);
  const int sub = threadIdx.x % kThreadsPerRow;
  // Every load of the thread's rows (O, dO, LSE) is issued before any is used: with a loop over rows that the
  // compiler could not unroll (its trip count depends on the thread), each pass waited on its loads and then on the
  // LSE load behind them.
  constexpr int kPasses = kBlockM / kRowsPerPass;
  static_assert(kBlockM % kRowsPerPass == 0, "whole passes of rows");
  // Each row's share of d sink, by row of the tile (written by the row's sub == 0 thread).
  __shared__ float sink_share[kBlockM];
  uint4 o_vec[kPasses], do_vec[kPasses];
  float lse_in[kPasses];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int row = m_block * kBlockM + pass * kRowsPerPass + threadIdx.x / kThreadsPerRow;
    const bool in_rows = row < seqlen_q && sub * kVec < p.headdim;
    const Element* o = static_cast<const Element*>(p.o) + o_first + head * p.o_head + row * p.o_row;
    const Element* d = static_cast<const Element*>(p.dout) + do_first + head * p.do_head + row * p.do_row;
    o_vec[pass] = load_or_zero(in_rows, reinterpret_cast<const uint4*>(o) + sub);
    do_vec[pass] = load_or_zero(in_rows, reinterpret_cast<const uint4*>(d) + sub);
    lse_in[pass] = sub == 0 && row < seqlen_q ? lse_row[row] : -INFINITY;
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int r = pass * kRowsPerPass + threadIdx.x / kThreadsPerRow;
    const int row = m_block * kBlockM + r;
    float dot = 0.f;
    const Element* oe = reinterpret_cast<const Element*>(&o_vec[pass]);
    const Element* de = reinterpret_cast<const Element*>(&do_vec[pass]);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dot += float(oe[i]) * float(de[i]);
#pragma unroll
    for (int off = kThreadsPerRow / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (sub == 0) {
      const float lse2 = lse_in[pass] == -INFINITY ? INFINITY : lse_in[pass] * float(M_LOG2E);
      const float dsum = row < seqlen_q ? dot : 0.f;
      // Rows past the sequence, or without lse, take no part (and exp(sink + inf) * 0 would be NaN).
      if (p.sink != nullptr) {
        sink_share[r] = lse2 == INFINITY ? 0.f : -expf(p.sink[head] - lse_in[pass]) * dsum;
      }
      if constexpr (kGemmStats) {
        // Row r of the tile goes to line r % (kBlockM / 2), in its first half for r < kBlockM / 2 (GemmStatLines).
        alignas(8) cutlass::bfloat16_t parts[2 * kGemmStatParts];
        split_into_parts(lse2 == INFINITY ? -kNoKeyScore : -lse2 * p.inv_scale_log2, parts);
        split_into_parts(-dsum, parts + kGemmStatParts);
        constexpr int kHalf = kBlockM / 2;
        const int64_t line = tile_index * kHalf + r % kHalf;
        reinterpret_cast<uint2*>(p.gemm_stats)[2 * line + r / kHalf] = *reinterpret_cast<const uint2*>(parts);
      } else {
        const int64_t idx = bh * p.seqlen_q_rounded + row;
        p.lse_log2[idx] = lse2;
        p.dsum[idx] = dsum;
      }
    }
  }

  if (p.sink != nullptr) {
    __syncthreads();
    // Warp 0 adds the tile's rows in a fixed order: row-strided sums per lane, then a butterfly over the lanes.
    if (threadIdx.x < 32) {
      float share = 0.f;
#pragma unroll
      for (int r = threadIdx.x; r < kBlockM; r += 32) share += sink_share[r];
#pragma unroll
      for (int off = 16; off > 0; off /= 2) share += __shfl_xor_sync(0xffffffffu, share, off);
      if (threadIdx.x == 0) p.sink_partials[tile_index] = share;
    }
  }

  if (threadIdx.x == 0) {
    for (int run = 0; run < p.dq_runs; ++run) {
      int32_t* sems = tile_semaphores<kHeadDim>(p.semaphores, run_tile_index(tile_index, run, p.num_q_tiles));
      for (int part = 0; part < BwdConfig<kHeadDim>::kDqParts; ++part) sems[part] = 0;
    }
    p.dq_claims[tile_index] = 0;
  }
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    for (int i = threadIdx.x; i < p.num_split_counters; i += blockDim.x) p.split_counters[i] = 0;
    if (threadIdx.x == 0) *p.unit_counter = 0;
  }
}

// d sink_h from the preprocess's per-tile shares, one warp per head: each sequence's tiles are added lane-strided
// and joined by a butterfly, then the sequences in batch order. The order depends on nothing but the tile's place in
// its sequence (tiles past a sequence's end add exact zeros), so a sequence's share is the same whatever the grid,
// the other sequences or num_m_blocks.
static __global__ void __launch_bounds__(32) sink_grad_kernel(const float* partials, float* dsink, int32_t batch,
                                                       int32_t nheads, int32_t num_m_blocks) {
  const int head = blockIdx.x;
  float total = 0.f;
  for (int b = 0; b < batch; ++b) {
    const float* tiles = partials + (int64_t(b) * nheads + head) * num_m_blocks;
    float share = 0.f;
    for (int m = threadIdx.x; m < num_m_blocks; m += 32) share += tiles[m];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) share += __shfl_xor_sync(0xffffffffu, share, off);
    total += share;
  }
  if (threadIdx.x == 0) dsink[head] = total;
}

}  // namespace dash::bwd
