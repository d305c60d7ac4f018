// Main loop of the sm90 backward: kernel traits (shared-memory layouts, WGMMA tilings, TMA types), the shared
// storage, the producer warp's load loop and the consumer warpgroups' compute loop.
//
// One CTA owns one KV tile (K_j, V_j resident in shared memory) at a time and visits Q tiles in the order the schedule
// gives. The producer streams Q_i, dO_i, LSE_i, D_i through a kStages-deep mbarrier pipeline; the consumers compute
// S^T, dP^T, P, dS, accumulate dK/dV in registers, compute the partial dQ_i and hand it to the dQ-writer warp through
// a shared-memory staging buffer (see bwd_dq_writer.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "bwd/bwd_config.h"
#include "bwd/bwd_fragments.h"
#include "bwd/bwd_tile_scheduler.h"
#include "common/params.h"
#include "common/score_mod.h"

namespace dash::bwd {

using namespace cute;

template <int kHeadDim_, class Element_, MaskKind kMask_, ScoreMod kScoreMod_ = ScoreMod::kNone>
struct BwdTraits {
  using Element = Element_;
  using Cfg = BwdConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kStages = Cfg::kStages;
  static constexpr MaskKind kMask = kMask_;
  static constexpr ScoreMod kScoreMod = kScoreMod_;
  static constexpr bool kSoftcap = kScoreMod_ == ScoreMod::kSoftcap;
  static constexpr int kNumMmaThreads = BwdThreads::kNumMmaThreads;
  using BM = Int<kBlockM>;
  using BN = Int<kBlockN>;
  using HD = Int<kHeadDim>;

