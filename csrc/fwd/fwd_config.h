// Compile-time configuration of the sm90 forward kernel: one named tile config per head dim, and the CuTe types
// (MMAs, shared-memory layouts, pipelines) derived from it. Everything else in csrc/fwd reads its sizes from here.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/params.h"
#include "common/score_mod.h"
#include "common/wgmma.h"

namespace dash::fwd {

// Tile of one CTA: kBlockM query rows (one consumer warpgroup per 64 rows) against block_n(mask) keys per mainloop
// step. kStages is the depth of each of the K and V shared-memory rings. kPingPong: consumer warpgroups take turns
// issuing their GEMMs (see WarpGroupTurns), so one warpgroup's softmax overlaps another's tensor-core work. Register
// budgets are per thread after setmaxnreg; producer * 128 + consumer * kNumConsumerThreads must fit the 64K-register
// file. softmax_fence(mask): whether a step ends ptxas's scheduling block after its softmax (schedule_fence,
// common/wgmma.h); without it ptxas hoists the wait on the step's PV GEMM above the row maxima and every exp2, so the
// softmax runs after that GEMM instead of beside it. Never with a softcap (FwdKernelTraits::kSoftmaxFence).
// Which of a head dim's tile configs a kernel runs: every head dim has kDefault; kShort is a second, shorter query
// tile for calls with few query rows (FwdTileConfig<kHeadDim>::short_tile_max_seqlen_q says which calls take it,
// fwd_launch.h picks it per call). A row's result does not depend on the tile it is in: the tile's extra key tiles are
// fully masked for that row and add exact zeros (fwd_mainloop.h), so both tiles give the same bits.
enum class FwdTileSize : int { kDefault = 0, kShort = 1 };

template <int kHeadDim, FwdTileSize kSize = FwdTileSize::kDefault>
struct FwdTileConfig;

// How the epilogue writes O. kTmaFromShared: each consumer warpgroup stages its 64 rows in a shared-memory buffer
// of its own and one thread issues a TMA store, so the warpgroup goes on to the next tile while the copy engine
// writes O; it needs kBlockM * headdim elements of shared memory besides the mainloop's buffers. kTmaThroughV: the
// same TMA store, staged in the V ring (for configs whose mainloop fills shared memory): once every consumer
// warpgroup has run the tile's last P V GEMM the ring holds nothing the tile still needs, and the producer loads the
// next tile's first V only after the TMA unit has read O out (FwdNamedBarrier::kOStagedInV). kRegisters: plain global
// stores straight from the accumulator.
enum class OStorePath : int { kRegisters = 0, kTmaFromShared = 1, kTmaThroughV = 2 };

// Where a step rescales the O accumulator by the softmax's correction (fwd_mainloop.h), per tile config, mask and
// score transform (FwdTileConfig::o_rescale). kBeforePv: in the next step, between issuing QK^T and the PV GEMM that
// needs it, so the multiplies run while the tensor cores work on QK^T. kAfterPv: at the end of the step, once its PV
// GEMM has completed, so the next step issues both GEMMs back to back.
enum class ORescale : int { kBeforePv = 0, kAfterPv = 1 };

// Small head dim: the QK^T GEMM is short, so a taller tile (3 consumer warpgroups) amortises the K/V loads.
template <>
struct FwdTileConfig<64> {
  static constexpr int kBlockM = 192;
  static constexpr int block_n(MaskKind) { return 128; }
  static constexpr int kStages = 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 160;
  static constexpr bool kPingPong = true;
  static constexpr OStorePath kOStore = OStorePath::kTmaFromShared;
  // After the PV GEMM at full and causal: beside FA3 in one process (docs/tuning.md) it ran 1.5-4.6% faster at full
  // (1k-16k) and within 2% at causal. The soft-capped kernels spilled 16/24 bytes with it; windows were not measured.
  static constexpr ORescale o_rescale(MaskKind mask, ScoreMod mod) {
    return mask == MaskKind::kWindow || mod == ScoreMod::kSoftcap ? ORescale::kBeforePv : ORescale::kAfterPv;
  }
  // Full masks only: beside FA3 on an H100 (docs/tuning.md) it ran 1-2% faster at full and 2% slower at causal 2k;
  // windows were not measured.
  static constexpr bool softmax_fence(MaskKind mask) { return mask == MaskKind::kFull; }
  // Causal calls of up to 1024 query rows (the bound of a packed call) run FwdTileConfig<64, kShort>: at 1k the
  // 192-row tiles compute 1.50x the visible scores (the last tile ragged, the diagonal wide), 128-row tiles 1.12x.
  // H100, beside FA3 and cuDNN (docs/tuning.md): 128 rows 1.11x as fast as 192 at causal 1k, 0.95x at 2k, slower
  // at every full-mask length. Not with a softcap (not measured).
  static constexpr int short_tile_max_seqlen_q(MaskKind mask, ScoreMod mod) {
    return mask == MaskKind::kCausal && mod == ScoreMod::kNone ? 1024 : 0;
  }
};

// Short causal calls at head dim 64: two consumer warpgroups of 64 rows, the registers of the 128-row tiles of head
// dim 128; everything else as the 192-row tile.
template <>
struct FwdTileConfig<64, FwdTileSize::kShort> : FwdTileConfig<64> {
  static constexpr int kBlockM = 128;
  static constexpr int kConsumerRegs = 240;
};

template <>
struct FwdTileConfig<128> {
  static constexpr int kBlockM = 128;
  static constexpr int block_n(MaskKind) { return 128; }
  static constexpr int kStages = 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr bool kPingPong = true;
  static constexpr OStorePath kOStore = OStorePath::kTmaFromShared;
  // Before the PV GEMM: after it, causal ran 5% slower at 4k and 4% faster at 16k, full within 2% (docs/tuning.md).
  static constexpr ORescale o_rescale(MaskKind, ScoreMod) { return ORescale::kBeforePv; }
  // Full and causal masks: beside FA3 on an H100 (docs/tuning.md) full ran 2-4% faster, causal within 1%; windows
  // were not measured.
  static constexpr bool softmax_fence(MaskKind mask) { return mask != MaskKind::kWindow; }
  static constexpr int short_tile_max_seqlen_q(MaskKind, ScoreMod) { return 0; }  // no second tile
};

// Large head dim: the O accumulator alone takes 128 registers per consumer thread, and Q + 2 stages of K and V take
// 192 KB (64-key tiles) or 224 KB (80-key tiles) of shared memory, so O has no buffer of its own and is staged in the
// V ring (64 KB of O in 64 or 80 KB of V). Issue turns as at the other head dims.
template <>
struct FwdTileConfig<256> {
  static constexpr int kBlockM = 128;
  // 80-key tiles (WGMMA N = 80, CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED) on full and causal masks: 2-9% faster than
  // 64-key tiles from 8k keys, within 2% at 2k (docs/tuning.md). Windows keep 64-key tiles (not measured with 80).
  static constexpr int block_n(MaskKind mask) { return mask == MaskKind::kWindow ? 64 : 80; }
  static constexpr int kStages = 2;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  // Without turns, with kAfterPv or with the softmax fence the full and causal kernels ran within the spread of
  // these choices (docs/tuning.md, Forward); O through the V ring ran 4-15% ahead of register stores at 1k-2k.
  static constexpr bool kPingPong = true;
  static constexpr OStorePath kOStore = OStorePath::kTmaThroughV;
  static constexpr ORescale o_rescale(MaskKind, ScoreMod) { return ORescale::kBeforePv; }
  static constexpr bool softmax_fence(MaskKind) { return false; }
  static constexpr int short_tile_max_seqlen_q(MaskKind, ScoreMod) { return 0; }  // no second tile
};

template <int kHeadDim_, class Element_, MaskKind kMask_, ScoreMod kScoreMod_ = ScoreMod::kNone,
          SeqLayout kLayout_ = SeqLayout::kBatched, FwdTileSize kTileSize_ = FwdTileSize::kDefault>
struct FwdKernelTraits {
  using Element = Element_;
  using Tile = FwdTileConfig<kHeadDim_, kTileSize_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr MaskKind kMask = kMask_;
  static constexpr SeqLayout kLayout = kLayout_;
  static constexpr bool kPacked = kLayout_ == SeqLayout::kPacked;
  static constexpr bool kSoftcap = kScoreMod_ == ScoreMod::kSoftcap;
  static constexpr bool kCausal = kMask_ == MaskKind::kCausal;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::block_n(kMask_);
  static constexpr int kStages = Tile::kStages;
  static constexpr ORescale kORescale = Tile::o_rescale(kMask_, kScoreMod_);
  // Not with a softcap: those kernels spill 24-56 bytes with the fence (docs/tuning.md).
  static constexpr bool kSoftmaxFence = !kSoftcap && Tile::softmax_fence(kMask_);
  // Whether steps without a mask take a second copy of the softmax, without the guards against rows that saw no key
  // (OnlineSoftmax::step). Not for windows and soft-capped kernels: with it their hdim 64 builds spill past the
  // allowance (ptxas: window 92 / 96 -> 100 / 120 bytes stored / loaded, softcap 0 -> 32 / 40).
  static constexpr bool kUnmaskedSoftmax = !kSoftcap && kMask_ != MaskKind::kWindow;
  // Whether a step skips the O rescale where no row of the warp raised its max (OnlineSoftmax::max_moved). Not for
  // the soft-capped hdim 64 kernels: with it their dense builds spill 16 / 24 bytes (ptxas).
  static constexpr bool kSkipIdleRescale = !(kSoftcap && kHeadDim_ == 64);

