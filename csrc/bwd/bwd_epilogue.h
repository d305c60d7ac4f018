// Epilogue of one KV tile: dK * softmax_scale and dV in the input dtype, staged in shared memory and written by TMA
// (DkDvEpilogue::kTmaStagedInTurn / kTmaStagedAtOnce) or stored straight from the consumers' registers
// (kRegisterStores). GQA needs no cross-CTA reduction: the CTA walked every query head of the KV head's group, so the
// registers already hold the group's sum, accumulated in the schedule's fixed visit order.
#pragma once
#include "bwd/bwd_fragments.h"
#include "bwd/bwd_storage.h"

namespace dash::bwd {

// bar.red.or over consumer named barrier `id` (ConsumerBarrier numbering, as NamedBarrier::sync takes it): whether
// any of the num_threads threads passed true, for each of them.
CUTLASS_DEVICE bool named_barrier_any(uint32_t num_threads, uint32_t id, bool pred) {
  const uint32_t hw_id = id + static_cast<uint32_t>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p_in, p_out;\n setp.ne.u32 p_in, %1, 0;\n bar.red.or.pred p_out, %2, %3, p_in;\n"
      " selp.u32 %0, 1, 0, p_out;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(hw_id), "r"(num_threads)
      : "memory");
  return any != 0;
}

template <class T>
struct DkDvStore {
  BwdKernelParams<T> const& p;
  // Its dS^T buffers, free at the end of a KV tile once both warpgroups' last dQ GEMMs have completed, are the
  // staging area of the tile's dK and dV (in turn or side by side; BwdTraits::SmemLayoutStage).
  BwdSharedStorage<T>& ss;

  using Element = typename T::Element;
  static constexpr int kStageElems = cute::cosize_v<typename T::SmemLayoutStage3>;

