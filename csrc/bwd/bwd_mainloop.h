// Main loop of the sm90 backward: the consumer warpgroups' compute loop.
//
// One CTA owns one KV tile (K_j, V_j resident in shared memory) at a time and visits Q tiles in the order the schedule
// gives. The producer (bwd_producer.h) streams Q_i, dO_i, LSE_i, D_i through a kStages-deep mbarrier pipeline; the
// consumers compute S^T, dP^T, P, dS, accumulate dK/dV in registers, compute the partial dQ_i and hand it to the
// dQ-writer warp through a shared-memory staging buffer (see bwd_dq_writer.h). Types: bwd_traits.h; shared storage
// and records: bwd_storage.h.
#pragma once

#include <cutlass/numeric_conversion.h>

#include "bwd/bwd_fragments.h"
#include "bwd/bwd_storage.h"
#include "common/score_mod.h"

namespace dash::bwd {

// ----------------------------------------------------------------------------------------------------------------
// The stages of one consumer step, in the order consumer_loop runs them. All are force-inlined into the step body
// (once per step body: see BwdConfig::masked_steps). The step counters stay consumer_loop's and go into the stages
// by value: passed by reference, they are promoted to registers in another order, which reorders the loop's phis
// and changes the register allocation. need_mask stays in the loop too: in a function it came out as an int and the
// tile's n_block with another extension (the window kernels then spill).
namespace detail {

// With few query columns per thread (hdim 128: 16) LSE goes to registers once per column; with many (hdim 64: 32)
// that array would not fit next to the larger S/dP fragments, so it is read per element from shared memory.
// Shuffled statistics have them in registers already.
template <class T, class Cols>
CUTLASS_HOST_DEVICE constexpr bool lse_in_regs() {
  return !T::kGemmStats && (T::kShuffleStats || Cols::kCols <= 16);
}

// Soft-capping keeps 1 - t^2 per element in registers (as fp16) where LSE sits in registers (see compute_p).
template <class T, class Cols>
CUTLASS_HOST_DEVICE constexpr bool dtanh_in_regs() {
  return T::kSoftcap && lse_in_regs<T, Cols>();
}

// LSE_log2 of accumulator element i: from registers or, per element, from the stage's copy in shared memory.
template <class T, class Cols, class Coords>
CUTLASS_DEVICE float lse_of(int i, float const (&lse_cols)[Cols::kCols], float const* lse_smem, Coords const& tScS) {
  return lse_in_regs<T, Cols>() ? lse_cols[Cols::slot(i)] : lse_smem[get<1>(tScS.offset(i))];
}

// Issue S^T = K Q^T and dP^T = V dO^T on the stage's Q and dO.
// kShuffle shuffles LSE (shuffle_lse, from lse_lanes) while the S WGMMAs run.
template <class T, class Mma, class FK, class FQ, class FV, class FdO, class Acc, class ShuffleLse>
CUTLASS_DEVICE void issue_s_dp(Mma& mma_sdp, FK& tSrK, FQ& tSrQ, FV& tSrV, FdO& tSrdO, int stage, Acc& tSrS,
                               Acc& tdPrdP, BwdSharedStorage<T>& ss, GemmStats const& gemm_stats,
                               ShuffleLse&& shuffle_lse, LaneStats<T::kBlockM> const& lse_lanes) {
  if constexpr (T::kGemmStats) {
    // S^T - LSE_log2 / scale_log2 and dP^T - D, the statistics added by the tensor cores (RowStats::kGemmInit).
    const uint64_t desc = GemmStats::descriptor(ss.gemm_stats[stage]);
    wgmma_gemm_from_stats<T::kBlockM>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS, gemm_stats, 0, desc);
    wgmma_gemm_from_stats<T::kBlockM>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tdPrdP, gemm_stats, 1, desc);
  } else {
    wgmma_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), tSrS);
    if constexpr (!T::kLseAhead) shuffle_lse(lse_lanes);  // ptxas issues them among the S WGMMAs
    wgmma_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, stage), tdPrdP);
  }
}

