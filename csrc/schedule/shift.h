// Shift (DASH, full mask): KV tile j visits Q tile (j k + s) mod M at step s, so at any step the KV tiles of a head
// sit on distinct Q tiles and pi = arrival order never waits: makespan M(c+r), the lower bound, when a head's KV tiles
// run together and M >= their number. k = 1 in the DASH paper (ShiftSpacing::kAdjacent); by default k = 2 where
// M >= 2N with Q tiles at most half as tall as KV tiles (2N <= M keeps the start tiles distinct; hdim 128's tiles
// have M = 2N), so a dQ tile's contributors arrive two steps apart instead of one: a deterministic add then waits
// only if the previous contributor's CTA runs more than a step (less its reduce) behind, where with k = 1 any lag
// stalls the chain. k = 2 and not M / N: the producer warp's 24 registers take a shift, not a division by k, per
// visit.
//
// pi is: earlier waves first; inside a wave by arrival step (m - j k) mod M, ties (N > M, k = 1) by ascending j.
// This is the arrival order of tiles that start together and deadlock-free for every grid (waves.h).
// Batch-invariant while each head's KV tiles fall in one wave; otherwise the order depends on where the head sits
// relative to the wave boundaries (its (batch, head) index, the tile count and the CTA count), not on the batch size
// or other sequences (except in a split last wave, whose units depend on the batch size).
// Units are launched head-major so a head's tiles start side by side. The last, partial wave is cut into one chunk of
// steps per CTA (tail_split.h); its pi: after the whole waves, by position in chunk, ties by tail unit.
// Precondition: every (Q tile, KV tile) pair live. Otherwise (causal, windows) it is Descending, layout included.
#pragma once
#include "schedule/descending.h"
#include "schedule/tail_split.h"

namespace dash::sched {

struct Shift {
  using Units = TileUnits<TileOrder::kHeadMajor>;
  DASH_HD static bool applies(const Problem& p) { return covers_all_tiles(p); }
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return applies(p) ? num_items_applied(p, cta) : Descending::num_items(p, cta);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return applies(p) ? item_applied(p, cta, k) : Descending::item(p, cta, k);
  }
  DASH_HD static StepRange item_steps(const Problem& p, int32_t cta, int64_t k) {
    if (applies(p)) return item_steps_applied(p, cta, k);
    return StepRange{0, Descending::num_visits(p, Descending::item(p, cta, k))};
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Units::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    return applies(p) ? visit_applied(p, t, step, Units::slot_of(p, t)) : Descending::visit(p, t, step);
  }

  // The split of the last wave (tail_split.h); every unit has g * M steps. Full masks only: the split's code lives in
  // the full-mask kernels alone (windows that leave every tile pair live keep whole units).
  DASH_HD static TailSplit tail(const Problem& p) {
    if (p.mask != MaskKind::kFull) return TailSplit{};
    return TailSplit::of(p, Units::num_units(p), group_size(p) * num_m_blocks(p));
  }

  // The schedule proper, for problems where applies(p) holds (the kernel resolves the fallback once, on the host).
  // Items: one per unit of the whole waves (Units' snake), then the tail units that the CTA's chunk touches. The
  // kernel (bwd_tile_scheduler.h) keeps ts from the host and routes the tail items to the tail_* functions itself.
  DASH_HD static int64_t num_items_applied(const Problem& p, int32_t cta) { return num_items_with(p, tail(p), cta); }
  DASH_HD static KvTile item_applied(const Problem& p, int32_t cta, int64_t k) {
    return item_with(p, tail(p), cta, k);
  }
  DASH_HD static StepRange item_steps_applied(const Problem& p, int32_t cta, int64_t k) {
    const TailSplit ts = tail(p);
    return in_tail(ts, k) ? tail_steps(ts, cta, k) : StepRange{0, group_size(p) * num_m_blocks(p)};
  }
  DASH_HD static Visit visit_applied(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    const TailSplit ts = tail(p);
    if (ts.active && Units::unit_of(p, t) >= ts.first_unit) return tail_visit(p, ts, t, step);
    return whole_visit(p, t, step, r);
  }

  // The items given the split ts = tail(p), which the kernel derives once on the host (bwd_tile_scheduler.h).
  DASH_HD static int64_t num_items_with(const Problem& p, const TailSplit& ts, int32_t cta) {
    return ts.active ? ts.waves + ts.units_in(cta) : Units::num_items(p, cta);
  }
  DASH_HD static KvTile item_with(const Problem& p, const TailSplit& ts, int32_t cta, int64_t k) {
    return in_tail(ts, k) ? Units::tile_of_unit(p, ts.unit_of_item(cta, k)) : Units::item(p, cta, k);
  }
  // Item k of a CTA belongs to the split tail.
  DASH_HD static bool in_tail(const TailSplit& ts, int64_t k) { return ts.active && k >= ts.waves; }
  DASH_HD static StepRange tail_steps(const TailSplit& ts, int32_t cta, int64_t k) {
    return ts.steps(ts.tail_index(cta, k), cta);
  }

