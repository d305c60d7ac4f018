// Shift-causal (DASH symmetric pairing), for bands without a left bound (causal, causal-like windows), any tile
// counts and seqlen_q != seqlen_k.
//
// Per (batch, KV head) with N KV tiles and Q = N/2 pairs: work unit u < Q is the pair (long tile u, short tile
// N-1-u), run back to back on one CTA, so every unit carries about the same work. With odd N the middle tile Q is a
// unit of its own; middle units are launched after all pair units of the grid (shorter work last).
//   long tile u:  first the rectangle [Rs, M) shared by all long tiles (Rs = first live Q tile of the last long tile),
//                 cyclically shifted: Q tile Rs + (u + s) mod R at step s (R = M - Rs), so the long tiles of a wave
//                 sit on distinct Q tiles; then its own triangle [lo_u, Rs) ascending from the diagonal, where
//                 arrival steps R + (m - lo_u) again differ between tiles.
//   short tile, middle tile: descending from the last Q tile; shorts only touch Q tiles >= Rs, after every long.
// pi at Q tile m (arrival order of units that start a wave together): earlier waves first; in the wave, rectangle
// longs by step (ties by ascending u), triangle longs by descending u, then shorts by ascending KV index; middle
// tiles last. Every rule sorts by (wave, class, step, tie) so it is deadlock-free for any grid (waves.h).
// Batch-invariant while each head's units fall in one wave (see shift.h). Falls back to Shift for a full mask and
// to Descending for windows with a left bound.
#pragma once
#include "schedule/shift.h"

namespace dash::sched {

struct ShiftCausal {
  // Per-head geometry of the pairing.
  struct Layout {
    int32_t N, M, Q;  // KV tiles, Q tiles, pairs
    int32_t Rs, R;    // rectangle [Rs, M) of Q tiles that every long tile visits, R = M - Rs
    bool has_middle;
    int64_t pair_units;  // pair units in the whole grid (middle units follow them)
  };
  enum class Role : int32_t { kLong, kShort, kMiddle };

  DASH_HD static bool applies(const Problem& p) { return prefix_contributors(p) && !covers_all_tiles(p); }

  DASH_HD static Layout layout(const Problem& p) {
    Layout l;
    l.N = num_n_blocks(p);
    l.M = num_m_blocks(p);
    l.Q = l.N / 2;
    l.Rs = l.Q > 0 ? m_block_range(p, l.Q - 1).lo : 0;
    l.R = l.M - l.Rs;
    l.has_middle = (l.N & 1) != 0;
    l.pair_units = num_kv_heads_total(p) * l.Q;
    return l;
  }

  DASH_HD static int64_t total_units(const Problem& p, const Layout& l) {
    return l.pair_units + (l.has_middle ? num_kv_heads_total(p) : 0);
  }

  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return applies(p) ? num_items_applied(p, cta) : Shift::num_items(p, cta);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return applies(p) ? item_applied(p, cta, k) : Shift::item(p, cta, k);
  }
  // Its own units run whole; the fallback to shift may cut shift's tail.
  DASH_HD static StepRange item_steps(const Problem& p, int32_t cta, int64_t k) {
    return applies(p) ? StepRange{0, num_visits(p, item_applied(p, cta, k))} : Shift::item_steps(p, cta, k);
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    return applies(p) ? visit_applied(p, t, step, slot_of(p, t)) : Shift::visit(p, t, step);
  }

  // The schedule proper, for problems where applies(p) holds (the kernel resolves the fallback once, on the host).
  DASH_HD static int64_t num_items_applied(const Problem& p, int32_t cta) {
    const Layout l = layout(p);
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    const int64_t units = Snake::units_on(total_units(p, l), p.num_ctas, cta);
    return 2 * pairs + (units - pairs);
  }

  DASH_HD static KvTile item_applied(const Problem& p, int32_t cta, int64_t k) {
    return item_paired(p, layout(p), cta, k, false);
  }

  // The pair unit u of index r among its head's pair units in launch order. descending_units: they launch in
  // descending u (ShiftCausalRuns' stepped walk, runs.h), else ascending (shift_causal, and ShiftCausalRuns' rotated
  // walk).
  DASH_HD static int32_t pair_unit(const Layout& l, int32_t r, bool descending_units) {
    return descending_units ? l.Q - 1 - r : r;
  }

