// dQ writer: one thread of a dedicated warp adds each partial dQ tile, staged in shared memory by the consumers, into
// the fp32 accumulator with a bulk reduce-add (cp.reduce.async.bulk .add.f32), in the CTA's visit order.
//
// Schedules with two accumulators per tile (schedule/runs.h): a visit's record says which (kRun1); each run is a
// tile of its own here, with its own semaphores and chain.
//
// Staging layout: consumer thread `tid` (0..kNumMmaThreads-1) puts its accumulator elements 4c..4c+3 at float4 slot
// c * kNumMmaThreads + tid (conflict-free stores). The accumulator tile (batch, head, m_block) is a contiguous
// kBlockM x d block of floats in that same permuted order, so one 1-D bulk reduce adds the whole tile; the
// postprocess undoes the permutation.
//
// Deterministic mode: the add into tile (b, h, m) is the visit's wait_target-th add of that tile. Spin (acquire) until
// the tile's semaphore equals wait_target, add, wait until the reduce has fully COMPLETED (not merely finished reading
// shared memory), fence, then release wait_target + 1. Releasing earlier would let the next CTA's add race with ours
// and silently change the summation order.
//
// Parts (BwdConfig::kDqParts > 1, hdim 256): the tile is added as contiguous parts of the permuted block, each with
// its own semaphore and the same chain order; each part is spun for, added and released on its own. The parts' chains
// are copies of the tile's chain, so the deadlock argument below holds for each of them.
//
// Both modes: nothing zeroes the accumulator (bwd_preprocess.h). The tile's first add in schedule order
// (wait_target 0) is a plain bulk store, completed and released like a deterministic add. ScheduleKind::kDynamic has
// no schedule order: the producer elects the first visit loaded as that store (bwd_producer.h) and gives every
// other visit wait_target 1. The non-deterministic mode
// orders only that one: its other adds wait until the semaphore is at least 1 (the store has landed), then add in
// arrival order. Each of them is counted (+1 on the semaphore, release) once it has completed, which the writer learns
// without stalling only one add later (wait_group kDqParts), so that the postprocess can convert a tile as soon as
// its count reaches its number of contributors in both modes. Its waits are a subset of the deterministic mode's
// (each add there waits, through the chain, for add 0), so every schedule that cannot deadlock deterministically
// cannot deadlock here either (verify.h proves the former for 1..256 SMs).
//
// Release cost: the release store after fence.proxy.async is already a gpu-scope fence; an extra __threadfence()
// (fence.sc.gpu) before it only slows both modes, the non-deterministic one most (one per add; docs/tuning.md).
#pragma once
#include <cstdio>

#include "bwd/bwd_storage.h"

// log2 of the spin count after which the debug build traps (DASH_BWD_SPIN_TRAP).
#ifndef DASH_BWD_SPIN_TRAP_LOG2
#define DASH_BWD_SPIN_TRAP_LOG2 26
#endif

namespace dash::bwd {

CUTLASS_DEVICE void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;\n"
               :
               : "l"(gmem), "r"(s), "r"(bytes), "l"(uint64_t(cute::TMA::CacheHintSm90::EVICT_LAST))
               : "memory");
}
// Plain bulk store: the first add into a tile (both modes; nothing zeroes the accumulator).
CUTLASS_DEVICE void bulk_store_f32(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t s = cute::cast_smem_ptr_to_uint(smem);
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;\n"
               :
               : "l"(gmem), "r"(s), "r"(bytes), "l"(uint64_t(cute::TMA::CacheHintSm90::EVICT_LAST))
               : "memory");
}
CUTLASS_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Source shared memory may be reused.
CUTLASS_DEVICE void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Writes to global memory have been performed for every group but the kPending newest.
template <int kPending>
CUTLASS_DEVICE void bulk_wait_all_but() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
CUTLASS_DEVICE void bulk_wait_all() { bulk_wait_all_but<0>(); }
// Orders the completed async-proxy writes of this thread before a generic release that publishes them.
CUTLASS_DEVICE void fence_async_writes() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }

