// The last, partial wave of the shift schedule, spread over the whole grid.
//
// U equal work units on C CTAs take ceil(U / C) unit times, and the last wave keeps only R = U mod C CTAs busy: with
// the standard 16k-token rows (2048 units at hdim 128, 15.5 waves on 132 SMs; 4096 at hdim 64, 31.03 waves) the idle
// half of the grid costs about one unit time in 16 (32). Here the R tail units are laid end to end as R * V steps
// (V steps a unit) and cut into chunks of S = max(ceil(R * V / C), tail_chunk_min) consecutive steps; CTA c runs
// chunk c (Problem::tail_chunk_min, 16 by default, is the shortest chunk). A chunk touches one or two units (S < V),
// so a unit is run in pieces by consecutive CTAs; each piece's dK/dV is a partial sum that the unit's last piece to
// finish adds up, in piece order, whatever the order of arrival (bwd_epilogue.h): bitwise reproducible.
//
// Order of a tail unit's dQ adds (shift.h): after every earlier wave, by the step's position in its chunk (the chunks
// start together, so that is when it arrives), ties by tail unit. A CTA's positions increase along its chunk, so
// every waiting edge points forward in (wave, position, unit): deadlock-free for every grid, as the simulator checks.
// Host+device, 32-bit: R * V is capped at 2^30 (a split is skipped beyond), so c * S and i * V never overflow.
#pragma once
#include "schedule/problem.h"

namespace dash::sched {

// Steps [lo, hi) of a work unit that one item runs.
struct StepRange {
  int32_t lo, hi;
};

struct TailSplit {
  static constexpr int32_t kMaxSteps = 1 << 30;

  int64_t waves = 0;       // whole waves before the tail, U / C
  int64_t first_unit = 0;  // launch index of the first tail unit, waves * C
  int32_t units = 0;       // R
  int32_t visits = 0;      // V, steps of every unit
  int32_t chunk = 0;       // S
  bool active = false;

  // total_units: U; visits_per_unit: V (the same for every unit, which the callers guarantee).
  DASH_HD static TailSplit of(const Problem& p, int64_t total_units, int32_t visits_per_unit) {
    TailSplit s;
    if (p.tail_chunk_min <= 0 || visits_per_unit <= p.tail_chunk_min) return s;
    const DivMod64 w = divmod_nonneg(total_units, p.num_ctas);
    if (w.r == 0 || w.r * visits_per_unit > kMaxSteps) return s;
    const int32_t steps = static_cast<int32_t>(w.r) * visits_per_unit;
    int32_t chunk = ceil_div_u32(steps, p.num_ctas);
    if (chunk < p.tail_chunk_min) chunk = p.tail_chunk_min;
    if (chunk >= visits_per_unit) return s;  // no unit would be cut
    s.waves = w.q;
    s.first_unit = total_units - w.r;
    s.units = static_cast<int32_t>(w.r);
    s.visits = visits_per_unit;
    s.chunk = chunk;
    s.active = true;
    return s;
  }

  DASH_HD int32_t total_steps() const { return units * visits; }
  DASH_HD int32_t num_chunks() const { return ceil_div_u32(total_steps(), chunk); }
  // Item k >= waves of CTA c: tail unit first_unit_of(c) + k - waves (tail_index), launch index first_unit + that.
  DASH_HD int32_t tail_index(int32_t c, int64_t k) const {
    return first_unit_of(c) + static_cast<int32_t>(k - waves);
  }
  DASH_HD int64_t unit_of_item(int32_t c, int64_t k) const { return first_unit + first_unit_of(c) + (k - waves); }
  // Tail units that chunk c runs: [first_unit_of(c), first_unit_of(c) + units_in(c)).
  DASH_HD int32_t first_unit_of(int32_t c) const { return div_u32(static_cast<int64_t>(c) * chunk, visits); }
  DASH_HD int32_t units_in(int32_t c) const {
    if (c >= num_chunks()) return 0;
    const int32_t end = min_i32((c + 1) * chunk, total_steps());
    return div_u32(end - 1, visits) - first_unit_of(c) + 1;
  }
  // The steps of tail unit i that chunk c runs.
  DASH_HD StepRange steps(int32_t i, int32_t c) const {
    const int32_t begin = c * chunk - i * visits, end = min_i32((c + 1) * chunk, total_steps()) - i * visits;
    return StepRange{begin > 0 ? begin : 0, end < visits ? end : visits};
  }
  // Chunks that run tail unit i: [first_chunk(i), last_chunk(i)]; its piece in chunk c is piece c - first_chunk(i).
  DASH_HD int32_t first_chunk(int32_t i) const { return div_u32(i * visits, chunk); }
  DASH_HD int32_t last_chunk(int32_t i) const { return div_u32((i + 1) * visits - 1, chunk); }
  // When step t of tail unit i runs: its position in its chunk.
  DASH_HD int32_t position(int32_t i, int32_t t) const {
    return static_cast<int32_t>(static_cast<uint32_t>(i * visits + t) % static_cast<uint32_t>(chunk));
  }
  // Partial dK/dV slot of tail unit i's piece in chunk c: two per chunk (S < V, so a chunk touches at most two
  // units), the second for a unit that starts inside the chunk.
  DASH_HD int32_t slot(int32_t i, int32_t c) const { return 2 * c + (c * chunk < i * visits ? 1 : 0); }
  // Slots a grid of num_ctas CTAs may use.
  DASH_HD static int64_t max_slots(int32_t num_ctas) { return 2 * static_cast<int64_t>(num_ctas); }

 private:
  DASH_HD static int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }
};

}  // namespace dash::sched
