// Forward mainloop: the producer warp streams Q once per tile and K/V tile by tile through two TMA/mbarrier rings; the
// consumer warpgroups compute S = Q K^T with WGMMA, run the online softmax on the accumulator registers and add
// P V into the O accumulator. Key tiles are walked from the last one down so that the tiles that need masking
// (ragged seqlen_k, causal diagonal, the right edge of a window) come first and the steady state runs mask-free; a
// window's left edge comes last, masked too.
#pragma once

#include <algorithm>
#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "common/packed_seqs.h"
#include "fwd/fwd_config.h"

namespace dash::fwd {

// Named barrier ids used by this kernel (CUTLASS offsets them past its reserved ids, which leaves 8 ids). kTurnFirst + w
// is the issue-turn barrier of consumer warpgroup w, kOStagingFirst + w the one guarding its O staging buffer; there
// are at most kMaxConsumerWarpGroups consumer warpgroups. O staged in the V ring (OStorePath::kTmaThroughV) has no
// staging buffers, so it takes kOStagingFirst for the barrier of all consumers (kVRingFree) and adds kOStagedInV, on
// which the producer waits before it loads the next tile's first V.
constexpr uint32_t kMaxConsumerWarpGroups = 3;
enum class FwdNamedBarrier : uint32_t {
  kQueryEmpty = 0,
  kTurnFirst = 1,
  kOStagingFirst = kTurnFirst + kMaxConsumerWarpGroups,
  kVRingFree = kOStagingFirst,
  kOStagedInV = kOStagingFirst + kMaxConsumerWarpGroups,
};
static_assert(static_cast<uint32_t>(FwdNamedBarrier::kOStagedInV) < 8, "CUTLASS leaves 8 named barrier ids");

// The arrivals the producer's waits on kQueryEmpty and kOStagedInV take: every consumer thread and the producer warp.
template <class Traits>
constexpr uint32_t kProducerBarrierThreads = Traits::kNumConsumerThreads + cutlass::NumThreadsPerWarp;

// Round-robin issue turns of the consumer warpgroups (when the tile config asks for them): warpgroup w issues its
// GEMMs only after warpgroup w - 1 has issued its own for the same step, so the tensor cores work on one warpgroup's
// GEMMs while the others run their softmax. Every warpgroup takes the same number of turns (same tiles, same key
// tiles); the last warpgroup pre-arrives on the first one's barrier, and finish() consumes that extra arrival.
template <class Traits>
struct WarpGroupTurns {
  static constexpr int kNum = Traits::kNumConsumerWarpGroups;
  static constexpr bool kEnabled = Traits::Tile::kPingPong && kNum > 1;
  static_assert(kNum <= kMaxConsumerWarpGroups, "named barrier ids are laid out for at most 3 consumers");
  static constexpr uint32_t kThreads = 2 * cutlass::NumThreadsPerWarpGroup;  // the waiter and its predecessor

  CUTLASS_DEVICE static uint32_t barrier(int wg) {
    return static_cast<uint32_t>(FwdNamedBarrier::kTurnFirst) + static_cast<uint32_t>(wg);
  }
  CUTLASS_DEVICE static void init(int wg) {
    if constexpr (kEnabled) {
      if (wg == kNum - 1) { cutlass::arch::NamedBarrier::arrive(kThreads, barrier(0)); }
    }
  }
  CUTLASS_DEVICE static void begin(int wg) {
    if constexpr (kEnabled) { cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, barrier(wg)); }
  }
  CUTLASS_DEVICE static void end(int wg) {
    if constexpr (kEnabled) { cutlass::arch::NamedBarrier::arrive(kThreads, barrier((wg + 1) % kNum)); }
  }
  CUTLASS_DEVICE static void finish(int wg) {
    if constexpr (kEnabled) {
      if (wg == 0) { cutlass::arch::NamedBarrier::arrive_and_wait(kThreads, barrier(0)); }
    }
  }
};

