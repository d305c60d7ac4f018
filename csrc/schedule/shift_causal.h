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
    if (!applies(p)) return Shift::num_items(p, cta);
    const Layout l = layout(p);
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    const int64_t units = Snake::units_on(total_units(p, l), p.num_ctas, cta);
    return 2 * pairs + (units - pairs);
  }

  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    if (!applies(p)) return Shift::item(p, cta, k);
    const Layout l = layout(p);
    const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
    int64_t head_index;
    int32_t n;
    if (k < 2 * pairs) {
      const int64_t unit = Snake::unit_at(p.num_ctas, cta, k / 2);
      head_index = unit / l.Q;
      const int32_t u = static_cast<int32_t>(unit % l.Q);
      n = (k % 2 == 0) ? u : l.N - 1 - u;
    } else {
      head_index = Snake::unit_at(p.num_ctas, cta, pairs + (k - 2 * pairs)) - l.pair_units;
      n = l.Q;
    }
    return KvTile{static_cast<int32_t>(head_index / p.nheads_k), static_cast<int32_t>(head_index % p.nheads_k), n};
  }

  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Shift::Units::num_visits(p, t); }

  DASH_HD static Role role(const Layout& l, int32_t n) {
    if (n < l.Q) return Role::kLong;
    return (l.has_middle && n == l.Q) ? Role::kMiddle : Role::kShort;
  }

  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    if (!applies(p)) return Shift::visit(p, t, step);
    const Layout l = layout(p);
    const int32_t g = group_size(p);
    const int32_t s = step / g;
    const int32_t head = t.head_k * g + step % g;
    const Role r = role(l, t.n_block);
    int32_t m;
    if (r == Role::kLong) {
      m = s < l.R ? l.Rs + (t.n_block + s) % l.R : m_block_range(p, t.n_block).lo + (s - l.R);
    } else {
      m = l.M - 1 - s;
    }
    return Visit{head, m, static_cast<int32_t>(position(p, l, t, r, m))};
  }

  // Accumulation position of tile t (role r) in dQ tile m of its head.
  DASH_HD static int64_t position(const Problem& p, const Layout& l, const KvTile& t, Role r, int32_t m) {
    const int64_t contrib_hi = n_block_range(p, m).hi;   // contributors are KV tiles [0, contrib_hi)
    const int64_t longs_hi = min64(l.Q, contrib_hi);     // units whose long tile contributes: [0, longs_hi)
    const int64_t shorts_lo = max64(0, l.N - contrib_hi);  // units whose short tile contributes: [shorts_lo, Q)
    if (r == Role::kMiddle) return longs_hi + overlap(shorts_lo, l.Q, 0, l.Q);
    const int64_t u = (r == Role::kLong) ? t.n_block : l.N - 1 - t.n_block;
    const int64_t head_index = static_cast<int64_t>(t.batch) * p.nheads_k + t.head_k;
    int64_t wave_lo, wave_hi;
    wave_span(p.num_ctas, head_index * l.Q, 1, l.Q, u, &wave_lo, &wave_hi);
    const int64_t earlier = overlap(0, longs_hi, 0, wave_lo) + overlap(shorts_lo, l.Q, 0, wave_lo);
    if (r == Role::kShort) {
      // m >= Rs here: every long of the wave came first, then shorts of higher unit index.
      return earlier + (wave_hi - wave_lo) + (wave_hi - u - 1);
    }
    if (m < l.Rs) {
      // Triangle: only longs with lo <= m contribute, the later-starting (higher) ones arrive first.
      return earlier + (min64(wave_hi, longs_hi) - u - 1);
    }
    const int64_t step = pos_mod(m - l.Rs - u, l.R);
    const int64_t sooner = count_cyclic(wave_lo, wave_hi, pos_mod(m - l.Rs - step + 1, l.R), step, l.R);
    const int64_t ties = (u - wave_lo) / l.R;
    return earlier + sooner + ties;
  }
};

}  // namespace dash::sched