// P = exp2(S * scale * log2e - LSE_log2) in tSrS, once S is done, computed while the dP GEMM runs; masked entries
// and rows without keys (LSE_log2 = +inf) give 0.
template <class T, class Cols, class Coords, class Acc, class Dtanh, class TileLimits>
CUTLASS_DEVICE void compute_p(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss, int stage, Coords const& tScS,
                              Acc& tSrS, Dtanh& dtanh, float (&lse_cols)[Cols::kCols], bool body_masked,
                              bool need_mask, int kv_rows, int diagonal, TileLimits&& tile_limits) {
  constexpr bool kLseInRegs = lse_in_regs<T, Cols>();
  warpgroup_wait<1>();  // S done
  float const* lse_smem = ss.lse[stage] + tScS.m0();
  if constexpr (kLseInRegs && !T::kShuffleStats) Cols::load(lse_cols, lse_smem, tScS);
  warpgroup_fence_operand(tSrS);
  // Soft-capping: the score of element i is t = tanh(S * softmax_scale / softcap), and dS will need 1 - t^2.
  // Where LSE sits in registers, 1 - t^2 is kept per element until then, as fp16 (in [0, 1]: 11 bits against the
  // 8 of the bf16 dS it scales; in fp32 the hdim 128 consumers spilled 116 bytes, in fp16 36-56). Where LSE is
  // read per element from shared memory (hdim 64: 64 elements per thread, which spilled ~300 bytes held in fp16),
  // t is recovered from P instead: log2 P = t * scale_log2 - LSE_log2. The plain kernels allocate nothing.
  auto score = [&](int i) {
    if constexpr (T::kSoftcap) {
      const float t = tanh_approx(tSrS(i) * p.softcap_pre_tanh);
      if constexpr (dtanh_in_regs<T, Cols>()) dtanh(i) = cutlass::half_t(fmaf(-t, t, 1.f));
      return t;
    } else {
      return tSrS(i);
    }
  };
  // The exponent of P: with RowStats::kGemmInit the accumulator holds the score less LSE_log2 / scale_log2.
  auto exponent = [&](int i, float x) {
    if constexpr (T::kGemmStats) {
      return x * p.scale_log2;
    } else {
      return fmaf(x, p.scale_log2, -lse_of<T, Cols>(i, lse_cols, lse_smem, tScS));
    }
  };
  // Whether the element at offset d from this thread's first one (see AccCoords) is masked, given the tile's
  // limits.
  auto is_masked = [&](auto d, int rows, int diag) {
    const int thr_rows = rows - tScS.n0();
    const int thr_diagonal = diag - (tScS.n0() - tScS.m0());
    // Causal is the band (no left bound, right = 0) but keeps its own expression: a compile-time diagonal test,
    // without the band's two run-time bounds in the masked P loop.
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
  // P. With only the row test (full mask, LSE in registers) the separate loop is slower, so that case keeps one
  // loop; the shuffled statistics (hdim 128 full included) were tuned with the separate loop (docs/tuning.md).
  constexpr bool kSeparateUnmaskedLoop =
      T::kTwoStepBodies || T::kShuffleStats || T::kMask != MaskKind::kFull || !kLseInRegs;
  if constexpr (kSeparateUnmaskedLoop) {
    if (body_masked) {
      // The limits are read again here rather than held across the GEMMs: the unmasked loop needs the registers.
      const auto [rows, diag] = tile_limits();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) {
        const float x = score(i);  // also where masked: dS multiplies the 0 of P by its 1 - t^2
        tSrS(i) = is_masked(tScS.offset(i), rows, diag) ? 0.f : exp2f(exponent(i, x));
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) = exp2f(exponent(i, score(i)));
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) {
      bool masked = false;
      if (need_mask) masked = is_masked(tScS.offset(i), kv_rows, diagonal);
      const float x = score(i);
      tSrS(i) = masked ? 0.f : exp2f(exponent(i, x));
    }
  }
}

