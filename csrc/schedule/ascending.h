// Ascending: FlashAttention-3's original deterministic order and the baseline the others are measured against.
// sigma: each KV tile walks its live Q tiles in ascending order. pi: ascending KV index.
// Units launch tile-major like Descending (same balance, so the comparison isolates sigma). pi follows the launch
// order (a KV tile never waits for a tile launched after it): deadlock-free for any grid, and it depends only on
// the KV index: batch-invariant.
#pragma once
#include "schedule/waves.h"

namespace dash::sched {

struct Ascending {
  using Units = TileUnits<TileOrder::kTileMajor>;
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) { return Units::num_items(p, cta); }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) { return Units::item(p, cta, k); }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Units::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const int32_t g = group_size(p);
    const int32_t m = m_block_range(p, t.n_block).lo + step / g;
    return Visit{t.head_k * g + step % g, m, t.n_block - n_block_range(p, m).lo};
  }
};

}  // namespace dash::sched
