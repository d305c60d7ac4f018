// Descending lanes: descending's accumulation order (each dQ tile sums its KV tiles by ascending index) and its walk
// (each KV tile visits its live Q tiles from the last one down), run on a layout that keeps the grid busy: CTAs form
// groups of `lanes` CTAs, lane l of a group always runs the same KV tile (or, causal, the same pair of tiles) of one
// head after another. Every bit of dQ, dK and dV is descending's, so the schedule is invariant and a dense call
// matches a varlen one; only when adds happen changes.
//
// Why it keeps the grid busy. All KV tiles of a head start at their last Q tile, so in the first head lane j waits j
// steps for the adds of tiles 0..j-1 there; from then on tile j reaches each Q tile one step after tile j-1, without
// waits. Because each lane runs the same tile of the next head as soon as it is done, that stagger carries over from
// head to head: the group pays it once per call instead of once per head, as descending's tile-major layout does.
// With a causal band the KV tiles differ in length, so lane u runs the long tile u and then the short tile N-1-u
// (constant total per lane on square bands); where a Q tile spans at least two fewer KV tiles per KV tile (block_n
// >= 2 block_m), the short tiles then start in ascending order too and add without waits. With an odd N the middle
// tile has no partner: its lane runs it alone, half a pair's work, and idles the rest (1 / (N + 1) of the group's
// time; unpaired lanes, tile u on lane u, would leave the lanes of the short tiles idle half the time instead).
//
// Deadlock-freedom, for any grid: order units by (head index, phase, KV index), phase 0 for full masks and for the
// long tile of a pair or the middle tile, 1 for the short one. A unit waits only for units of its own head with a
// smaller KV index, which come earlier in that order; each lane runs its units in increasing order. Grids smaller than
// one group run descending's layout: the same bits.
#pragma once
#include "schedule/descending.h"

namespace dash::sched {

struct DescendingLanes {
  // Pairs (long tile u, short tile N-1-u) on one lane: causal bands; with an odd N the last lane holds the middle
  // tile alone.
  DASH_HD static bool paired(const Problem& p) { return p.mask == MaskKind::kCausal; }
  DASH_HD static int32_t lanes(const Problem& p) {
    const int32_t N = num_n_blocks(p);
    return paired(p) ? (N + 1) / 2 : N;
  }
  // Units per head on lane `lane`: two where it holds a pair, else one (full masks, the middle tile).
  DASH_HD static int32_t units_per_head(const Problem& p, int32_t lane) {
    return paired(p) && 2 * lane + 1 != num_n_blocks(p) ? 2 : 1;
  }
  DASH_HD static int32_t groups(const Problem& p) {
    const int32_t l = lanes(p);
    return l > 0 ? div_u32(p.num_ctas, l) : 0;
  }
  // At least one whole group, and work for it; head indices in 32 bits (more heads than that run descending's layout,
  // with the same bits), which keeps the producer warp's unit arithmetic in 32-bit registers.
  DASH_HD static bool applies(const Problem& p) {
    const int64_t heads = num_kv_heads_total(p);
    return groups(p) > 0 && heads > 0 && heads <= INT32_MAX;
  }

  // The heads group g runs: g, g + groups, ...
  // num_items and item assume applies(p): elsewhere resolve_schedule runs descending instead (resolved_before_use).
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    const int32_t l = lanes(p), G = groups(p);
    if (cta >= G * l) return 0;  // the CTAs left over past the last whole group
    const int32_t g = div_u32(cta, l);
    const int32_t heads = static_cast<int32_t>(num_kv_heads_total(p));
    const int32_t mine = heads > g ? div_u32(heads - g - 1, G) + 1 : 0;
    return static_cast<int64_t>(mine) * units_per_head(p, cta - g * l);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    const int32_t l = lanes(p);
    const int32_t g = div_u32(cta, l), lane = cta - g * l;
    const bool pair = units_per_head(p, lane) == 2;
    // Unit k of the lane: head k (or k / 2 on a pair's lane) of the group; on a pair's lane odd k is the short tile.
    // k counts this lane's units, fewer than 2 x the heads, so it fits 32 bits.
    const uint32_t unit = static_cast<uint32_t>(k);
    const uint32_t head_index =
        static_cast<uint32_t>(g) + static_cast<uint32_t>(groups(p)) * (pair ? unit >> 1 : unit);
    const int32_t n = (pair && (unit & 1)) ? num_n_blocks(p) - 1 - lane : lane;
    const int32_t b = div_u32(head_index, p.nheads_k);
    return KvTile{b, static_cast<int32_t>(head_index) - b * p.nheads_k, n};
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Descending::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) { return Descending::visit(p, t, step); }
};

}  // namespace dash::sched