// Issue dV += P^T dO with P^T taken from the registers of rP.
template <class Mma, class RP, class FdOt, class Acc>
CUTLASS_DEVICE void issue_dv_from_regs(Mma& mma_dv, RP& rP, FdOt& tdVrdOt, int stage, Acc& tdVrdV, bool first) {
  warpgroup_fence_operand(rP);
  wgmma_gemm<-1>(mma_dv, make_tensor(rP.data(), accumulator_as_a_operand(rP.layout())), tdVrdOt(_, _, _, stage),
                 tdVrdV, first);
}

// DvIssue::kAfterP: P converted to Element, and dV += P^T dO issued to run while dS is computed; P^T comes from
// registers or, after a round trip, shared memory.
template <class T, class Mma, class OpDv, class Acc, class RP, class R2S, class R2SThr, class PtDst, class SPt,
          class FdOt, class DvAcc>
CUTLASS_DEVICE void issue_dv_after_p(Mma& mma_dv, OpDv& op_dv, Acc& tSrS, RP& rP, R2S& r2s, R2SThr& r2s_thr,
                                     PtDst& tPsPt, SPt& sPt, FdOt& tdVrdOt, int stage, DvAcc& tdVrdV, bool first,
                                     uint32_t wg_barrier) {
  constexpr uint32_t kMmaBarrier = uint32_t(ConsumerBarrier::kBoth);
  rP = convert_fragment<typename T::Element>(tSrS);
  if constexpr (T::kDvFromRegs) {
    issue_dv_from_regs(mma_dv, rP, tdVrdOt, stage, tdVrdV, first);
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

// dS^T = P^T * (dP^T - D) (times 1 - t^2 where soft-capped), dP done, converted to Element (rdS) and stored to
// dS^T buffer ds_buf; with DvIssue::kAfterDs P is converted to rP here too.
template <class T, class Cols, class Coords, class Acc, class Dtanh, class RP, class RdS, class R2S, class R2SThr,
          class DsDst>
CUTLASS_DEVICE void compute_ds(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss, int stage, Coords const& tScS,
                               Acc& tSrS, Acc& tdPrdP, Dtanh& dtanh, float (&lse_cols)[Cols::kCols],
                               LaneStats<T::kBlockM> const& dsum_lanes, int ds_buf, RP& rP, RdS& rdS, R2S& r2s,
                               R2SThr& r2s_thr, DsDst& tPsdSt) {
  // Without shuffled statistics D is read per element straight from shared memory: with DvIssue::kAfterP this is
  // the consumers' register peak (dK, dV, P, dP and the P^T operand of the running dV GEMM are all live), and a
  // register copy of D made them spill.
  float const* dsum = ss.dsum[stage] + tScS.m0();
  if constexpr (T::kGemmStats) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = tSrS(i) * tdPrdP(i);  // the accumulator holds dP - D
  } else if constexpr (T::kShuffleStats) {
    Cols::for_each_column(dsum_lanes, tScS, [&](int j, float d) { tdPrdP(j) = tSrS(j) * (tdPrdP(j) - d); });
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tdPrdP(i) = tSrS(i) * (tdPrdP(i) - dsum[get<1>(tScS.offset(i))]);
  }
  if constexpr (dtanh_in_regs<T, Cols>()) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdPrdP); ++i) tdPrdP(i) *= float(dtanh(i));
  } else if constexpr (T::kSoftcap) {
    // P = 0 (masked, or below exp2's range) has no t to recover, and its dS is 0 whatever 1 - t^2 is.
    float const* lse_smem = ss.lse[stage] + tScS.m0();
    const float inv_scale_log2 = 1.f / p.scale_log2;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdPrdP); ++i) {
      const float t = (log2f(tSrS(i)) + lse_of<T, Cols>(i, lse_cols, lse_smem, tScS)) * inv_scale_log2;
      tdPrdP(i) = tSrS(i) > 0.f ? tdPrdP(i) * fmaf(-t, t, 1.f) : 0.f;
    }
  }
  if constexpr (T::kDvAfterDs) rP = convert_fragment<typename T::Element>(tSrS);
  rdS = convert_fragment<typename T::Element>(tdPrdP);
  cute::copy(r2s, r2s_thr.retile_S(rdS), tPsdSt(_, _, _, ds_buf));
}

