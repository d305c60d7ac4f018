// Backward postprocess, one CTA per (m_block, head, batch): dQ = softmax_scale * accumulator, cast to the input dtype
// and written with dq's strides. The accumulator tile is in the consumers' register order (bwd_dq_writer.h); each
// thread here plays consumer thread `tid` and recovers (row, col) of its elements from the same dQ WGMMA tiling.
//
// Overlap with the main kernel (both modes): the postprocess is launched as a programmatic dependent of the main
// kernel (bwd_launch.h), so its CTAs start on the SMs that main CTAs leave once they run out of work units, and each
// CTA waits only for its own tile: the tile's semaphore reaching its number of contributing KV tiles means every add
// into it has completed (the writer counts an add only after its bulk reduce completed, bwd_dq_writer.h). Head-major
// schedules finish heads wave by wave, so most tiles are converted during the main kernel's last, partial wave.
// The non-deterministic adds are counted as well, though that mode needs no order, because the overlap makes it
// faster at short causal sequences (docs/tuning.md).
#pragma once
#include "bwd/bwd_dq_writer.h"
#include "schedule/schedule.h"

namespace dash::bwd {

struct PostprocessParams {
  const float* dq_accum;
  void* dq;
  int64_t dq_row, dq_head, dq_batch;
  int32_t seqlen_q, nheads, num_m_blocks;
  float scale;
  bool aligned16;  // dq and its row/head/batch strides allow 16-byte stores
  const int32_t* semaphores;  // counts of completed adds per tile part (both modes)
  sched::Problem problem;  // the main kernel's tiling and mask: a tile's number of contributing KV tiles
  int32_t headdim;  // of dq; may be below T::kHeadDim (common/head_dims.h): the columns past it are not stored
  PackedSeqs packed;  // T::kPacked: dq rows of sequence `batch` from its first row
  // The schedule the main kernel ran (resolved) and the distance between a tile's accumulator runs (schedule/runs.h).
  ScheduleKind schedule;
  int64_t num_q_tiles;
};

// Returns once all adds into the tile have completed (its semaphore equals the number of
// contributors), with acquire semantics for the accumulator loads that follow.
CUTLASS_DEVICE void wait_tile_complete(const int32_t* sem, int32_t contributors) {
  uint32_t sleep_ns = 64;
  while (ld_acquire_gpu(sem) != contributors) {
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns < 1024 ? 2 * sleep_ns : 1024;
  }
}

// The cast tile goes through shared memory so that global writes are whole 16-byte row chunks: written straight from
// the accumulator order, each warp store covers 8 rows x 16 bytes and the kernel runs at about a third of the
// memory bandwidth.
template <class T>
struct PostprocessTile {
  using Element = typename T::Element;
  static constexpr int kPad = 16 / sizeof(Element);  // keeps rows 16-byte aligned and staggers the banks
  static constexpr int kRowElems = T::kHeadDim + kPad;
  static constexpr int kChunkElems = 16 / sizeof(Element);
  static constexpr int kChunksPerRow = T::kHeadDim / kChunkElems;
};

template <class T>
__global__ void __launch_bounds__(T::kNumMmaThreads) bwd_postprocess_kernel(const PostprocessParams p) {
  using Element = typename T::Element;
  using Tile = PostprocessTile<T>;
  __shared__ alignas(16) Element tile[T::kBlockM * Tile::kRowElems];
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int tid = threadIdx.x;
  const int64_t tile_index = q_tile_index(batch, head, p.nheads, p.num_m_blocks, m_block);
  const SeqRows seq = seq_rows<T::kLayout>(p.packed, batch, p.seqlen_q, 0);
  const int rows = min(T::kBlockM, seq.len_q - m_block * T::kBlockM);
  // Per accumulator run (schedule/runs.h): its adds, and its tile. A run without contributing KV tiles was never
  // written (nothing zeroes the accumulator): it adds 0. Runs are summed in run order, a fixed order.
  int32_t contributors[sched::kMaxDqRuns];
  const float4* acc[sched::kMaxDqRuns];
  const int32_t runs = sched::dq_runs(p.schedule);
  // Unrolled, so that both arrays stay in registers (a rolled loop put them on the stack).
  CUTLASS_PRAGMA_UNROLL
  for (int run = 0; run < sched::kMaxDqRuns; ++run) {
    contributors[run] = run < runs ? sched::tile_contributors(p.schedule, p.problem, batch, m_block, run) : 0;
    acc[run] = reinterpret_cast<const float4*>(p.dq_accum +
                                               run_tile_index(tile_index, run, p.num_q_tiles) * T::kDqElems);
  }
  // Packed sequences: a tile past its sequence's end had no visits (bwd_producer.h) and has no rows to write.
  const bool past_end = T::kPacked && rows <= 0;
  if (threadIdx.x == 0 && !past_end) {
    for (int run = 0; run < runs; ++run) {
      const int32_t* sems = tile_semaphores<T::kHeadDim>(p.semaphores, run_tile_index(tile_index, run, p.num_q_tiles));
      for (int part = 0; part < T::kDqParts; ++part) wait_tile_complete(sems + part, contributors[run]);
    }
  }
  __syncthreads();

  typename T::TiledMmadQ mma_dq;
  auto thr = mma_dq.get_thread_slice(tid);
  Tensor tc = thr.partition_C(make_identity_tensor(Shape<typename T::BM, typename T::HD>{}));
  static_assert(decltype(size(tc))::value == T::kDqPerThread, "one accumulator slot per consumer element");

  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < T::kDqPerThread / 4; ++c) {
    // L2: written by bulk reduces of other SMs, possibly while this CTA already ran.
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    bool written = false;
    CUTLASS_PRAGMA_UNROLL
    for (int run = 0; run < sched::kMaxDqRuns; ++run) {
      if (contributors[run] == 0) continue;
      const float4 a = __ldcg(acc[run] + c * T::kNumMmaThreads + tid);
      v = written ? make_float4(v.x + a.x, v.y + a.y, v.z + a.z, v.w + a.w) : a;
      written = true;
    }
    const float vals[4] = {v.x, v.y, v.z, v.w};
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; e += 2) {
      // Elements 4c+e and 4c+e+1 are adjacent columns of one row.
      const int row = get<0>(tc(4 * c + e));
      const int col = get<1>(tc(4 * c + e));
      cutlass::Array<float, 2> f = {vals[e] * p.scale, vals[e + 1] * p.scale};
      auto h = cutlass::NumericArrayConverter<Element, float, 2>{}(f);
      *reinterpret_cast<uint32_t*>(&tile[row * Tile::kRowElems + col]) = reinterpret_cast<uint32_t const&>(h);
    }
  }
  __syncthreads();

  const int64_t first = T::kPacked ? int64_t(seq.first_q) * p.dq_row : batch * p.dq_batch;
  Element* out = static_cast<Element*>(p.dq) + first + head * p.dq_head + int64_t(m_block) * T::kBlockM * p.dq_row;
  for (int i = tid; i < rows * Tile::kChunksPerRow; i += T::kNumMmaThreads) {
    const int row = i / Tile::kChunksPerRow;
    const int col = (i % Tile::kChunksPerRow) * Tile::kChunkElems;
    if (col >= p.headdim) continue;
    const uint4 chunk = *reinterpret_cast<uint4 const*>(&tile[row * Tile::kRowElems + col]);
    Element* dst = out + int64_t(row) * p.dq_row + col;
    if (p.aligned16) {
      *reinterpret_cast<uint4*>(dst) = chunk;
    } else {  // dq is only 4-byte aligned (dash_bwd checks base and even strides)
      const uint32_t w[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 4; ++k) reinterpret_cast<uint32_t*>(dst)[k] = w[k];
    }
  }
  // A dependent grid that never waits for its primary could complete before it; the stream's next work must not start
  // while the main kernel still stores dK/dV. The CTA dispatched last waits, so no other CTA is held back.
  if (blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  }
}

}  // namespace dash::bwd
