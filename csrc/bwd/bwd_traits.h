// Compile-time types of the sm90 backward kernel for one (head dim, dtype, mask, score transform): WGMMA tilings,
// shared-memory layouts, TMA types and the sizes derived from BwdConfig. Everything else in csrc/bwd reads its tile
// shapes and operand sources from here.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>

#include "bwd/bwd_config.h"
#include "common/params.h"
#include "common/wgmma.h"

namespace dash::bwd {

using namespace cute;

template <int kHeadDim_, class Element_, MaskKind kMask_, ScoreMod kScoreMod_ = ScoreMod::kNone,
          SeqLayout kLayout_ = SeqLayout::kBatched>
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
  static constexpr SeqLayout kLayout = kLayout_;
  static constexpr bool kPacked = kLayout_ == SeqLayout::kPacked;
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
  // Statistics through the tensor cores, or the config's gemm_init_fallback (bwd_config.h, reads_gemm_stats).
  static constexpr bool kGemmStats = reads_gemm_stats<Cfg>(kMask, std::is_same_v<Element, cutlass::bfloat16_t>,
                                                           kSoftcap);
  static constexpr RowStats row_stats_kind() {
    if constexpr (Cfg::row_stats(kMask) == RowStats::kGemmInit && !kGemmStats) {
      return Cfg::gemm_init_fallback(kMask);
    } else {
      return Cfg::row_stats(kMask);
    }
  }
  static constexpr RowStats kRowStats = row_stats_kind();
  static constexpr bool kShuffleStats = kRowStats == RowStats::kShuffle || kRowStats == RowStats::kShuffleAhead;
  static constexpr bool kLseAhead = kRowStats == RowStats::kShuffleAhead;
  static constexpr bool kOperandsPerWarpGroup =
      Cfg::operand_partition(kMask, kRowStats) == OperandPartition::kPerWarpGroup;
  static_assert(!kShuffleStats || Cfg::SdPSplit::kAlongN == 1, "shuffled statistics need a warpgroup per query row");
  static_assert(!kGemmStats || Cfg::SdPSplit::kAlongN == 1, "the stats WGMMA spans a warpgroup's whole query extent");
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
  static_assert(wgmma_n<TiledMmaSdP>() == kBlockM / Cfg::SdPSplit::kAlongN,
                "S^T and dP^T are not one WGMMA wide per warpgroup (common/wgmma.h)");
  static_assert(wgmma_n<TiledMmadV>() == kHeadDim / Cfg::dKVSplit::kAlongN &&
                    wgmma_n<TiledMmadK>() == kHeadDim / Cfg::dKVSplit::kAlongN,
                "dK and dV are not one WGMMA wide per warpgroup (common/wgmma.h)");
  static_assert(wgmma_n<TiledMmadQ>() == kHeadDim / Cfg::dQSplit::kAlongN,
                "dQ is not one WGMMA wide per warpgroup (common/wgmma.h)");
  static constexpr bool kDvAfterDs = Cfg::dv_issue(kMask) == DvIssue::kAfterDs;
  static constexpr bool kTwoStepBodies = Cfg::masked_steps(kMask, kRowStats) == MaskedSteps::kTwoBodies;
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
  // Packed sequences keep it for the KV tiles inside a sequence and store the tile that reaches past its end from
  // registers (bwd_epilogue.h): a TMA box there would also write the next sequence's first rows, another CTA's.
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
  // RowStats::kGemmInit: the Q tile's GemmStatLines, also the B operand (kBlockM / 2 x 16, K-major, no swizzle) of
  // the stats WGMMAs; the shared-memory LSE/D arrays then keep one element.
  static constexpr uint32_t kGemmStatBytes = kGemmStats ? kBlockM * kGemmStatRowBytes : 0;
  static constexpr int kSmemStatRows = kGemmStats ? 1 : kBlockM;
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

}  // namespace dash::bwd