// --- Register layout helpers ---------------------------------------------------------------------------------------

// A WGMMA accumulator fragment is ((2 cols, 2 rows, N/8 col groups), MMA_M, MMA_N). View it as (rows, cols) so that
// softmax code can loop over the rows a thread owns and the columns of each row.
template <class Layout>
CUTLASS_DEVICE constexpr auto acc_to_rowcol(Layout const& acc) {
  using namespace cute;
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)), make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

// The same registers, read as the A operand of the register-sourced P V WGMMA: one k-block of 16 keys is two of the
// accumulator's 8-column groups, so the column-group mode splits into (2, N/16).
template <class Layout>
CUTLASS_DEVICE constexpr auto acc_to_operand_a(Layout const& acc) {
  using namespace cute;
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(v), get<2>(acc))));
}

// Issue one warpgroup GEMM C (+)= A B over all k-blocks as one commit group. kWait >= 0 waits until at most kWait
// groups are in flight; kWait < 0 returns with the GEMM still running (the caller waits later).
template <int kWait, class TiledMma, class TA, class TB, class TC>
CUTLASS_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TA const& tA, TB const& tB, TC& tC, bool zero_init) {
  using namespace cute;
  // A is either GMMA shared-memory descriptors (QK^T) or register values (P V); only the latter need fencing.
  constexpr bool kRegisterA = !is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kRegisterA) { warpgroup_fence_operand(const_cast<TA&>(tA)); }
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  tiled_mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    gemm(tiled_mma, tA(_, _, k), tB(_, _, k), tC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) { warpgroup_wait<kWait>(); }
  warpgroup_fence_operand(tC);
  if constexpr (kRegisterA) { warpgroup_fence_operand(const_cast<TA&>(tA)); }
}

// Float fragment -> Element fragment of the same layout (packed conversions).
template <class To, class TensorFrom, class TensorTo>
CUTLASS_DEVICE void convert_fragment(TensorFrom const& from, TensorTo& to) {
  using From = typename TensorFrom::value_type;
  constexpr int kN = decltype(cute::size(from))::value;
  static_assert(decltype(cute::size(to))::value == kN);
  cutlass::NumericArrayConverter<To, From, kN> convert;
  *reinterpret_cast<cutlass::Array<To, kN>*>(to.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kN> const*>(from.data()));
}

// --- Online softmax ------------------------------------------------------------------------------------------------

// With OnlineSoftmax's kTrackMoves a row's max is the one the probabilities are taken against, not the largest score
// seen: it moves only when a step's scores exceed it by more than 2^kStaleMaxLog2, so past the first key tile hardly
// a step rescales O. With the exact max 31% of the steps at 16k keys would and 95% at 1k (a model: full mask, 16 rows
// a warp, 128-key tiles, independent standard normal scores; with this bound none after the first). The
// probabilities then reach 2^kStaleMaxLog2 instead of 1: far inside the range of the 16-bit P operand, the fp32
// accumulators and the row sums; finalize() divides by the sum taken against the same max. The kernel parameters
// carry the bound in raw score units (kStaleMaxLog2 / scale_log2), so no step divides.
inline constexpr float kStaleMaxLog2 = 8.f;

// That bound in raw score units for a call's scale_log2; 0 (the exact max) where it is not a finite non-negative
// number: scales below about 1e-38, whose quotient overflows (an infinite bound makes a row's first max test
// -inf + inf = NaN). Python never passes such scales (validation.MIN_SOFTMAX_SCALE, checked by the public functions
// and the custom ops; scale 0 runs as dash_attn/api.py's _scoreless_queries); a call of the extension itself can.
inline float stale_gap(float scale_log2) {
  float const gap = kStaleMaxLog2 / scale_log2;
  return std::isfinite(gap) && gap >= 0.f ? gap : 0.f;
}

