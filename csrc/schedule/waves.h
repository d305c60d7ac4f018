// Static persistent-grid arithmetic shared by all schedules: which CTA runs which work unit, in which wave, and the
// cyclic counting that turns "arrival order" into an O(1) accumulation position.
//
// Work units (one KV tile, or a pair of KV tiles for shift_causal) have a global launch index L. Wave w holds units
// [w*C, (w+1)*C) of a C-CTA grid, one per CTA, dealt boustrophedon (even waves CTA 0..C-1, odd waves C-1..0). The
// snake is a static stand-in for greedy dispatch: a CTA that got a long unit in one wave gets a short one in the
// next, so the per-CTA totals of a causal problem stay balanced.
//
// Deadlock-freedom argument used by every schedule: give each visit a key that increases along a CTA's execution and
// order the contributors of each dQ tile by increasing key. Every waiting edge then points from a smaller to a larger
// key, so the wait graph is acyclic and the static grid always makes progress, for every CTA count. The keys used:
// (launch index L of the unit, step t) for ascending/descending (pi = ascending KV index = ascending L within a
// head), and (wave of the unit, per-unit class, step t, tie-break) for spt/shift/shift_causal. A CTA's units have
// strictly increasing L and waves, and steps inside a unit strictly increase.
#pragma once
#include "schedule/problem.h"

namespace dash::sched {

struct Snake {
  // Units that CTA `cta` runs when `total` units are dealt over `ctas` CTAs. The k-th unit of a CTA does not depend on
  // `total`, so the same call with a smaller total counts how many of the CTA's units lie below that bound.
  DASH_HD static int64_t units_on(int64_t total, int32_t ctas, int32_t cta) {
    const int64_t full = total / ctas, rem = total % ctas;
    if (rem == 0) return full;
    const int64_t slot = (full & 1) ? ctas - 1 - cta : cta;
    return full + (slot < rem ? 1 : 0);
  }
  // Launch index of the k-th unit of CTA `cta`.
  DASH_HD static int64_t unit_at(int32_t ctas, int32_t cta, int64_t k) {
    const int64_t slot = (k & 1) ? ctas - 1 - cta : cta;
    return k * ctas + slot;
  }
  DASH_HD static int32_t cta_of(int32_t ctas, int64_t unit) {
    const int64_t wave = unit / ctas, slot = unit % ctas;
    return static_cast<int32_t>((wave & 1) ? ctas - 1 - slot : slot);
  }
};

DASH_HD inline int64_t ceil_div_pos(int64_t a, int64_t b) { return a > 0 ? (a + b - 1) / b : 0; }

// Local units u of one (batch, KV head) whose launch index is base + stride * u (u < units_per_head) and that share
// a wave with local unit u, as a range [lo, hi).
DASH_HD inline void wave_span(int32_t ctas, int64_t base, int64_t stride, int64_t units_per_head, int64_t u,
                              int64_t* lo, int64_t* hi) {
  const int64_t wave = (base + stride * u) / ctas;
  *lo = ceil_div_pos(wave * ctas - base, stride);
  *hi = min64(units_per_head, ceil_div_pos((wave + 1) * ctas - base, stride));
}

// |[a, b) intersect [c, d)|
DASH_HD inline int64_t overlap(int64_t a, int64_t b, int64_t c, int64_t d) {
  const int64_t lo = max64(a, c), hi = min64(b, d);
  return hi > lo ? hi - lo : 0;
}

// #{x in [0, x_end) : (x - r0) mod period < len}, for 0 <= r0 < period, 0 <= len <= period, x_end >= 0.
DASH_HD inline int64_t count_cyclic_below(int64_t x_end, int64_t r0, int64_t len, int64_t period) {
  const int64_t whole = x_end / period, rem = x_end % period;
  int64_t n = whole * len;
  if (r0 + len <= period) {
    n += overlap(0, rem, r0, r0 + len);
  } else {
    n += overlap(0, rem, r0, period) + overlap(0, rem, 0, r0 + len - period);
  }
  return n;
}

// #{x in [a, b) : (x - r0) mod period < len}
DASH_HD inline int64_t count_cyclic(int64_t a, int64_t b, int64_t r0, int64_t len, int64_t period) {
  if (b <= a) return 0;
  return count_cyclic_below(b, r0, len, period) - count_cyclic_below(a, r0, len, period);
}

DASH_HD inline int64_t pos_mod(int64_t a, int64_t m) {
  const int64_t r = a % m;
  return r < 0 ? r + m : r;
}

// How single-KV-tile work units are numbered (launch order).
enum class TileOrder : int32_t {
  kHeadMajor,  // L = head_index * N + n: a head's tiles launch together (shift needs them side by side)
  kTileMajor,  // L = n * heads + head_index: KV tile 0 of every head first, i.e. longest-first under a causal mask,
               // an LPT order that keeps the static grid balanced when heads are longer than a wave
};

// Work-unit layout of the schedules whose unit is one KV tile; ascending KV index within a head in both orders.
template <TileOrder kOrder>
struct TileUnits {
  DASH_HD static int64_t num_units(const Problem& p) { return num_kv_heads_total(p) * num_n_blocks(p); }
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return Snake::units_on(num_units(p), p.num_ctas, cta);
  }
  DASH_HD static KvTile tile_of_unit(const Problem& p, int64_t unit) {
    int64_t head_index, n;
    if (kOrder == TileOrder::kHeadMajor) {
      const int64_t N = num_n_blocks(p);
      head_index = unit / N;
      n = unit % N;
    } else {
      const int64_t heads = num_kv_heads_total(p);
      head_index = unit % heads;
      n = unit / heads;
    }
    return KvTile{static_cast<int32_t>(head_index / p.nheads_k), static_cast<int32_t>(head_index % p.nheads_k),
                  static_cast<int32_t>(n)};
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return tile_of_unit(p, Snake::unit_at(p.num_ctas, cta, k));
  }
  // Range [lo, hi) of KV tiles of this tile's (batch, KV head) that run in the same wave as it.
  DASH_HD static void wave_of(const Problem& p, const KvTile& t, int64_t* lo, int64_t* hi) {
    const int64_t head_index = static_cast<int64_t>(t.batch) * p.nheads_k + t.head_k;
    const int64_t N = num_n_blocks(p);
    if (kOrder == TileOrder::kHeadMajor) {
      wave_span(p.num_ctas, head_index * N, 1, N, t.n_block, lo, hi);
    } else {
      wave_span(p.num_ctas, head_index, num_kv_heads_total(p), N, t.n_block, lo, hi);
    }
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) {
    return group_size(p) * m_block_range(p, t.n_block).size();
  }
};

}  // namespace dash::sched
