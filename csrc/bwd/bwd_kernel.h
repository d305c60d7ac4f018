// The persistent sm90 backward kernel: role split and barrier set-up. Grid = sched.problem.num_ctas CTAs, one per SM
// at most (the shared storage needs a whole SM), all co-resident, which is the execution model under which the
// schedules' dQ wait chains are deadlock-free.
#pragma once
#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_dq_writer.h"
#include "bwd/bwd_epilogue.h"
#include "bwd/bwd_mainloop.h"
#include "bwd/bwd_producer.h"

namespace dash::bwd {

// Opt-in shared memory per block on sm90 (227 KB).
constexpr size_t kMaxSmemPerBlock = 227 * 1024;

// The storage needs 1024-byte alignment (128-byte swizzle). The dynamic block normally starts 1024-aligned (no
// static shared memory here); where the budget allows, 1024 bytes of slack let the kernel realign regardless.
template <class T>
constexpr size_t bwd_smem_slack() {
  return sizeof(BwdSharedStorage<T>) + 1024 <= kMaxSmemPerBlock ? 1024 : 0;
}
template <class T>
constexpr size_t bwd_smem_bytes() {
  return sizeof(BwdSharedStorage<T>) + bwd_smem_slack<T>();
}

template <class T>
__global__ void __launch_bounds__(BwdThreads::kNumThreads, 1)
    bwd_main_kernel(const __grid_constant__ BwdKernelParams<T> p) {
  static_assert(bwd_smem_bytes<T>() <= kMaxSmemPerBlock, "shared storage exceeds the per-block limit");
  extern __shared__ __align__(1024) char smem_raw[];
  // Realign by pointer arithmetic on smem_raw, never through an integer round trip: the compiler then still knows
  // every access to `ss` is a shared-memory access (LDS/STS). Through uintptr_t it fell back to generic loads and
  // stores (LD.E/ST.E via L1TEX) for the row statistics, the visit records and the dQ staging.
  char* base = smem_raw;
  if constexpr (bwd_smem_slack<T>() > 0) base += (1024 - reinterpret_cast<uintptr_t>(smem_raw) % 1024) % 1024;
  auto& ss = *reinterpret_cast<BwdSharedStorage<T>*>(base);

  // Lets the postprocess grid, a programmatic dependent of this one (bwd_launch.h), start on the SMs that this grid's
  // CTAs leave; it synchronises per dQ tile itself (bwd_postprocess.h). Without a dependent this does nothing.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&ss.q_full[s], 1);
      Barrier::init(&ss.q_empty[s], T::kNumMmaThreads);
    }
    Barrier::init(&ss.kv_full, 1);
    Barrier::init(&ss.kv_empty, T::kNumMmaThreads);
    for (int b = 0; b < T::kDqBuffers; ++b) {
      Barrier::init(&ss.dq_full[b], T::kNumMmaThreads);
      Barrier::init(&ss.dq_empty[b], 1);
    }
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<BwdThreads::kProducerRegs>();
    if (warp == BwdThreads::kProducerWarp) {
      producer_loop<T>(p, ss);
    } else if (warp == BwdThreads::kDqWriterWarp && lane == 0) {
      dq_writer_loop<T>(p, ss);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<BwdThreads::kConsumerRegs>();
    consumer_loop<T>(p, ss, DkDvStore<T>{p, ss});
  }
}

}  // namespace dash::bwd
