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
// Batch-invariant while each head's units fall in one wave, outside a split tail (see shift.h). Falls back to Shift
// for a full mask and to Descending for windows with a left bound.
// The last, partial wave of pair units is cut into one chunk of steps per CTA (tail_split.h) where every pair has the
// same step count (causal with seqlen_q = seqlen_k among others) and N is even; its pi: after the whole waves, by
// position in chunk, ties by tail tile.
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
  DASH_HD static StepRange item_steps(const Problem& p, int32_t cta, int64_t k) {
    if (!applies(p)) return Shift::item_steps(p, cta, k);
    const TailSplit ts = tail(p);
    if (ts.in_tail(k)) return tail_steps(p, ts, cta, k);
    return StepRange{0, num_visits(p, item_with(p, ts, cta, k))};
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    if (!applies(p)) return Shift::visit(p, t, step);
    const TailSplit ts = tail(p);
    if (ts.active && unit_of(p, t) >= ts.first_unit) return tail_visit(p, ts, t, step);
    return visit_applied(p, t, step, slot_of(p, t));
  }

  // The schedule proper, for problems where applies(p) holds (the kernel resolves the fallback once, on the host).
  DASH_HD static int64_t num_items_applied(const Problem& p, int32_t cta) { return num_items_with(p, tail(p), cta); }
  DASH_HD static KvTile item_applied(const Problem& p, int32_t cta, int64_t k) {
    return item_with(p, tail(p), cta, k);
  }

  // The items of the whole grid when the last wave is not split: both tiles of each pair unit, then middle tiles.
  DASH_HD static int64_t whole_num_items(const Problem& p, int32_t cta) {
    const Layout l = layout(p);
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    const int64_t units = Snake::units_on(total_units(p, l), p.num_ctas, cta);
    return 2 * pairs + (units - pairs);
  }

  DASH_HD static KvTile whole_item(const Problem& p, int32_t cta, int64_t k) {
    const Layout l = layout(p);
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    int64_t head_index;
    int32_t n;
    if (k < 2 * pairs) {
      const int64_t unit = Snake::unit_at(p.num_ctas, cta, k / 2);
      const DivMod64 qr = divmod_nonneg(unit, l.Q);
      head_index = qr.q;
      const int32_t u = static_cast<int32_t>(qr.r);
      n = (k % 2 == 0) ? u : l.N - 1 - u;
    } else {
      head_index = Snake::unit_at(p.num_ctas, cta, pairs + (k - 2 * pairs)) - l.pair_units;
      n = l.Q;
    }
    const DivMod64 bh = divmod_nonneg(head_index, p.nheads_k);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r), n};
  }

  // ---- The split last wave (tail_split.h). A tail unit is a pair: tile 0 its long tile, tile 1 its short one. ----
  // Steps of the long tile of pair u, i.e. the pair's split point.
  DASH_HD static int32_t long_steps(const Problem& p, int32_t u) {
    return group_size(p) * m_block_range(p, u).size();
  }
  DASH_HD static int32_t short_steps(const Problem& p, const Layout& l, int32_t u) {
    return group_size(p) * m_block_range(p, l.N - 1 - u).size();
  }
  // Host: the split needs every pair to have the same steps (the tail lays them end to end at a fixed stride) and
  // no middle tiles (a unit of one tile in the last wave); both tiles of a pair need steps to have pieces. Causal
  // masks only: the split's code lives in the causal kernels alone (causal-like windows keep whole units).
  DASH_HD static TailSplit tail(const Problem& p) {
    const Layout l = layout(p);
    if (p.mask != MaskKind::kCausal || p.tail_chunk_min <= 0 || l.has_middle || l.Q == 0) return TailSplit{};
    const int32_t V = long_steps(p, 0) + short_steps(p, l, 0);
    for (int32_t u = 0; u < l.Q; ++u) {
      const int32_t a = long_steps(p, u), b = short_steps(p, l, u);
      if (a == 0 || b == 0 || a + b != V) return TailSplit{};
    }
    return TailSplit::of(p, l.pair_units, V, 2);
  }
  // Split point a(i) of tail unit i: the steps of its long tile (pair u = (first unit + i) mod Q).
  struct TailPoints {
    static constexpr int32_t kTilesPerUnit = 2;
    Problem p;  // by value: a reference would give the kernel's copy an address, i.e. put it on the stack
    int32_t first_u, Q;
    DASH_HD int32_t operator()(int32_t i) const {
      return long_steps(p, static_cast<int32_t>(static_cast<uint32_t>(first_u + i) % static_cast<uint32_t>(Q)));
    }
  };
  DASH_HD static TailPoints tail_points(const Problem& p, const TailSplit& ts) {
    const int32_t Q = num_n_blocks(p) / 2;
    return TailPoints{p, static_cast<int32_t>(divmod_nonneg(ts.first_unit, Q).r), Q};
  }

  DASH_HD static int64_t num_items_with(const Problem& p, const TailSplit& ts, int32_t cta) {
    return ts.active ? ts.whole_items() + ts.tiles_in(cta, tail_points(p, ts)) : whole_num_items(p, cta);
  }
  DASH_HD static KvTile item_with(const Problem& p, const TailSplit& ts, int32_t cta, int64_t k) {
    if (!ts.in_tail(k)) return whole_item(p, cta, k);
    const int32_t tau = ts.tile_of_item(cta, k, tail_points(p, ts));
    const int32_t Q = num_n_blocks(p) / 2;
    const DivMod64 qr = divmod_nonneg(ts.unit_of_tile(tau), Q);
    const DivMod64 bh = divmod_nonneg(qr.q, p.nheads_k);
    const int32_t u = static_cast<int32_t>(qr.r);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r), (tau & 1) ? 2 * Q - 1 - u : u};
  }
  DASH_HD static StepRange tail_steps(const Problem& p, const TailSplit& ts, int32_t cta, int64_t k) {
    const TailPoints a = tail_points(p, ts);
    return ts.steps(ts.tile_of_item(cta, k, a), cta, a);
  }
  // Launch index of the pair unit of long or short tile t.
  DASH_HD static int64_t unit_of(const Problem& p, const KvTile& t) {
    const int32_t N = num_n_blocks(p), Q = N / 2;
    const int32_t u = t.n_block < Q ? t.n_block : N - 1 - t.n_block;
    return (static_cast<int64_t>(t.batch) * p.nheads_k + t.head_k) * Q + u;
  }
  // Index tau of tail tile t: 2 * (its unit's index in the tail) + (short ? 1 : 0).
  DASH_HD static int32_t tail_tile(const Problem& p, const TailSplit& ts, const KvTile& t) {
    return 2 * static_cast<int32_t>(unit_of(p, t) - ts.first_unit) + (t.n_block >= num_n_blocks(p) / 2 ? 1 : 0);
  }

  // A visit of a tail tile: its Q tile as in the whole waves; its position comes after the head's contributors of
  // the whole waves (all of them precede it), then by position in chunk, ties by tail tile (tail_split.h). The
  // head's tail units are its pairs u' >= u - i (tail unit i + u' - u); the long tile of u' contributes to Q tile m
  // iff u' < hi, the short one iff N - 1 - u' < hi (contributors are the prefix [0, hi)). One pass over them: the
  // tail holds fewer than num_ctas units.
  DASH_HD static Visit tail_visit(const Problem& p, const TailSplit& ts, const KvTile& t, int32_t step) {
    const Layout l = layout(p);
    const int32_t g = group_size(p);
    const StepSplit st = split_step(step, g, t.head_k);
    const int32_t h = step - st.s * g;
    const Role r = role(l, t.n_block);
    const int32_t u = r == Role::kLong ? t.n_block : l.N - 1 - t.n_block;
    const int32_t m = q_tile(p, l, r, t.n_block, st.s);
    const int32_t tau = tail_tile(p, ts, t);
    const int32_t i = tau >> 1;
    const int32_t mine = ts.position_at(i * ts.visits + (r == Role::kLong ? 0 : long_steps(p, u)) + step);
    const int32_t hi = n_block_range(p, m).hi;
    // Tail unit i + d holds the head's pair u + d; x: a step's place in the tail's step sequence.
    const int32_t d0 = (u > i ? u - i : 0) - u, V = ts.visits;
    int32_t sooner = 0;
    auto count = [&](int32_t x, int32_t tau_other) {
      const int32_t theirs = ts.position_at(x);
      sooner += (theirs < mine || (theirs == mine && tau_other < tau)) ? 1 : 0;
    };
    const int32_t longs_end = (hi < l.Q ? hi : l.Q) - u;  // long tiles u + d < hi contribute
#pragma unroll 1
    for (int32_t d = d0; d < longs_end; ++d) {
      const int32_t up = u + d;
      const int32_t s_long = m >= l.Rs ? pos_mod(m - l.Rs - up, l.R) : l.R + (m - m_block_range(p, up).lo);
      count((i + d) * V + s_long * g + h, 2 * (i + d));
    }
    const int32_t shorts_begin = (l.N - hi > u + d0 ? l.N - hi - u : d0);  // short tiles N - 1 - (u + d) < hi
    const int32_t shorts_end = l.Q - u;
#pragma unroll 1
    for (int32_t d = shorts_begin; d < shorts_end; ++d) {
      count((i + d) * V + long_steps(p, u + d) + (l.M - 1 - m) * g + h, 2 * (i + d) + 1);
    }
    const int32_t in_tail =
        (longs_end > d0 ? longs_end - d0 : 0) + (shorts_end > shorts_begin ? shorts_end - shorts_begin : 0);
    return Visit{st.head, m, hi - in_tail + sooner};
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

  // Q tile of step s (of its own query head) of tile n, role r.
  DASH_HD static int32_t q_tile(const Problem& p, const Layout& l, Role r, int32_t n, int32_t s) {
    if (r != Role::kLong) return l.M - 1 - s;
    return s < l.R ? l.Rs + (n + s) % l.R : m_block_range(p, n).lo + (s - l.R);
  }

  // slot: the tile's wave slot (slot_of, slot_of_item).
  DASH_HD static Visit visit_applied(const Problem& p, const KvTile& t, int32_t step, int32_t slot) {
    const Layout l = layout(p);
    const StepSplit st = split_step(step, group_size(p), t.head_k);
    const Role role_of = role(l, t.n_block);
    const int32_t m = q_tile(p, l, role_of, t.n_block, st.s);
    return Visit{st.head, m, position(p, l, t, role_of, m, slot)};
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