  // stmatrix (8x8 tiles, the accumulators' own layout) of one of dK, dV, scaled and converted, into the warpgroup
  // tiles at `base`.
  template <class Frag, class ThrMma>
  CUTLASS_DEVICE void stage(Frag const& acc, ThrMma const& thr, Element* base, float scale, int tid) const {
    Tensor sStage = make_tensor(make_smem_ptr(base), typename T::SmemLayoutStage{});
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, thr);
    auto r2s_thr = r2s.get_thread_slice(tid);
    Tensor converted = make_tensor<Element>(acc.layout());
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      const auto h = scaled_pair<Element>(acc, i, scale);
      converted(i) = h[0];
      converted(i + 1) = h[1];
    }
    cute::copy(r2s, r2s_thr.retile_S(converted), r2s_thr.partition_D(sStage));
  }

  // One thread of warpgroup `wg` stores its tile at `base` by TMA (rows past seqlen_k are clipped by TMA; the tensor
  // is 4-D, so no row of another head is touched).
  // first_k: the sequence's first row (packed sequences; the tensor is then one batch entry of all rows).
  CUTLASS_DEVICE void issue(typename T::TmaStoreKV const& tma, Element* base, const KvTileRef& tile, int wg,
                            int32_t first_k) const {
    Tensor sWG = staged_tile(base, wg);
    Tensor mOut = tma.get_tma_tensor(p.shape_k);
    Tensor gOut = local_tile(sequence_of<T::kLayout>(mOut, tile.head_k, tile.batch, first_k),
                             Shape<typename T::StageRows, typename T::HD>{},
                             make_coord(T::Cfg::dKVSplit::kAlongM * tile.n_block + wg, _0{}));
    auto [tSg, tSs] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sWG), group_modes<0, 2>(gOut));
    cute::copy(tma, tSs, tSg);
  }

  // One staged tile of dK or dV: where it lies in shared memory and the tensor it goes to.
  struct Staged {
    typename T::TmaStoreKV const& tma;
    Element* base;
    void* out;
    int64_t row_stride, head_stride;
  };

  // Packed sequences: the first row of `tile`'s sequence in the tensors and the tile's rows inside the sequence
  // (looked up where the accumulators are no longer needed: see hand_off).
  CUTLASS_DEVICE void tile_rows(KvTileRef tile, int32_t& first_k, int& rows) const {
    asm volatile("" : "+r"(tile.batch));  // keeps the loads behind what the caller did before
    int32_t len_k;
    clamped_rows(p.packed.cu_seqlens_k, p.packed.seqused_k, tile.batch, p.packed.total_k, first_k, len_k);
    rows = len_k - tile.n_block * T::kBlockN;
  }

  // Warpgroup wg's staged tile at `base` (the TMA store's source).
  CUTLASS_DEVICE static auto staged_tile(Element* base, int wg) {
    return make_tensor(make_smem_ptr(base + wg * cute::cosize_v<typename T::SmemLayoutStageWG>),
                       typename T::SmemLayoutStageWG{});
  }

  // Rows [0, rows) of warpgroup wg's tile of `s`, copied to the tensor by the warpgroup, 16 bytes per thread at a time
  // (t: the thread's index in the warpgroup; first_k: the sequence's first row).
  CUTLASS_DEVICE static void copy_rows(Staged const& s, const KvTileRef& tile, int wg, int t, int32_t first_k,
                                       int rows) {
    constexpr int kVec = 16 / sizeof(Element);
    constexpr int kRowVecs = T::kHeadDim / kVec;
    static_assert(128 % kRowVecs == 0, "a pass of the warpgroup stores whole rows");
    Tensor sWG = staged_tile(s.base, wg);
    Element* out = static_cast<Element*>(s.out) +
                   (int64_t(first_k) + tile.n_block * T::kBlockN + wg * T::kStageRows) * s.row_stride +
                   tile.head_k * s.head_stride;
    const int col = (t % kRowVecs) * kVec;
#pragma unroll 1
    for (int r = t / kRowVecs; r < rows; r += 128 / kRowVecs) {
      *reinterpret_cast<uint4*>(out + r * s.row_stride + col) = *reinterpret_cast<uint4 const*>(&sWG(r, col));
    }
  }

  // The warpgroup's stmatrix stores of its tiles of `staged` become visible to their readers, which store them: its
  // TMA thread, which waits until the tiles have been read (they may then be written again), or, for a packed tile
  // that reaches past its sequence's end, the whole warpgroup, row by row up to that end (a TMA box would also write
  // the next sequence's first rows, another CTA's; TMA clips a batched tile at seqlen_k itself).
  template <class... Tiles>
  CUTLASS_DEVICE void hand_off(int tid, uint32_t wg_barrier, KvTileRef tile, Tiles const&... staged) const {
    const int wg = tid / 128;
    int32_t first_k = 0, rows = T::kBlockN;  // the tile's first row in the tensor, its rows inside the sequence
    // The sequence is looked up here, behind the staging stores: looked up with the accumulators live, or with the
    // tile stored from registers, it made the consumers spill in the step loop.
    if constexpr (T::kPacked) tile_rows(tile, first_k, rows);
    if (rows >= T::kBlockN) {
      cutlass::arch::fence_view_async_shared();  // generic-proxy stores read next by TMA (async proxy)
      cutlass::arch::NamedBarrier::sync(128, wg_barrier);
      if (tid % 128 == 0) {
        (issue(staged.tma, staged.base, tile, wg, first_k), ...);
        tma_store_arrive();
        tma_store_wait<0>();
      }
    } else {
      cutlass::arch::NamedBarrier::sync(128, wg_barrier);
      const int wg_rows = min(rows - wg * T::kStageRows, T::kStageRows);
      (copy_rows(staged, tile, wg, tid % 128, first_k, wg_rows), ...);
    }
    cutlass::arch::NamedBarrier::sync(128, wg_barrier);
  }

  // kZeros stores zeros without reading `acc`: a read of accumulator registers that a WGMMA may (as far as ptxas can
  // tell) still be writing would make ptxas serialise the kernel's WGMMAs.
  // entry: the tile's batch entry (packed sequences: the sequence's first row; see BwdKernelParams::dk_batch);
  // seqlen_k: its sequence's keys.
  template <bool kZeros, class Frag, class ThrMma>
  CUTLASS_DEVICE void store_one(Frag const& acc, ThrMma const& thr, void* base, int64_t row_stride,
                                int64_t head_stride, int64_t batch_stride, const KvTileRef& tile, int32_t entry,
                                int seqlen_k, float scale) const {
    Element* ptr = static_cast<Element*>(base) + entry * batch_stride + tile.head_k * head_stride +
                   int64_t(tile.n_block) * T::kBlockN * row_stride;
    Tensor g = make_tensor(make_gmem_ptr(ptr), make_shape(typename T::BN{}, typename T::HD{}),
                           make_stride(row_stride, _1{}));
    Tensor tg = thr.partition_C(g);
    Tensor tc = thr.partition_C(make_identity_tensor(Shape<typename T::BN, typename T::HD>{}));
    const int rows_left = seqlen_k - tile.n_block * T::kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += 2) {
      // Elements i, i+1 are adjacent columns of one row: one 32-bit store.
      if (get<0>(tc(i)) < rows_left) {
        auto h = cutlass::NumericArrayConverter<Element, float, 2>{}(cutlass::Array<float, 2>{0.f, 0.f});
        if constexpr (!kZeros) h = scaled_pair<Element>(acc, i, scale);
        *reinterpret_cast<uint32_t*>(&tg(i)) = reinterpret_cast<uint32_t const&>(h);
      }
    }
  }

  template <class FragK, class FragV, class ThrMma>
  CUTLASS_DEVICE void operator()(const KvTileRef& tile, FragK const& dk, FragV const& dv, ThrMma const& thr) const {
    if constexpr (T::kStagedEpilogue) {
      // The staging addresses depend on the thread only, so the compiler would compute them once before the tile
      // loop and keep them live through it (ptxas then spilled inside the loop); an opaque copy of the thread index
      // keeps their computation here.
      int tid = threadIdx.x - 128;  // as in consumer_loop
      asm volatile("" : "+r"(tid));
      const uint32_t wg_barrier = uint32_t(ConsumerBarrier::kWarpgroup0) + tid / 128;
      // Both warpgroups' last dQ GEMMs, which read every row of the current dS^T buffer, have completed.
      cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, uint32_t(ConsumerBarrier::kBoth));
      Element* base_k = ss.dst.data();
      if constexpr (T::kDkDvEpilogue == DkDvEpilogue::kTmaStagedAtOnce) {
        Element* base_v = base_k + kStageElems;
        stage(dk, thr, base_k, p.scale, tid);
        stage(dv, thr, base_v, 1.0f, tid);
        hand_off(tid, wg_barrier, tile, Staged{p.tma_dk, base_k, p.dk, p.dk_row, p.dk_head},
                 Staged{p.tma_dv, base_v, p.dv, p.dv_row, p.dv_head});
      } else {
        stage(dk, thr, base_k, p.scale, tid);
        hand_off(tid, wg_barrier, tile, Staged{p.tma_dk, base_k, p.dk, p.dk_row, p.dk_head});
        stage(dv, thr, base_k, 1.0f, tid);
        hand_off(tid, wg_barrier, tile, Staged{p.tma_dv, base_k, p.dv, p.dv_row, p.dv_head});
      }
      // The next tile's first dS^T store may write into the other warpgroup's staging tile.
      cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, uint32_t(ConsumerBarrier::kBoth));
    } else {
      const SeqRows seq = seq_rows<T::kLayout>(p.packed, tile.batch, 0, get<0>(p.shape_k));
      const int32_t entry = T::kPacked ? seq.first_k : tile.batch;
      store_one<false>(dk, thr, p.dk, p.dk_row, p.dk_head, p.dk_batch, tile, entry, seq.len_k, p.scale);
      store_one<false>(dv, thr, p.dv, p.dv_row, p.dv_head, p.dv_batch, tile, entry, seq.len_k, 1.0f);
    }
  }

  // Shift's split tail (schedule/tail_split.h): this CTA ran one piece of `tile`, and dk/dv hold the piece's partial
  // sums. Every piece stores them in fp32, in the tile's (row, column) layout, in its slot and counts itself in the
  // unit's counter; the piece that finishes last adds the slots in piece order and stores dK and dV, so the sum does
  // not depend on which piece finishes last. The adding runs in plain loops over the slots, after the accumulators are
  // dead: done in the accumulators' registers (unrolled), it made the step loop around it spill (hdim 64 full: 104 ->
  // 312 bytes). Calls that split have kHeadDim columns in dK and dV (bwd_problem), so every column is stored.
  template <class FragK, class FragV, class ThrMma>
  CUTLASS_DEVICE void store_piece(const KvTileRef& tile, FragK const& dk, FragV const& dv, ThrMma const& thr) const {
    int tid = threadIdx.x - 128;  // as in consumer_loop; opaque for the reason given in operator()
    asm volatile("" : "+r"(tid));
    constexpr int kCols = T::kHeadDim;
    constexpr int kTileElems = T::kBlockN * kCols;
    const sched::TailSplit& ts = p.sched.tail;
    const sched::Problem& pr = p.sched.problem;
    const int32_t i = static_cast<int32_t>(sched::Shift::Units::unit_of(pr, tile) - ts.first_unit);
    const int32_t first = ts.first_chunk(i), last = ts.last_chunk(i);
    auto slot_of = [&](int32_t c) { return p.split_partials + int64_t(ts.slot(i, c)) * (2 * kTileElems); };
    float* own = slot_of(blockIdx.x);
    Tensor tc = thr.partition_C(make_identity_tensor(Shape<typename T::BN, typename T::HD>{}));
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < size(dk); e += 2) {  // elements e, e + 1: adjacent columns of one row
      const int at = get<0>(tc(e)) * kCols + get<1>(tc(e));
      *reinterpret_cast<float2*>(own + at) = make_float2(dk(e), dk(e + 1));
      *reinterpret_cast<float2*>(own + kTileElems + at) = make_float2(dv(e), dv(e + 1));
    }
    __threadfence();  // every thread's partials, before the count that publishes them
    cutlass::arch::NamedBarrier::sync(T::kNumMmaThreads, uint32_t(ConsumerBarrier::kBoth));
    bool mine_last = false;
    if (tid == 0) mine_last = atomicAdd(p.split_counters + i, 1) == last - first;
    if (!named_barrier_any(T::kNumMmaThreads, uint32_t(ConsumerBarrier::kBoth), mine_last)) return;
    __threadfence();  // the other pieces' partials, after their counts
    const int rows = get<0>(p.shape_k) - tile.n_block * T::kBlockN;
    constexpr int kVecs = kTileElems / 4, kUnroll = 4, kStride = kUnroll * T::kNumMmaThreads;
    static_assert(kVecs % kStride == 0, "whole unrolled passes over the tile");