  // Spacing k of the start tiles (ShiftSpacing): 2 where M >= 2N and Q tiles are at most half as tall as KV tiles
  // (hdim 128), else 1. The tile shapes are the kernel's constants, so kernels with square tiles (hdim 64, 256, where
  // M >= 2N needs seqlen_q >= 2 seqlen_k) carry no spread code, which there only slows the step (docs/tuning.md).
  DASH_HD static int32_t spacing(const Problem& p) {
    if (p.shift_spacing == ShiftSpacing::kAdjacent || 2 * p.block_m > p.block_n) return 1;
    return num_m_blocks(p) >= 2 * num_n_blocks(p) ? 2 : 1;
  }
  // Start tile of KV tile j, j k mod M: with k = 2, 2j < 2N <= M.
  DASH_HD static int32_t start_tile(int32_t j, int32_t k, int32_t M) {
    return k == 1 ? static_cast<int32_t>(static_cast<uint32_t>(j) % static_cast<uint32_t>(M)) : 2 * j;
  }

  // A visit of a unit of the whole waves. 32-bit per visit: the start tile and s lie in [0, M), and the wave's local
  // tile range in [0, N]. r: the tile's wave slot (Units::slot_of, Units::slot_of_item).
  DASH_HD static Visit whole_visit(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    const int32_t g = group_size(p);
    const int32_t M = num_m_blocks(p);
    const int32_t j = t.n_block;
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t s = st.s;
    const int32_t k = spacing(p);
    const int32_t m = pos_mod_near(start_tile(j, k, M) + s, M);
    int32_t wave_lo, wave_hi;
    Units::wave_of(p, t, r, &wave_lo, &wave_hi);
    if (k == 1) {
      // Same-wave tiles j' reach m earlier iff (m - j') mod M < s, i.e. j' mod M lies in the s residues ending at m.
      const int32_t sooner = count_cyclic(wave_lo, wave_hi, pos_mod_near(m - s + 1, M), s, M);  // m, s in [0, M)
      // j' = j - M, j - 2M, ... in the wave arrive at the same step (j >= wave_lo)
      const int32_t ties = static_cast<int32_t>(static_cast<uint32_t>(j - wave_lo) / static_cast<uint32_t>(M));
      return Visit{st.head, m, wave_lo + sooner + ties};
    }
    // 2 j' (< M, no wrap) lies in the s residues ending at m: [lo, lo + s) cyclically; no ties.
    const int32_t lo = pos_mod_near(m - s + 1, M);
    const int32_t sooner = lo + s <= M ? evens_in(wave_lo, wave_hi, lo, lo + s)
                                       : evens_in(wave_lo, wave_hi, lo, M) + evens_in(wave_lo, wave_hi, 0, lo + s - M);
    return Visit{st.head, m, wave_lo + sooner};
  }
  // #{j in [a, b) : 2 j in [x, y)}, 0 <= x <= y < 2^31 - 1.
  DASH_HD static int32_t evens_in(int32_t a, int32_t b, int32_t x, int32_t y) {
    return overlap(a, b, (x + 1) >> 1, (y + 1) >> 1);
  }

  // A visit of a tail unit: Q tile m = (j k + s) mod M as in the whole waves; its accumulation position comes after
  // the head's tiles of the whole waves, which all precede it (every tile contributes to every Q tile), then by
  // position in chunk, ties by tail unit (tail_split.h). The head's tail units are its tiles j' >= j - i (tail unit
  // i + j' - j); each visits (head, m) once, at step ((m - j' k) mod M) * g + (step mod g). One pass over them: the
  // tail holds fewer than num_ctas units.
  DASH_HD static Visit tail_visit(const Problem& p, const TailSplit& ts, const KvTile& t, int32_t step) {
    const int32_t g = group_size(p), M = num_m_blocks(p), N = num_n_blocks(p);
    const int32_t j = t.n_block;
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t k = spacing(p);
    const int32_t m = pos_mod_near(start_tile(j, k, M) + st.s, M);
    const int32_t i = static_cast<int32_t>(Units::unit_of(p, t) - ts.first_unit);
    const int32_t mine = ts.position(i, step);
    const int32_t lo = j > i ? j - i : 0;
    const int32_t h = step - st.s * g;
    int32_t sooner = 0;
    for (int32_t jp = lo; jp < N; ++jp) {
      const int32_t ip = i + jp - j;
      const int32_t theirs = ts.position(ip, pos_mod_near(m - start_tile(jp, k, M), M) * g + h);
      sooner += (theirs < mine || (theirs == mine && ip < i)) ? 1 : 0;
    }
    return Visit{st.head, m, lo + sooner};
  }
};

}  // namespace dash::sched