  // WGMMA tilings; each atom is one warpgroup, laid out over (M, N) as the config says.
  template <class Split>
  using AtomLayout = Layout<Shape<Int<Split::kAlongM>, Int<Split::kAlongN>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockN / Cfg::SdPSplit::kAlongM>, Int<kBlockM / Cfg::SdPSplit::kAlongN>, HD>,
                           GMMA::Major::K, GMMA::Major::K>(),
      AtomLayout<typename Cfg::SdPSplit>{}));
  static constexpr bool kDvFromRegs = Cfg::kDkvA != DkvOperandA::kSharedMemory;
  static constexpr bool kDkFromRegs = Cfg::kDkvA == DkvOperandA::kRegisters;
  static constexpr bool kOperandsPerWarpGroup = Cfg::operand_partition(kMask) == OperandPartition::kPerWarpGroup;
  static constexpr bool kShuffleStats = Cfg::row_stats(kMask) != RowStats::kSharedMemory;
  static constexpr bool kLseAhead = Cfg::row_stats(kMask) == RowStats::kShuffleAhead;
  static_assert(!kShuffleStats || Cfg::SdPSplit::kAlongN == 1, "shuffled statistics need a warpgroup per query row");
  static_assert(!kDvFromRegs || (Cfg::SdPSplit::kAlongN == 1 && Cfg::dKVSplit::kAlongN == 1 &&
                                  Cfg::SdPSplit::kAlongM == Cfg::dKVSplit::kAlongM),
                "register-sourced dK/dV GEMMs need each warpgroup's S^T rows to be its dK/dV rows");
  using TileShapedKV = Shape<Int<kBlockN / Cfg::dKVSplit::kAlongM>, Int<kHeadDim / Cfg::dKVSplit::kAlongN>, BM>;
  using MmaOpdKVrs =
      decltype(GMMA::rs_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K, GMMA::Major::MN>());
  using MmaOpdKVss =
      decltype(GMMA::ss_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K, GMMA::Major::MN>());
  using TiledMmadV = decltype(make_tiled_mma(std::conditional_t<kDvFromRegs, MmaOpdKVrs, MmaOpdKVss>{},
                                             AtomLayout<typename Cfg::dKVSplit>{}));
  using TiledMmadK = decltype(make_tiled_mma(std::conditional_t<kDkFromRegs, MmaOpdKVrs, MmaOpdKVss>{},
                                             AtomLayout<typename Cfg::dKVSplit>{}));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM / Cfg::dQSplit::kAlongM>, Int<kHeadDim / Cfg::dQSplit::kAlongN>, BN>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      AtomLayout<typename Cfg::dQSplit>{}));
  static constexpr bool kDvAfterDs = Cfg::dv_issue(kMask) == DvIssue::kAfterDs;
  static constexpr bool kTwoStepBodies = Cfg::masked_steps(kMask) == MaskedSteps::kTwoBodies;
  static_assert(!kDvAfterDs || kDvFromRegs, "the late dV issue is the register-sourced dV GEMM's");

  // Shared-memory layouts. Q/dO/K/V are stored row-major (d contiguous, K-major for S^T and dP^T); the transposed
  // views used as MN-major operands of dK/dV and dQ alias the same bytes. P^T and dS^T are stored (kBlockN, kBlockM)
  // with kBlockM contiguous: K-major A operand of dK/dV, and (via the transposed view) MN-major A operand of dQ.
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BM, HD>());
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, HD>());
  using SmemAtomPt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, BN, BM>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<BM, HD, Int<kStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BN, HD>{}));
  using SmemLayoutPt = decltype(tile_to_shape(SmemAtomPt{}, Shape<BN, BM>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<HD, BM, Int<kStages>>{}, Stride<BM, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{}, make_layout(Shape<HD, BN>{}, Stride<BN, _1>{})));
  // dS^T is double-buffered so a warpgroup can store step t+1's dS while the other still reads step t's in its dQ
  // GEMM.
  static constexpr int kDsBuffers = 2;
  using SmemLayoutdSt = decltype(tile_to_shape(SmemAtomPt{}, Shape<BN, BM, Int<kDsBuffers>>{}));
  using SmemLayoutdS = decltype(composition(
      SmemLayoutdSt{}, make_layout(Shape<BM, BN, Int<kDsBuffers>>{}, Stride<BN, _1, Int<kBlockN * kBlockM>>{})));
  static constexpr int kDqBuffers = Cfg::kDqBuffers;
  // P^T rows are read only by the warpgroup that wrote them unless the dK/dV GEMMs split d across warpgroups.
  static constexpr bool kPtShared = Cfg::dKVSplit::kAlongN > 1;

  // Global tensors as TMA sees them: (seqlen, d, head, batch).
  using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = cute::Stride<int64_t, _1, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                                                  StrideQKV{}),
                                      take<0, 2>(SmemLayoutQ{}), Shape<BM, HD>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{},
                                                  StrideQKV{}),
                                      SmemLayoutK{}, Shape<BN, HD>{}, _1{}));

  // dK/dV staging at the end of a KV tile (DkDvEpilogue::kTmaStaged*, bwd_epilogue.h): each warpgroup's rows as one
  // 128-byte-swizzled (rows, d) tile, the two side by side in the dS^T buffers, each stored by one TMA.
  static constexpr DkDvEpilogue kDkDvEpilogue = Cfg::dkdv_epilogue(kMask);
  static constexpr bool kStagedEpilogue = kDkDvEpilogue != DkDvEpilogue::kRegisterStores;
  static constexpr int kStageRows = kBlockN / Cfg::dKVSplit::kAlongM;
  using StageRows = Int<kStageRows>;
  using SmemLayoutStageWG = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<StageRows, HD>{}));
  using SmemLayoutStage3 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                                  Shape<StageRows, HD, Int<Cfg::dKVSplit::kAlongM>>{}));
  // (row of the KV tile, column of d) -> the warpgroup tiles: rows [w * kStageRows, (w + 1) * kStageRows) are tile w.
  using SmemLayoutStage = decltype(composition(
      SmemLayoutStage3{},
      Layout<Shape<Shape<StageRows, Int<Cfg::dKVSplit::kAlongM>>, HD>,
             Stride<Stride<_1, Int<kStageRows * kHeadDim>>, StageRows>>{}));
  static_assert(!kStagedEpilogue || (Cfg::dKVSplit::kAlongM == 2 && Cfg::dKVSplit::kAlongN == 1),
                "the staged epilogue stores whole rows per warpgroup");
  static_assert(!kStagedEpilogue ||
                    cute::cosize_v<SmemLayoutStage3> * (kDkDvEpilogue == DkDvEpilogue::kTmaStagedAtOnce ? 2 : 1) <=
                        cute::cosize_v<SmemLayoutdSt>,
                "the staging tiles live in the dS^T buffers");
  using TmaStoreKV = decltype(make_tma_copy(SM90_TMA_STORE{},
                                            make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), ShapeQKV{},
                                                        StrideQKV{}),
                                            SmemLayoutStageWG{}, Shape<StageRows, HD>{}, _1{}));

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kSmemGapElems = Cfg::kSmemGapAfterV / sizeof(Element);
  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);
  // Partial dQ tile, fp32, in the consumers' register order (see bwd_dq_writer.h).
  static constexpr int kDqElems = kBlockM * kHeadDim;
  static constexpr uint32_t kDqBytes = kDqElems * sizeof(float);
  static constexpr int kDqPerThread = kDqElems / kNumMmaThreads;
  static_assert(kDqPerThread % 4 == 0, "dQ staging moves float4 chunks");
  static constexpr int kDqParts = Cfg::kDqParts;
  static_assert(kDqElems % (kDqParts * 4) == 0, "dQ parts are whole float4 chunks");
  static constexpr int kDqPartElems = kDqElems / kDqParts;
  static constexpr uint32_t kDqPartBytes = kDqBytes / kDqParts;
};

// One pipeline step as the producer decoded it from the schedule. Consumers and the dQ writer read these records
// instead of evaluating the schedule themselves: the schedule arithmetic (64-bit divisions, five schedule kinds)
// stays in the producer warp and out of the consumers' register budget.
struct VisitRecord {
  enum Flags : int32_t { kFirst = 1, kLast = 2, kEmptyTile = 4, kEnd = 8 };
  int32_t batch, head_k, n_block;  // the KV tile
  int32_t head, m_block, wait_target;
  int32_t flags;
};

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

