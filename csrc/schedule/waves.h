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
    const DivMod64 qr = divmod_nonneg(total, ctas);
    const int64_t full = qr.q, rem = qr.r;
    if (rem == 0) return full;
    const int64_t slot = (full & 1) ? ctas - 1 - cta : cta;
    return full + (slot < rem ? 1 : 0);
  }
  // Position of the k-th unit of CTA `cta` in its wave: its launch index mod ctas.
  DASH_HD static int32_t slot_at(int32_t ctas, int32_t cta, int64_t k) { return (k & 1) ? ctas - 1 - cta : cta; }
  // Launch index of the k-th unit of CTA `cta`.
  DASH_HD static int64_t unit_at(int32_t ctas, int32_t cta, int64_t k) { return k * ctas + slot_at(ctas, cta, k); }
  DASH_HD static int32_t cta_of(int32_t ctas, int64_t unit) {
    const DivMod64 qr = divmod_nonneg(unit, ctas);
    const int64_t wave = qr.q, slot = qr.r;
    return static_cast<int32_t>((wave & 1) ? ctas - 1 - slot : slot);
  }
};

// Local units u of one (batch, KV head) whose launch index is base + stride * u (u < units_per_head) and that share
// a wave with local unit u, as a range [lo, hi), given the unit's wave slot r = (base + stride * u) mod ctas.
// The wave starts at launch index L - r, so lo = ceil((stride * u - r) / stride) clamped at 0, i.e.
// max(0, u - floor(r / stride)), and hi = u + ceil((ctas - r) / stride) clamped at units_per_head: 32-bit arithmetic
// (r < ctas). The range lies in [0, units_per_head] (a tile count, int32).
// The slot comes from the launch index (wave_slot) or, in the kernel, from the CTA and item index (Snake::slot_at),
// which needs no 64-bit division.
DASH_HD inline int32_t wave_slot(int32_t ctas, int64_t launch_index) {
  return static_cast<int32_t>(divmod_nonneg(launch_index, ctas).r);
}
DASH_HD inline void wave_span(int32_t ctas, int32_t r, int64_t stride, int32_t units_per_head, int32_t u,
                              int32_t* lo, int32_t* hi) {
  const bool wide = stride > INT32_MAX;  // then r / stride = 0 and ceil((ctas - r) / stride) = 1
  const int32_t below = wide ? 0 : div_u32(r, static_cast<int32_t>(stride));
  const int32_t ahead = wide ? 1 : div_u32(static_cast<int64_t>(ctas) - r + stride - 1, static_cast<int32_t>(stride));
  *lo = u > below ? u - below : 0;
  *hi = static_cast<int32_t>(min64(units_per_head, static_cast<int64_t>(u) + ahead));
}

// The counts below run per visit, so they are 32-bit: every caller counts tiles or local units of one
// (batch, KV head) (x <= N or Q, int32), cyclically modulo a Q-tile count (period <= M, int32), whole * len <= x_end.

// |[a, b) intersect [c, d)|
DASH_HD inline int32_t overlap(int32_t a, int32_t b, int32_t c, int32_t d) {
  const int32_t lo = a > c ? a : c, hi = b < d ? b : d;
  return hi > lo ? hi - lo : 0;
}

// #{x in [0, x_end) : (x - r0) mod period < len}, for 0 <= r0 < period, 0 <= len <= period, 0 <= x_end <= INT32_MAX.
DASH_HD inline int32_t count_cyclic_below(int32_t x_end, int32_t r0, int32_t len, int32_t period) {
  const uint32_t whole = static_cast<uint32_t>(x_end) / static_cast<uint32_t>(period);
  const int32_t rem = x_end - static_cast<int32_t>(whole) * period;
  int32_t n = static_cast<int32_t>(whole) * len;
  if (len <= period - r0) {
    n += overlap(0, rem, r0, r0 + len);
  } else {
    n += overlap(0, rem, r0, period) + overlap(0, rem, 0, len - (period - r0));
  }
  return n;
}

// #{x in [a, b) : (x - r0) mod period < len}, 0 <= a, b <= INT32_MAX.
DASH_HD inline int32_t count_cyclic(int32_t a, int32_t b, int32_t r0, int32_t len, int32_t period) {
  if (b <= a) return 0;
  return count_cyclic_below(b, r0, len, period) - count_cyclic_below(a, r0, len, period);
}

// a mod m in [0, m), m > 0.
DASH_HD inline int32_t pos_mod(int32_t a, int32_t m) {
  const int32_t r = a % m;
  return r < 0 ? r + m : r;
}
// a mod m for -m <= a < 2m: one wrap, no division.
DASH_HD inline int32_t pos_mod_near(int32_t a, int32_t m) {
  return a < 0 ? a + m : (a >= m ? a - m : a);
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
      const DivMod64 qr = divmod_nonneg(unit, num_n_blocks(p));
      head_index = qr.q;
      n = qr.r;
    } else {
      const int64_t heads = num_kv_heads_total(p);
      const DivMod64 qr = divmod_nonneg(unit, heads);
      head_index = qr.r;
      n = qr.q;
    }
    const DivMod64 bh = divmod_nonneg(head_index, p.nheads_k);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r),
                  static_cast<int32_t>(n)};
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return tile_of_unit(p, Snake::unit_at(p.num_ctas, cta, k));
  }
  // Launch index of tile t (the inverse of tile_of_unit).
  DASH_HD static int64_t unit_of(const Problem& p, const KvTile& t) {
    const int64_t head_index = static_cast<int64_t>(t.batch) * p.nheads_k + t.head_k;
    return kOrder == TileOrder::kHeadMajor ? head_index * num_n_blocks(p) + t.n_block
                                           : head_index + num_kv_heads_total(p) * t.n_block;
  }
  // Wave slot of tile t (its launch index mod num_ctas), from the tile, or from the item that produced it.
  DASH_HD static int32_t slot_of(const Problem& p, const KvTile& t) { return wave_slot(p.num_ctas, unit_of(p, t)); }
  DASH_HD static int32_t slot_of_item(const Problem& p, int32_t cta, int64_t k) {
    return Snake::slot_at(p.num_ctas, cta, k);
  }
  // Range [lo, hi) of KV tiles of this tile's (batch, KV head) that run in the same wave as it (wave slot r).
  DASH_HD static void wave_of(const Problem& p, const KvTile& t, int32_t r, int32_t* lo, int32_t* hi) {
    const int32_t N = num_n_blocks(p);
    if (kOrder == TileOrder::kHeadMajor) {
      wave_span(p.num_ctas, r, 1, N, t.n_block, lo, hi);
    } else {
      wave_span(p.num_ctas, r, num_kv_heads_total(p), N, t.n_block, lo, hi);
    }
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) {
    return group_size(p) * m_block_range(p, t.n_block).size();
  }
};

}  // namespace dash::sched
