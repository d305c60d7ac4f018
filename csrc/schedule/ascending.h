// Ascending: FlashAttention-3's original deterministic order and the baseline the others are measured against.
// sigma: each KV tile walks its live Q tiles in ascending order. pi: ascending KV index.
// Units launch tile-major like Descending (same balance, so the comparison isolates sigma). pi follows the launch
// order (a KV tile never waits for a tile launched after it): deadlock-free for any grid, and it depends only on
// the KV index: batch-invariant.
#pragma once
#include "schedule/waves.h"

namespace dash::sched {

// num_items / item / num_visits come from the tile-major unit layout; the schedule adds only its visit order.
struct Ascending : TileUnits<TileOrder::kTileMajor> {
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const int32_t g = group_size(p);
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t m = m_block_range(p, t.n_block).lo + st.s;
    return Visit{st.head, m, t.n_block - n_block_range(p, m).lo};
  }
};

}  // namespace dash::sched
