// Forward epilogue: normalised O straight from the accumulator registers to global memory, and the per-row LSE.
// Each thread holds pairs of adjacent columns, so O goes out as 4-byte stores (a quad of threads covers 16
// contiguous bytes of a row); rows past seqlen_q (ragged last query tile) are skipped.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "fwd/fwd_config.h"
#include "fwd/fwd_mainloop.h"

namespace dash::fwd {

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;

  struct Params {
    Element* o;
    TensorStrides o_stride;
    float* lse;  // (batch, nheads, seqlen_q)
    int32_t seqlen_q;
    int32_t nheads;
    float softmax_scale;
  };

  static Params make_params(FwdParams const& p) {
    return {static_cast<Element*>(p.o), p.o_stride, p.lse, p.shape.seqlen_q, p.shape.nheads,
            p.shape.softmax_scale};
  }

  // tOrO: unnormalised accumulator of this thread; softmax: its row statistics. Both are consumed.
  template <class FragO, class Softmax>
  CUTLASS_DEVICE static void store(Params const& p, FragO& tOrO, Softmax& softmax, int thread_idx, int m_block,
                                   int head, int batch) {
    using namespace cute;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor o_rc = make_tensor(tOrO.data(), acc_to_rowcol(tOrO.layout()));
    Tensor cO = make_identity_tensor(select<0, 1>(typename Traits::TileShapePV{}));
    Tensor tOcO = thr_pv.partition_C(cO);
    Tensor coord_rc = make_tensor(tOcO.data(), acc_to_rowcol(tOcO.layout()));
    static_assert(decltype(size<1>(o_rc))::value % 2 == 0);

    auto const lse = softmax.finalize(o_rc, p.softmax_scale);

    int64_t const head_offset = int64_t(batch) * p.o_stride.batch + int64_t(head) * p.o_stride.head;
    Element* o_head = p.o + head_offset;
    float* lse_head = p.lse + (int64_t(batch) * p.nheads + head) * p.seqlen_q;
    cutlass::NumericArrayConverter<Element, float, 2> convert;

    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(o_rc); ++r) {
      int const row = m_block * kBlockM + get<0>(coord_rc(r, 0));
      if (row >= p.seqlen_q) { continue; }
      Element* o_row = o_head + int64_t(row) * p.o_stride.row;
      // The innermost accumulator mode is two adjacent columns: pair (c, c + 1) is one aligned 4-byte store.
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        cutlass::Array<float, 2> pair;
        pair[0] = o_rc(r, c);
        pair[1] = o_rc(r, c + 1);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(o_row + get<1>(coord_rc(r, c))) = convert(pair);
      }
      if (thread_idx % 4 == 0) { lse_head[row] = lse[r]; }
    }
  }
};

}  // namespace dash::fwd
