// Persistent tile scheduler of the forward: the grid has one CTA per SM (the SM count is read at run time) and CTA c
// takes work items c, c + grid, c + 2 * grid, ... A static order keeps the kernel free of global counters (no
// workspace, no reset between launches) and makes every run issue the same tiles on the same CTAs.
//
// Full mask: every query tile costs the same, so the query tile index varies fastest and concurrently running CTAs
// share the K/V of one head in L2. Causal: later query tiles see more keys, so items are ordered heaviest query tile
// first (longest-processing-time order), which leaves the short tiles to fill the tail of the last wave.
#pragma once

#include <cutlass/cutlass.h>

namespace dash::fwd {

enum class TileOrder : int { kHeadMajor = 0, kHeavyFirst = 1 };

template <TileOrder kOrder>
struct FwdTileScheduler {
  struct Params {
    int32_t num_m_blocks;
    int32_t nheads;
    int32_t batch;
    int32_t num_items;
  };

  struct WorkTile {
    int32_t m_block;
    int32_t head;
    int32_t batch;
  };

  static Params make_params(int32_t seqlen_q, int32_t block_m, int32_t nheads, int32_t batch) {
    int32_t const num_m_blocks = (seqlen_q + block_m - 1) / block_m;
    return {num_m_blocks, nheads, batch, num_m_blocks * nheads * batch};
  }

  static int grid_size(Params const& p, int num_sms) {
    int const grid = p.num_items < num_sms ? p.num_items : num_sms;
    return grid < 1 ? 1 : grid;
  }

  CUTLASS_DEVICE static int first_item() { return blockIdx.x; }
  CUTLASS_DEVICE static int next_item(int item) { return item + gridDim.x; }
  CUTLASS_DEVICE static bool valid(Params const& p, int item) { return item < p.num_items; }

  CUTLASS_DEVICE static WorkTile decode(Params const& p, int item) {
    int const heads_total = p.nheads * p.batch;
    WorkTile t;
    int bh;
    if constexpr (kOrder == TileOrder::kHeavyFirst) {
      t.m_block = p.num_m_blocks - 1 - item / heads_total;
      bh = item % heads_total;
    } else {
      t.m_block = item % p.num_m_blocks;
      bh = item / p.num_m_blocks;
    }
    t.head = bh % p.nheads;
    t.batch = bh / p.nheads;
    return t;
  }
};

}  // namespace dash::fwd
