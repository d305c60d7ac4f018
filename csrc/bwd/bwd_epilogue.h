// Epilogue of one KV tile: dK * softmax_scale and dV, stored in the input dtype straight from the consumers'
// registers. GQA needs no cross-CTA reduction: the CTA walked every query head of the KV head's group, so the
// registers already hold the group's sum, accumulated in the schedule's fixed visit order.
#pragma once
#include "bwd/bwd_mainloop.h"

namespace dash::bwd {

template <class T>
struct DkDvStore {
  BwdKernelParams<T> const& p;

  // kZeros stores zeros without reading `acc`: a read of accumulator registers that a WGMMA may (as far as ptxas can
  // tell) still be writing would make ptxas serialise the kernel's WGMMAs.
  template <bool kZeros, class Frag, class ThrMma>
  CUTLASS_DEVICE void store_one(Frag const& acc, ThrMma const& thr, void* base, int64_t row_stride,
                                int64_t head_stride, int64_t batch_stride, const KvTileRef& tile, float scale) const {
    using Element = typename T::Element;
    const int seqlen_k = get<0>(p.shape_k);
    Element* ptr = static_cast<Element*>(base) + tile.batch * batch_stride + tile.head_k * head_stride +
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
        cutlass::Array<float, 2> f = {0.f, 0.f};
        if constexpr (!kZeros) f = {acc(i) * scale, acc(i + 1) * scale};
        auto h = cutlass::NumericArrayConverter<Element, float, 2>{}(f);
        *reinterpret_cast<uint32_t*>(&tg(i)) = reinterpret_cast<uint32_t const&>(h);
      }
    }
  }

  template <class FragK, class FragV, class ThrMma>
  CUTLASS_DEVICE void operator()(const KvTileRef& tile, FragK const& dk, FragV const& dv, ThrMma const& thr) const {
    store_one<false>(dk, thr, p.dk, p.dk_row, p.dk_head, p.dk_batch, tile, p.scale);
    store_one<false>(dv, thr, p.dv, p.dv_row, p.dv_head, p.dv_batch, tile, 1.0f);
  }

  // A KV tile that no query row sees: dK = dV = 0.
  template <class ThrMma>
  CUTLASS_DEVICE void store_zeros(const KvTileRef& tile, ThrMma const& thr) const {
    // Only the layout of this fragment is used.
    auto shape_only = partition_fragment_C(thr, Shape<typename T::BN, typename T::HD>{});
    store_one<true>(shape_only, thr, p.dk, p.dk_row, p.dk_head, p.dk_batch, tile, p.scale);
    store_one<true>(shape_only, thr, p.dv, p.dv_row, p.dv_head, p.dv_batch, tile, 1.0f);
  }
};

}  // namespace dash::bwd