// Running row max (with kTrackMoves one that may lag the largest score: kStaleMaxLog2) and row sum for the kRows query
// rows a consumer thread holds. Scores stay raw (unscaled) in the accumulator; exponentials are taken in base 2 with
// the scale folded into one FFMA. The four threads of a quad share a row: the max is reduced across them every step,
// the sum only once at the end (each thread keeps a partial sum).
template <int kRows, bool kTrackMoves = false>
struct OnlineSoftmax {
  static constexpr int kNumRows = kRows;
  float row_max[kRows];
  float row_sum[kRows];

  CUTLASS_DEVICE void reset() {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  CUTLASS_DEVICE static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  }
  CUTLASS_DEVICE static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }

  // Turns scores (rows, cols) into unnormalised probabilities in place; returns per row the factor by which the
  // previous O accumulator must be multiplied. kMasked: some scores of the step may be -inf. Without a mask every
  // row's new max is finite, so max_scaled needs no guard, and a row whose old max is -inf gets the factor
  // exp2(-inf) = 0 without one: the unmasked steps, the bulk of a tile, skip both selects.
  template <bool kMasked, class TensorS>
  CUTLASS_DEVICE cute::array<float, kRows> step(TensorS& s, float scale_log2, float stale_gap) {
    static_assert(decltype(cute::size<0>(s))::value == kRows, "softmax rows must match the accumulator rows");
    constexpr int kCols = decltype(cute::size<1>(s))::value;
    static_assert(kCols % kChains == 0);
    cute::array<float, kRows> correction;
    bool moved = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const old_max = row_max[r];
      float part[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kChains; ++i) { part[i] = s(r, i); }
      CUTLASS_PRAGMA_UNROLL
      for (int c = kChains; c < kCols; ++c) { part[c % kChains] = fmaxf(part[c % kChains], s(r, c)); }
      float m = quad_max(fmaxf(old_max, combine_max(part)));
      if constexpr (kTrackMoves) {
        // The row keeps its old max unless the step's scores exceed it by more than a factor of 2^kStaleMaxLog2
        // (stale_gap: that bound in raw score units).
        bool const raise = m > old_max + stale_gap;
        m = raise ? m : old_max;
        moved |= raise;
      }
      row_max[r] = m;
      // A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps exp2(-inf) = 0, not NaN.
      float const max_scaled = kMasked && m == -INFINITY ? 0.f : m * scale_log2;
      // Where steps may skip the rescale, the product is rounded before the subtraction (no FFMA), so that an
      // unchanged max gives exactly exp2(0) = 1 and a skipped rescale changes no bit.
      float const exponent = kTrackMoves ? __fsub_rn(__fmul_rn(old_max, scale_log2), max_scaled)
                                         : old_max * scale_log2 - max_scaled;
      correction[r] = kMasked && old_max == -INFINITY ? 0.f : exp2f(exponent);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kCols; ++c) {
        s(r, c) = exp2f(s(r, c) * scale_log2 - max_scaled);
        part[c % kChains] = c < kChains ? s(r, c) : part[c % kChains] + s(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + combine_sum(part);
    }
    if constexpr (kTrackMoves) { max_moved = __any_sync(0xffffffffu, moved); }
    return correction;
  }

  // kTrackMoves: whether the last step raised the max of some row this warp holds (always true without). Where it
  // did not, every factor of that step is exactly 1 and the O rescale (64 multiplies a thread at head dim 128) can
  // be skipped without changing a bit. Warp-uniform, so the skip is a uniform branch.
  bool max_moved = true;

  // Row reductions run as kChains independent chains joined by a tree at the end: one serial chain over a
  // thread's 32 columns is 32 dependent instructions, which with only two or three warps per scheduler is latency,
  // not throughput, and the max sits on the critical path between the QK^T GEMM and the next GEMM issue.
  static constexpr int kChains = 4;
  static_assert((kChains & (kChains - 1)) == 0, "the tree join halves the chain count");
  CUTLASS_DEVICE static float combine_max(float (&part)[kChains]) {
    CUTLASS_PRAGMA_UNROLL
    for (int half = kChains / 2; half > 0; half /= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < half; ++i) { part[i] = fmaxf(part[i], part[i + half]); }
    }
    return part[0];
  }
  CUTLASS_DEVICE static float combine_sum(float (&part)[kChains]) {
    CUTLASS_PRAGMA_UNROLL
    for (int half = kChains / 2; half > 0; half /= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < half; ++i) { part[i] += part[i + half]; }
    }
    return part[0];
  }

  template <class TensorO>
  CUTLASS_DEVICE static void rescale(TensorO& o, cute::array<float, kRows> const& factor) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < cute::size<1>(o); ++c) { o(r, c) *= factor[r]; }
    }
  }

  // Normalises O by the row sums and returns the natural-log LSE per row (-inf, with O = 0, for rows that saw no
  // key). sink: the head's learnable sink logit (natural-log units, like softmax_scale * row max), -inf for none. It
  // joins the denominator once, here, rather than as a column of every step: it has no value vector, so only the
  // final sum sees it. The sum is taken relative to max(row max, sink) so that a sink far above the scores cannot
  // overflow; a row that saw no key keeps O = 0 and gets LSE = sink.
  template <class TensorO>
  CUTLASS_DEVICE cute::array<float, kRows> finalize(TensorO& o, float softmax_scale, float sink) {
    cute::array<float, kRows> lse;
    cute::array<float, kRows> inv_sum;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const sum = quad_sum(row_sum[r]);
      bool const empty = sum == 0.f || sum != sum;
      float const row_top = row_max[r] * softmax_scale;
      if (sink == -INFINITY) {
        inv_sum[r] = empty ? 0.f : 1.f / sum;
        lse[r] = empty ? -INFINITY : row_top + logf(sum);
      } else {
        float const top = empty ? sink : fmaxf(row_top, sink);
        float const keys_scale = empty ? 0.f : expf(row_top - top);
        float const total = sum * keys_scale + expf(sink - top);
        inv_sum[r] = keys_scale / total;
        lse[r] = top + logf(total);
      }
    }
    rescale(o, inv_sum);
    return lse;
  }
};

