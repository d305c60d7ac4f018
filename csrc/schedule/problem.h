// Problem description and mask arithmetic shared by every backward schedule.
// Host+device, no CUDA-only code and no torch: the kernels and the CPU module dash_attn._sched include the same
// definitions, so what the simulator enumerates is exactly what the kernel executes.
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "common/params.h"
#include "schedule/fingerprint.h"

namespace dash::sched {

// One sequence of a packed launch that schedules every sequence on its own geometry (seq_runs.h): its first work
// unit in the launch, its rows in use and the schedule its geometry resolves to. 16 bytes, one vector load.
struct alignas(16) SeqEntry {
  int32_t first_unit, len_q, len_k;
  ScheduleKind kind;
};

// One backward launch as the schedules see it. num_ctas is the persistent grid size (any value >= 1, run time).
struct Problem {
  int32_t batch, nheads, nheads_k, seqlen_q, seqlen_k, block_m, block_n;
  MaskKind mask;
  int32_t window_left, window_right;  // -1 = unbounded; only read for MaskKind::kWindow
  int32_t num_ctas;
  // Shortest chunk, in steps, when shift cuts its last, partial wave into pieces run by the whole grid
  // (tail_split.h); 0: never cut (kernels whose items must be whole KV tiles: packed sequences).
  int32_t tail_chunk_min = kDefaultTailChunkMin;
  ShiftSpacing shift_spacing = ShiftSpacing::kSpread;  // shift's start tiles (shift.h)
  // Packed launches scheduled per sequence (seq_runs.h): batch + 1 entries, the last holding the unit total. Device
  // memory in the kernels (built by the backward's seq-table kernel), host memory in dash_attn._sched; else null.
  const SeqEntry* seqs = nullptr;
};

// One CTA work item: one KV tile of one KV head. The CTA walks every query head of the GQA group of head_k.
struct KvTile {
  int32_t batch, head_k, n_block;
};

// One step of a work item: query head, Q tile and the accumulation position of this KV tile's partial dQ in the dQ
// tile (batch, head, m_block). Deterministic mode spins until that tile's semaphore equals wait_target, adds, then
// releases wait_target + 1. `run` picks the tile's accumulator where a schedule keeps two (runs.h); each run has its
// own semaphore and its own positions 0, 1, ...
struct Visit {
  int32_t head;
  int32_t m_block;
  int32_t wait_target;
  int32_t run = 0;
};

// Half-open range [lo, hi) of tile indices; empty when lo >= hi.
struct BlockRange {
  int32_t lo, hi;
  DASH_HD bool empty() const { return lo >= hi; }
  DASH_HD int32_t size() const { return hi > lo ? hi - lo : 0; }
};

DASH_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
DASH_HD inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Quotient and remainder of a >= 0 by b > 0 without the compiler's 64-bit division call, whose register convention
// made the 24-register producer warp spill. Operands that fit in 32 bits, the usual case, take the 32-bit division;
// otherwise a restoring long division, one quotient bit per iteration: slow, but it needs a handful of registers.
// The host (the CPU module) divides directly: the device-only paths give the same quotient and remainder for every
// operand in range (checked exhaustively at the boundaries and on random operands against the host division).
struct DivMod64 {
  int64_t q, r;
};
// Any divisor d > 0.
DASH_HD inline DivMod64 divmod_long(uint64_t n, uint64_t d) {
  uint64_t q = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int i = 63; i >= 0; --i) {
    if ((n >> i) >= d) {  // then d << i <= n: no overflow
      n -= d << i;
      q |= uint64_t(1) << i;
    }
  }
  return DivMod64{static_cast<int64_t>(q), static_cast<int64_t>(n)};
}
// Divisor 0 < d < 2^31: the high word divides in 32 bits, and the low word one bit per iteration with a remainder that
// stays below d, so 2 * r + 1 < 2^32 fits 32 bits.
DASH_HD inline DivMod64 divmod_long_by_int32(uint64_t n, uint32_t d) {
  const uint32_t hi = static_cast<uint32_t>(n >> 32);
  const uint32_t q_hi = hi / d;
  uint32_t r = hi - q_hi * d;
  uint32_t lo = static_cast<uint32_t>(n);  // shifted out at the top, quotient bits shifted in at the bottom
#if defined(__CUDA_ARCH__)
#pragma unroll 1
#endif
  for (int i = 0; i < 32; ++i) {
    r = (r << 1) | (lo >> 31);
    lo <<= 1;
    if (r >= d) {
      r -= d;
      lo |= 1;
    }
  }
  return DivMod64{static_cast<int64_t>((static_cast<uint64_t>(q_hi) << 32) | lo), static_cast<int64_t>(r)};
}
DASH_HD inline DivMod64 divmod_nonneg(int64_t a, int64_t b) {
#if defined(__CUDA_ARCH__)
  const uint64_t n = static_cast<uint64_t>(a), d = static_cast<uint64_t>(b);
  if (((n | d) >> 32) == 0) {
    const uint32_t q = static_cast<uint32_t>(n) / static_cast<uint32_t>(d);
    return DivMod64{q, static_cast<uint32_t>(n) - q * static_cast<uint32_t>(d)};
  }
  return divmod_long(n, d);
#else
  return DivMod64{a / b, a % b};
#endif
}
// Same for a positive int32 divisor (CTA counts, tile counts, KV heads per batch element).
DASH_HD inline DivMod64 divmod_nonneg(int64_t a, int32_t b) {
#if defined(__CUDA_ARCH__)
  const uint64_t n = static_cast<uint64_t>(a);
  const uint32_t d = static_cast<uint32_t>(b);
  if ((n >> 32) == 0) {
    const uint32_t q = static_cast<uint32_t>(n) / d;
    return DivMod64{q, static_cast<uint32_t>(n) - q * d};
  }
  return divmod_long_by_int32(n, d);
#else
  return DivMod64{a / b, a % b};
#endif
}

