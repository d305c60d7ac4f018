// Shift (DASH, full mask): KV tile j visits Q tile (j + s) mod M at step s, so at any step the KV tiles of a head sit
// on distinct Q tiles and pi = arrival order never waits: makespan M(c+r), the lower bound, when a head's KV tiles
// run together and M >= their number.
//
// pi is: earlier waves first; inside a wave by arrival step (m - j) mod M, ties (N > M) by ascending j. This is the
// arrival order of tiles that start together and deadlock-free for every grid (waves.h). Batch-invariant while each
// head's KV tiles fall in one wave; otherwise the order depends on where the head sits relative to the wave
// boundaries (its (batch, head) index, the tile count and the CTA count), not on the batch size or other sequences.
// Units are launched head-major so a head's tiles start side by side.
// Precondition: every (Q tile, KV tile) pair live. Otherwise (causal, windows) it is Descending, layout included.
#pragma once
#include "schedule/descending.h"

namespace dash::sched {

struct Shift {
  using Units = TileUnits<TileOrder::kHeadMajor>;
  DASH_HD static bool applies(const Problem& p) { return covers_all_tiles(p); }
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return applies(p) ? Units::num_items(p, cta) : Descending::num_items(p, cta);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return applies(p) ? Units::item(p, cta, k) : Descending::item(p, cta, k);
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Units::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    if (!applies(p)) return Descending::visit(p, t, step);
    const int32_t g = group_size(p);
    const int64_t M = num_m_blocks(p);
    const int64_t j = t.n_block;
    const int64_t s = step / g;
    const int64_t m = (j + s) % M;
    int64_t wave_lo, wave_hi;
    Units::wave_of(p, t, &wave_lo, &wave_hi);
    // Same-wave tiles j' reach m earlier iff (m - j') mod M < s, i.e. j' mod M lies in the s residues ending at m.
    const int64_t sooner = count_cyclic(wave_lo, wave_hi, pos_mod(m - s + 1, M), s, M);
    const int64_t ties = (j - wave_lo) / M;  // j' = j - M, j - 2M, ... in the wave arrive at the same step
    return Visit{t.head_k * g + static_cast<int32_t>(step % g), static_cast<int32_t>(m),
                 static_cast<int32_t>(wave_lo + sooner + ties)};
  }
};

}  // namespace dash::sched
