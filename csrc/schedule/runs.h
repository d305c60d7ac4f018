// The invariant deterministic schedules: every bit of a sequence's dQ, dK and dV depends on that sequence's geometry
// alone, not on the CTA count, the batch or where the sequence sits in it, at the speed of the arrival-order ones.
//
// Why two accumulators. A KV tile runs all of its visits on one CTA, so with one CTA the adds into every dQ tile
// arrive in the order the tiles run: an order that is the same for every CTA count must be one linear order of a
// head's KV tiles, shared by all of its Q tiles. Shift's cyclic walk (every Q tile receives its KV tiles in a rotated
// order, so no add waits) is no such order. But at Q tile m a rotation is two runs, each linear: the tiles that
// reached m before wrapping around and those that reached it after. Each run gets its own fp32 accumulator ("run"
// 0 and 1, Visit::run); the postprocess adds run 0 and run 1 of a tile in that order. Inside each run the order is
// descending KV index, and a head's units launch in that order too, so every add waits only for units launched
// earlier (deadlock-free for any grid, waves.h) and, when a head's tiles start together, for nobody.
//
// Which run and which position a visit takes are functions of (KV tile, Q tile, tile counts, spacing) only. The unit
// layout over the grid may depend on anything; it changes when adds happen, never what they sum to. dK/dV: every KV
// tile runs whole, walking its Q tiles in an order fixed by the geometry, so its in-register sums are invariant too
// (no split tail: a split's pieces would follow the grid).
#pragma once
#include "schedule/shift_causal.h"

namespace dash::sched {

// Accumulators per dQ tile a schedule uses (ScheduleKind): 2 for the invariant ones, 1 otherwise.
constexpr int32_t kMaxDqRuns = 2;
DASH_HD inline int32_t dq_runs(ScheduleKind kind) {
  return kind == ScheduleKind::kShiftRuns || kind == ScheduleKind::kShiftCausalRuns ||
                 kind == ScheduleKind::kSeqCausalRuns
             ? 2
             : 1;
}

// Full masks (every tile pair live). Per (batch, KV head): KV tile j walks Q tiles (k j + s) mod M, s = 0 .. M-1,
// k the spacing: 2 where Q tiles are at most half as tall as KV tiles (hdim 128), else 1. At Q tile m, run 0 holds
// the tiles with k j <= m (they arrive at step m - k j) and run 1 the others (step m - k j + M): both in descending
// j, which is their arrival order while k (N - 1) <= M (waits_free, which applies requires). k
// depends on the tile shape alone, not on M and N as shift's does: a sequence packed with longer ones (varlen) is
// scheduled on the longest one's tile counts and must still take the walk and the runs it takes alone.
// With GQA a KV tile walks its group's query heads one after another (split_step_heads_outer): with the heads
// innermost, each Q tile's (Q, dO, dQ) set had to stay in L2 for g times as many visits between two KV tiles' adds,
// which the CPU model (L2 term) put at 1.4x the time at GQA 4 and 8, hdim 128 (docs/tuning.md).
// Units: head-major, descending j within a head.
struct ShiftRuns {
  DASH_HD static bool applies(const Problem& p) { return covers_all_tiles(p) && waits_free(p); }
  DASH_HD static int32_t spacing(const Problem& p) {
    return p.shift_spacing == ShiftSpacing::kAdjacent || 2 * p.block_m > p.block_n ? 1 : 2;
  }
  // Whether the adds arrive in their runs' order, so that none waits: k (N - 1) <= M. With more KV tiles a tile
  // that reaches a Q tile on its walk's second wrap adds after tiles that arrive up to M steps later, and the waits
  // chain: the engine put k (N - 1) = M + 1 at 1.3x the makespan of descending and M + 2 .. M + 7 at 2-6x (seqlen_q
  // below seqlen_k; docs/tuning.md). Where it fails, shift_runs runs descending (applies), dense and per sequence of
  // a pack alike, so both give a sequence the same bits.
  DASH_HD static bool waits_free(const Problem& p) { return spacing(p) * (num_n_blocks(p) - 1) <= num_m_blocks(p); }
  DASH_HD static int64_t num_units(const Problem& p) { return num_kv_heads_total(p) * num_n_blocks(p); }
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return Snake::units_on(num_units(p), p.num_ctas, cta);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    const int32_t N = num_n_blocks(p);
    const DivMod64 hu = divmod_nonneg(Snake::unit_at(p.num_ctas, cta, k), N);
    const DivMod64 bh = divmod_nonneg(hu.q, p.nheads_k);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r), N - 1 - static_cast<int32_t>(hu.r)};
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) {
    return group_size(p) * m_block_range(p, t.n_block).size();
  }
  // Run-0 contributors of Q tile m: KV tiles j < N with k j <= m.
  DASH_HD static int32_t run0_size(const Problem& p, int32_t m) {
    const int32_t n = (m >> (spacing(p) - 1)) + 1, N = num_n_blocks(p);  // k is 1 or 2
    return n < N ? n : N;
  }
  DASH_HD static int32_t contributors(const Problem& p, int32_t m, int32_t run) {
    return run == 0 ? run0_size(p, m) : num_n_blocks(p) - run0_size(p, m);
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const int32_t M = num_m_blocks(p), N = num_n_blocks(p);
    const int32_t j = t.n_block, k = spacing(p);
    const StepSplit st = split_step_heads_outer(step, M, group_size(p), t.head_k);
    // k j <= M where ShiftRuns applies (waits_free): the division only at k j = M (the producer's registers are few).
    const int32_t kj = k * j;
    const int32_t start = kj < M ? kj : static_cast<int32_t>(static_cast<uint32_t>(kj) % static_cast<uint32_t>(M));
    const int32_t m = pos_mod_near(start + st.s, M);
    if (k * j <= m) return Visit{st.head, m, run0_size(p, m) - 1 - j, 0};
    return Visit{st.head, m, N - 1 - j, 1};
  }
};

