// Dynamic (non-deterministic mode only): CTAs claim work units from a global counter as they free up, instead of a
// static deal. A static persistent grid cannot balance units of unequal length: under a causal mask shift_causal's
// pairs leave its last wave partly idle (1024 pairs on 132 CTAs: 7.76 waves run in 8), and the tile-major orders that
// balance statically stream every head at once from DRAM. Claimed dynamically, a short unit fills any gap, and an SM
// that runs slower simply claims fewer units.
//
// Claim order (launch index u): (batch, KV head) pairs head-major with ascending KV index inside each (longest first
// under a bottom-right causal mask), so the tiles running together share one or two heads' Q, dO and dQ in L2; the
// last tail_heads pairs go tile-major instead (KV tile 0 of each of them, then tile 1, ...): longest first across
// them, the end game of list scheduling, which the head-major order alone plays badly when a head is short against
// the grid (the model: 1.06-1.07 x the lower bound at causal 1k-8k on 132 CTAs; with the tail <= 1.02).
// sigma: cyclic over the tile's live Q tiles from an offset, so that the tiles of a head that run together add into
// different dQ tiles. Under causal and window masks the offset is n steps past the tile's first live Q tile lo(n):
// tile n, claimed at time c(n), reaches Q tile m at about c(n) + m - lo(n) - n. Claimed together (c = 0) or k per
// step (c(n) = n / k, a head's tiles in steady state) those times differ for every n, as lo(n) + n - n / k grows
// with n. Without the offset the square tiles (lo(n) = n) of hdim 64, claimed about one per step, meet in lockstep on
// one dQ tile, whose adds then contend. On a full mask (all starting at Q tile 0) tile n starts at Q tile
// floor(n M / N).
// pi: none. Static wait targets are only a stand-in for the CPU model's static dispatch (ascending KV index, which is
// also the claim order inside a head): the kernel elects each dQ tile's first add (a plain store; nothing zeroes the
// accumulator) when the producer loads the visit, from a per-tile claim counter, and the other adds wait for that
// store and then add in arrival order. Every wait points to an earlier election, so nothing can deadlock.
#pragma once
#include "schedule/waves.h"

namespace dash::sched {

struct Dynamic {
  // Where the kernels claim units (resolve_schedule; bwd_tile_scheduler.h): causal masks, whose units differ in
  // length. Elsewhere `dynamic` runs shift_causal's fallback (shift on full masks). This header's functions define
  // the claims for any mask, which the CPU model may simulate.
  DASH_HD static bool applies(const Problem& p) { return p.mask == MaskKind::kCausal; }
  // Work of the tile-major tail, in waves of single KV tiles on the grid: a longer tail balances better until the
  // heads it streams at once outgrow L2 (8 waves: nine heads' Q, dO and dQ at hdim 128; docs/tuning.md).
  static constexpr int32_t kTailWaves = 4;

  DASH_HD static int64_t num_units(const Problem& p) { return num_kv_heads_total(p) * num_n_blocks(p); }
  // (batch, KV head) pairs whose tiles are claimed tile-major at the end: enough for kTailWaves waves.
  DASH_HD static int64_t tail_heads(const Problem& p) {
    const int32_t N = num_n_blocks(p);
    const int64_t want = divmod_nonneg(static_cast<int64_t>(kTailWaves) * p.num_ctas + N - 1, N).q;
    return min64(num_kv_heads_total(p), want);
  }
  // The unit of launch index u < num_units.
  DASH_HD static KvTile unit(const Problem& p, int64_t u) {
    const int32_t N = num_n_blocks(p);
    const int64_t heads = num_kv_heads_total(p);
    const int64_t tail = tail_heads(p);
    const int64_t bulk = (heads - tail) * N;
    int64_t head_index, n;
    if (u < bulk) {
      const DivMod64 qr = divmod_nonneg(u, N);
      head_index = qr.q;
      n = qr.r;
    } else {
      const DivMod64 qr = divmod_nonneg(u - bulk, tail);
      head_index = heads - tail + qr.r;
      n = qr.q;
    }
    const DivMod64 bh = divmod_nonneg(head_index, p.nheads_k);
    return KvTile{static_cast<int32_t>(bh.q), static_cast<int32_t>(bh.r), static_cast<int32_t>(n)};
  }

  // Static stand-in (the CPU model's static dispatch and its enumeration): the claim order dealt like every other
  // schedule's units (waves.h). Greedy dispatch in the model replays the claims.
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return Snake::units_on(num_units(p), p.num_ctas, cta);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return unit(p, Snake::unit_at(p.num_ctas, cta, k));
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) {
    return group_size(p) * m_block_range(p, t.n_block).size();
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const StepSplit st = split_step(step, group_size(p), t.head_k);
    const BlockRange r = m_block_range(p, t.n_block);
    const int32_t len = r.size();
    int32_t start;
    if (p.mask == MaskKind::kFull) {
      start = static_cast<int32_t>(divmod_nonneg(static_cast<int64_t>(t.n_block) * len, num_n_blocks(p)).q);
    } else {
      start = t.n_block - len * div_u32(t.n_block, len);
    }
    const int32_t m = r.lo + pos_mod_near(st.s + start, len);
    return Visit{st.head, m, t.n_block - n_block_range(p, m).lo};
  }
};

}  // namespace dash::sched