// Once every warpgroup's dS^T is in shared memory (dK, when d is split, and dQ need all its rows): issue dQ = dS K
// and dK += dS^T Q, then wait for dV and dQ (dK may still run). dQ goes first so that its hand-off to the writer
// overlaps the dK GEMM.
template <class T, class MmaDq, class MmaDk, class OpDk, class FdS, class FKt, class FQt, class RdS, class SdSt,
          class DqAcc, class DkAcc, class DvAcc, class RP>
CUTLASS_DEVICE void issue_dq_dk(MmaDq& mma_dq, MmaDk& mma_dk, OpDk& op_dk, FdS& tdQrdS, FKt& tdQrKt, FQt& tdKrQt,
                                RdS& rdS, SdSt& sdSt, int stage, int ds_buf, bool first, DqAcc& tdQrdQ,
                                DkAcc& tdKrdK, DvAcc& tdVrdV, RP& rP) {
  constexpr uint32_t kMmaBarrier = uint32_t(ConsumerBarrier::kBoth);
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, kMmaBarrier);
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
}

// Hand the partial dQ to the writer warp through staging buffer dq_count (mod kDqBuffers), once the writer has read
// it; returns the next dq_count.
template <class T, class DqAcc>
CUTLASS_DEVICE uint32_t hand_off_dq(BwdSharedStorage<T>& ss, DqAcc& tdQrdQ, VisitRecordOf<T> const& srec, int tid,
                                    uint32_t dq_count) {
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
  return dq_count;
}

// RowStats::kShuffle*: the LSE of the thread's query columns into lse_cols, shuffled from the lanes that loaded it.
// The empty asm keeps the compiler from sinking the shuffles back to their use.
template <class T, class Cols, class Coords>
CUTLASS_DEVICE void shuffle_lse(float (&lse_cols)[Cols::kCols], LaneStats<T::kBlockM> const& lanes,
                                Coords const& tScS) {
  if constexpr (T::kShuffleStats) {
    Cols::fetch(lse_cols, lanes, tScS);
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < Cols::kCols; ++c) asm volatile("" : "+f"(lse_cols[c]));
  }
}

// RowStats::kShuffleAhead: waits for the stage of step `count` and shuffles its LSE into lse_cols.
template <class T, class Cols, class Coords>
CUTLASS_DEVICE void shuffle_lse_ahead(BwdSharedStorage<T>& ss, int tid, uint32_t count,
                                      float (&lse_cols)[Cols::kCols], Coords const& tScS) {
  if constexpr (T::kLseAhead) {
    const RingPos pos = ring_pos<T::kStages>(count);
    wait_barrier(ss.q_full[pos.index], pos.phase, WaitSite::kQFull);
    LaneStats<T::kBlockM> lanes;
    lanes.load(ss.lse[pos.index], tid % 32);
    shuffle_lse<T, Cols>(lse_cols, lanes, tScS);
  }
}

// The GEMM operands a consumer reads from shared memory: its fragments (GMMA descriptors) of K, Q, V and dO for S^T
// and dP^T, of dO^T for dV, Q^T for dK, dS and K^T for dQ, and the P^T and dS^T buffers it writes.
template <class T, class OpSdp, class OpDv, class OpDk, class OpDq>
CUTLASS_DEVICE auto gemm_operands(BwdSharedStorage<T>& ss, OpSdp& op_sdp, OpDv& op_dv, OpDk& op_dk, OpDq& op_dq) {
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
  struct Operands {
    decltype(tSrK) tSrK;
    decltype(tSrQ) tSrQ;
    decltype(tSrV) tSrV;
    decltype(tSrdO) tSrdO;
    decltype(tdVrdOt) tdVrdOt;
    decltype(tdKrQt) tdKrQt;
    decltype(tdQrdS) tdQrdS;
    decltype(tdQrKt) tdQrKt;
    decltype(sPt) sPt;
    decltype(sdSt) sdSt;
  };
  return Operands{tSrK, tSrQ, tSrV, tSrdO, tdVrdOt, tdKrQt, tdQrdS, tdQrKt, sPt, sdSt};
}

