// Register-fragment helpers of the backward consumers: issuing a GEMM's WGMMAs, an accumulator reused as a WGMMA A
// operand, the query columns and coordinates a thread's S^T / dP^T elements belong to, the shuffled row statistics,
// and fp32 -> Element conversion of a fragment.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

// Declared as CUDA's sm_30_intrinsics.hpp does inside __shfl_sync (at global scope, where the builtin lives).
extern __device__ __device_builtin__ unsigned __nvvm_shfl_idx_sync(unsigned mask, unsigned a, unsigned b, unsigned c);

namespace dash::bwd {

using namespace cute;

// The WGMMAs of every k-block of one GEMM, the first with `first` (overwrite or accumulate), the rest accumulating.
template <class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void wgmma_k_blocks(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC,
                                   GMMA::ScaleOut first) {
  tiled_mma.accumulate_ = first;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

// Issue the WGMMAs of one GEMM (every k-block) as one commit group; waits for completion only when kWait >= 0.
// `zero_init` (run time) overwrites the accumulator instead of adding to it: the dK/dV accumulators start a KV tile
// this way rather than by a clear(), because a non-WGMMA write of accumulator registers inside a data-dependent
// branch makes ptxas serialise every WGMMA of the kernel (C7515/C7518).
template <int kWait, class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void wgmma_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC, bool zero_init) {
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  wgmma_k_blocks(tiled_mma, tCrA, tCrB, tCrC, zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) {
    warpgroup_wait<kWait>();
    warpgroup_fence_operand(tCrC);
  }
}
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void wgmma_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  wgmma_gemm<kWait>(tiled_mma, tCrA, tCrB, tCrC, kZeroInit);
}

// RowStats::kGemmInit (bwd_config.h): the WGMMAs that start a warpgroup's S^T or dP^T accumulators (64 x kBlockM) at
// one statistic of each query column, one WGMMA per half of the columns. B is the stage's GemmStatLines (kBlockM / 2
// lines of 16 bytes, a K-major operand without swizzle): line j holds the parts of LSE and D of columns j and
// j + kBlockM / 2 in k-slots 0-1, 2-3, 4-5, 6-7. A (64 x 16, registers) is 1 on the two slots of the wanted statistic
// and half, so every row of the product is that column's sum of parts. In the register layout of a 16-wide k-block,
// slots 2q and 2q + 1 are held by the lanes with lane % 4 == q in their first two registers; the other two registers
// hold slots 8-15, which are 0, so the descriptor reads the same 16 bytes for both 8-wide halves (leading byte offset
// 0) and touches no other memory.
struct GemmStats {
  uint32_t ones;  // two bf16 1.0
  int slot_pair;  // lane % 4: the k-slots 2 * slot_pair and 2 * slot_pair + 1 of each register A operand

  CUTLASS_DEVICE explicit GemmStats(int lane) : ones(0x3F803F80u), slot_pair(lane % 4) {}

  // The A registers selecting statistic `stat` (0: LSE, 1: D) of column half `half`: LSE of the first half on lanes
  // with slot pair 0, D on 1, LSE of the second half on 2, D on 3.
  CUTLASS_DEVICE void a_regs(int stat, int half, uint32_t (&a)[4]) const {
    a[0] = a[1] = slot_pair == stat + 2 * half ? ones : 0u;
    a[2] = a[3] = 0u;
  }

  CUTLASS_DEVICE static uint64_t descriptor(cutlass::bfloat16_t const* lines) {
    cute::GmmaDescriptor desc;
    desc.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(lines) >> 4);
    desc.bitfield.leading_byte_offset_ = 0;
    desc.bitfield.stride_byte_offset_ = 8;  // 16-byte units: 8 lines of 16 bytes between 8-line groups
    desc.bitfield.base_offset_ = 0;
    desc.bitfield.layout_type_ = static_cast<uint8_t>(GMMA::LayoutType::INTERLEAVE);
    return desc.desc_;
  }
};

