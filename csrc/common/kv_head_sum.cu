// Kernels of common/kv_head_sum.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#include "common/kv_head_sum.h"

namespace dash {
namespace {

constexpr int kSumThreads = 256;

template <class Element>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  __device__ static float2 widen(Type x) { return __bfloat1622float2(x); }
  __device__ static Type narrow(float2 x) { return __float22bfloat162_rn(x); }
};
template <>
struct Pair<__half> {
  using Type = __half2;
  __device__ static float2 widen(Type x) { return __half22float2(x); }
  __device__ static Type narrow(float2 x) { return __float22half2_rn(x); }
};

// a + b in IEEE single precision, subnormals kept: the package compiles with --use_fast_math, whose flush-to-zero
// adds would part from torch's (sum_groups) on subnormal gradients. An explicit instruction is not rewritten.
__device__ __forceinline__ float add_ieee(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// sum_groups' order on kCount shares: shares [count - half, count) added onto [0, half), half = count / 2, until one
// share is left.
template <int kCount, int kCopies>
__device__ __forceinline__ void fold(float2 (&acc)[kCopies]) {
  if constexpr (kCount > 1) {
    constexpr int kHalf = kCount / 2;
#pragma unroll
    for (int i = 0; i < kHalf; ++i) {
      acc[i].x = add_ieee(acc[i].x, acc[kCount - kHalf + i].x);
      acc[i].y = add_ieee(acc[i].y, acc[kCount - kHalf + i].y);
    }
    fold<kCount - kHalf>(acc);
  }
}

// Thread t of the grid-stride loop owns two adjacent columns of one (row, KV head): it loads the KV head's shares of
// them (all loads in flight before the first add), folds them and stores the pair.
template <class Element, int kCopies>
__global__ void __launch_bounds__(kSumThreads) sum_kv_heads_kernel(const KvHeadSums s) {
  using P = Pair<Element>;
  static_assert(kMaxKvHeadSums == 2, "one selection per sum");
  // Selected by value: indexing the parameter by blockIdx.y would copy the whole struct to the stack.
  const KvHeadSum sum = blockIdx.y == 0 ? s.sums[0] : s.sums[1];
  const int32_t pairs = sum.dim / 2;
  const int64_t per_row = int64_t(sum.heads_k) * pairs;
  const int64_t total = sum.rows * per_row;
  const auto* in = static_cast<const typename P::Type*>(sum.in);
  auto* out = static_cast<Element*>(sum.out);
  const int64_t stride = int64_t(gridDim.x) * kSumThreads;
  for (int64_t i = int64_t(blockIdx.x) * kSumThreads + threadIdx.x; i < total; i += stride) {
    const int64_t row = i / per_row;
    const int64_t rest = i - row * per_row;
    const int32_t head_k = static_cast<int32_t>(rest / pairs);
    const int32_t pair = static_cast<int32_t>(rest - int64_t(head_k) * pairs);
    const typename P::Type* share = in + (row * sum.heads_k + head_k) * kCopies * pairs + pair;
    typename P::Type x[kCopies];
#pragma unroll
    for (int j = 0; j < kCopies; ++j) x[j] = share[int64_t(j) * pairs];
    float2 acc[kCopies];
#pragma unroll
    for (int j = 0; j < kCopies; ++j) acc[j] = P::widen(x[j]);
    fold<kCopies>(acc);
    *reinterpret_cast<typename P::Type*>(out + row * sum.out_row_stride + head_k * sum.out_head_stride + 2 * pair) =
        P::narrow(acc[0]);
  }
}

// The copy counts with a kernel: every count up to 16 and the multiples of 8 up to 64 (the query heads per KV head of
// the models one meets); the rest take sum_groups in torch ops, with the same bits.
using CopyCounts =
    std::integer_sequence<int, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32, 40, 48, 56, 64>;

template <int... kCopiesList>
constexpr bool listed(int32_t copies, std::integer_sequence<int, kCopiesList...>) {
  return ((copies == kCopiesList) || ...);
}

template <class Element, int... kCopiesList>
void launch(const KvHeadSums& s, dim3 grid, cudaStream_t stream, std::integer_sequence<int, kCopiesList...>) {
  ((s.copies == kCopiesList ? (sum_kv_heads_kernel<Element, kCopiesList><<<grid, kSumThreads, 0, stream>>>(s), 0)
                            : 0),
   ...);
}

}  // namespace
}  // namespace dash

extern "C" bool dash_kv_head_sum_supported(int32_t copies) { return dash::listed(copies, dash::CopyCounts{}); }

extern "C" int dash_sum_kv_heads(const dash::KvHeadSums* sums, int32_t num_sms, void* stream) {
  if (sums->count <= 0 || !dash_kv_head_sum_supported(sums->copies)) return static_cast<int>(cudaErrorInvalidValue);
  // A few waves of CTAs: the loop strides over whatever is left.
  const dim3 grid(static_cast<unsigned>((num_sms > 0 ? num_sms : 1) * 8), static_cast<unsigned>(sums->count));
  const auto s = static_cast<cudaStream_t>(stream);
  if (sums->bfloat16) {
    dash::launch<__nv_bfloat16>(*sums, grid, s, dash::CopyCounts{});
  } else {
    dash::launch<__half>(*sums, grid, s, dash::CopyCounts{});
  }
  return static_cast<int>(cudaGetLastError());
}