template <class T>
struct BwdSharedStorage : BwdPtSlot<T> {
  using Element = typename T::Element;
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 1024 bytes and TMA/WGMMA assume it starts there.
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutQ>, 1024> q;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutQ>, 1024> dout;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutK>, 1024> k;
  // V, then the config's free gap before dS^T (BwdConfig::kSmemGapAfterV).
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutK> + T::kSmemGapElems, 1024> v;
  alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename T::SmemLayoutdSt>, 1024> dst;
  alignas(1024) cute::array_aligned<float, T::kDqElems, 1024> dq[T::kDqBuffers];
  alignas(128) float lse[T::kStages][T::kBlockM];
  alignas(128) float dsum[T::kStages][T::kBlockM];
  VisitRecord rec[T::kStages];  // travels with the Q/dO stage
  VisitRecord dq_rec[T::kDqBuffers];  // travels with the staged partial dQ
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
  int64_t dk_row, dk_head, dk_batch;
  int64_t dv_row, dv_head, dv_batch;
  // MaskKind::kWindow only (-1: that side unbounded). Last, so that the other fields keep the offsets (and the
  // full/causal kernels the exact SASS) they had before windows existed.
  int32_t window_left, window_right;
  // dK/dV stores from the staging tiles (DkDvEpilogue::kTmaStaged*); unset for kRegisterStores.
  typename T::TmaStoreKV tma_dk;
  typename T::TmaStoreKV tma_dv;
  float softcap_pre_tanh;  // ScoreMod::kSoftcap only: softmax_scale / softcap
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

// ----------------------------------------------------------------------------------------------------------------
// Producer warp: walks the schedule; per KV tile loads K_j, V_j once, per visit loads Q_i, dO_i, LSE_i, D_i into
// the next stage together with the visit's record. Tiles without visits and the end of the work travel as records
// without data. Runs ahead of the consumers by up to kStages steps; the empty barriers throttle it.
// The 32 lanes evaluate 32 visits of the schedule at once (integer arithmetic with divisions, slow on one thread);
// lane 0 issues the barriers and copies in visit order.
//
// Registers: the warpgroup runs with BwdThreads::kProducerRegs (24) per thread, and the schedule evaluation needs
// most of them. The warp-uniform loop state (item index, current tile, its visit count) is therefore kept one word
// per lane in a single register and read back with __shfl_sync where needed, instead of occupying seven registers
// of every lane across the evaluation.
template <class T>
CUTLASS_DEVICE void producer_loop(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss) {
  Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
  Tensor mdO = p.tma_do.get_tma_tensor(p.shape_q);
  Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
  Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
  // Special registers read through volatile asm where they are used: nothing keeps them live across the loop.
  auto lane_id = [] {
    uint32_t l;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
    return static_cast<int32_t>(l);
  };
  auto cta_index = [] {
    uint32_t c;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(c));
    return static_cast<int32_t>(c);
  };

  // Lane w holds word w of the loop state. Word kPipe is the leader's own: its pipeline position, bit 0 the parity
  // of the KV tiles loaded so far, the bits above the count of Q stages claimed (wrapping at 2^31, a multiple of
  // 2 * kStages, so stage and phase stay continuous). All words start at 0.
  static_assert(T::kStages == 1 || T::kStages == 2, "the packed stage count needs 2 * kStages to divide 2^31");
  enum Word : int { kPipe = 0, kItemLo, kItemHi, kNumVisits, kBatch, kHeadK, kNBlock };
  uint32_t state = 0;
  auto word = [&](int w) { return __shfl_sync(0xffffffffu, state, w); };  // the whole warp, converged
  auto set_word = [&](int w, uint32_t v) {  // v: the same on every lane
    if (lane_id() == w) state = v;
  };
  auto item_index = [&] { return static_cast<int64_t>((uint64_t(word(kItemHi)) << 32) | word(kItemLo)); };
  auto current_tile = [&] {
    return KvTileRef{static_cast<int32_t>(word(kBatch)), static_cast<int32_t>(word(kHeadK)),
                     static_cast<int32_t>(word(kNBlock))};
  };

  // Leader only: claims the next stage and publishes its record; the caller then issues the stage's loads (if any).
  auto next_stage = [&](const VisitRecord& rec, uint32_t tx_bytes) {
    const RingPos pos = ring_pos<T::kStages>(state >> 1);
    const int stage = pos.index;
    state += 2;
    wait_barrier(ss.q_empty[stage], pos.phase ^ 1, WaitSite::kQEmpty);
    ss.rec[stage] = rec;  // published by the arrive below (mbarrier arrive has release semantics)
    reinterpret_cast<TxBarrier&>(ss.q_full[stage]).arrive_and_expect_tx(tx_bytes);
    return stage;
  };

