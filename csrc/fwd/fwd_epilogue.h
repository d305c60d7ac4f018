// Forward epilogue: normalises the O accumulator, writes O and the per-row LSE. Three paths (OStorePath in
// fwd_config.h):
//   kTmaFromShared: each consumer warpgroup converts its 64 rows, writes them to its own swizzled staging block with
//     stmatrix and one of its threads issues a TMA store. The warpgroup does not wait for the store; it waits only
//     before it next overwrites the block, a whole mainloop later. Rows past seqlen_q are clipped by the TMA unit.
//   kTmaThroughV: the same blocks laid over the V ring. The consumers write them once all of them are done with the
//     tile's V, and every consumer thread then arrives on kOStagedInV (the issuers once the TMA unit has read their
//     block), on which the producer waits before the next tile's first V load. A tile whose K/V were never loaded
//     (no key in its rows' reach) has no such wait on the producer's side, so it goes out from registers.
//   kRegisters: 4-byte global stores straight from the accumulator (a quad of threads covers 16 contiguous bytes of a
//     row); rows past seqlen_q are skipped. Packed sequences take it for a tile that reaches past the end of its
//     sequence.
// LSE always goes out from registers (one float per row).
#pragma once

#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "fwd/fwd_config.h"
#include "common/packed_seqs.h"
#include "fwd/fwd_mainloop.h"

namespace dash::fwd {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kRowsPerWarpGroup = Traits::kRowsPerWarpGroup;
  static constexpr bool kTma = Traits::kOStore != OStorePath::kRegisters;
  static constexpr bool kOInV = Traits::kOInV;
  using SharedStorage = typename Traits::SharedStorage;

  // O as (seqlen_q, headdim, heads, batch), headdim contiguous; one TMA box is one warpgroup's rows.
  using ShapeO = cute::Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideO = cute::Stride<int64_t, cute::_1, int64_t, int64_t>;
  using TileOWarpGroup = cute::Shape<cute::Int<kRowsPerWarpGroup>, cute::Int<kHeadDim>>;
  static auto make_tma_o(Element* ptr, ShapeO const& shape, StrideO const& stride) {
    auto tensor = cute::make_tensor(cute::make_gmem_ptr(ptr), shape, stride);
    return cute::make_tma_copy(cute::SM90_TMA_STORE{}, tensor, typename Traits::SmemLayoutOWarpGroup{},
                               TileOWarpGroup{}, cute::_1{});
  }
  using TmaO = decltype(make_tma_o(nullptr, ShapeO{}, StrideO{}));

  struct Params {
    Element* o;
    TensorStrides o_stride;
    float* lse;  // (batch, nheads, seqlen_q)
    int32_t seqlen_q;
    int32_t nheads;
    float softmax_scale;  // of the row max in LSE: softcap with soft-capping (common/score_mod.h)
    const float* sink;    // (nheads,) learnable sink logits, or null
    TmaO tma_o;
    ShapeO shape_o;
  };

  static Params make_params(FwdParams const& p) {
    AttnShape const& s = p.shape;
    auto* o = static_cast<Element*>(p.o);
    // As for Q: an empty sequence writes nothing, but the tensor map needs a non-empty extent. Packed sequences are
    // one batch entry of all rows (any stride TMA accepts will do for that mode).
    int32_t const rows = Traits::kPacked ? p.packed.total_q : s.seqlen_q;
    ShapeO shape_o{std::max(rows, 1), value_head_dim(s), s.nheads, Traits::kPacked ? 1 : s.batch};
    StrideO stride_o{p.o_stride.row, cute::_1{}, p.o_stride.head,
                     Traits::kPacked ? p.o_stride.row : p.o_stride.batch};
    // Register stores need no tensor map.
    return {o, p.o_stride, p.lse, s.seqlen_q, s.nheads, score_scales(s).softmax, p.sink,
            kTma ? make_tma_o(o, shape_o, stride_o) : TmaO{}, shape_o};
  }