// The end of a step: wait for its dK GEMM and release the Q/dO stage; the tile's last step then stores dK/dV. Every
// step waits for its dK GEMM, as the next step may reuse this stage (one stage) or its dS^T registers (dK from
// registers; held into the next step, they would make the consumers spill).
template <class T, class DkAcc, class DvAcc, class RdS, class ThrDv, class StoreDkDv>
CUTLASS_DEVICE void end_step(BwdSharedStorage<T>& ss, int stage, VisitRecordOf<T> const& srec, int32_t flags,
                             DkAcc& tdKrdK, DvAcc& tdVrdV, RdS& rdS, ThrDv const& thr_dv, StoreDkDv& store_dkdv) {
  if (flags & VisitRecord::kLast) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdKrdK);
    if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);
    const KvTileRef tile{srec.batch, srec.head_k, srec.n_block};  // read before the stage is released
    reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
    // A piece of a split tile stores its partial sums; the last piece to finish stores the tile. Only the batched
    // full-mask kernels split (ScheduleRef::splits_tail).
    bool piece = false;
    if constexpr (ScheduleRef::splits_tail<T>()) piece = (flags & VisitRecord::kPiece) != 0;
    if (piece) {
      store_dkdv.store_piece(tile, tdKrdK, tdVrdV, thr_dv);
    } else {
      store_dkdv(tile, tdKrdK, tdVrdV, thr_dv);
    }
  } else {
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdKrdK);
    if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);
    reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
  }
}

// After the end record: tell the dQ writer there is nothing more, through the buffer it reads next.
template <class T>
CUTLASS_DEVICE void finish_consumers(BwdSharedStorage<T>& ss, int tid, uint32_t dq_count) {
  // Nothing is in flight here (the last step of every tile waits for its dK GEMM), but ptxas cannot tell: without
  // this wait it inserts one itself on the exit path and then serialises every WGMMA of the kernel (C7518).
  warpgroup_wait<0>();
  const RingPos endpos = ring_pos<T::kDqBuffers>(dq_count);
  const int end_buf = endpos.index;
  wait_barrier(ss.dq_empty[end_buf], endpos.phase ^ 1, WaitSite::kDqEmpty);
  if (tid == 0) ss.dq_rec[end_buf].flags = VisitRecord::kEnd;
  reinterpret_cast<Barrier&>(ss.dq_full[end_buf]).arrive();
}

}  // namespace detail

