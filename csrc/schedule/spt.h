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
    const int32_t g = group_size(p);
    const int32_t m = m_block_range(p, t.n_block).lo + step / g;
    const BlockRange contrib = n_block_range(p, m);
    int64_t wave_lo, wave_hi;
    Units::wave_of(p, t, &wave_lo, &wave_hi);
    const int64_t earlier = overlap(contrib.lo, contrib.hi, 0, wave_lo);
    const int64_t later_in_wave = min64(contrib.hi, wave_hi) - t.n_block - 1;
    return Visit{t.head_k * g + step % g, m, static_cast<int32_t>(earlier + later_in_wave)};
  }
};

}  // namespace dash::sched