// Bands without a left bound (causal, causal-like windows), any tile counts and seqlen_q != seqlen_k. Per (batch, KV
// head) with N KV tiles, Q = N / 2 pairs: unit u pairs long tile u with short tile N-1-u on one CTA, so units carry
// equal work and a head's units stay in step. With odd N the middle tile Q is a unit of its own, launched after every
// pair unit of the grid, and adds last in run 1. Falls back to ShiftRuns for a full mask and to Descending with a left
// bound. Two walks, by the band's shape alone:
// - Stepped (some long tile starts below Q tile 0: square and taller bands, and wide ones where fewer than half of the
//   KV tiles see every Q tile): the long tile walks up from its first live Q tile lo_u and arrives at Q tile m at step
//   m - lo_u: the longs arrive in descending u (run 0). The short tile then walks down from the last Q tile and
//   arrives at step (M - lo_u) + (M - 1 - m): the shorts arrive in descending u too (run 1). Units launch head-major
//   in descending u.
// - Rotated (causal masks where every long tile sees every Q tile: seqlen_q at most about half of seqlen_k). There
//   the stepped walk brings every long tile to a Q tile at the same step, and every short tile too, so each dQ chain
//   takes one add after the other. Instead unit u starts at r_u = the short tile's first live Q tile: the long tile
//   walks Q tiles r_u .. M-1 (run 0, arriving at m at step m - r_u), then wraps to 0 .. r_u - 1 (run 1, step
//   M - r_u + m); the short tile then walks up from r_u (run 1, step M + m - r_u). r_u falls as u grows, so both
//   runs take the units in ascending u, one after another as they arrive; every unit adds once to run 1 of every Q
//   tile. Units launch head-major in ascending u. Units whose short tile also sees every Q tile (r_u = 0) still meet
//   in step.
struct ShiftCausalRuns {
  DASH_HD static bool applies(const Problem& p) { return ShiftCausal::applies(p); }
  // The pairing's layout and which walk it takes. Rotated on causal masks only: the window kernels, which run this
  // schedule on windows without a left bound (never under `auto`), keep the stepped walk, whose code the rotated one
  // pushed into spills there (hdim 128: 60 -> 96 bytes).
  struct Layout : ShiftCausal::Layout {
    bool rotated;
  };
  DASH_HD static Layout layout(const Problem& p) {
    const ShiftCausal::Layout pairing = ShiftCausal::layout(p);
    return Layout{pairing, p.mask == MaskKind::kCausal && pairing.Q > 0 && pairing.Rs == 0};
  }
  // The pair unit of index r among its head's units, in launch order (descending u unless rotated).
  DASH_HD static int32_t unit_of_index(const Layout& l, int32_t r) { return ShiftCausal::pair_unit(l, r, !l.rotated); }

  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) { return ShiftCausal::num_items_applied(p, cta); }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    const Layout l = layout(p);
    return ShiftCausal::item_paired(p, l, cta, k, !l.rotated);
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return ShiftRuns::num_visits(p, t); }
  // Whether a tile walks its GQA group's query heads one after another (split_step_heads_outer) rather than every
  // query head at each Q tile: from groups of 4 (8 where Q tiles are 128 rows tall, hdim 64). The CPU model with the
  // L2 term put the heads outermost at 0.55-0.97x the makespan there and at 1.00-1.06x at the smaller groups; an H100
  // ran hdim 128 GQA 4 1.22-1.40x faster (docs/tuning.md). A function of the group size and the tile shape, so the
  // dK/dV sums stay invariant.
  DASH_HD static bool heads_outer(const Problem& p) {
    const int32_t g = group_size(p);
    return g >= (p.block_m >= 128 ? 8 : 4);
  }
  // The batched causal kernels claim the units at run time instead (bwd_tile_scheduler.h), two items a unit in launch
  // order: the pair units (long tile, then short), then the middle units (the middle tile, then tile N, which has no
  // visits and stores nothing). The items, walks and positions are those dealt above, so the bits are the same; the
  // claims start every unit in launch order, where the deal starts some of a head's units a wave late.
  DASH_HD static int64_t num_claimed_units(const Problem& p) { return ShiftCausal::total_units(p, ShiftCausal::layout(p)); }
  DASH_HD static KvTile claimed_item(const Problem& p, int64_t unit, bool second) {
    const Layout l = layout(p);
    return ShiftCausal::unit_tile(p, l, unit, second, !l.rotated);
  }

  // Contributors of Q tile m are the KV tiles [0, hi); longs are [0, Q), shorts [N - Q, N), the middle Q.
  DASH_HD static int32_t contributors(const Problem& p, int32_t m, int32_t run) {
    const Layout l = layout(p);
    const int32_t hi = n_block_range(p, m).hi;
    if (l.rotated) {
      // Run 0: the long tiles of the units with r_u <= m, i.e. whose short tile is live at m; run 1: every unit.
      if (run == 0) return l.Q - rotated_first_unit(l.N, l.Q, hi);
      return l.Q + (l.has_middle && hi > l.Q ? 1 : 0);
    }
    if (run == 0) return hi < l.Q ? hi : l.Q;
    const int32_t shorts = hi > l.N - l.Q ? hi - (l.N - l.Q) : 0;
    return shorts + (l.has_middle && hi > l.Q ? 1 : 0);
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const Layout l = layout(p);
    const int32_t n = t.n_block;
    const int32_t g = group_size(p);
    const BlockRange walk = m_block_range(p, n);
    const StepSplit st = heads_outer(p) ? split_step_heads_outer(step, walk.size(), g, t.head_k)
                                        : split_step(step, g, t.head_k);
    if (l.rotated) return rotated_visit(p, l, n, walk.lo, st);
    if (n < l.Q) {  // long: up from its first live Q tile
      const int32_t m = walk.lo + st.s;
      return Visit{st.head, m, contributors(p, m, 0) - 1 - n, 0};
    }
    const int32_t m = l.M - 1 - st.s;
    if (l.has_middle && n == l.Q) {  // after every short of m
      const int32_t hi = n_block_range(p, m).hi;
      return Visit{st.head, m, hi > l.N - l.Q ? hi - (l.N - l.Q) : 0, 1};
    }
    return Visit{st.head, m, n - (l.N - l.Q), 1};  // short: every short below it contributes to m too
  }

 private:
  // The first unit whose short tile is live at a Q tile whose contributors are the KV tiles [0, hi).
  DASH_HD static int32_t rotated_first_unit(int32_t N, int32_t Q, int32_t hi) {
    const int32_t u0 = N - hi;
    return u0 < 0 ? 0 : (u0 > Q ? Q : u0);
  }
  // lo: tile n's first live Q tile.
  DASH_HD static Visit rotated_visit(const Problem& p, const Layout& l, int32_t n, int32_t lo, const StepSplit& st) {
    if (l.has_middle && n == l.Q) {  // up from its first live Q tile, after every pair unit
      return Visit{st.head, lo + st.s, l.Q, 1};
    }
    const bool is_long = n < l.Q;
    const int32_t u = is_long ? n : l.N - 1 - n;
    const int32_t r = m_block_range(p, l.N - 1 - u).lo;
    if (is_long && st.s < l.M - r) {
      const int32_t m = r + st.s;
      return Visit{st.head, m, u - rotated_first_unit(l.N, l.Q, n_block_range(p, m).hi), 0};
    }
    const int32_t m = is_long ? st.s - (l.M - r) : r + st.s;
    return Visit{st.head, m, u, 1};
  }
};

// Adds into accumulator `run` of Q tile m of problem p under the resolved kind `kind` (resolve_schedule); the
// postprocess reads it through tile_contributors (schedule.h). Every other schedule keeps one accumulator per tile.
DASH_HD inline int32_t run_contributors(ScheduleKind kind, const Problem& p, int32_t m, int32_t run) {
  if (kind == ScheduleKind::kShiftRuns) return ShiftRuns::contributors(p, m, run);
  if (kind == ScheduleKind::kShiftCausalRuns) return ShiftCausalRuns::contributors(p, m, run);
  return run == 0 ? n_block_range(p, m).size() : 0;
}

}  // namespace dash::sched