CUTLASS_DEVICE int32_t ld_acquire_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
CUTLASS_DEVICE void st_release_gpu(int32_t* p, int32_t v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
CUTLASS_DEVICE void red_add_release_gpu(int32_t* p, int32_t v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Non-deterministic mode: counts one completed add into each part of a tile (the caller has waited for them).
template <int kParts>
CUTLASS_DEVICE void count_completed_adds(int32_t* sems) {
  fence_async_writes();
  CUTLASS_PRAGMA_UNROLL
  for (int part = 0; part < kParts; ++part) red_add_release_gpu(sems + part, 1);
}
// Releases `value` on the semaphore of each part of a tile once that part's bulk group, one of the kParts newest,
// has completed: part 0 first, so the next add of its chain can start while the later parts are still in flight.
template <int kParts, int kPart = 0>
CUTLASS_DEVICE void release_parts(int32_t* sems, int32_t value) {
  if constexpr (kPart < kParts) {
    bulk_wait_all_but<kParts - 1 - kPart>();
    fence_async_writes();
    st_release_gpu(sems + kPart, value);
    release_parts<kParts, kPart + 1>(sems, value);
  }
}

struct SpinSite {
  int32_t batch, head, m_block, n_block, wait_target;
};

CUTLASS_DEVICE void spin_until(const int32_t* sem, int32_t target, const SpinSite& site) {
  // Deterministic mode: the semaphore never passes target before this add releases, so >= means ==.
  // Non-deterministic mode: the other adds keep counting past the first store's 1.
#ifdef DASH_BWD_SPIN_TRAP
  uint64_t spins = 0;
  int32_t observed;  // reported by the trap
  while ((observed = ld_acquire_gpu(sem)) < target) {
    if (++spins == (uint64_t(1) << DASH_BWD_SPIN_TRAP_LOG2)) {
      printf("dash_bwd: dQ semaphore spin timeout: batch %d head %d m_block %d n_block %d wait_target %d observed %d\n",
             site.batch, site.head, site.m_block, site.n_block, site.wait_target, observed);
      __trap();
    }
  }
#else
  while (ld_acquire_gpu(sem) < target) {
  }
  (void)site;
#endif
}

// Runs on a single thread; takes each staged partial dQ with its visit record, in visit order, until the end record.
template <class T>
CUTLASS_DEVICE void dq_writer_loop(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss) {
  const int nheads = get<2>(p.shape_q);
  // Non-deterministic mode: the semaphores of an arrival-order add that has not been counted yet. It is counted when
  // the next arrival-order add has been issued (then waiting for all but that add's groups never waits for the add
  // just issued), or at the end; a first store in between leaves it pending, so that first stores and deterministic
  // adds take no extra release on their path.
  int32_t* uncounted = nullptr;
  for (uint32_t dq_count = 0;; ++dq_count) {
    const RingPos pos = ring_pos<T::kDqBuffers>(dq_count);
    const int buf = pos.index;
    wait_barrier(ss.dq_full[buf], pos.phase, WaitSite::kDqFull);
    const VisitRecord rec = ss.dq_rec[buf];
    if (rec.flags & VisitRecord::kEnd) break;
    const int64_t tile_index = run_tile_index(q_tile_index(rec.batch, rec.head, nheads, p.num_m_blocks, rec.m_block),
                                              (rec.flags & VisitRecord::kRun1) ? 1 : 0, p.num_q_tiles);
    float* gdq = p.dq_accum + tile_index * T::kDqElems;
    int32_t* sems = tile_semaphores<T::kHeadDim>(p.semaphores, tile_index);
    const bool first = rec.wait_target == 0;
    // One bulk group per part, in part order (BwdConfig::kDqParts).
    CUTLASS_PRAGMA_UNROLL
    for (int part = 0; part < T::kDqParts; ++part) {
      float* dst = gdq + part * T::kDqPartElems;
      const float* src = ss.dq[buf].data() + part * T::kDqPartElems;
      if (first) {
        bulk_store_f32(dst, src, T::kDqPartBytes);
      } else {
        const int32_t target = p.deterministic ? rec.wait_target : 1;
        spin_until(sems + part, target, SpinSite{rec.batch, rec.head, rec.m_block, rec.n_block, target});
        bulk_reduce_add_f32(dst, src, T::kDqPartBytes);
      }
      bulk_commit();
    }
    bulk_wait_read_all();
    reinterpret_cast<Barrier&>(ss.dq_empty[buf]).arrive();  // consumers may stage into this buffer again
    if (p.deterministic || first) {
      release_parts<T::kDqParts>(sems, rec.wait_target + 1);
    } else {
      if (uncounted != nullptr) {
        bulk_wait_all_but<T::kDqParts>();  // every group of the previous adds; this add's parts may still run
        count_completed_adds<T::kDqParts>(uncounted);
      }
      uncounted = sems;
    }
  }
  bulk_wait_all();  // the CTA must not exit while a reduce still reads its shared memory
  if (uncounted != nullptr) count_completed_adds<T::kDqParts>(uncounted);
}

}  // namespace dash::bwd