// Division of a value known to lie in [0, 2^32) by a positive int32: exact in 32-bit unsigned arithmetic, which the
// kernel's producer warp (24 registers) can afford, unlike a 64-bit division call.
DASH_HD inline int32_t div_u32(int64_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b));
}
// ceil(a / b) for 0 < a, b <= INT32_MAX: a + b - 1 < 2^32.
DASH_HD inline int32_t ceil_div_u32(int32_t a, int32_t b) {
  return div_u32(static_cast<int64_t>(a) + b - 1, b);
}

DASH_HD inline int32_t num_m_blocks(const Problem& p) {
  return p.seqlen_q > 0 ? ceil_div_u32(p.seqlen_q, p.block_m) : 0;
}
DASH_HD inline int32_t num_n_blocks(const Problem& p) {
  return p.seqlen_k > 0 ? ceil_div_u32(p.seqlen_k, p.block_n) : 0;
}
DASH_HD inline int32_t group_size(const Problem& p) { return div_u32(p.nheads, p.nheads_k); }
// Step `step` (>= 0) of a KV tile: index s = step / g along its walk over Q tiles and query head head_k * g + step % g
// (the g query heads of the GQA group visit each Q tile back to back). Unsigned: step >= 0, g > 0.
struct StepSplit {
  int32_t s, head;
};
DASH_HD inline StepSplit split_step(int32_t step, int32_t g, int32_t head_k) {
  const int32_t s = div_u32(step, g);
  return StepSplit{s, head_k * g + (step - s * g)};
}
// The same step with the query heads outermost: the whole walk of `walk` Q tiles for query head head_k * g, then for
// the next one. Which adds a dQ tile receives, and in which order, does not change (the order follows the Q tile and
// the KV tile alone); what changes is how far apart in time two KV tiles reach it. With the heads innermost there
// are g times as many visits between the adds of two consecutive KV tiles to one dQ tile, and the (Q, dO, dQ) tiles
// that must stay in L2 meanwhile are g times as many too.
DASH_HD inline StepSplit split_step_heads_outer(int32_t step, int32_t walk, int32_t g, int32_t head_k) {
  const int32_t h = div_u32(step, walk);
  return StepSplit{step - h * walk, head_k * g + h};
}
// Number of (batch, KV head) pairs; each one is an independent copy of the per-head tile grid.
DASH_HD inline int64_t num_kv_heads_total(const Problem& p) { return static_cast<int64_t>(p.batch) * p.nheads_k; }

// The mask as a diagonal band: query row i sees key j iff j - i - (seqlen_k - seqlen_q) lies in [-left, right],
// an absent bound meaning unbounded. Causal is the band with right = 0 and no left bound.
struct Band {
  bool has_left, has_right;
  int64_t left, right;
};

DASH_HD inline Band band_of(const Problem& p) {
  switch (p.mask) {
    case MaskKind::kCausal:
      return Band{false, true, 0, 0};
    case MaskKind::kWindow:
      return Band{p.window_left >= 0, p.window_right >= 0, p.window_left, p.window_right};
    default:
      return Band{false, false, 0, 0};
  }
}

