// Backward postprocess, one CTA per (m_block, head, batch): dQ = softmax_scale * accumulator, cast to the input dtype
// and written with dq's strides. The accumulator tile is in the consumers' register order (bwd_dq_writer.h); each
// thread here plays consumer thread `tid` and recovers (row, col) of its elements from the same dQ WGMMA tiling.
#pragma once
#include "bwd/bwd_mainloop.h"

namespace dash::bwd {

struct PostprocessParams {
  const float* dq_accum;
  void* dq;
  int64_t dq_row, dq_head, dq_batch;
  int32_t seqlen_q, nheads, num_m_blocks;
  float scale;
};

template <class T>
__global__ void __launch_bounds__(T::kNumMmaThreads) bwd_postprocess_kernel(const PostprocessParams p) {
  using Element = typename T::Element;
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int64_t tile_index = (int64_t(batch) * p.nheads + head) * p.num_m_blocks + m_block;
  const float4* acc = reinterpret_cast<const float4*>(p.dq_accum + tile_index * T::kDqElems);

  typename T::TiledMmadQ mma_dq;
  auto thr = mma_dq.get_thread_slice(tid);
  Tensor tc = thr.partition_C(make_identity_tensor(Shape<typename T::BM, typename T::HD>{}));
  static_assert(decltype(size(tc))::value == T::kDqPerThread, "one accumulator slot per consumer element");

  Element* out = static_cast<Element*>(p.dq) + batch * p.dq_batch + head * p.dq_head;
  const int rows_left = p.seqlen_q - m_block * T::kBlockM;
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < T::kDqPerThread / 4; ++c) {
    const float4 v = acc[c * T::kNumMmaThreads + tid];
    const float vals[4] = {v.x, v.y, v.z, v.w};
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; e += 2) {
      // Elements 4c+e and 4c+e+1 are adjacent columns of one row.
      const int row = get<0>(tc(4 * c + e));
      const int col = get<1>(tc(4 * c + e));
      if (row < rows_left) {
        cutlass::Array<float, 2> f = {vals[e] * p.scale, vals[e + 1] * p.scale};
        auto h = cutlass::NumericArrayConverter<Element, float, 2>{}(f);
        *reinterpret_cast<uint32_t*>(out + int64_t(m_block * T::kBlockM + row) * p.dq_row + col) =
            reinterpret_cast<uint32_t const&>(h);
      }
    }
  }
}

}  // namespace dash::bwd
