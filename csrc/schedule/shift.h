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
    return applies(p) ? item_applied(p, cta, k) : Descending::item(p, cta, k);
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Units::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    return applies(p) ? visit_applied(p, t, step, Units::slot_of(p, t)) : Descending::visit(p, t, step);
  }
  // The schedule proper, for problems where applies(p) holds (the kernel resolves the fallback once, on the host).
  DASH_HD static KvTile item_applied(const Problem& p, int32_t cta, int64_t k) { return Units::item(p, cta, k); }
  // 32-bit per visit: j < N, s < M, so j + s < 2^32 unsigned, and the wave's local tile range lies in [0, N].
  // r: the tile's wave slot (Units::slot_of, Units::slot_of_item).
  DASH_HD static Visit visit_applied(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    const int32_t g = group_size(p);
    const int32_t M = num_m_blocks(p);
    const int32_t j = t.n_block;
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t s = st.s;
    const int32_t m = static_cast<int32_t>((static_cast<uint32_t>(j) + s) % static_cast<uint32_t>(M));
    int32_t wave_lo, wave_hi;
    Units::wave_of(p, t, r, &wave_lo, &wave_hi);
    // Same-wave tiles j' reach m earlier iff (m - j') mod M < s, i.e. j' mod M lies in the s residues ending at m.
    const int32_t sooner = count_cyclic(wave_lo, wave_hi, pos_mod_near(m - s + 1, M), s, M);  // m, s in [0, M)
    // j' = j - M, j - 2M, ... in the wave arrive at the same step (j >= wave_lo)
    const int32_t ties = static_cast<int32_t>(static_cast<uint32_t>(j - wave_lo) / static_cast<uint32_t>(M));
    return Visit{st.head, m, wave_lo + sooner + ties};
  }
};

}  // namespace dash::sched