// Q tiles with at least one unmasked element against KV tile n_block (ragged last tiles included).
// Block (rows [r0, r1], keys [k0, k1]) is live iff k0 - r1 <= d + right and k1 - r0 >= d - left, d = sk - sq.
DASH_HD inline BlockRange m_block_range(const Problem& p, int32_t n_block) {
  const int32_t M = num_m_blocks(p);
  if (M == 0 || n_block < 0 || n_block >= num_n_blocks(p)) return BlockRange{0, 0};
  const Band b = band_of(p);
  const int64_t d = static_cast<int64_t>(p.seqlen_k) - p.seqlen_q;
  const int64_t k0 = static_cast<int64_t>(n_block) * p.block_n;
  const int64_t k1 = min64(k0 + p.block_n, p.seqlen_k) - 1;
  int64_t lo = 0, hi = M;
  if (b.has_right) {
    const int64_t first_row = k0 - d - b.right;
    if (first_row > p.seqlen_q - 1) return BlockRange{0, 0};
    if (first_row > 0) lo = div_u32(first_row, p.block_m);  // 0 < first_row < seqlen_q
  }
  if (b.has_left) {
    const int64_t last_row = k1 - d + b.left;
    if (last_row < 0) return BlockRange{0, 0};
    if (last_row < p.seqlen_q - 1) hi = div_u32(last_row, p.block_m) + 1;  // 0 <= last_row < seqlen_q
  }
  if (lo >= hi) return BlockRange{0, 0};
  return BlockRange{static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// KV tiles that contribute to Q tile m_block (the same band condition seen from the other side).
DASH_HD inline BlockRange n_block_range(const Problem& p, int32_t m_block) {
  const int32_t N = num_n_blocks(p);
  if (N == 0 || m_block < 0 || m_block >= num_m_blocks(p)) return BlockRange{0, 0};
  const Band b = band_of(p);
  const int64_t d = static_cast<int64_t>(p.seqlen_k) - p.seqlen_q;
  const int64_t r0 = static_cast<int64_t>(m_block) * p.block_m;
  const int64_t r1 = min64(r0 + p.block_m, p.seqlen_q) - 1;
  int64_t lo = 0, hi = N;
  if (b.has_left) {
    const int64_t first_key = r0 + d - b.left;
    if (first_key > p.seqlen_k - 1) return BlockRange{0, 0};
    if (first_key > 0) lo = div_u32(first_key, p.block_n);  // 0 < first_key < seqlen_k
  }
  if (b.has_right) {
    const int64_t last_key = r1 + d + b.right;
    if (last_key < 0) return BlockRange{0, 0};
    if (last_key < p.seqlen_k - 1) hi = div_u32(last_key, p.block_n) + 1;  // 0 <= last_key < seqlen_k
  }
  if (lo >= hi) return BlockRange{0, 0};
  return BlockRange{static_cast<int32_t>(lo), static_cast<int32_t>(hi)};
}

// Every (Q tile, KV tile) pair is live. lo and hi of m_block_range are nondecreasing in n_block, so checking the two
// extreme KV tiles suffices.
DASH_HD inline bool covers_all_tiles(const Problem& p) {
  const int32_t N = num_n_blocks(p), M = num_m_blocks(p);
  if (N == 0 || M == 0) return false;
  return m_block_range(p, N - 1).lo == 0 && m_block_range(p, 0).hi == M;
}

// Every KV tile is live and reaches the last Q tile (causal-like band without a left bound): the contributors of
// Q tile m are then exactly the prefix [0, n_block_range(m).hi) of KV tiles.
DASH_HD inline bool prefix_contributors(const Problem& p) {
  const int32_t N = num_n_blocks(p), M = num_m_blocks(p);
  if (N == 0 || M == 0) return false;
  return m_block_range(p, 0).hi == M && !m_block_range(p, N - 1).empty();
}

// KV tiles that every Q row of a causal band sees (aligned bottom-right, so only where seqlen_q < seqlen_k): each is as
// long as a full mask's tile. Tile n is fully live when its last key (n + 1) block_n - 1 is at most
// seqlen_k - seqlen_q.
DASH_HD inline int32_t fully_live_tiles(const Problem& p) {
  const int32_t free_keys = p.seqlen_k - p.seqlen_q + 1;
  if (p.mask != MaskKind::kCausal || free_keys <= 0) return 0;
  const int32_t f = div_u32(free_keys, p.block_n), N = num_n_blocks(p);
  return f < N ? f : N;
}

// A causal band that is nearly a full mask: more than 13/16 of its KV tiles fully live where Q tiles are at most half
// as tall as KV tiles (hdim 128), more than 3/4 elsewhere. Deterministic `auto` runs descending's orders there
// (schedules_table.invariant_schedule, seq_runs.h), and descending_lanes lays its tiles out unpaired, as on a full mask
// (lanes.h). Below the bound shift_causal_runs' rotated walk gives its units distinct start tiles: at 3/4 (seqlen_q =
// seqlen_k / 4) it ran 2-11% faster than descending_lanes, and at hdim 128 also at 13/16 (1536 x 8192, 3-4%); at 7/8
// descending_lanes ran 7-17% faster (docs/tuning.md). One compare in sixteenths: a second one pushed the hdim-256
// packed causal kernels past their spill allowance.
DASH_HD inline bool mostly_full_band(const Problem& p) {
  const int32_t N = num_n_blocks(p);
  const int64_t sixteenths = 2 * p.block_m <= p.block_n ? 13 : 12;
  return N > 0 && 16 * static_cast<int64_t>(fully_live_tiles(p)) > sixteenths * static_cast<int64_t>(N);
}

}  // namespace dash::sched
