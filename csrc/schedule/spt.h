// SPT (FlashAttention-3's current causal default): KV tiles launched longest-first (tile-major: KV tile 0 of every
// head, then tile 1, ...; the longest first under a bottom-right causal mask), sigma ascending from the tile's first
// live Q tile, pi decreasing KV index. Tiles that start at the same time reach Q tile m in decreasing KV index (the
// tile nearest the diagonal gets there first), so nobody waits.
//
// A pure "decreasing index" pi would let a tile wait for a higher tile that runs later on its own CTA (deadlock when
// a head spans several waves). pi is therefore: earlier waves first, decreasing KV index inside a wave, which is the
// arrival order when a wave starts together and deadlock-free always (see waves.h). Not batch-invariant in general:
// with tile-major launch, the wave boundaries inside a head depend on batch * nheads_k and the CTA count (it is
// run-to-run deterministic for a fixed shape and grid).
#pragma once
#include "schedule/waves.h"

namespace dash::sched {

// num_items / item / num_visits come from the tile-major unit layout; the schedule adds only its visit order.
struct Spt : TileUnits<TileOrder::kTileMajor> {
  using Units = TileUnits<TileOrder::kTileMajor>;
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    return visit_at(p, t, step, slot_of(p, t));
  }
  // visit() for a tile whose wave slot r is known (slot_of, slot_of_item).
  DASH_HD static Visit visit_at(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    const int32_t g = group_size(p);
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t m = m_block_range(p, t.n_block).lo + st.s;
    const BlockRange contrib = n_block_range(p, m);
    int32_t wave_lo, wave_hi;
    Units::wave_of(p, t, r, &wave_lo, &wave_hi);
    const int32_t earlier = overlap(contrib.lo, contrib.hi, 0, wave_lo);
    const int32_t later_in_wave = (contrib.hi < wave_hi ? contrib.hi : wave_hi) - t.n_block - 1;
    return Visit{st.head, m, earlier + later_in_wave};
  }
};

}  // namespace dash::sched