  static constexpr int kRowsPerWarpGroup = 64;  // M of one WGMMA instruction
  static constexpr int kNumConsumerWarpGroups = kBlockM / kRowsPerWarpGroup;
  static constexpr int kNumConsumerThreads = kNumConsumerWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumConsumerThreads + cutlass::NumThreadsPerWarpGroup;
  static_assert(kBlockM % kRowsPerWarpGroup == 0);
  static_assert(kNumConsumerWarpGroups * cutlass::NumThreadsPerWarpGroup * Tile::kConsumerRegs +
                        cutlass::NumThreadsPerWarpGroup * Tile::kProducerRegs <=
                    64 * 1024,
                "register split exceeds the register file");

  using TileShapeQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;  // S = Q K^T
  using TileShapePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;  // O = P V
  using AtomLayout = cute::Layout<cute::Shape<cute::Int<kNumConsumerWarpGroups>, cute::_1, cute::_1>>;

  // Both operands of S come from shared memory; P comes from registers (the softmax output never leaves them) and V
  // is read transposed (MN-major) from the same buffer the TMA filled.
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TileShapePV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      AtomLayout{}));
  static_assert(wgmma_n<TiledMmaQK>() == kBlockN, "Q K^T is not one WGMMA wide (common/wgmma.h)");
  static_assert(wgmma_n<TiledMmaPV>() == kHeadDim, "P V is not one WGMMA wide (common/wgmma.h)");

  // Rows of Q, K and V are headdim * 2 bytes, a multiple of 128 B for every supported head dim, so all three use the
  // widest (128-byte) swizzle atom, which is what the K-major GMMA descriptors read fastest.
  static_assert(kHeadDim * sizeof(Element) % 128 == 0);
  using SmemAtomQ = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemAtomKV = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemAtomQ{}, cute::make_shape(cute::Int<kBlockM>{},
                                                                                  cute::Int<kHeadDim>{})));
  using SmemLayoutKV = decltype(cute::tile_to_shape(
      SmemAtomKV{}, cute::make_shape(cute::Int<kBlockN>{}, cute::Int<kHeadDim>{}, cute::Int<kStages>{})));
  // V^T as the B operand of P V: (headdim, keys, stage) view of the K-major V buffer, i.e. MN-major.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutKV{}, cute::make_ordered_layout(cute::make_shape(cute::Int<kHeadDim>{}, cute::Int<kBlockN>{},
                                                                 cute::Int<kStages>{}),
                                                cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // O staging buffer: one (64 rows, headdim) block per consumer warpgroup, each a TMA store box of its own, stacked
  // along the rows so that the (kBlockM, headdim) view matches the PV accumulator's partitioning. Blocks are 16 KB
  // or more, a whole number of swizzle periods, so both views swizzle the same bytes alike.
  // Packed sequences take it for the query tiles inside a sequence and store the tile that reaches past its end from
  // registers (fwd_epilogue.h): a TMA box there would also write the next sequence's first rows, another CTA's.
  static constexpr OStorePath kOStore = Tile::kOStore;
  using SmemLayoutOWarpGroup = decltype(cute::tile_to_shape(
      SmemAtomQ{}, cute::make_shape(cute::Int<kRowsPerWarpGroup>{}, cute::Int<kHeadDim>{})));
  using SmemLayoutO = decltype(cute::tile_to_shape(SmemLayoutOWarpGroup{},
                                                   cute::make_shape(cute::Int<kBlockM>{}, cute::Int<kHeadDim>{})));
  static constexpr bool kOInV = kOStore == OStorePath::kTmaThroughV;
  struct NoStorage {};
  using StorageO = std::conditional_t<kOStore == OStorePath::kTmaFromShared,
                                      cute::array_aligned<Element, cute::cosize_v<SmemLayoutO>, 1024>, NoStorage>;

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename PipelineKV::PipelineState;

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  struct SharedStorage {
    // 128-byte swizzled GMMA layouts repeat every 1 KB, so each buffer starts on a 1 KB boundary.
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutKV>, 1024> v;
    StorageO o;
    typename PipelineKV::SharedStorage pipeline_k;
    typename PipelineKV::SharedStorage pipeline_v;
    uint64_t barrier_q;
  };
  static_assert(!kOInV || cute::cosize_v<SmemLayoutO> <= cute::cosize_v<SmemLayoutKV>, "O does not fit the V ring");
  static constexpr int kSharedStorageBytes = sizeof(SharedStorage);
  // Architectural limit of dynamic shared memory per block on sm90 (the launch opts in to all of it).
  static constexpr int kSm90MaxSharedBytesPerBlock = 227 * 1024;
  static_assert(kSharedStorageBytes <= kSm90MaxSharedBytesPerBlock, "tile config does not fit sm90 shared memory");
};

}  // namespace dash::fwd
