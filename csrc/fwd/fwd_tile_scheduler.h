// Persistent tile scheduler of the forward: the grid has one CTA per SM (the SM count is read at run time) and CTA c
// takes work units c, c + grid, c + 2 * grid, ... A static order keeps the kernel free of global counters (no
// workspace, no reset between launches) and makes every run issue the same tiles on the same CTAs. Host and device
// compile the same arithmetic (the grid size is an argument), so dash_attn._sched lists exactly what the kernel runs
// (tests/test_fwd_tile_order.py).
//
// Full mask (kHeadMajor): every query tile costs the same, so the query tile index varies fastest and concurrently
// running CTAs share the K/V of one head in L2.
//
// Causal (kPairedHeavyFirst): query tile m sees m + 1 key tiles, so tiles are not interchangeable. Two phases:
//  1. Pairs: a unit is query tiles (M - 1 - j, j) of one head, run back to back; every pair costs M + 1 key tiles, so
//     round robin balances them like full-mask tiles. Units are head-major, so the CTAs running at one time share
//     the K/V of a few heads in L2 (an order that spreads the tiles of a head over the whole launch re-reads K/V
//     from DRAM for every tile, which makes the kernel memory-bound at short sequences with many heads).
//  2. Tail: the heads that would only fill a last, partial wave of pairs are cut into single tiles and dealt out
//     heaviest first (longest-processing-time order), so the short tiles even out the end of the launch.
// Phase 1 covers whole heads and stops one wave of pairs short of the end, so the tail has enough tiles to balance.
// With an odd tile count M per head the middle tile (M - 1) / 2 has no partner: the paired heads' middle tiles join
// the tail at their weight (half a pair), the first tiles of that rank. Without phase 1 at odd M (every tile in the
// tail, tile-major) the CTAs running at one time each read another head's K/V: the CPU model with an LRU of the L2
// put hdim 64 causal 2k and 8k at 5-10x the compulsory K/V traffic, against 1.4-1.6x with the pairs, and the pairs
// ran 10% and 6% faster there on an H100 (docs/tuning.md).
// Every wave of the unit sequence is dealt out in alternating direction (boustrophedon): with a plain round robin
// CTA 0 would take the heaviest tile of every tail wave.
//
// Sliding windows (kHeadMajorSnake): head-major like the full mask, but dealt out boustrophedon too. A band's tiles
// cost the same except near the ends of the sequence; with a plain round robin and a grid that is a multiple of the
// tiles per head (132 CTAs, 22 tiles of 192 rows at seqlen 4096), every CTA got the same query tile in every wave, so
// the light tiles always go to the same CTAs.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/params.h"

namespace dash::fwd {

enum class TileOrder : int { kHeadMajor = 0, kPairedHeavyFirst = 1, kHeadMajorSnake = 2 };

// The order a mask's kernels run (fwd_kernel.h) and dash_attn._sched lists.
constexpr TileOrder tile_order(MaskKind mask) {
  return mask == MaskKind::kCausal   ? TileOrder::kPairedHeavyFirst
         : mask == MaskKind::kWindow ? TileOrder::kHeadMajorSnake
                                     : TileOrder::kHeadMajor;
}

template <TileOrder kOrder>
struct FwdTileScheduler {
  struct Params {
    int32_t num_m_blocks;
    int32_t nheads;
    int32_t batch;
    int32_t num_units;       // units of both phases
    int32_t num_pair_units;  // phase 1 units (kPairedHeavyFirst only)
    int32_t pairs_per_head;
    int32_t tail_first_head;  // first (batch, head) index whose tiles all run in the tail
    int32_t tail_heads;
    int32_t mid_heads;       // odd num_m_blocks: the paired heads, whose middle tiles run in the tail; else 0
    int32_t tail_mid_first;  // tail position of the first of those middle tiles
  };

  struct WorkTile {
    int32_t m_block;
    int32_t head;
    int32_t batch;
  };