#pragma unroll 1
    for (int which = 0; which < 2; ++which) {  // dK, then dV
      Element* out = static_cast<Element*>(which == 0 ? p.dk : p.dv) +
                     (which == 0 ? tile.batch * p.dk_batch + tile.head_k * p.dk_head
                                 : tile.batch * p.dv_batch + tile.head_k * p.dv_head);
      const int64_t row_stride = which == 0 ? p.dk_row : p.dv_row;
      const float scale = which == 0 ? p.scale : 1.f;
#pragma unroll 1
      for (int v0 = tid; v0 < kVecs; v0 += kStride) {
        float4 sum[kUnroll];
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kUnroll; ++u) {
          sum[u] = __ldcg(reinterpret_cast<const float4*>(slot_of(first) + which * kTileElems) + v0 +
                          u * T::kNumMmaThreads);
        }
#pragma unroll 1
        for (int32_t c = first + 1; c <= last; ++c) {
          CUTLASS_PRAGMA_UNROLL
          for (int u = 0; u < kUnroll; ++u) {
            const float4 x = __ldcg(reinterpret_cast<const float4*>(slot_of(c) + which * kTileElems) + v0 +
                                    u * T::kNumMmaThreads);
            sum[u] = make_float4(sum[u].x + x.x, sum[u].y + x.y, sum[u].z + x.z, sum[u].w + x.w);
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + u * T::kNumMmaThreads;
          const int row = v / (kCols / 4), col = 4 * (v % (kCols / 4));
          if (row >= rows) continue;
          const auto lo = cutlass::NumericArrayConverter<Element, float, 2>{}(
              cutlass::Array<float, 2>{sum[u].x * scale, sum[u].y * scale});
          const auto hi = cutlass::NumericArrayConverter<Element, float, 2>{}(
              cutlass::Array<float, 2>{sum[u].z * scale, sum[u].w * scale});
          Element* dst = out + (int64_t(tile.n_block) * T::kBlockN + row) * row_stride + col;
          *reinterpret_cast<uint2*>(dst) =
              make_uint2(reinterpret_cast<const uint32_t&>(lo), reinterpret_cast<const uint32_t&>(hi));
        }
      }
    }
  }

  // A KV tile that no query row sees (its record `rec`): dK = dV = 0. Packed sequences: the producer passes the
  // sequence's first row and keys in the record (looked up here, in the step loop, they made the consumers spill).
  template <class ThrMma>
  CUTLASS_DEVICE void store_zeros(VisitRecordOf<T> const& rec, ThrMma const& thr) const {
    const KvTileRef tile{rec.batch, rec.head_k, rec.n_block};
    int32_t entry = rec.batch;
    int seqlen_k = get<0>(p.shape_k);
    if constexpr (T::kPacked) {
      entry = rec.seq_first_k;
      seqlen_k = rec.seq_len_k;
    }
    // Only the layout of this fragment is used.
    auto shape_only = partition_fragment_C(thr, Shape<typename T::BN, typename T::HD>{});
    store_one<true>(shape_only, thr, p.dk, p.dk_row, p.dk_head, p.dk_batch, tile, entry, seqlen_k, p.scale);
    store_one<true>(shape_only, thr, p.dv, p.dv_row, p.dv_head, p.dv_batch, tile, entry, seqlen_k, 1.0f);
  }
};

}  // namespace dash::bwd
