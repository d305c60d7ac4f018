// Descending (DASH): sigma walks the live Q tiles from the last one down; pi stays ascending KV index.
// Under a causal mask every KV tile reaches the last Q tile, so all tiles of a head arrive at each Q tile together and
// the ascending-index chain costs one reduction per predecessor (j*r) instead of j*(c+r); short KV tiles finish
// first and free their CTAs. Units launch tile-major (KV tile 0 of every head, then tile 1, ...): longest-first
// under a causal mask, which keeps the static grid balanced. pi follows the launch order within a head, so it is
// deadlock-free for any grid, and it depends on the KV index only: batch-invariant.
// This is also the fallback of shift / shift_causal where their preconditions fail.
#pragma once
#include "schedule/waves.h"

namespace dash::sched {

// num_items / item / num_visits come from the tile-major unit layout; the schedule adds only its visit order.
struct Descending : TileUnits<TileOrder::kTileMajor> {
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const int32_t g = group_size(p);
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t m = m_block_range(p, t.n_block).hi - 1 - st.s;
    return Visit{st.head, m, t.n_block - n_block_range(p, m).lo};
  }
};

}  // namespace dash::sched
