// The sequence table of a packed call scheduled per sequence (schedule/seq_runs.h), built on the device from
// the cu_seqlens/seqused the kernels read, so that a captured call whose lengths the host never saw schedules the
// lengths it replays. One CTA: each sequence's rows in use (clamped as every packed kernel clamps them) and the
// schedule its geometry resolves to; the launch order (longest first up to kSortedSeqsMax sequences, by rank); the
// first unit of each sequence, an exclusive scan over the launch order. Launched before the main kernel, in order.
#pragma once
#include <cuda_runtime.h>

#include "bwd/bwd_config.h"
#include "common/packed_seqs.h"

namespace dash::bwd {

constexpr int kSeqTableThreads = sched::SeqCausalRuns::kSortedSeqsMax;

struct SeqTableParams {
  PackedSeqs packed;
  sched::Problem problem;  // the main kernel's tiling, heads and mask; batch = sequences
  int32_t short_k;         // causal: sequences of up to this many keys run Descending (SeqCausalRuns::entry_for)
  sched::SeqEntry* table;  // seq_table_bytes(batch)
};

static __global__ void __launch_bounds__(kSeqTableThreads) bwd_seq_table_kernel(const SeqTableParams p) {
  using sched::SeqCausalRuns;
  using sched::SeqEntry;
  __shared__ SeqEntry entries[kSeqTableThreads];
  __shared__ int32_t scan[kSeqTableThreads];
  __shared__ int32_t carry;
  const int32_t B = p.problem.batch, tid = threadIdx.x;
  int32_t* order = reinterpret_cast<int32_t*>(p.table + B + 1);
  const bool sorted = B <= SeqCausalRuns::kSortedSeqsMax;
  if (tid == 0) carry = 0;
  for (int32_t base = 0; base < B; base += kSeqTableThreads) {
    const int32_t b = base + tid;
    const int32_t n = min(B - base, kSeqTableThreads);
    SeqEntry e{0, 0, 0, ScheduleKind::kDescending};
    if (b < B) {
      int32_t first_q, len_q, first_k, len_k;
      clamped_rows(p.packed.cu_seqlens_q, p.packed.seqused_q, b, p.packed.total_q, first_q, len_q);
      clamped_rows(p.packed.cu_seqlens_k, p.packed.seqused_k, b, p.packed.total_k, first_k, len_k);
      e = SeqCausalRuns::entry_for(p.problem, len_q, len_k, p.short_k);
    }
    entries[tid] = e;
    __syncthreads();
    // Launch position of this sequence in its chunk: its rank among the chunk (the whole pack where it is sorted).
    int32_t pos = tid;
    if (sorted && tid < n) {
      pos = 0;
      for (int32_t o = 0; o < n; ++o) pos += o != tid && SeqCausalRuns::launches_before(entries[o], o, e, tid);
    }
    scan[pos] = tid < n ? SeqCausalRuns::units_of(p.problem, e) : 0;
    __syncthreads();
    // Inclusive scan over launch positions (Hillis-Steele).
    for (int32_t step = 1; step < kSeqTableThreads; step <<= 1) {
      const int32_t add = tid >= step ? scan[tid - step] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    if (tid < n) {
      e.first_unit = carry + (pos > 0 ? scan[pos - 1] : 0);
      p.table[b] = e;
      order[base + pos] = b;
    }
    __syncthreads();
    if (tid == 0) carry += scan[kSeqTableThreads - 1];
    __syncthreads();
  }
  if (tid == 0) p.table[B] = SeqEntry{carry, 0, 0, ScheduleKind::kDescending};
}

}  // namespace dash::bwd