// --- Mainloop ------------------------------------------------------------------------------------------------------

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr bool kCausal = Traits::kCausal;
  static constexpr bool kWindow = Traits::kMask == MaskKind::kWindow;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;

  // Global tensors as (seqlen, headdim, heads, batch); headdim is the contiguous mode.
  using ShapeQKV = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;

  template <class SmemLayout, class TileShape>
  static auto make_tma(Element const* ptr, ShapeQKV const& shape, StrideQKV const& stride, SmemLayout smem,
                       TileShape tile) {
    auto tensor = cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride);
    return cute::make_tma_copy(cute::SM90_TMA_LOAD{}, tensor, smem, tile, cute::_1{});
  }
  using TileQ = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>;
  using TileKV = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TmaQ = decltype(make_tma(nullptr, ShapeQKV{}, StrideQKV{}, typename Traits::SmemLayoutQ{}, TileQ{}));
  using TmaKV = decltype(make_tma(nullptr, ShapeQKV{}, StrideQKV{},
                                  cute::take<0, 2>(typename Traits::SmemLayoutKV{}), TileKV{}));

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k;
    TmaKV tma_v;
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    int32_t seqlen_q;
    int32_t seqlen_k;
    int32_t head_ratio;  // nheads / nheads_k
    float scale_log2;    // softmax_scale * log2(e); with soft-capping softcap * log2(e) (common/score_mod.h)
    float stale_gap;     // stale_gap(scale_log2): how far a score may pass a row's max before it moves
    int32_t window_left, window_right;  // kWindow only (-1: that side unbounded)
    float softcap_pre_tanh;             // kSoftcap only: softmax_scale / softcap
  };

  static Params make_params(FwdParams const& p) {
    AttnShape const& s = p.shape;
    // A zero-length sequence has no tiles to load, but the tensor map still needs a non-empty extent. Packed
    // sequences are one batch of all rows; a tile starts at its sequence's first row (load's first_q/first_k).
    int32_t const rows_q = Traits::kPacked ? p.packed.total_q : s.seqlen_q;
    int32_t const rows_k = Traits::kPacked ? p.packed.total_k : s.seqlen_k;
    int32_t const batch = Traits::kPacked ? 1 : s.batch;
    ShapeQKV shape_q{std::max(rows_q, 1), s.headdim, s.nheads, batch};
    float const scale_log2 = score_scales(s).softmax * static_cast<float>(M_LOG2E);
    ShapeQKV shape_k{std::max(rows_k, 1), s.headdim, s.nheads_k, batch};
    // V's own head dim (it may differ from K's); the kernel addresses both through shape_k's tile coordinates.
    ShapeQKV shape_v{std::max(rows_k, 1), value_head_dim(s), s.nheads_k, batch};
    // The packed layout's batch mode has one entry; any stride TMA accepts will do for it.
    auto stride = [](TensorStrides const& t) {
      return StrideQKV{t.row, cute::_1{}, t.head, Traits::kPacked ? t.row : t.batch};
    };
    auto const* q = static_cast<Element const*>(p.q);
    auto const* k = static_cast<Element const*>(p.k);
    auto const* v = static_cast<Element const*>(p.v);
    auto kv_smem = cute::take<0, 2>(typename Traits::SmemLayoutKV{});
    return {make_tma(q, shape_q, stride(p.q_stride), typename Traits::SmemLayoutQ{}, TileQ{}),
            make_tma(k, shape_k, stride(p.k_stride), kv_smem, TileKV{}),
            make_tma(v, shape_v, stride(p.v_stride), kv_smem, TileKV{}),
            shape_q,
            shape_k,
            s.seqlen_q,
            s.seqlen_k,
            s.nheads / s.nheads_k,
            scale_log2,
            dash::fwd::stale_gap(scale_log2),
            s.window_left,
            s.window_right,
            score_scales(s).pre_tanh};
  }

  CUTLASS_DEVICE static void prefetch_descriptors(Params const& p) {
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // The band of keys around the bottom-right diagonal: row i sees keys j with
  // i + d - left <= j <= i + d + right, d = seqlen_k - seqlen_q; a negative bound is absent. Causal is (-1, 0).
  CUTLASS_DEVICE static int band_left(Params const& p) { return kWindow ? p.window_left : -1; }
  CUTLASS_DEVICE static int band_right(Params const& p) { return kCausal ? 0 : kWindow ? p.window_right : -1; }

  // Key tiles [lo, hi) that query tile m_block sees; empty (lo >= hi) when the whole tile is masked.
  struct KeyTiles {
    int lo, hi;
  };
  // `lens` has the sequence's seqlen_q and seqlen_k: the parameters themselves for batched sequences, a SeqLens
  // for packed ones.
  template <class Lens>
  CUTLASS_DEVICE static KeyTiles key_tiles(Params const& p, Lens const& lens, int m_block) {
    int last_col = lens.seqlen_k;  // exclusive
    if (band_right(p) >= 0) {
      last_col = min(last_col, (m_block + 1) * kBlockM + lens.seqlen_k - lens.seqlen_q + band_right(p));
    }
    int first_col = 0;
    if (band_left(p) >= 0) first_col = max(0, m_block * kBlockM + lens.seqlen_k - lens.seqlen_q - band_left(p));
    int const hi = last_col <= 0 ? 0 : (last_col + kBlockN - 1) / kBlockN;
    // Without a left bound lo is the constant 0, so full and causal carry no run-time lower bound and compile to the
    // same code as without window support.
    return {kWindow ? min(first_col / kBlockN, hi) : 0, hi};
  }

  // Producer: one warp; lane 0 issues every TMA and carries the expect-tx arrivals (it is the pipelines' leader).
  // Load order per tile: K[last], Q, then (K[n], V[n+1]) pairs walking down, then V[0]; the consumer uses them in
  // the same order. Q is rewritten only after the consumers signal that the previous tile's QK^T GEMMs are done.
  // `rows`: the sequence's first rows in the packed tensors (unused for batched sequences).
  CUTLASS_DEVICE static void load(Params const& p, SharedStorage& smem, PipelineKV& pipeline_k,
                                  PipelineKV& pipeline_v, PipelineState& write_k, PipelineState& write_v,
                                  int m_block, int head, int batch, KeyTiles tiles, bool first_tile,
                                  SeqRows const& rows) {
    using namespace cute;
    bool const issuer = cutlass::canonical_lane_idx() == 0;
    int const head_k = head / p.head_ratio;
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
    constexpr SeqLayout kLayout = Traits::kLayout;
    // (M, D) and (N, D, n) tiles of this head's sequence.
    Tensor gQ = local_tile(sequence_of<kLayout>(mQ, head, batch, rows.first_q), TileQ{}, make_coord(m_block, _0{}));
    Tensor gK = local_tile(sequence_of<kLayout>(mK, head_k, batch, rows.first_k), TileKV{}, make_coord(_, _0{}));
    Tensor gV = local_tile(sequence_of<kLayout>(mV, head_k, batch, rows.first_k), TileKV{}, make_coord(_, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
    auto q_parts = tma_partition(p.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto k_parts = tma_partition(p.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(p.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Tensor tQgQ = get<0>(q_parts);  // (TMA, ...) source and destination views
    Tensor tQsQ = get<1>(q_parts);
    Tensor tKgK = get<0>(k_parts);  // (TMA, n)
    Tensor tKsK = get<1>(k_parts);  // (TMA, stage)
    Tensor tVgV = get<0>(v_parts);
    Tensor tVsV = get<1>(v_parts);

    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_k);
      if (issuer) {
        copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write_k)), tKgK(_, n_block), tKsK(_, write_k.index()));
      }
      ++write_k;
    };
    // With O staged in the V ring the previous tile's O must have been read out before a V load overwrites it.
    bool v_ring_free = first_tile || !Traits::kOInV;
    auto load_v = [&](int n_block) {
      if (!v_ring_free) {
        cutlass::arch::NamedBarrier::arrive_and_wait(kProducerBarrierThreads<Traits>,
                                                     static_cast<uint32_t>(FwdNamedBarrier::kOStagedInV));
        v_ring_free = true;
      }
      pipeline_v.producer_acquire(write_v);
      if (issuer) {
        copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_block), tVsV(_, write_v.index()));
      }
      ++write_v;
    };

    int n_block = tiles.hi - 1;
    load_k(n_block);
    if (!first_tile) {
      cutlass::arch::NamedBarrier::arrive_and_wait(kProducerBarrierThreads<Traits>,
                                                   static_cast<uint32_t>(FwdNamedBarrier::kQueryEmpty));
    }
    if (issuer) {
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.barrier_q, Traits::kTmaBytesQ);
      copy(p.tma_q.with(smem.barrier_q), tQgQ, tQsQ);
    }
    for (; n_block > tiles.lo; --n_block) {
      load_k(n_block - 1);
      load_v(n_block);
    }
    load_v(tiles.lo);
  }

  // Called once by the producer after its last tile: matches the consumers' query-empty (and O-staged) arrivals of
  // that tile so that every arrival on the named barriers has its wait.
  CUTLASS_DEVICE static void load_tail() {
    cutlass::arch::NamedBarrier::arrive_and_wait(kProducerBarrierThreads<Traits>,
                                                 static_cast<uint32_t>(FwdNamedBarrier::kQueryEmpty));
    if constexpr (Traits::kOInV) {
      cutlass::arch::NamedBarrier::arrive_and_wait(kProducerBarrierThreads<Traits>,
                                                   static_cast<uint32_t>(FwdNamedBarrier::kOStagedInV));
    }
  }

  // Scores of key tile n_block that are outside the mask become -inf. Only the last key tile can be ragged; the
  // band limits move with the row.
  template <class Lens, class TensorS, class TensorC>
  CUTLASS_DEVICE static void apply_mask(Params const& p, Lens const& lens, TensorS& s, TensorC const& coord,
                                        int m_block, int n_block) {
    using namespace cute;
    int const col_limit_k = lens.seqlen_k - n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      int col_limit = col_limit_k;  // exclusive
      int col_start = 0;
      int const row = m_block * kBlockM + get<0>(coord(r, 0));
      if (band_right(p) >= 0) {
        col_limit = min(col_limit, row + 1 + lens.seqlen_k - lens.seqlen_q - n_block * kBlockN + band_right(p));
      }
      if (band_left(p) >= 0) col_start = row + lens.seqlen_k - lens.seqlen_q - n_block * kBlockN - band_left(p);
      // Columns as offsets from the thread's first one (constants of the layout): the limits move by that column
      // once per row, and the empty asm keeps the compiler from folding it back into every column's index, so each
      // compare takes an immediate instead of an add and a compare.
      int const first_col = get<1>(coord(r, 0));
      int limit_rel = col_limit - first_col, start_rel = col_start - first_col;
      asm("" : "+r"(limit_rel), "+r"(start_rel));
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        int const col = get<1>(coord(r, c)) - first_col;
        if (col >= limit_rel || (kWindow && col < start_rel)) { s(r, c) = -INFINITY; }
      }
    }
  }

  template <class Lens>
  CUTLASS_DEVICE static bool needs_mask(Params const& p, Lens const& lens, int m_block, int n_block) {
    int const diag = lens.seqlen_k - lens.seqlen_q;
    bool const ragged = (n_block + 1) * kBlockN > lens.seqlen_k;
    // Some key right of the first row's band, or left of the last row's band.
    bool const right = band_right(p) >= 0 && (n_block + 1) * kBlockN - 1 > m_block * kBlockM + diag + band_right(p);
    bool const left = band_left(p) >= 0 && n_block * kBlockN < (m_block + 1) * kBlockM - 1 + diag - band_left(p);
    return ragged || right || left;
  }

  // Soft-capping (ScoreMod::kSoftcap): the raw scores become tanh(S * softmax_scale / softcap), before the mask sets
  // masked ones to -inf; the softmax's scale_log2 carries the factor softcap.
  template <class TensorS>
  CUTLASS_DEVICE static void apply_score_mod(Params const& p, TensorS& s) {
    if constexpr (Traits::kSoftcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(s); ++i) { s(i) = tanh_approx(s(i) * p.softcap_pre_tanh); }
    }
  }

  // Consumer: computes the unnormalised O tile (accumulator tOrO, cleared here) and the softmax statistics for one
  // query tile with a non-empty range of key tiles. Overlap inside each warpgroup: the QK^T GEMM of tile n and the PV
  // GEMM of tile n+1 are in flight together while the previous softmax result is converted.
  template <class Lens, class FragO, class Softmax>
  CUTLASS_DEVICE static void mma(Params const& p, Lens const& lens, SharedStorage& smem, PipelineKV& pipeline_k,
                                 PipelineKV& pipeline_v, PipelineState& read_k, PipelineState& read_v,
                                 uint32_t q_phase, int thread_idx, int m_block, KeyTiles tiles, FragO& tOrO,
                                 Softmax& softmax) {
    using namespace cute;
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);

    Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename Traits::TileShapeQK{}));
    Tensor tOrP = make_tensor<Element>(acc_to_operand_a(tSrS.layout()));
    Tensor s_rc = make_tensor(tSrS.data(), acc_to_rowcol(tSrS.layout()));
    Tensor o_rc = make_tensor(tOrO.data(), acc_to_rowcol(tOrO.layout()));
    Tensor cS = make_identity_tensor(select<0, 1>(typename Traits::TileShapeQK{}));
    Tensor tScS = thr_qk.partition_C(cS);
    Tensor coord_rc = make_tensor(tScS.data(), acc_to_rowcol(tScS.layout()));

    clear(tOrO);
    softmax.reset();

    auto convert_p = [&]() {
      Tensor p_flat = make_tensor(tOrP.data(), tSrS.layout());
      convert_fragment<Element>(tSrS, p_flat);
    };

    cutlass::arch::ClusterTransactionBarrier::wait(&smem.barrier_q, q_phase);

    using Turns = WarpGroupTurns<Traits>;
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    int n_block = tiles.hi - 1;
    pipeline_k.consumer_wait(read_k);
    Turns::begin(wg);
    warpgroup_gemm<-1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
    Turns::end(wg);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(read_k);
    ++read_k;
    apply_score_mod(p, tSrS);
    if (needs_mask(p, lens, m_block, n_block)) { apply_mask(p, lens, s_rc, coord_rc, m_block, n_block); }
    softmax.template step<true>(s_rc, p.scale_log2, p.stale_gap);
    convert_p();

    // The O rescale a softmax step asks for (Traits::kORescale, fwd_config.h): kBeforePv applies it in the next step
    // between issuing QK^T and the PV GEMM, kAfterPv at the end of the step once its PV GEMM has completed.
    constexpr bool kRescaleAfterPv = Traits::kORescale == ORescale::kAfterPv;
    cute::array<float, Softmax::kNumRows> correction;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < Softmax::kNumRows; ++r) { correction[r] = 1.f; }
    bool rescale_o = true;  // constant where the softmax does not track moves (a branch there spills at hdim 64)
    for (--n_block; n_block >= tiles.lo; --n_block) {
      pipeline_k.consumer_wait(read_k);
      Turns::begin(wg);
      warpgroup_gemm<-1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS, /*zero_init=*/true);
      if constexpr (!kRescaleAfterPv) {
        warpgroup_fence_operand(tOrO);
        if (rescale_o) { Softmax::rescale(o_rc, correction); }
      }
      pipeline_v.consumer_wait(read_v);
      warpgroup_gemm<-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, /*zero_init=*/false);
      Turns::end(wg);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(read_k);
      ++read_k;
      apply_score_mod(p, tSrS);
      bool const masked = needs_mask(p, lens, m_block, n_block);
      if (masked) { apply_mask(p, lens, s_rc, coord_rc, m_block, n_block); }
      if (!Traits::kUnmaskedSoftmax || masked) {
        correction = softmax.template step<true>(s_rc, p.scale_log2, p.stale_gap);
      } else {
        correction = softmax.template step<false>(s_rc, p.scale_log2, p.stale_gap);
      }
      if constexpr (Traits::kSoftmaxFence) { schedule_fence(softmax.row_sum[0]); }  // keeps the wait below it
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      pipeline_v.consumer_release(read_v);
      ++read_v;
      rescale_o = softmax.max_moved;
      if constexpr (kRescaleAfterPv) {
        if (rescale_o) { Softmax::rescale(o_rc, correction); }
      }
      convert_p();
    }
    if constexpr (!kRescaleAfterPv) {
      warpgroup_fence_operand(tOrO);
      if (rescale_o) { Softmax::rescale(o_rc, correction); }
    }

    // Every QK^T GEMM of this tile has completed: the producer may overwrite Q with the next tile's.
    cutlass::arch::NamedBarrier::arrive(kProducerBarrierThreads<Traits>,
                                        static_cast<uint32_t>(FwdNamedBarrier::kQueryEmpty));

    pipeline_v.consumer_wait(read_v);
    Turns::begin(wg);
    warpgroup_gemm<-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO, /*zero_init=*/false);
    Turns::end(wg);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    warpgroup_fence_operand(tOrP);
    pipeline_v.consumer_release(read_v);
    ++read_v;
  }
};

}  // namespace dash::fwd