  for (;;) {
    {
      const int64_t it = item_index();
      if (it >= p.sched.template num_items<T>(cta_index())) break;
      const KvTileRef tile = p.sched.template item<T>(cta_index(), it);
      const int32_t nv = p.sched.template num_visits<T>(tile);
      set_word(kNumVisits, nv);
      set_word(kBatch, tile.batch);
      set_word(kHeadK, tile.head_k);
      set_word(kNBlock, tile.n_block);
      if (lane_id() == 0) {
        if (nv == 0) {
          next_stage(VisitRecord{tile.batch, tile.head_k, tile.n_block, 0, 0, 0, VisitRecord::kEmptyTile}, 0);
        } else {
          wait_barrier(ss.kv_empty, (state & 1) ^ 1, WaitSite::kKvEmpty);
          reinterpret_cast<TxBarrier&>(ss.kv_full).arrive_and_expect_tx(2 * T::kKBytes);
          Tensor gK = local_tile(mK(_, _, tile.head_k, tile.batch), Shape<typename T::BN, typename T::HD>{},
                                 make_coord(tile.n_block, _0{}));
          Tensor gV = local_tile(mV(_, _, tile.head_k, tile.batch), Shape<typename T::BN, typename T::HD>{},
                                 make_coord(tile.n_block, _0{}));
          auto [tKgK, tKsK] =
              tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
          auto [tVgV, tVsV] =
              tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
          // L2 hints: K/V are read by this CTA alone; Q, dO and the dQ accumulator (bwd_dq_writer.h) by every CTA
          // of the head, so they should outlive K/V in L2.
          copy(p.tma_k.with(ss.kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tKgK, tKsK);
          copy(p.tma_v.with(ss.kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tVgV, tVsV);
          state ^= 1;
        }
      }
      __syncwarp();
    }

    for (int32_t t0 = 0; t0 < static_cast<int32_t>(word(kNumVisits)); t0 += 32) {
      VisitRef mine{0, 0, 0};
      {
        const int32_t step = t0 + lane_id();
        const int32_t nv = static_cast<int32_t>(word(kNumVisits));
        const KvTileRef tile = current_tile();
        const int64_t it = item_index();
        if (step < nv) mine = p.sched.template visit<T>(cta_index(), it, tile, step);
      }
      const int32_t nv = static_cast<int32_t>(word(kNumVisits));
#pragma unroll 1
      for (int32_t j = 0; j < min(32, nv - t0); ++j) {
        const int32_t head = __shfl_sync(0xffffffffu, mine.head, j);
        const int32_t m_block = __shfl_sync(0xffffffffu, mine.m_block, j);
        const int32_t wait_target = __shfl_sync(0xffffffffu, mine.wait_target, j);
        const KvTileRef tile = current_tile();
        if (lane_id() != 0) continue;
        const int32_t t = t0 + j;
        const int32_t flags = (t == 0 ? VisitRecord::kFirst : 0) | (t == nv - 1 ? VisitRecord::kLast : 0);
        const int stage = next_stage(
            VisitRecord{tile.batch, tile.head_k, tile.n_block, head, m_block, wait_target, flags},
            2 * T::kQBytes + 2 * T::kRowStatBytes);
        Tensor gQ = local_tile(mQ(_, _, head, tile.batch), Shape<typename T::BM, typename T::HD>{},
                               make_coord(m_block, _0{}));
        Tensor gdO = local_tile(mdO(_, _, head, tile.batch), Shape<typename T::BM, typename T::HD>{},
                                make_coord(m_block, _0{}));
        Tensor sQs = sQ(_, _, stage);
        Tensor sdOs = sdO(_, _, stage);
        auto [tQgQ, tQsQ] =
            tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQs), group_modes<0, 2>(gQ));
        auto [tOgO, tOsO] =
            tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdOs), group_modes<0, 2>(gdO));
        copy(p.tma_q.with(ss.q_full[stage], 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ, tQsQ);
        copy(p.tma_do.with(ss.q_full[stage], 0, TMA::CacheHintSm90::EVICT_LAST), tOgO, tOsO);
        const int64_t row0 = (int64_t(tile.batch) * get<2>(p.shape_q) + head) * p.seqlen_q_rounded +
                             int64_t(m_block) * T::kBlockM;
        SM90_BULK_COPY_G2S::copy(p.lse_log2 + row0, &ss.q_full[stage], ss.lse[stage], T::kRowStatBytes);
        SM90_BULK_COPY_G2S::copy(p.dsum + row0, &ss.q_full[stage], ss.dsum[stage], T::kRowStatBytes);
      }
      __syncwarp();
    }

    const uint64_t next = static_cast<uint64_t>(item_index()) + 1;
    set_word(kItemLo, static_cast<uint32_t>(next));
    set_word(kItemHi, static_cast<uint32_t>(next >> 32));
  }
  if (lane_id() == 0) next_stage(VisitRecord{0, 0, 0, 0, 0, 0, VisitRecord::kEnd}, 0);
}