// Issue one GEMM as wgmma_gemm does, its accumulator first overwritten with statistic `stat` by the GemmStats WGMMAs
// (in the same commit group, so that the accumulator's only writers between the fences are WGMMAs).
template <int kBlockM, class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void wgmma_gemm_from_stats(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC,
                                          GemmStats const& stats, int stat, uint64_t desc_stats) {
  using StatsOp = decltype(GMMA::rs_op_selector<cutlass::bfloat16_t, cutlass::bfloat16_t, float,
                                                Shape<_64, Int<kBlockM / 2>, _16>, GMMA::Major::K, GMMA::Major::K>());
  constexpr int kHalfAcc = std::extent_v<typename StatsOp::CRegisters>;
  static_assert(decltype(size(tCrC))::value == 2 * kHalfAcc, "one warpgroup's 64 x kBlockM accumulator");
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  GMMA::ScaleOut overwrite = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int half = 0; half < 2; ++half) {
    // The accumulator's registers run over 8-column groups, so each half of the columns is a contiguous half of them.
    Tensor acc = make_tensor(tCrC.data() + half * kHalfAcc, make_layout(Int<kHalfAcc>{}));
    uint32_t a[4];
    stats.a_regs(stat, half, a);
    cute::detail::explode(StatsOp::fma, a, make_int_sequence<4>{}, &desc_stats, make_int_sequence<1>{}, acc,
                          make_int_sequence<kHalfAcc>{}, &overwrite, make_int_sequence<1>{});
  }
  wgmma_k_blocks(tiled_mma, tCrA, tCrB, tCrC, GMMA::ScaleOut::One);
  warpgroup_commit_batch();
}

// The (fp32 -> Element) accumulator fragment of one WGMMA, ((2, 2, N/8), M, N), viewed as the register A operand
// ((2, 2, 2), M, K/16) of a GEMM that reduces over this one's N: the third value mode splits into the 8-column half
// within a 16-wide k-block and the k-block index.
template <class Layout>
CUTLASS_DEVICE constexpr auto accumulator_as_a_operand(Layout const& acc) {
  auto halves = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(halves), get<1>(halves), get<2, 0>(halves)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(halves), get<2>(acc))));
}

// Query-column statistics (LSE_log2) of one thread's S^T / dP^T accumulator fragment ((2, 2, G), MMA_M, MMA_N).
// The thread holds each of its query columns in several rows (r and r + 8 of every 16-row block), so each column's
// value is loaded once into a register slot: slot = c + 2 * (g + G * n) for element coordinate ((c, r, g), m, n),
// two adjacent columns per 8-byte load. From shared memory (RowStats::kSharedMemory) they are loaded right after the
// GEMM wait that needs them: loading them earlier, while the WGMMA runs, would keep them live across it and push the
// consumers into spilling (measured slower). Shuffled ones (kShuffle) are fetched while the GEMMs run (consumer_loop).
template <class AccLayout>
struct AccColumns {
  static constexpr int kGroups = decltype(size<0, 2>(AccLayout{}))::value;
  static constexpr int kCols = 2 * kGroups * decltype(size<2>(AccLayout{}))::value;

  CUTLASS_DEVICE static constexpr int slot(int i) {
    const auto c = idx2crd(i, shape(AccLayout{}));
    return get<0, 0>(c) + 2 * (get<0, 2>(c) + kGroups * get<2>(c));
  }
  // Elements (r = 0, m = 0) are the first of their query column; the column's others have the same slot.
  CUTLASS_DEVICE static constexpr bool first_of_column(int i) {
    const auto c = idx2crd(i, shape(AccLayout{}));
    return get<0, 1>(c) == 0 && get<1>(c) == 0;
  }
  // out[slot] = stat.at(offset of the slot's query column): the register slots of `load` filled by one fetch per
  // column (RowStats::kShuffle*, where a fetch is a shuffle). tScS gives the elements' (n, m) offsets (see AccCoords).
  template <class Stat, class Coords>
  CUTLASS_DEVICE static void fetch(float (&out)[kCols], Stat const& stat, Coords const& tScS) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(size(AccLayout{}))::value; ++i) {
      if (first_of_column(i)) out[slot(i)] = stat.at(get<1>(tScS.offset(i)));
    }
  }
  // elem(j, value) for every element j, with value = stat.at(offset of j's query column), fetched once per column.
  template <class Stat, class Coords, class Elem>
  CUTLASS_DEVICE static void for_each_column(Stat const& stat, Coords const& tScS, Elem&& elem) {
    float cols[kCols];
    fetch(cols, stat, tScS);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < decltype(size(AccLayout{}))::value; ++j) elem(j, cols[slot(j)]);
  }
  // Elements (c = 0, r = 0, m = 0) start a pair of adjacent query columns (c = 0, 1), loaded as one float2.
  CUTLASS_DEVICE static constexpr bool starts_pair(int i) {
    const auto c = idx2crd(i, shape(AccLayout{}));
    return get<0, 0>(c) == 0 && get<0, 1>(c) == 0 && get<1>(c) == 0;
  }

  // out[slot] = stat[query column of the slot]; `stat` is already offset to this thread's first column and tScS
  // gives the elements' (n, m) offsets from it (see AccCoords).
  template <class Coords>
  CUTLASS_DEVICE static void load(float (&out)[kCols], float const* stat, Coords const& tScS) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < decltype(size(AccLayout{}))::value; ++i) {
      if (starts_pair(i)) {
        const float2 v = *reinterpret_cast<float2 const*>(stat + get<1>(tScS.offset(i)));  // even column
        out[slot(i)] = v.x;
        out[slot(i) + 1] = v.y;
      }
    }
  }
};

