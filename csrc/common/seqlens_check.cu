// Kernels of common/seqlens_check.h.
#include <cuda_runtime.h>

#include "common/seqlens_check.h"

namespace dash {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kPoisonThreads = 256;

// One CTA: each thread checks a share of the sequences in int64 (differences of arbitrary int32 values must not
// wrap around), then one vote.
__global__ void __launch_bounds__(kCheckThreads) check_seqlens_kernel(const SeqlensCheck c) {
  bool bad = false;
  if (threadIdx.x == 0) {
    bad = c.cu_seqlens_q[0] != 0 || c.cu_seqlens_k[0] != 0 || c.cu_seqlens_q[c.batch] != c.total_q ||
          c.cu_seqlens_k[c.batch] != c.total_k;
  }
  const int64_t diagonal = int64_t(c.max_k) - c.max_q;
  for (int b = threadIdx.x; b < c.batch; b += kCheckThreads) {
    int64_t len_q = int64_t(c.cu_seqlens_q[b + 1]) - c.cu_seqlens_q[b];
    int64_t len_k = int64_t(c.cu_seqlens_k[b + 1]) - c.cu_seqlens_k[b];
    bad |= len_q < 0 || len_k < 0;
    if (c.seqused_q != nullptr) {
      bad |= c.seqused_q[b] < 0 || c.seqused_q[b] > len_q;
      len_q = c.seqused_q[b];
    }
    if (c.seqused_k != nullptr) {
      bad |= c.seqused_k[b] < 0 || c.seqused_k[b] > len_k;
      len_k = c.seqused_k[b];
    }
    bad |= len_q > c.max_q || len_k > c.max_k;
    bad |= c.right_bounded && len_k - len_q > diagonal;
    bad |= c.left_bounded && len_k - len_q < diagonal;
  }
  const bool any_bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) *c.ok = any_bad ? 0 : 1;
}

__global__ void __launch_bounds__(kPoisonThreads) poison_unless_ok_kernel(const PoisonTargets p) {
  if (*p.ok != 0) return;
  const int64_t stride = int64_t(gridDim.x) * kPoisonThreads;
  for (int i = 0; i < p.count; ++i) {
    const PoisonTarget& t = p.targets[i];
    for (int64_t w = int64_t(blockIdx.x) * kPoisonThreads + threadIdx.x; w < t.words; w += stride) {
      if (t.word_bytes == 2) {
        static_cast<uint16_t*>(t.data)[w] = static_cast<uint16_t>(t.nan_bits);
      } else {
        static_cast<uint32_t*>(t.data)[w] = t.nan_bits;
      }
    }
  }
}

}  // namespace
}  // namespace dash

extern "C" int dash_check_seqlens(const dash::SeqlensCheck* check, void* stream) {
  dash::check_seqlens_kernel<<<1, dash::kCheckThreads, 0, static_cast<cudaStream_t>(stream)>>>(*check);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int dash_poison_unless_ok(const dash::PoisonTargets* targets, int32_t num_sms, void* stream) {
  // Valid calls are the ones that matter: one wave of CTAs, each gone after its flag load.
  const int grid = num_sms > 0 ? num_sms : 1;
  dash::poison_unless_ok_kernel<<<grid, dash::kPoisonThreads, 0, static_cast<cudaStream_t>(stream)>>>(*targets);
  return static_cast<int>(cudaGetLastError());
}