// ----------------------------------------------------------------------------------------------------------------
// Consumer warpgroups: one step per record until the end record; dK/dV of each tile go out through `store_dkdv`.
template <class T, class StoreDkDv>
CUTLASS_DEVICE void consumer_loop(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss, StoreDkDv&& store_dkdv) {
  using Element = typename T::Element;
  using BM = typename T::BM;
  using BN = typename T::BN;
  using HD = typename T::HD;
  const int tid = threadIdx.x - 128;  // 0 .. kNumMmaThreads-1
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

  auto [tSrK, tSrQ, tSrV, tSrdO, tdVrdOt, tdKrQt, tdQrdS, tdQrKt, sPt, sdSt] =
      detail::gemm_operands<T>(ss, op_sdp, op_dv, op_dk, op_dq);

  // Coordinates (kv row n, query row m) of each S^T accumulator element.
  Tensor tScS_full = thr_sdp.partition_C(make_identity_tensor(Shape<BN, BM>{}));
  const AccCoords<decltype(tScS_full)> tScS{tScS_full};
  // P^T and dS^T leave the accumulators through stmatrix (8x8 tiles, one address per four tiles).
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto r2s_thr = r2s.get_thread_slice(tid);
  Tensor tPsPt = r2s_thr.partition_D(sPt);
  auto ds_store_view = [&dst = sdSt] {  // see BwdConfig::ds_store_address_swizzle
    if constexpr (T::Cfg::ds_store_address_swizzle(T::kMask)) {
      return cute::as_position_independent_swizzle_tensor(dst);
    } else {
      return dst;
    }
  };
  Tensor tPsdSt = r2s_thr.partition_D(ds_store_view());

  const int seqlen_q = get<0>(p.shape_q);
  const int seqlen_k = get<0>(p.shape_k);
  const int causal_offset = seqlen_k - seqlen_q;  // bottom-right aligned diagonal
  // Packed sequences: the current KV tile's sequence (its length of keys and diagonal), read at the tile's first step.
  [[maybe_unused]] int32_t seq_len_k = 0, seq_diagonal = 0;

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
  // The LSE of each of the thread's query columns, in registers. RowStats::kShuffle*: shuffled from the lanes that
  // loaded it (LaneStats) while the S and dP GEMMs are issued (kShuffle) or at the end of the step before
  // (kShuffleAhead, which waits for that step's stage there, so that the top of the loop need not). Shuffled after
  // the S wait, the first exp2 would wait on them: they queue in the MIO pipe behind the dP GEMM's operand reads.
  // Issued during the GEMMs they are faster except under the descending order, which a step ahead serves (see
  // docs/tuning.md). The empty asm keeps the compiler from sinking the shuffles back to their use.
  // kSharedMemory: loaded here after the S wait when it fits in registers (detail::lse_in_regs); unused (and dropped)
  // otherwise.
  float lse_cols[Cols::kCols];
  auto shuffle_lse = [&](LaneStats<T::kBlockM> const& lanes) { detail::shuffle_lse<T, Cols>(lse_cols, lanes, tScS); };
  // kShuffleAhead: the LSE of step `count` (its record may be the end, then the values go unused).
  auto shuffle_lse_ahead = [&](uint32_t count) {
    detail::shuffle_lse_ahead<T, Cols>(ss, tid, count, lse_cols, tScS);
  };
  [[maybe_unused]] const GemmStats gemm_stats(tid % 32);
  shuffle_lse_ahead(0);
  for (uint32_t q_count = 0;; ++q_count) {
    const RingPos qpos = ring_pos<T::kStages>(q_count);
    const int stage = qpos.index;
    // kShuffleAhead waited for this stage already (the prologue's or the previous step's shuffle_lse_ahead).
    if constexpr (!T::kLseAhead) wait_barrier(ss.q_full[stage], qpos.phase, WaitSite::kQFull);
    // Only the fields a step needs are held in registers (the consumers have none to spare); the record stays in
    // shared memory until the stage is released, and the rest is read from there when needed.
    const VisitRecordOf<T>& srec = ss.rec[stage];
    const int32_t flags = srec.flags;
    if (flags & VisitRecord::kEnd) break;
    if (flags & VisitRecord::kEmptyTile) {
      // The stage is released after the stores, which read the tile's sequence from its record.
      store_dkdv.store_zeros(srec, thr_dv);
      reinterpret_cast<Barrier&>(ss.q_empty[stage]).arrive();
      shuffle_lse_ahead(q_count + 1);
      continue;
    }
    // The tile's first dK/dV GEMMs overwrite the accumulators (no clear(): see wgmma_gemm).
    const bool first = flags & VisitRecord::kFirst;
    if constexpr (T::kPacked) {
      if (first) {
        const SeqRows rows = seq_rows<SeqLayout::kPacked>(p.packed, srec.batch, 0, 0);
        seq_len_k = rows.len_k;
        seq_diagonal = rows.len_k - rows.len_q;
      }
    }
    // Key row n of the tile is masked for query column m if n >= kv_rows (past seqlen_k) or n - m leaves the band
    // around the tile's diagonal (tile coordinates): causal, n - m > diagonal; a window, n - m > diagonal + right or
    // n - m < diagonal - left (a negative bound is absent). Read before the GEMMs: read after the S wait, the
    // shared-memory load of the tile indices sat behind the LSE loads and stalled every step.
    auto tile_limits = [&] {
      const int n0 = srec.n_block * T::kBlockN;
      if constexpr (T::kPacked) {
        return cute::make_tuple(seq_len_k - n0, srec.m_block * T::kBlockM + seq_diagonal - n0);
      } else {
        return cute::make_tuple(seqlen_k - n0, srec.m_block * T::kBlockM + causal_offset - n0);
      }
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
    // one it runs once with the tile's need_mask. (A lambda per body would change the SASS of the one-body kernels
    // too.)
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
      detail::issue_s_dp<T>(mma_sdp, tSrK, tSrQ, tSrV, tSrdO, stage, tSrS, tdPrdP, ss, gemm_stats, shuffle_lse,
                            lse_lanes);
      // At most the two groups just issued are pending here (every step ends with its dK GEMM complete), so this
      // wait returns at once. It and the fences are kept: without them the kernels compile to other code, whose speed
      // is unknown.
      warpgroup_wait<2>();
      warpgroup_fence_operand(tdKrdK);
      if constexpr (T::kDkFromRegs) warpgroup_fence_operand(rdS);

      Tensor dtanh = make_tensor<cutlass::half_t>(
          std::conditional_t<detail::dtanh_in_regs<T, Cols>(), decltype(tSrS.layout()), Layout<_1>>{});
      detail::compute_p<T, Cols>(p, ss, stage, tScS, tSrS, dtanh, lse_cols, body_masked, need_mask, kv_rows,
                                 diagonal, tile_limits);
      Tensor rP = make_tensor<Element>(tSrS.layout());
      if constexpr (!T::kDvAfterDs) {
        detail::issue_dv_after_p<T>(mma_dv, op_dv, tSrS, rP, r2s, r2s_thr, tPsPt, sPt, tdVrdOt, stage, tdVrdV, first,
                                    wg_barrier);
      }
      // dP done; with DvIssue::kAfterP the dV GEMM may still run, with kAfterDs it is not issued yet.
      warpgroup_wait<T::kDvAfterDs ? 0 : 1>();
      warpgroup_fence_operand(tdPrdP);
      const int ds_buf = ds_count++ % T::kDsBuffers;
      detail::compute_ds<T, Cols>(p, ss, stage, tScS, tSrS, tdPrdP, dtanh, lse_cols, dsum_lanes, ds_buf, rP, rdS, r2s,
                                  r2s_thr, tPsdSt);
      // DvIssue::kAfterDs: dV += P^T dO runs while dS is handed over; it reads P^T and dO only, so it need not wait
      // for the dS^T stores to be fenced.
      if constexpr (T::kDvAfterDs) detail::issue_dv_from_regs(mma_dv, rP, tdVrdOt, stage, tdVrdV, first);
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<BM, HD>{});
      detail::issue_dq_dk<T>(mma_dq, mma_dk, op_dk, tdQrdS, tdQrKt, tdKrQt, rdS, sdSt, stage, ds_buf, first, tdQrdQ,
                             tdKrdK, tdVrdV, rP);
      // The tile's last reads of K (S, dQ) and V (dP) are done; the still-running dK GEMM reads only dS^T and Q.
      // Freeing K/V now lets the producer start the next tile's K/V loads during the dQ hand-off, dK and the dK/dV
      // stores.
      if (flags & VisitRecord::kLast) reinterpret_cast<Barrier&>(ss.kv_empty).arrive();
      dq_count = detail::hand_off_dq<T>(ss, tdQrdQ, srec, tid, dq_count);

      detail::end_step<T>(ss, stage, srec, flags, tdKrdK, tdVrdV, rdS, thr_dv, store_dkdv);
    }
    shuffle_lse_ahead(q_count + 1);
  }
  detail::finish_consumers<T>(ss, tid, dq_count);
}

}  // namespace dash::bwd