// ----------------------------------------------------------------------------------------------------------------
// Consumer warpgroups: one step per record until the end record; dK/dV of each tile go out through `store_dkdv`.
template <class T, class StoreDkDv>
CUTLASS_DEVICE void consumer_loop(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss, StoreDkDv&& store_dkdv) {
  using Element = typename T::Element;
  using BM = typename T::BM;
  using BN = typename T::BN;
  using HD = typename T::HD;
  const int tid = threadIdx.x - 128;  // 0 .. kNumMmaThreads-1
  constexpr uint32_t kMmaBarrier = uint32_t(ConsumerBarrier::kBoth);
  const uint32_t wg_barrier = uint32_t(ConsumerBarrier::kWarpgroup0) + tid / 128;

  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadV mma_dv;
  typename T::TiledMmadK mma_dk;
  typename T::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dv = mma_dv.get_thread_slice(tid);
  // Slices that partition the shared-memory operands (BwdConfig::operand_partition). With GMMA the A/B partitions
  // depend only on the warpgroup, so any of its threads' indices gives the same ones; the first thread's, from a
  // warp-uniform shuffle, lets the compiler keep the descriptors in uniform registers.
  const int operand_tid = [&] {
    if constexpr (T::kOperandsPerWarpGroup) {
      return __shfl_sync(0xffffffffu, tid / 128, 0) * 128;
    } else {
      return tid;
    }
  }();
  auto op_sdp = mma_sdp.get_slice(operand_tid);
  auto op_dv = mma_dv.get_slice(operand_tid);
  auto op_dk = mma_dk.get_slice(operand_tid);
  auto op_dq = mma_dq.get_slice(operand_tid);

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
  Tensor sPt = make_tensor(make_smem_ptr(ss.pt_data()), typename T::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.dst.data()), typename T::SmemLayoutdSt{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(ss.dst.data()), typename T::SmemLayoutdS{});

  Tensor tSrK = op_sdp.partition_fragment_A(sK);
  Tensor tSrQ = op_sdp.partition_fragment_B(sQ);
  Tensor tSrV = op_sdp.partition_fragment_A(sV);
  Tensor tSrdO = op_sdp.partition_fragment_B(sdO);
  Tensor tdVrdOt = op_dv.partition_fragment_B(sdOt);
  Tensor tdKrQt = op_dk.partition_fragment_B(sQt);
  Tensor tdQrdS = op_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = op_dq.partition_fragment_B(sKt);

  // Coordinates (kv row n, query row m) of each S^T accumulator element.
  Tensor tScS_full = thr_sdp.partition_C(make_identity_tensor(Shape<BN, BM>{}));
  const AccCoords<decltype(tScS_full)> tScS{tScS_full};
  // P^T and dS^T leave the accumulators through stmatrix (8x8 tiles, one address per four tiles).
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto r2s_thr = r2s.get_thread_slice(tid);
  Tensor tPsPt = r2s_thr.partition_D(sPt);
  auto ds_store_view = [&] {  // see BwdConfig::ds_store_address_swizzle
    if constexpr (T::Cfg::ds_store_address_swizzle(T::kMask)) {
      return cute::as_position_independent_swizzle_tensor(sdSt);
    } else {
      return sdSt;
    }
  };
  Tensor tPsdSt = r2s_thr.partition_D(ds_store_view());

  const int seqlen_q = get<0>(p.shape_q);
  const int seqlen_k = get<0>(p.shape_k);
  const int causal_offset = seqlen_k - seqlen_q;  // bottom-right aligned diagonal

  // Same accumulator layout for both (the dK and dV GEMMs differ at most in where A comes from).
  Tensor tdVrdV = partition_fragment_C(mma_dv, Shape<BN, HD>{});
  Tensor tdKrdK = partition_fragment_C(mma_dk, Shape<BN, HD>{});
  // dS^T in Element precision. With a register-sourced dK GEMM it must survive until that GEMM has completed (at the
  // end of its step); the fences at the completing waits keep the compiler from reusing it earlier.
  Tensor rdS = make_tensor<Element>(partition_fragment_C(mma_sdp, Shape<BN, BM>{}).layout());
  using Cols = AccColumns<decltype(partition_fragment_C(mma_sdp, Shape<BN, BM>{}).layout())>;
  uint32_t kv_count = 0;
  uint32_t dq_count = 0;
  uint32_t ds_count = 0;
  // A config that lets step t's dK GEMM run into step t+1 (two stages, dS^T read from shared memory: kPtRegisters;
  // none today, every step ends by waiting for its dK GEMM) releases step t's Q/dO stage once that GEMM completed.
  int unreleased_stage = -1;
  // The LSE of each of the thread's query columns, in registers. RowStats::kShuffle*: shuffled from the lanes that
  // loaded it (LaneStats) while the S and dP GEMMs are issued (kShuffle) or at the end of the step before
  // (kShuffleAhead, which waits for that step's stage there, so that the top of the loop need not). Shuffled after
  // the S wait, the first exp2 waited on them: they queued in the MIO pipe behind the dP GEMM's operand reads (ncu,
  // causal 16k: 10% of the consumers' stall samples on the P loop's first FFMAs). H200 (4 runs of 3-4 alternations,
  // hdim 128 causal, during the GEMMs against after the S wait): non-det and shift_causal 0.95-0.99 of the time at
  // 1k-16k (0.954-0.972 at 8k/16k), the descending order 1.02-1.06 at 4k-16k; a step ahead recovers descending (see
  // BwdConfig<128>::row_stats). The empty asm keeps the compiler from sinking the shuffles back to their use.
  // kSharedMemory: loaded here after the S wait when it fits in registers (P's kLseInRegs); unused (and dropped)
  // otherwise.
  float lse_cols[Cols::kCols];
  auto shuffle_lse = [&](LaneStats<T::kBlockM> const& lanes) {
    if constexpr (T::kShuffleStats) {
      Cols::fetch(lse_cols, lanes, tScS);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < Cols::kCols; ++c) asm volatile("" : "+f"(lse_cols[c]));
    }
  };
  // kShuffleAhead: the LSE of step `count` (its record may be the end, then the values go unused).
  auto shuffle_lse_ahead = [&](uint32_t count) {
    if constexpr (T::kLseAhead) {
      const RingPos pos = ring_pos<T::kStages>(count);
      wait_barrier(ss.q_full[pos.index], pos.phase, WaitSite::kQFull);
      LaneStats<T::kBlockM> lanes;
      lanes.load(ss.lse[pos.index], tid % 32);
      shuffle_lse(lanes);
    }
  };
  shuffle_lse_ahead(0);
  for (uint32_t q_count = 0;; ++q_count) {
    const RingPos qpos = ring_pos<T::kStages>(q_count);
    const int stage = qpos.index;
    // kShuffleAhead waited for this stage already (the prologue's or the previous step's shuffle_lse_ahead).
    if constexpr (!T::kLseAhead) wait_barrier(ss.q_full[stage], qpos.phase, WaitSite::kQFull);
    // Only the fields a step needs are held in registers (the consumers have none to spare); the record stays in
    // shared memory until the stage is released, and the rest is read from there when needed.
    const VisitRecord& srec = ss.rec[stage];
    const int32_t flags = srec.flags;
    if (flags & VisitRecord::kEnd) break;
    if (flags & VisitRecord::kEmptyTile) {
      const KvTileRef tile{srec.batch, srec.head_k, srec.n_block};
      reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
      store_dkdv.store_zeros(tile, thr_dv);
      shuffle_lse_ahead(q_count + 1);
      continue;
    }
    // The tile's first dK/dV GEMMs overwrite the accumulators (no clear(): see wgmma_gemm).
    const bool first = flags & VisitRecord::kFirst;
    // Key row n of the tile is masked for query column m if n >= kv_rows (past seqlen_k) or n - m leaves the band
    // around the tile's diagonal (tile coordinates): causal, n - m > diagonal; a window, n - m > diagonal + right or
    // n - m < diagonal - left (a negative bound is absent). Read before the GEMMs: read after the S wait, the
    // shared-memory load of the tile indices sat behind the LSE loads and stalled every step.
    auto tile_limits = [&] {
      const int n0 = srec.n_block * T::kBlockN;
      return cute::make_tuple(seqlen_k - n0, srec.m_block * T::kBlockM + causal_offset - n0);
    };
    const auto [kv_rows, diagonal] = tile_limits();
    // n - m spans [-(kBlockM - 1), kBlockN - 1] in a tile.
    auto cuts_window = [&](int diag) {
      return (p.window_right >= 0 && T::kBlockN - 1 > diag + p.window_right) ||
             (p.window_left >= 0 && 1 - T::kBlockM < diag - p.window_left);
    };
    const bool need_mask = kv_rows < T::kBlockN || (T::kMask == MaskKind::kCausal && T::kBlockN - 1 > diagonal) ||
                           (T::kMask == MaskKind::kWindow && cuts_window(diagonal));
    // The rest of the step, once per body (BwdConfig::masked_steps). With two bodies this loop unrolls into a
    // masked and an unmasked copy, `body_masked` a constant in each, and a step runs the copy of its tile's kind; with
    // one it runs once with the tile's need_mask. (A lambda per body instead changed the SASS of the one-body
    // kernels too.)
    constexpr int kBodies = T::kTwoStepBodies ? 2 : 1;
    CUTLASS_PRAGMA_UNROLL
    for (int body = 0; body < kBodies; ++body) {
      const bool body_masked = kBodies == 2 ? body == 0 : need_mask;
      if (kBodies == 2 && body_masked != need_mask) continue;
      if (first) {
        wait_barrier(ss.kv_full, kv_count & 1, WaitSite::kKvFull);
        ++kv_count;
      }

      // RowStats::kShuffle*: the lanes' share of LSE (kShuffle) and D, loaded before the GEMMs (a few registers per
      // thread) so that the loads do not queue behind the GEMMs' operand reads.
      LaneStats<T::kBlockM> dsum_lanes;
      [[maybe_unused]] LaneStats<T::kBlockM> lse_lanes;  // kShuffleAhead loads the LSE a step earlier instead
      if constexpr (T::kShuffleStats && !T::kLseAhead) lse_lanes.load(ss.lse[stage], tid % 32);
      if constexpr (T::kShuffleStats) dsum_lanes.load(ss.dsum[stage], tid % 32);
      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<BN, BM>{});
      wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
      if constexpr (!T::kLseAhead) shuffle_lse(lse_lanes);  // ptxas issues them among the S WGMMAs
      wgmma_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tdPrdP);
      // A previous dK GEMM still running (see unreleased_stage; none in today's configs) is done once at most the two
      // groups just issued are pending: release its stage now, not after S, so the producer's next loads start one S
      // GEMM earlier. The wait is unconditional; a wait inside a data-dependent branch would make ptxas serialise the
      // WGMMAs.
      warpgroup_wait<2>();
      warpgroup_fence_operand(tdKrdK);
      if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);
      if (unreleased_stage >= 0) {
        reinterpret_cast<Barrier&>(ss.q_empty[unreleased_stage]).arrive();
        unreleased_stage = -1;
      }

      // P = exp2(S * scale * log2e - LSE_log2), computed while the dP GEMM runs; masked entries and rows without
      // keys (LSE_log2 = +inf) give 0.
      warpgroup_wait<1>();  // S done
      // With few query columns per thread (hdim 128: 16) LSE goes to registers once per column; with many (hdim 64:
      // 32) that array would not fit next to the larger S/dP fragments, so it is read per element from shared memory.
      // Shuffled statistics have them in lse_cols already.
      constexpr bool kLseInRegs = T::kShuffleStats || Cols::kCols <= 16;
      float const* lse_smem = ss.lse[stage] + tScS.m0();
      if constexpr (kLseInRegs && !T::kShuffleStats) Cols::load(lse_cols, lse_smem, tScS);
      warpgroup_fence_operand(tSrS);
      // Soft-capping: the score of element i is t = tanh(S * softmax_scale / softcap), and dS will need 1 - t^2.
      // Where LSE sits in registers, 1 - t^2 is kept per element until then, as fp16 (in [0, 1]: 11 bits against the
      // 8 of the bf16 dS it scales; in fp32 the hdim 128 consumers spilled 116 bytes, in fp16 36-56). Where LSE is
      // read per element from shared memory (hdim 64: 64 elements per thread, which spilled ~300 bytes held in fp16),
      // t is recovered from P instead: log2 P = t * scale_log2 - LSE_log2. The plain kernels allocate nothing.
      constexpr bool kDtanhInRegs = T::kSoftcap && kLseInRegs;
      Tensor dtanh =
          make_tensor<cutlass::half_t>(std::conditional_t<kDtanhInRegs, decltype(tSrS.layout()), Layout<_1>>{});
      auto score = [&](int i) {
        if constexpr (T::kSoftcap) {
          const float t = tanh_approx(tSrS(i) * p.softcap_pre_tanh);
          if constexpr (kDtanhInRegs) dtanh(i) = cutlass::half_t(fmaf(-t, t, 1.f));
          return t;
        } else {
          return tSrS(i);
        }
      };
      auto lse_of = [&](int i) { return kLseInRegs ? lse_cols[Cols::slot(i)] : lse_smem[get<1>(tScS.offset(i))]; };
      // Whether the element at offset d from this thread's first one (see AccCoords) is masked, given the tile's limits.
      auto is_masked = [&](auto d, int rows, int diag) {
        const int thr_rows = rows - tScS.n0();
        const int thr_diagonal = diag - (tScS.n0() - tScS.m0());
        // Causal is the band (no left bound, right = 0) but keeps its own expression, unchanged since it was measured
        // (its SASS is byte-identical to the build before windows).
        if constexpr (T::kMask == MaskKind::kWindow) {
          const int nm = get<0>(d) - get<1>(d);
          return get<0>(d) >= thr_rows || (p.window_right >= 0 && nm > thr_diagonal + p.window_right) ||
                 (p.window_left >= 0 && nm < thr_diagonal - p.window_left);
        } else {
          return get<0>(d) >= thr_rows || (T::kMask == MaskKind::kCausal && get<0>(d) - get<1>(d) > thr_diagonal);
        }
      };
      // Tiles that need no mask (all but the diagonal and ragged-end ones) take a loop without the tests where the
      // tests are per element (causal) or the LSE comes from shared memory per element (hdim 64): there, with the
      // tests in every step, ptxas predicated each exp2, zeroed its result beforehand and reloaded the scale from the
      // constant bank per element, on the stretch between the S wait and the dV GEMM while the tensor cores wait for
      // P. H200, 3 alternating runs: causal 4k-16k +2-5% (hdim 128, shift_causal), hdim 64 +1-9%. With only the row
      // test (full mask, LSE in registers) the separate loop measured 1-5% slower, so that case keeps one loop.
      // Shuffled statistics (hdim 128 full included) measured with the separate loop.
      constexpr bool kSeparateUnmaskedLoop =
          T::kTwoStepBodies || T::kShuffleStats || T::kMask != MaskKind::kFull || !kLseInRegs;
      if constexpr (kSeparateUnmaskedLoop) {
        if (body_masked) {
          // The limits are read again here rather than held across the GEMMs: the unmasked loop needs the registers.
          const auto [rows, diag] = tile_limits();
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) {
            const float x = score(i);  // also where masked: dS multiplies the 0 of P by its 1 - t^2
            tSrS(i) = is_masked(tScS.offset(i), rows, diag) ? 0.f : exp2f(fmaf(x, p.scale_log2, -lse_of(i)));
          }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f(fmaf(score(i), p.scale_log2, -lse_of(i)));
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          bool masked = false;
          if (need_mask) masked = is_masked(tScS.offset(i), kv_rows, diagonal);
          const float x = score(i);
          tSrS(i) = masked ? 0.f : exp2f(fmaf(x, p.scale_log2, -lse_of(i)));
        }
      }

      // dV += P^T dO runs while dS is computed (DvIssue::kAfterP) or while dS is handed over (kAfterDs, issued
      // below); P^T comes from registers or, after a round trip, shared memory.
      auto issue_dv = [&](auto& rP) {
        warpgroup_fence_operand(rP);
        wgmma_gemm<-1>(mma_dv, make_tensor(rP.data(), accumulator_as_a_operand(rP.layout())),
                       tdVrdOt(_, _, _, stage), tdVrdV, first);
      };
      Tensor rP = make_tensor<Element>(tSrS.layout());
      if constexpr (!T::kDvAfterDs) {
        rP = convert_fragment<Element>(tSrS);
        if constexpr (T::kDvFromRegs) {
          issue_dv(rP);
        } else {
          if constexpr (T::kPtShared) cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, kMmaBarrier);
          cute::copy(r2s, r2s_thr.retile_S(rP), tPsPt);
          cutlass::arch::fence_view_async_shared();  // generic-proxy stores read next by WGMMA (async proxy)
          if constexpr (T::kPtShared) {
            cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, kMmaBarrier);
          } else {
            cutlass::arch::NamedBarrier::sync(128, wg_barrier);
          }
          wgmma_gemm<-1>(mma_dv, op_dv.partition_fragment_A(sPt), tdVrdOt(_, _, _, stage), tdVrdV, first);
        }
      }

      // dP done; with DvIssue::kAfterP the dV GEMM may still run, with kAfterDs it is not issued yet.
      warpgroup_wait<T::kDvAfterDs ? 0 : 1>();
      warpgroup_fence_operand(tdPrdP);
      // Without shuffled statistics D is read per element straight from shared memory: with DvIssue::kAfterP this is
      // the consumers' register peak (dK, dV, P, dP and the P^T operand of the running dV GEMM are all live), and a
      // register copy of D made them spill.
      float const* dsum = ss.dsum[stage] + tScS.m0();
      const int ds_buf = ds_count++ % T::kDsBuffers;
      if constexpr (T::kShuffleStats) {
        Cols::for_each_column(dsum_lanes, tScS, [&](int j, float d) { tdPrdP(j) = tSrS(j) * (tdPrdP(j) - d); });
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = tSrS(i) * (tdPrdP(i) - dsum[get<1>(tScS.offset(i))]);
      }
      if constexpr (kDtanhInRegs) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) tdPrdP(i) *= float(dtanh(i));
      } else if constexpr (T::kSoftcap) {
        // P = 0 (masked, or below exp2's range) has no t to recover, and its dS is 0 whatever 1 - t^2 is.
        const float inv_scale_log2 = 1.f / p.scale_log2;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) {
          const float t = (log2f(tSrS(i)) + lse_of(i)) * inv_scale_log2;
          tdPrdP(i) = tSrS(i) > 0.f ? tdPrdP(i) * fmaf(-t, t, 1.f) : 0.f;
        }
      }
      if constexpr (T::kDvAfterDs) rP = convert_fragment<Element>(tSrS);
      rdS = convert_fragment<Element>(tdPrdP);
      cute::copy(r2s, r2s_thr.retile_S(rdS), tPsdSt(_, _, _, ds_buf));
      if constexpr (T::kDvAfterDs) issue_dv(rP);  // reads P^T and dO only, so it need not wait for the fence below
      cutlass::arch::fence_view_async_shared();
      // dK (when d is split) and dQ need every warpgroup's rows of dS.
      cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, kMmaBarrier);

      // dQ first so that its hand-off to the writer overlaps the dK GEMM.
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BM, HD>{});
      wgmma_gemm<true, -1>(mma_dq, tdQrdS(_, _, _, ds_buf), tdQrKt, tdQrdQ);
      if constexpr (T::kDkFromRegs) {
        warpgroup_fence_operand(rdS);
        wgmma_gemm<-1>(mma_dk, make_tensor(rdS.data(), accumulator_as_a_operand(rdS.layout())),
                       tdKrQt(_, _, _, stage), tdKrdK, first);
      } else {
        wgmma_gemm<-1>(mma_dk, op_dk.partition_fragment_A(sdSt)(_, _, _, ds_buf), tdKrQt(_, _, _, stage), tdKrdK,
                       first);
      }
      warpgroup_wait<1>();  // dV and dQ done; dK may still run
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdQrdQ);
      if constexpr (T::kDvFromRegs) warpgroup_fence_operand(rP);
      // The tile's last reads of K (S, dQ) and V (dP) are done; the still-running dK GEMM reads only dS^T and Q. Freeing
      // K/V now lets the producer start the next tile's K/V loads during the dQ hand-off, dK and the dK/dV stores.
      if (flags & VisitRecord::kLast) reinterpret_cast<Barrier&>(ss.kv_empty).arrive();

      // Hand the partial dQ to the writer warp through the next staging buffer, once the writer has read it.
      const RingPos dqpos = ring_pos<T::kDqBuffers>(dq_count);
      const int dq_buf = dqpos.index;
      wait_barrier(ss.dq_empty[dq_buf], dqpos.phase ^ 1, WaitSite::kDqEmpty);
      ++dq_count;
      float4* sdq = reinterpret_cast<float4*>(ss.dq[dq_buf].data());
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < T::kDqPerThread / 4; ++c) {
        sdq[c * T::kNumMmaThreads + tid] =
            make_float4(tdQrdQ(4 * c), tdQrdQ(4 * c + 1), tdQrdQ(4 * c + 2), tdQrdQ(4 * c + 3));
      }
      if (tid == 0) ss.dq_rec[dq_buf] = srec;
      cutlass::arch::fence_view_async_shared();  // the bulk reduce reads the staging buffer through the async proxy
      reinterpret_cast<Barrier&>(ss.dq_full[dq_buf]).arrive();

      if (flags & VisitRecord::kLast) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdKrdK);
        if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);
        const KvTileRef tile{srec.batch, srec.head_k, srec.n_block};  // read before the stage is released
        reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
        store_dkdv(tile, tdKrdK, tdVrdV, thr_dv);
      } else if constexpr (T::kStages == 1 || T::kDkFromRegs) {
        // The next step reuses this stage (one stage), or its dS^T registers (dK from registers): wait for the dK GEMM
        // and release the stage now.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdKrdK);
        if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);
        reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
      } else {
        unreleased_stage = stage;
      }
    }
    shuffle_lse_ahead(q_count + 1);
  }
  // Nothing is in flight here (the last step of every tile waits for its dK GEMM), but ptxas cannot tell: without
  // this wait it inserts one itself on the exit path and then serialises every WGMMA of the kernel (C7518).
  warpgroup_wait<0>();
  // Tell the writer there is nothing more, through the buffer it reads next.
  const RingPos endpos = ring_pos<T::kDqBuffers>(dq_count);
  const int end_buf = endpos.index;
  wait_barrier(ss.dq_empty[end_buf], endpos.phase ^ 1, WaitSite::kDqEmpty);
  if (tid == 0) ss.dq_rec[end_buf].flags = VisitRecord::kEnd;
  reinterpret_cast<Barrier&>(ss.dq_full[end_buf]).arrive();
}

}  // namespace dash::bwd
