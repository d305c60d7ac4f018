// What the roles of the sm90 backward kernel share: the visit records the producer hands on, the shared storage with
// its mbarriers, the kernel parameters, and the barrier helpers (ring positions, waits with a debug trap).
#pragma once
#include <cstdio>

#include "bwd/bwd_traits.h"
#include "bwd/bwd_tile_scheduler.h"
#include "common/packed_seqs.h"

namespace dash::bwd {

// One pipeline step as the producer decoded it from the schedule. Consumers and the dQ writer read these records
// instead of evaluating the schedule themselves: the schedule arithmetic (64-bit divisions, five schedule kinds)
// stays in the producer warp and out of the consumers' register budget.
struct VisitRecord {
  // kPiece: the visit's item runs only part of its tile's steps (shift's split tail); the dK/dV it ends with are a
  // partial sum (bwd_epilogue.h).
  // kRun1: the partial dQ goes to the tile's second accumulator (schedule/runs.h).
  enum Flags : int32_t { kFirst = 1, kLast = 2, kEmptyTile = 4, kEnd = 8, kPiece = 16, kRun1 = 32 };
  int32_t batch, head_k, n_block;  // the KV tile
  int32_t head, m_block, wait_target;
  int32_t flags;
};

// The record of packed-sequence kernels. kEmptyTile: the sequence's first row in the k-side tensors and its keys, for
// the zeros the consumers store (looked up there, in the step loop, they made the consumers spill); 0 elsewhere. The
// 16-byte alignment is ptxas' register allocation's: with the record 36 bytes long the hdim 64 causal consumers
// spilled in the step loop.
struct alignas(16) PackedVisitRecord : VisitRecord {
  int32_t seq_first_k = 0, seq_len_k = 0;
};
template <class T>
using VisitRecordOf = std::conditional_t<T::kPacked, PackedVisitRecord, VisitRecord>;

// The P^T staging buffer, present only when the dV GEMM reads P^T from shared memory. A base class, so that when it is
// absent it takes no room (a member would take a byte, and the 1024-byte alignment of the next buffer a kilobyte).
template <class T, bool kPresent = !T::kDvFromRegs>
struct BwdPtSlot {
  alignas(1024) cute::array_aligned<typename T::Element, cute::cosize_v<typename T::SmemLayoutPt>, 1024> pt;
  CUTLASS_DEVICE typename T::Element* pt_data() { return pt.data(); }
};
template <class T>
struct BwdPtSlot<T, false> {
  CUTLASS_DEVICE typename T::Element* pt_data() { return nullptr; }
};

// RowStats::kGemmInit: each stage's GemmStatLines, at the front of the storage. The stats WGMMA's descriptor reads a
// stage's lines for both 8-wide k halves (bwd_fragments.h); compute-sanitizer counts its footprint as the twice as
// many bytes a canonical 16-wide tile would span from the stage's start, so what follows the last stage must be Q
// (loaded before any stats WGMMA runs: finite values whatever reads them). Absent elsewhere (empty base).
template <class T, bool kPresent = T::kGemmStats>
struct BwdStatSlot {
  alignas(1024) cutlass::bfloat16_t gemm_stats[T::kStages][T::kGemmStatBytes / 2];
};
template <class T>
struct BwdStatSlot<T, false> {};

template <class T>
struct BwdSharedStorage : BwdStatSlot<T>, BwdPtSlot<T> {
  using Element = typename T::Element;
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 1024 bytes and TMA/WGMMA assume it starts there.
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutQ>, 1024> q;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutQ>, 1024> dout;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutK>, 1024> k;
  // V, then the config's free gap before dS^T (BwdConfig::kSmemGapAfterV).
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutK> + T::kSmemGapElems, 1024> v;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutdSt>, 1024> dst;
  alignas(1024) cute::array_aligned<float, T::kDqElems, 1024> dq[T::kDqBuffers];
  alignas(128) float lse[T::kStages][T::kSmemStatRows];
  alignas(128) float dsum[T::kStages][T::kSmemStatRows];
  VisitRecordOf<T> rec[T::kStages];  // travels with the Q/dO stage
  VisitRecordOf<T> dq_rec[T::kDqBuffers];  // travels with the staged partial dQ
  alignas(8) uint64_t q_full[T::kStages];
  alignas(8) uint64_t q_empty[T::kStages];
  alignas(8) uint64_t kv_full;
  alignas(8) uint64_t kv_empty;
  alignas(8) uint64_t dq_full[T::kDqBuffers];
  alignas(8) uint64_t dq_empty[T::kDqBuffers];
};

// Kernel parameters (passed as __grid_constant__, TMA descriptors inside).
template <class T>
struct BwdKernelParams {
  typename T::TmaQ tma_q;
  typename T::TmaQ tma_do;
  typename T::TmaK tma_k;
  typename T::TmaK tma_v;
  typename T::ShapeQKV shape_q;
  typename T::ShapeQKV shape_k;
  ScheduleRef sched;
  bool deterministic;
  int32_t seqlen_q_rounded;
  int32_t num_m_blocks;
  float scale;       // softmax scale (dK and, in the postprocess, dQ)
  float scale_log2;  // softmax scale * log2(e); with soft-capping softcap * log2(e) (common/score_mod.h)
  const float* lse_log2;
  const float* dsum;
  float* dq_accum;
  int32_t* semaphores;
  void* dk;
  void* dv;
  // Element strides. Packed sequences: the batch stride is the row stride (a sequence's batch entry is its first row).
  int64_t dk_row, dk_head, dk_batch;
  int64_t dv_row, dv_head, dv_batch;
  // MaskKind::kWindow only (-1: that side unbounded). After the fields every kernel reads, whose offsets then do not
  // depend on them.
  int32_t window_left, window_right;
  // dK/dV stores from the staging tiles (DkDvEpilogue::kTmaStaged*); unset for kRegisterStores.
  typename T::TmaStoreKV tma_dk;
  typename T::TmaStoreKV tma_dv;
  float softcap_pre_tanh;  // ScoreMod::kSoftcap only: softmax_scale / softcap
  PackedSeqs packed;       // SeqLayout::kPacked only
  // RowStats::kGemmInit only: GemmStatLines (batch, nheads, seqlen_q_rounded / 2). Last, so that the other kernels keep
  // their parameter offsets.
  const cutlass::bfloat16_t* gemm_stats;
  // Shift's split tail (schedule/tail_split.h, bwd_epilogue.h): the pieces' partial dK/dV slots and the per-unit
  // counts of finished pieces; null where the call cannot split.
  float* split_partials;
  int32_t* split_counters;
  // ScheduleKind::kDynamic (schedule/dynamic.h): the launch index of the next unclaimed unit, and per dQ tile the
  // number of its visits loaded so far (the first one loaded stores, the others add). Zeroed by the preprocess.
  unsigned long long* unit_counter;
  int32_t* dq_claims;
  int64_t num_q_tiles;  // distance between a tile's accumulator runs (run_tile_index)
};

using Barrier = cutlass::arch::ClusterBarrier;
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

// Named barriers of the consumer warpgroups (CUTLASS offsets the ids past the ones it reserves).
enum class ConsumerBarrier : uint32_t {
  kBoth = 1,        // the two consumer warpgroups
  kWarpgroup0 = 2,  // one consumer warpgroup: kWarpgroup0 + its index
};

// Position of the count-th use of a ring of kSize buffers guarded by full/empty mbarriers: the buffer, and the phase
// its full barrier completes with on that use (a waiter on the empty barrier waits for the opposite parity).
struct RingPos {
  int index;
  uint32_t phase;
};
template <int kSize>
CUTLASS_DEVICE RingPos ring_pos(uint32_t count) {
  return RingPos{static_cast<int>(count % kSize), (count / kSize) & 1};
}

// log2 of the mbarrier polls after which the debug build traps (each poll may itself block for a while).
#ifndef DASH_BWD_WAIT_TRAP_LOG2
#define DASH_BWD_WAIT_TRAP_LOG2 22
#endif

// Where a thread waits on an mbarrier; reported by the debug trap.
enum class WaitSite : int { kQFull, kQEmpty, kKvFull, kKvEmpty, kDqFull, kDqEmpty };

// mbarrier phase wait. With DASH_BWD_SPIN_TRAP an over-long wait prints the site and traps instead of hanging.
CUTLASS_DEVICE void wait_barrier(uint64_t& bar, uint32_t phase, WaitSite site) {
#ifdef DASH_BWD_SPIN_TRAP
  uint32_t polls = 0;
  while (!reinterpret_cast<Barrier&>(bar).try_wait(phase)) {
    if (++polls == (1u << DASH_BWD_WAIT_TRAP_LOG2)) {
      printf("dash_bwd: mbarrier wait timeout: site %d phase %u block %d thread %d\n", int(site), phase, blockIdx.x,
             threadIdx.x);
      __trap();
    }
  }
#else
  (void)site;
  reinterpret_cast<Barrier&>(bar).wait(phase);
#endif
}

}  // namespace dash::bwd