  CUTLASS_DEVICE static void prefetch_descriptors(Params const& p) {
    if constexpr (kTma) { cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor()); }
  }

  CUTLASS_DEVICE static bool is_store_issuer(int thread_idx) {
    return thread_idx % cutlass::NumThreadsPerWarpGroup == 0;
  }

  // The head's learnable sink logit, -inf without sinks (OnlineSoftmax::finalize).
  CUTLASS_DEVICE static float sink_logit(Params const& p, int head) {
    return p.sink == nullptr ? -INFINITY : p.sink[head];
  }

  // tOrO: unnormalised accumulator of this thread; softmax: its row statistics. Both are consumed. sink: sink_logit
  // of the tile's head. rows and total_q: the tile's sequence and the number of packed query rows (SeqLayout::kPacked;
  // unused for batched sequences). loaded: whether the producer loaded K/V for the tile (it has keys in reach).
  template <class FragO, class Softmax>
  CUTLASS_DEVICE static void store(Params const& p, SharedStorage& smem, FragO& tOrO, Softmax& softmax, float sink,
                                   int thread_idx, int m_block, int head, int batch, SeqRows const& rows,
                                   int32_t total_q, bool loaded) {
    using namespace cute;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor o_rc = make_tensor(tOrO.data(), acc_to_rowcol(tOrO.layout()));
    Tensor cO = make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}));
    Tensor tOcO = thr_pv.partition_C(cO);
    Tensor coord_rc = make_tensor(tOcO.data(), acc_to_rowcol(tOcO.layout()));

    auto const lse = softmax.finalize(o_rc, p.softmax_scale, sink);
    // The sequence's rows; O and LSE from its row 0. LSE is (batch, nheads, seqlen_q) for batched sequences and
    // (nheads, total_q) for packed ones.
    // Read where it is used: read once ahead of the O store, it would change the batched kernels' code.
    auto seqlen_q = [&] { return Traits::kPacked ? rows.len_q : p.seqlen_q; };
    auto from_registers = [&] {
      Element* const o_seq = Traits::kPacked
                                 ? p.o + int64_t(head) * p.o_stride.head + int64_t(rows.first_q) * p.o_stride.row
                                 : p.o + int64_t(batch) * p.o_stride.batch + int64_t(head) * p.o_stride.head;
      store_o_registers(p, o_seq, seqlen_q(), o_rc, coord_rc, m_block);
    };
    if constexpr (kTma) {
      // A packed sequence's tile that reaches past its end goes out from registers: a TMA box would also write the
      // next sequence's first rows, another CTA's. Batched tiles clip at the tensor's end.
      if ((!Traits::kPacked || (m_block + 1) * kBlockM <= seqlen_q()) && (!kOInV || loaded)) {
        store_o_tma(p, smem, tOrO, thread_idx, m_block, head, batch, rows.first_q);
      } else {
        from_registers();
        // Registers only: each thread's own P V GEMMs are done, so the V ring may be refilled once all have arrived.
        if (kOInV && loaded) { arrive_o_staged(); }
      }
    } else {
      from_registers();
    }

    float* const lse_seq = Traits::kPacked ? p.lse + int64_t(head) * total_q + rows.first_q
                                           : p.lse + (int64_t(batch) * p.nheads + head) * p.seqlen_q;
    if (thread_idx % 4 == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(o_rc); ++r) {
        int const row = m_block * kBlockM + get<0>(coord_rc(r, 0));
        if (row < seqlen_q()) { lse_seq[row] = lse[r]; }
      }
    }
  }

  // Called once by every consumer thread after its last tile: shared memory must stay valid until the TMA unit has
  // read the last staged block (with kTmaThroughV the issuers have already waited).
  CUTLASS_DEVICE static void store_tail(int thread_idx) {
    if constexpr (kTma) {
      if (is_store_issuer(thread_idx)) { cute::tma_store_wait<0>(); }
    }
  }

 private:
  // kTmaThroughV: this thread is done with the tile's V ring (FwdNamedBarrier::kOStagedInV).
  CUTLASS_DEVICE static void arrive_o_staged() {
    cutlass::arch::NamedBarrier::arrive(kProducerBarrierThreads<Traits>,
                                        static_cast<uint32_t>(FwdNamedBarrier::kOStagedInV));
  }

  // The barrier before and after the staging writes: the warpgroup's own, or with kTmaThroughV that of all consumers
  // (none may write into the V ring while another still reads it).
  CUTLASS_DEVICE static void sync_staging(int wg) {
    if constexpr (kOInV) {
      cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads,
                                        static_cast<uint32_t>(FwdNamedBarrier::kVRingFree));
    } else {
      cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup,
                                        static_cast<uint32_t>(FwdNamedBarrier::kOStagingFirst) + wg);
    }
  }

  // Where the warpgroups' O blocks are staged: the V ring or O's own buffer.
  CUTLASS_DEVICE static Element* staging_blocks(SharedStorage& smem) {
    if constexpr (kOInV) {
      return smem.v.data();
    } else {
      return smem.o.data();
    }
  }

  // first_q: the sequence's first row (packed sequences; the tensor is then one batch entry of all rows).
  template <class FragO>
  CUTLASS_DEVICE static void store_o_tma(Params const& p, SharedStorage& smem, FragO const& tOrO, int thread_idx,
                                         int m_block, int head, int batch, int32_t first_q) {
    using namespace cute;
    int const wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
    Element* const staging = staging_blocks(smem);

    Tensor rO = make_tensor<Element>(tOrO.layout());
    convert_fragment<Element>(tOrO, rO);

    // The previous tile's store from this warpgroup's block must have been read out before it is overwritten (with
    // kTmaThroughV its issuer waited then, and every consumer must be done with the V ring).
    if (!kOInV && is_store_issuer(thread_idx)) { tma_store_wait<0>(); }
    sync_staging(wg);

    typename Traits::TiledMmaPV mma_pv;
    auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
    auto thr_copy = smem_copy.get_thread_slice(thread_idx);
    Tensor sO = make_tensor(make_smem_ptr(staging), typename Traits::SmemLayoutO{});
    Tensor tRrO = thr_copy.retile_S(rO);
    Tensor tRsO = thr_copy.partition_D(sO);
    copy(smem_copy, tRrO, tRsO);

    // Generic-proxy writes must be visible to the TMA unit (async proxy) before the store is issued.
    tma_store_fence();
    sync_staging(wg);

    if (is_store_issuer(thread_idx)) {
      Tensor mO = p.tma_o.get_tma_tensor(p.shape_o);
      Tensor gO = local_tile(sequence_of<Traits::kLayout>(mO, head, batch, first_q), TileOWarpGroup{},
                             make_coord(m_block * Traits::kNumConsumerWarpGroups + wg, _0{}));
      Tensor sOwg = make_tensor(make_smem_ptr(staging + wg * kRowsPerWarpGroup * kHeadDim),
                                typename Traits::SmemLayoutOWarpGroup{});
      auto parts = tma_partition(p.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sOwg), group_modes<0, 2>(gO));
      copy(p.tma_o, get<1>(parts), get<0>(parts));
      tma_store_arrive();
      // The producer refills the V ring once this block is read out.
      if constexpr (kOInV) { tma_store_wait<0>(); }
    }
    if constexpr (kOInV) { arrive_o_staged(); }
  }

  // o_head: row 0 of the head's sequence; rows from seqlen_q on are not stored.
  template <class TensorO, class TensorC>
  CUTLASS_DEVICE static void store_o_registers(Params const& p, Element* o_head, int seqlen_q, TensorO const& o_rc,
                                               TensorC const& coord_rc, int m_block) {
    using namespace cute;
    static_assert(decltype(size<1>(o_rc))::value % 2 == 0);
    cutlass::NumericArrayConverter<Element, float, 2> convert;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(o_rc); ++r) {
      int const row = m_block * kBlockM + get<0>(coord_rc(r, 0));
      if (row >= seqlen_q) { continue; }
      Element* o_row = o_head + int64_t(row) * p.o_stride.row;
      // The innermost accumulator mode is two adjacent columns: pair (c, c + 1) is one aligned 4-byte store.
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        cutlass::Array<float, 2> pair;
        pair[0] = o_rc(r, c);
        pair[1] = o_rc(r, c + 1);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(o_row + get<1>(coord_rc(r, c))) = convert(pair);
      }
    }
  }
};

}  // namespace dash::fwd
