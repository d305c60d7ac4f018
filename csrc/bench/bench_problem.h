// Device-side problem of the C++ benchmark: its shape, its tensors filled with reproducible random data, and the
// FwdParams/BwdParams of the C ABI that point at them (contiguous (batch, seqlen, heads, headdim) layout).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "bench/bench_timer.h"
#include "common/params.h"

namespace dash::bench {

// Hash-based normal numbers (Box-Muller on two 32-bit hashes): reproducible from the seed, no curand dependency.
__device__ __forceinline__ uint32_t mix32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

template <class T>
__global__ void fill_normal(T* out, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u1 = (mix32(seed ^ (2 * i)) + 1.0f) * 2.3283064e-10f;  // (0, 1]
    const float u2 = mix32(seed ^ (2 * i + 1)) * 2.3283064e-10f;
    const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[i] = __float2bfloat16(z);
    } else {
      out[i] = __float2half(z);
    }
  }
}

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) { DASH_BENCH_CUDA(cudaMalloc(&ptr, n)); }
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void grow(size_t n) {
    if (n <= bytes) return;
    if (ptr != nullptr) DASH_BENCH_CUDA(cudaFree(ptr));
    ptr = nullptr;
    bytes = n;
    DASH_BENCH_CUDA(cudaMalloc(&ptr, n));
  }
};

struct Problem {
  int batch, seqlen, nheads, nheads_k, headdim;
  MaskKind mask;
  DType dtype;
  int window_left = -1, window_right = -1;  // MaskKind::kWindow only
  float softcap = 0.f;                      // 0: off
  size_t q_elems() const { return size_t(batch) * seqlen * nheads * headdim; }
  size_t k_elems() const { return size_t(batch) * seqlen * nheads_k * headdim; }
  bool causal() const { return mask == MaskKind::kCausal; }
};

// All tensors of one problem, filled with random data (never zeros: they can run faster than real data).
struct ProblemBuffers {
  DeviceBuffer q, k, v, o, dout, dq, dk, dv, lse, workspace;
  ProblemBuffers(const Problem& p, cudaStream_t stream)
      : q(p.q_elems() * 2), k(p.k_elems() * 2), v(p.k_elems() * 2), o(p.q_elems() * 2), dout(p.q_elems() * 2),
        dq(p.q_elems() * 2), dk(p.k_elems() * 2), dv(p.k_elems() * 2),
        lse(size_t(p.batch) * p.nheads * p.seqlen * sizeof(float)) {
    uint64_t seed = 0x5eed;
    for (DeviceBuffer* b : {&q, &k, &v, &dout, &o, &dq, &dk, &dv}) fill(*b, p.dtype, seed++, stream);
    DASH_BENCH_CUDA(cudaMemsetAsync(lse.ptr, 0, lse.bytes, stream));
  }
  static void fill(DeviceBuffer& b, DType dtype, uint64_t seed, cudaStream_t stream) {
    const size_t n = b.bytes / 2;
    constexpr int kThreads = 256;
    const unsigned blocks = static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535));
    if (dtype == DType::kBFloat16) {
      fill_normal<<<blocks, kThreads, 0, stream>>>(static_cast<__nv_bfloat16*>(b.ptr), n, seed);
    } else {
      fill_normal<<<blocks, kThreads, 0, stream>>>(static_cast<__half*>(b.ptr), n, seed);
    }
    DASH_BENCH_CUDA(cudaGetLastError());
  }
};

inline dash::AttnShape make_shape(const Problem& p) {
  dash::AttnShape s;
  s.batch = p.batch;
  s.seqlen_q = p.seqlen;
  s.seqlen_k = p.seqlen;
  s.nheads = p.nheads;
  s.nheads_k = p.nheads_k;
  s.headdim = p.headdim;
  s.dtype = p.dtype;
  s.mask = p.mask;
  if (p.mask == MaskKind::kWindow) {
    s.window_left = p.window_left;
    s.window_right = p.window_right;
  }
  s.softmax_scale = 1.0f / std::sqrt(static_cast<float>(p.headdim));
  s.softcap = p.softcap;
  return s;
}

// Layout (batch, seqlen, heads, headdim), contiguous.
inline dash::TensorStrides strides_for(const Problem& p, int heads) {
  dash::TensorStrides st;
  st.head = p.headdim;
  st.row = int64_t(heads) * p.headdim;
  st.batch = st.row * p.seqlen;
  return st;
}

inline dash::FwdParams make_fwd_params(const Problem& p, ProblemBuffers& b, int num_sms) {
  dash::FwdParams f;
  f.shape = make_shape(p);
  f.q = b.q.ptr;
  f.k = b.k.ptr;
  f.v = b.v.ptr;
  f.o = b.o.ptr;
  f.lse = static_cast<float*>(b.lse.ptr);
  f.q_stride = f.o_stride = strides_for(p, p.nheads);
  f.k_stride = f.v_stride = strides_for(p, p.nheads_k);
  f.num_sms = num_sms;
  return f;
}

inline dash::BwdParams make_bwd_params(const Problem& p, ProblemBuffers& b, int num_sms, int sm_margin) {
  dash::BwdParams g;
  g.shape = make_shape(p);
  g.q = b.q.ptr;
  g.k = b.k.ptr;
  g.v = b.v.ptr;
  g.o = b.o.ptr;
  g.dout = b.dout.ptr;
  g.lse = static_cast<const float*>(b.lse.ptr);
  g.dq = b.dq.ptr;
  g.dk = b.dk.ptr;
  g.dv = b.dv.ptr;
  g.q_stride = g.o_stride = g.do_stride = g.dq_stride = strides_for(p, p.nheads);
  g.k_stride = g.v_stride = g.dk_stride = g.dv_stride = strides_for(p, p.nheads_k);
  g.num_sms = num_sms;
  g.sm_margin = sm_margin;
  return g;
}

}  // namespace dash::bench
