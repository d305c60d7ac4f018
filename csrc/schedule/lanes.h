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
// With a causal band the KV tiles differ in length (but where most are fully live, paired() below), so lane u runs
// the long tile u and then the short tile N-1-u
// (constant total per lane on square bands); where a Q tile spans at least two fewer KV tiles per KV tile (block_n
// >= 2 block_m), the short tiles then start in ascending order too and add without waits. With an odd N the middle
// tile has no partner: its lane runs it alone, half a pair's work, and idles the rest (1 / (N + 1) of the group's
// time; unpaired lanes, tile u on lane u, would leave the lanes of the short tiles idle half the time instead).
//
// Several tiles per lane (full masks). A group of N lanes leaves C mod N of C CTAs idle: N = 47 KV tiles on 132 CTAs
// keeps 94 busy. So a lane may run k tiles of each head, tiles l, l + L, l + 2L, ... of a group of L = ceil(N / k)
// lanes, k the fewest rounds of (heads per group) x k (tiles_per_lane, k <= kMaxTilesPerLane; ties keep fewer tiles
// per lane). The second tile of lane l starts a walk (M steps) after its first, once lane l - 1 has started its own
// second one: the stagger carries over as it does from head to head, since a walk is longer than L adds.
//
// Deadlock-freedom, for any grid: order units by (head index, phase, KV index), phase 0 for full masks and for the
// long tile of a pair or the middle tile, 1 for the short one. A unit waits only for units of its own head with a
// smaller KV index, which come earlier in that order; each lane runs its units in increasing order (its tiles of a
// head in increasing KV index). Grids smaller than one group, or kept less than kMinBusyPercent busy, run
// descending's layout: the same bits.
#pragma once
#include "schedule/descending.h"

namespace dash::sched {

struct DescendingLanes {
  static constexpr int32_t kMaxTilesPerLane = 4;
  // Pairs (long tile u, short tile N-1-u) on one lane: causal bands; with an odd N the last lane holds the middle
  // tile alone. Not where most KV tiles are fully live (mostly_full_band): those tiles are all as long as a full
  // mask's, pairing puts a long tile in the second slot of most lanes, whose adds then chain in reverse lane order,
  // so the lanes run unpaired as on a full mask (the engine with the L2 term: 0.2-0.8 of the paired makespan at
  // seqlen_q <= seqlen_k / 4, within 10% at 3/4 fully live tiles).
  DASH_HD static bool paired(const Problem& p) { return p.mask == MaskKind::kCausal && !mostly_full_band(p); }
  // KV tiles a lane runs of each head (full masks; pairs keep one pair per lane, and unpaired causal lanes one tile,
  // which keeps that search out of the causal kernels' producer): the k of the fewest rounds.
  DASH_HD static int32_t tiles_per_lane(const Problem& p) {
    const int32_t N = num_n_blocks(p);
    const int64_t heads = num_kv_heads_total(p);
    if (p.mask == MaskKind::kCausal || N <= 0 || heads <= 0 || heads > INT32_MAX / kMaxTilesPerLane) return 1;
    int32_t best = 1;
    int64_t best_rounds = -1;
    for (int32_t k = 1; k <= kMaxTilesPerLane && k <= N; ++k) {
      const int32_t G = div_u32(p.num_ctas, ceil_div_u32(N, k));
      if (G == 0) continue;
      const int64_t rounds = static_cast<int64_t>(ceil_div_u32(static_cast<int32_t>(heads), G)) * k;
      if (best_rounds < 0 || rounds < best_rounds) {
        best = k;
        best_rounds = rounds;
      }
    }
    return best;
  }
  DASH_HD static int32_t lanes(const Problem& p) {
    const int32_t N = num_n_blocks(p);
    return paired(p) ? (N + 1) / 2 : (N > 0 ? ceil_div_u32(N, tiles_per_lane(p)) : 0);
  }
  // Units per head on lane `lane` of `l` lanes: two where it holds a pair, one for the middle tile; full masks, the
  // lane's tiles lane, lane + l, ... below N.
  DASH_HD static int32_t units_per_head(const Problem& p, int32_t lane, int32_t l) {
    const int32_t N = num_n_blocks(p);
    if (paired(p)) return 2 * lane + 1 != N ? 2 : 1;
    return div_u32(N - lane + l - 1, l);
  }
  DASH_HD static int32_t groups(const Problem& p) {
    const int32_t l = lanes(p);
    return l > 0 ? div_u32(p.num_ctas, l) : 0;
  }
  // Lanes run at least this share of the grid's capacity, rounds of heads x tiles per lane (full) or pairs (causal)
  // on every CTA, or the call runs descending's layout (the same bits): with 8 heads of 24 lanes of pairs on 132 CTAs
  // (5 groups, 2 rounds, 73% busy) descending's layout ran 15% faster.
  static constexpr int64_t kMinBusyPercent = 80;
  // At least one whole group, work for it, and kMinBusyPercent of the grid busy; a lane's unit counts in 32 bits
  // (more heads than that run descending's layout, with the same bits), which keeps the producer warp's unit
  // arithmetic in 32-bit registers.
  DASH_HD static bool applies(const Problem& p) {
    const int64_t heads = num_kv_heads_total(p);
    const int32_t G = groups(p);
    if (G <= 0 || heads <= 0 || heads > INT32_MAX / kMaxTilesPerLane) return false;
    const int32_t N = num_n_blocks(p);
    const int64_t per_head = paired(p) ? (N + 1) / 2 : N;  // lane slots of one head
    const int64_t per_round = paired(p) ? 1 : tiles_per_lane(p);
    const int64_t rounds = ceil_div_u32(static_cast<int32_t>(heads), G);
    return 100 * heads * per_head >= kMinBusyPercent * p.num_ctas * rounds * per_round;
  }

  // The heads group g runs: g, g + groups, ...
  // num_items and item assume applies(p): elsewhere resolve_schedule runs descending instead (resolved_before_use).
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    const int32_t l = lanes(p);
    const int32_t G = div_u32(p.num_ctas, l);
    if (cta >= G * l) return 0;  // the CTAs left over past the last whole group
    const int32_t g = div_u32(cta, l);
    const int32_t heads = static_cast<int32_t>(num_kv_heads_total(p));
    const int32_t mine = heads > g ? div_u32(heads - g - 1, G) + 1 : 0;
    return static_cast<int64_t>(mine) * units_per_head(p, cta - g * l, l);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    const int32_t l = lanes(p);
    const int32_t g = div_u32(cta, l), lane = cta - g * l;
    const int32_t per = units_per_head(p, lane, l);
    // Unit k of the lane: head k / per of the group, and the lane's (k mod per)-th unit of it: on a pair's lane the
    // long tile, then the short one; full masks, tile lane + l * (k mod per). k counts this lane's units, at most
    // kMaxTilesPerLane per head, so it fits 32 bits for the head counts applies() admits.
    const uint32_t unit = static_cast<uint32_t>(k);
    const uint32_t round = unit / static_cast<uint32_t>(per), within = unit - round * static_cast<uint32_t>(per);
    const uint32_t head_index = static_cast<uint32_t>(g) + static_cast<uint32_t>(div_u32(p.num_ctas, l)) * round;
    const int32_t n =
        paired(p) ? (within ? num_n_blocks(p) - 1 - lane : lane) : lane + l * static_cast<int32_t>(within);
    const int32_t b = div_u32(head_index, p.nheads_k);
    return KvTile{b, static_cast<int32_t>(head_index) - b * p.nheads_k, n};
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) { return Descending::num_visits(p, t); }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) { return Descending::visit(p, t, step); }
};

}  // namespace dash::sched
