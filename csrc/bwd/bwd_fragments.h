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

// Issue the WGMMAs of one GEMM (every k-block) as one commit group; waits for completion only when kWait >= 0.
// `zero_init` (run time) overwrites the accumulator instead of adding to it: the dK/dV accumulators start a KV tile
// this way rather than by a clear(), because a non-WGMMA write of accumulator registers inside a data-dependent
// branch makes ptxas serialise every WGMMA of the kernel (C7515/C7518).
template <int kWait, class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void wgmma_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC, bool zero_init) {
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  tiled_mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
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
// GEMM wait that needs them: loading them earlier, while the WGMMA runs, kept them live across it and pushed the
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