  // Item k of a CTA under the pairing: items 2i and 2i+1 are the long and short tile of the CTA's i-th pair unit,
  // later items middle tiles.
  DASH_HD static KvTile item_paired(const Problem& p, const Layout& l, int32_t cta, int64_t k, bool descending_units) {
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    if (k < 2 * pairs) return unit_tile(p, l, Snake::unit_at(p.num_ctas, cta, k / 2), k % 2 != 0, descending_units);
    return unit_tile(p, l, Snake::unit_at(p.num_ctas, cta, pairs + (k - 2 * pairs)), false, descending_units);
  }
  // Tile `second` (else the first) of the unit of launch index `unit`: a pair unit's long tile u, then its short tile
  // N-1-u; a middle unit's middle tile Q, then tile N, past the last (no visits; only claimed units reach it, runs.h).
  DASH_HD static KvTile unit_tile(const Problem& p, const Layout& l, int64_t unit, bool second,
                                  bool descending_units) {
    int64_t head_index;
    int32_t n;
    if (unit < l.pair_units) {
      const DivMod64 qr = divmod_nonneg(unit, l.Q);
      head_index = qr.q;
      const int32_t u = pair_unit(l, static_cast<int32_t>(qr.r), descending_units);
      n = second ? l.N - 1 - u : u;
    } else {
      head_index = unit - l.pair_units;
      n = second ? l.N : l.Q;
    }
    const DivMod64 bh = divmod_nonneg(head_index, p.nheads_k);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r), n};
  }

  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Shift::Units::num_visits(p, t); }

  DASH_HD static Role role(const Layout& l, int32_t n) {
    if (n < l.Q) return Role::kLong;
    return (l.has_middle && n == l.Q) ? Role::kMiddle : Role::kShort;
  }

  // Wave slot of a long or short tile: that of its pair unit (middle tiles do not use one).
  DASH_HD static int32_t slot_of(const Problem& p, const KvTile& t) {
    const Layout l = layout(p);
    if (role(l, t.n_block) == Role::kMiddle) return 0;
    const int32_t u = t.n_block < l.Q ? t.n_block : l.N - 1 - t.n_block;
    return wave_slot(p.num_ctas, (static_cast<int64_t>(t.batch) * p.nheads_k + t.head_k) * l.Q + u);
  }
  // Item k < 2 * pairs is a tile of the CTA's pair unit k / 2; later items are middle tiles.
  DASH_HD static int32_t slot_of_item(const Problem& p, int32_t cta, int64_t k) {
    return Snake::slot_at(p.num_ctas, cta, k / 2);
  }

  // slot: the tile's wave slot (slot_of, slot_of_item).
  DASH_HD static Visit visit_applied(const Problem& p, const KvTile& t, int32_t step, int32_t slot) {
    const Layout l = layout(p);
    const int32_t g = group_size(p);
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t s = st.s;
    const int32_t head = st.head;
    const Role role_of = role(l, t.n_block);
    int32_t m;
    if (role_of == Role::kLong) {
      m = s < l.R ? l.Rs + (t.n_block + s) % l.R : m_block_range(p, t.n_block).lo + (s - l.R);
    } else {
      m = l.M - 1 - s;
    }
    return Visit{head, m, position(p, l, t, role_of, m, slot)};
  }

  // Accumulation position of tile t (role r) in dQ tile m of its head. 32-bit: every count is of KV tiles or units of
  // one head (<= N), and each return value is a sum of non-negative counts bounded by the tile's contributors.
  DASH_HD static int32_t position(const Problem& p, const Layout& l, const KvTile& t, Role r, int32_t m,
                                  int32_t slot) {
    const int32_t contrib_hi = n_block_range(p, m).hi;          // contributors are KV tiles [0, contrib_hi)
    const int32_t longs_hi = l.Q < contrib_hi ? l.Q : contrib_hi;  // units whose long tile contributes: [0, longs_hi)
    const int32_t shorts_lo = l.N > contrib_hi ? l.N - contrib_hi : 0;  // units whose short tile contributes
    if (r == Role::kMiddle) return longs_hi + overlap(shorts_lo, l.Q, 0, l.Q);
    const int32_t u = (r == Role::kLong) ? t.n_block : l.N - 1 - t.n_block;
    int32_t wave_lo, wave_hi;
    wave_span(p.num_ctas, slot, 1, l.Q, u, &wave_lo, &wave_hi);
    const int32_t earlier = overlap(0, longs_hi, 0, wave_lo) + overlap(shorts_lo, l.Q, 0, wave_lo);
    if (r == Role::kShort) {
      // m >= Rs here: every long of the wave came first, then shorts of higher unit index.
      return earlier + (wave_hi - wave_lo) + (wave_hi - u - 1);
    }
    if (m < l.Rs) {
      // Triangle: only longs with lo <= m contribute, the later-starting (higher) ones arrive first.
      return earlier + ((wave_hi < longs_hi ? wave_hi : longs_hi) - u - 1);
    }
    // Rectangle: m - Rs and the step lie in [0, R).
    const int32_t step = pos_mod(m - l.Rs - u, l.R);
    const int32_t sooner = count_cyclic(wave_lo, wave_hi, pos_mod_near(m - l.Rs - step + 1, l.R), step, l.R);
    const int32_t ties = static_cast<int32_t>(static_cast<uint32_t>(u - wave_lo) / static_cast<uint32_t>(l.R));
    return earlier + sooner + ties;
  }
};

}  // namespace dash::sched