// One row statistic of the Q tile spread over a warp (RowStats::kShuffle). A thread of lane l holds query columns
// m0 + 8g + {0, 1}, m0 = 2 * (l % 4), for every 8-column group g of the tile. Lane l = q + 4r keeps the column pairs
// of its own m0 for the groups g = r, r + 8, ... (one float2 each, kBlockM / 64 of them); the element at compile-time
// column offset o = 8g + c from m0 then takes its value from lane (l % 4) + 4 * (g % 8), a shuffle whose source
// keeps the caller's two low lane bits (segment mask 3) and takes the rest from an immediate: no lane register.
template <int kBlockM>
struct LaneStats {
  static_assert(kBlockM % 64 == 0, "whole groups of 8 lanes x 8 columns");
  static constexpr int kPairs = kBlockM / 64;
  float2 v[kPairs];
  CUTLASS_DEVICE void load(float const* stat, int lane) {
    float const* base = stat + 2 * (lane % 4) + 8 * (lane / 4);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kPairs; ++k) v[k] = *reinterpret_cast<float2 const*>(base + 64 * k);
  }
  CUTLASS_DEVICE float at(int o) const {
    const int g = o / 8;
    const float mine = (o % 8) ? v[g / 8].y : v[g / 8].x;
    // The builtin behind __shfl_sync (which offers only power-of-two segments): unlike inline asm it is convergent,
    // so the compiler cannot sink it into the masked branches of the callers.
    return __uint_as_float(__nvvm_shfl_idx_sync(0xffffffffu, __float_as_uint(mine), 4 * (g % 8), 0x31fu));
  }
};

// (n, m) coordinates of a thread's accumulator elements, split into the thread's own (run-time) coordinate and each
// element's compile-time offset from it. Used as base + offset, per-element tests and addresses become one register
// compared with (or added to) an immediate; taken whole, the compiler hoisted 64 run-time coordinate pairs out of the
// step loop and the consumers spilled them.
template <class IdentityFragment>
struct AccCoords {
  IdentityFragment const& frag;
  CUTLASS_DEVICE int n0() const { return get<0>(*frag.data()); }
  CUTLASS_DEVICE int m0() const { return get<1>(*frag.data()); }
  CUTLASS_DEVICE auto offset(int i) const { return frag.layout()(i); }
};

// Accumulator elements i and i + 1 (adjacent columns of one row) times `scale`, converted to `To`: the pair the
// epilogue writes as one 32-bit word (dK carries the softmax scale, dV 1).
template <class To, class Frag>
CUTLASS_DEVICE cutlass::Array<To, 2> scaled_pair(Frag const& acc, int i, float scale) {
  const cutlass::Array<float, 2> f = {acc(i) * scale, acc(i + 1) * scale};
  return cutlass::NumericArrayConverter<To, float, 2>{}(f);
}

// Register fragment of fp32 accumulators converted to `To`, same layout.
template <class To, class Engine, class Layout>
CUTLASS_DEVICE auto convert_fragment(Tensor<Engine, Layout> const& t) {
  constexpr int N = decltype(size(t))::value;
  Tensor out = make_tensor<To>(t.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) = cutlass::NumericArrayConverter<To, float, N>{}(
      *reinterpret_cast<cutlass::Array<float, N> const*>(t.data()));
  return out;
}

}  // namespace dash::bwd
