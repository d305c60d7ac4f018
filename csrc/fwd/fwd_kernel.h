// Warp-specialised persistent forward kernel. Warpgroup 0 is the producer: it gives registers back with setmaxnreg
// and one of its warps issues all TMA loads; warpgroups 1.. are consumers that take the freed registers and own 64
// query rows each. Both sides walk the same static tile sequence, so they agree on every tile without talking.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "fwd/fwd_config.h"
#include "fwd/fwd_epilogue.h"
#include "fwd/fwd_mainloop.h"
#include "fwd/fwd_tile_scheduler.h"

namespace dash::fwd {

template <class Traits>
struct FwdKernel {
  using Mainloop = FwdMainloop<Traits>;
  using Epilogue = FwdEpilogue<Traits>;
  using Scheduler = FwdTileScheduler<tile_order(Traits::kMask)>;
  using SharedStorage = typename Traits::SharedStorage;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename Traits::PipelineState;

  struct Params {
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename Scheduler::Params scheduler;
    PackedSeqs packed;  // SeqLayout::kPacked only
  };

  // The sequence of a work tile, and whether the tile has rows in it. Packed sequences are tiled as a batch of the
  // longest one, so the tiles past a shorter sequence's end are skipped (by producer and consumers alike).
  CUTLASS_DEVICE static SeqRows tile_rows(Params const& params, int batch) {
    return seq_rows<Traits::kLayout>(params.packed, batch, params.mainloop.seqlen_q, params.mainloop.seqlen_k);
  }
  // The lengths the mask arithmetic takes: the parameters themselves for batched sequences, so that their code does
  // not depend on the packed layout's existence.
  CUTLASS_DEVICE static decltype(auto) lens_of(Params const& params, SeqRows const& rows) {
    if constexpr (Traits::kPacked) {
      return SeqLens{rows.len_q, rows.len_k};
    } else {
      return (params.mainloop);
    }
  }

  // Rows per consumer thread in the accumulator (two per 64-row warpgroup tile).
  static constexpr int kRowsPerThread = 2;

  CUTLASS_DEVICE static void run(Params const& params, char* smem_raw) {
    using namespace cute;
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;

    if (threadIdx.x == 0) {
      Mainloop::prefetch_descriptors(params.mainloop);
      Epilogue::prefetch_descriptors(params.epilogue);
      cutlass::arch::ClusterTransactionBarrier::init(&smem.barrier_q, 1);
    }

    typename PipelineKV::Params pipe_params;
    pipe_params.transaction_bytes = Traits::kTmaBytesKV;
    pipe_params.role = warp_group == 0 ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
    pipe_params.is_leader = threadIdx.x == 0;
    pipe_params.num_consumers = Traits::kNumConsumerThreads;
    PipelineKV pipeline_k(smem.pipeline_k, pipe_params, Shape<_1, _1, _1>{});
    PipelineKV pipeline_v(smem.pipeline_v, pipe_params, Shape<_1, _1, _1>{});
    cutlass::arch::fence_barrier_init();
    __syncthreads();

    if (warp_group == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::Tile::kProducerRegs>();
      if (warp_in_group != 0) { return; }
      PipelineState write_k = cutlass::make_producer_start_state<PipelineKV>();
      PipelineState write_v = cutlass::make_producer_start_state<PipelineKV>();
      bool first_tile = true;
      auto const& sched = params.scheduler;
      int const grid = gridDim.x;
      for (auto cur = Scheduler::first(blockIdx.x); Scheduler::valid(sched, cur, grid);
           cur = Scheduler::next(sched, cur, grid)) {
        auto const tile = Scheduler::decode(sched, cur, grid);
        SeqRows const rows = tile_rows(params, tile.batch);
        if (Traits::kPacked && tile.m_block * Traits::kBlockM >= rows.len_q) { continue; }
        auto const keys = Mainloop::key_tiles(params.mainloop, lens_of(params, rows), tile.m_block);
        if (keys.lo >= keys.hi) { continue; }
        Mainloop::load(params.mainloop, smem, pipeline_k, pipeline_v, write_k, write_v, tile.m_block, tile.head,
                       tile.batch, keys, first_tile, rows);
        first_tile = false;
      }
      if (!first_tile) { Mainloop::load_tail(); }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::Tile::kConsumerRegs>();
      int const thread_idx = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
      int const consumer_wg = thread_idx / cutlass::NumThreadsPerWarpGroup;
      WarpGroupTurns<Traits>::init(consumer_wg);
      PipelineState read_k;
      PipelineState read_v;
      uint32_t q_phase = 0;
      typename Traits::TiledMmaPV mma_pv;
      Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(typename Traits::TileShapePV{}));
      OnlineSoftmax<kRowsPerThread, Traits::kSkipIdleRescale> softmax;
      auto const& sched = params.scheduler;
      int const grid = gridDim.x;
      for (auto cur = Scheduler::first(blockIdx.x); Scheduler::valid(sched, cur, grid);
           cur = Scheduler::next(sched, cur, grid)) {
        auto const tile = Scheduler::decode(sched, cur, grid);
        SeqRows const rows = tile_rows(params, tile.batch);
        if (Traits::kPacked && tile.m_block * Traits::kBlockM >= rows.len_q) { continue; }
        auto&& lens = lens_of(params, rows);
        // Loaded ahead of the mainloop, so that the epilogue does not wait on it.
        float const sink = Epilogue::sink_logit(params.epilogue, tile.head);
        auto const keys = Mainloop::key_tiles(params.mainloop, lens, tile.m_block);
        bool const loaded = keys.lo < keys.hi;  // as the producer decides
        if (loaded) {
          Mainloop::mma(params.mainloop, lens, smem, pipeline_k, pipeline_v, read_k, read_v, q_phase, thread_idx,
                        tile.m_block, keys, tOrO, softmax);
          q_phase ^= 1;
        } else {
          // Every key is masked for these rows: O = 0 and LSE = -inf.
          clear(tOrO);
          softmax.reset();
        }
        Epilogue::store(params.epilogue, smem, tOrO, softmax, sink, thread_idx, tile.m_block, tile.head, tile.batch,
                        rows, params.packed.total_q, loaded);
      }
      WarpGroupTurns<Traits>::finish(consumer_wg);
      Epilogue::store_tail(thread_idx);
    }
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    fwd_kernel(CUTE_GRID_CONSTANT typename FwdKernel<Traits>::Params const params) {
  extern __shared__ __align__(1024) char smem_raw[];
  FwdKernel<Traits>::run(params, smem_raw);
}

}  // namespace dash::fwd