  // counter runs c, c + grid, ... (one value per unit); second selects the low tile of a pair unit.
  struct Cursor {
    int32_t counter;
    int32_t second;
  };

  static int grid_size(int32_t num_units, int num_sms) {
    int const grid = num_units < num_sms ? num_units : num_sms;
    return grid < 1 ? 1 : grid;
  }

  static Params make_params(int32_t seqlen_q, int32_t block_m, int32_t nheads, int32_t batch, int num_sms) {
    Params p{};
    p.num_m_blocks = (seqlen_q + block_m - 1) / block_m;
    p.nheads = nheads;
    p.batch = batch;
    int32_t const heads_total = nheads * batch;
    p.num_units = p.num_m_blocks * heads_total;
    if constexpr (kOrder == TileOrder::kPairedHeavyFirst) {
      p.pairs_per_head = p.num_m_blocks / 2;
      int32_t const num_pairs = p.pairs_per_head * heads_total;
      int32_t const grid = grid_size(num_pairs, num_sms);
      int32_t const full_waves = num_pairs / grid;
      int32_t paired_heads = 0;
      if (full_waves >= 2) { paired_heads = (full_waves - 1) * grid / p.pairs_per_head; }
      p.num_pair_units = paired_heads * p.pairs_per_head;
      p.tail_first_head = paired_heads;
      p.tail_heads = heads_total - paired_heads;
      p.mid_heads = p.num_m_blocks % 2 == 1 ? paired_heads : 0;
      p.tail_mid_first = (p.num_m_blocks - 1) / 2 * p.tail_heads;
      p.num_units = p.num_pair_units + p.tail_heads * p.num_m_blocks + p.mid_heads;
    }
    return p;
  }

  static int grid_size(Params const& p, int num_sms) { return grid_size(p.num_units, num_sms); }

  DASH_HD static Cursor first(int cta) { return {cta, 0}; }
  DASH_HD static bool valid(Params const& p, Cursor c, int grid) { return position(c.counter, grid) < p.num_units; }
  DASH_HD static Cursor next(Params const& p, Cursor c, int grid) {
    if (c.second == 0 && position(c.counter, grid) < p.num_pair_units) { return {c.counter, 1}; }
    return {c.counter + grid, 0};
  }

  // Index in the unit sequence of the unit the counter stands for.
  DASH_HD static int position(int counter, int grid) {
    if constexpr (kOrder != TileOrder::kHeadMajor) {
      int const wave = counter / grid;
      int const slot = counter - wave * grid;
      return wave * grid + ((wave & 1) ? grid - 1 - slot : slot);
    } else {
      return counter;
    }
  }

  DASH_HD static WorkTile decode(Params const& p, Cursor c, int grid) {
    int const pos = position(c.counter, grid);
    WorkTile t;
    int bh;
    if constexpr (kOrder == TileOrder::kPairedHeavyFirst) {
      if (pos < p.num_pair_units) {
        bh = pos / p.pairs_per_head;
        int const j = pos - bh * p.pairs_per_head;
        t.m_block = c.second ? j : p.num_m_blocks - 1 - j;
      } else {
        int tail = pos - p.num_pair_units;
        int const mid = tail - p.tail_mid_first;
        if (mid >= 0 && mid < p.mid_heads) {
          t.m_block = (p.num_m_blocks - 1) / 2;
          bh = mid;
        } else {
          if (mid >= 0) { tail -= p.mid_heads; }
          int const rank = tail / p.tail_heads;
          t.m_block = p.num_m_blocks - 1 - rank;
          bh = p.tail_first_head + (tail - rank * p.tail_heads);
        }
      }
    } else {
      bh = pos / p.num_m_blocks;
      t.m_block = pos - bh * p.num_m_blocks;
    }
    t.head = bh % p.nheads;
    t.batch = bh / p.nheads;
    return t;
  }
};

}  // namespace dash::fwd
