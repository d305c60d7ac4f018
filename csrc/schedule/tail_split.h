// The last, partial wave of the shift schedules, spread over the whole grid.
//
// U equal work units on C CTAs take ceil(U / C) unit times, and the last wave keeps only R = U mod C CTAs busy: with
// the standard 16k-token rows (2048 KV-tile units at hdim 128, 15.5 waves on 132 SMs; 1024 causal pairs, 7.76 waves)
// the idle part of the grid costs a good fraction of one unit time. Here the R tail units are laid end to end as
// R * V steps (V steps a unit) and cut into chunks of S = max(ceil(R * V / C), tail_chunk_min) consecutive steps; CTA
// c runs chunk c (Problem::tail_chunk_min, 16 by default, is the shortest chunk).
//
// A unit is one KV tile (shift) or two run back to back (shift_causal's pairs: tile 0 runs the unit's steps
// [0, a(i)), tile 1 the steps [a(i), V), a(i) the schedule's split point). Tail tile tau = tiles_per_unit * i + b is
// tile b of tail unit i; a chunk runs every tail tile that overlaps it, a tile overlapping several chunks is run in
// pieces by consecutive CTAs; each piece's dK/dV is a partial sum that the tile's last piece to finish adds up, in
// piece order, whatever the order of arrival (bwd_epilogue.h): bitwise reproducible.
//
// Order of the tail's dQ adds (shift.h, shift_causal.h): after every earlier wave, by the step's position in its
// chunk (the chunks start together, so that is when it arrives), ties by tail tile. A CTA's positions increase along
// its chunk, so every waiting edge points forward in (wave, position, tile): deadlock-free for every grid, as the
// simulator checks.
// Host+device, 32-bit: R * V is capped at 2^30 (a split is skipped beyond), so c * S and i * V never overflow.
#pragma once
#include "schedule/problem.h"

namespace dash::sched {

// Steps [lo, hi) of a KV tile that one item runs.
struct StepRange {
  int32_t lo, hi;
};

// The unit shape of a split, as the tile functions below take it: kTilesPerUnit and, for two, the split point a(i)
// of tail unit i. One-tile units (shift) have no split point.
struct OneTileUnits {
  static constexpr int32_t kTilesPerUnit = 1;
  DASH_HD int32_t operator()(int32_t) const { return 0; }
};

struct TailSplit {
  static constexpr int32_t kMaxSteps = 1 << 30;

  int64_t waves = 0;       // whole waves before the tail, U / C
  int64_t first_unit = 0;  // launch index of the first tail unit, waves * C
  int32_t units = 0;       // R
  int32_t visits = 0;      // V, steps of every unit
  int32_t chunk = 0;       // S
  int32_t tiles_per_unit = 1;
  bool active = false;

  // total_units: U; visits_per_unit: V (the same for every unit, which the callers guarantee).
  DASH_HD static TailSplit of(const Problem& p, int64_t total_units, int32_t visits_per_unit,
                              int32_t tiles_per_unit) {
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
    s.tiles_per_unit = tiles_per_unit;
    s.active = true;
    return s;
  }

  // Partial dK/dV slots and piece counters a grid of num_ctas CTAs may use: slot(tau, c) = c + tau < C + T * R.
  DASH_HD static int64_t max_slots(int32_t num_ctas, int32_t tiles_per_unit) {
    return (1 + static_cast<int64_t>(tiles_per_unit)) * num_ctas;
  }
  DASH_HD static int64_t max_tiles(int32_t num_ctas, int32_t tiles_per_unit) {
    return static_cast<int64_t>(tiles_per_unit) * num_ctas;
  }

  DASH_HD int32_t total_steps() const { return units * visits; }
  DASH_HD int32_t num_chunks() const { return ceil_div_u32(total_steps(), chunk); }
  // A CTA's items: one per unit tile of the whole waves, then the tail tiles its chunk overlaps.
  DASH_HD int64_t whole_items() const { return waves * tiles_per_unit; }
  DASH_HD bool in_tail(int64_t k) const { return active && k >= whole_items(); }
  DASH_HD int64_t unit_of_tile(int32_t tau) const { return first_unit + tau / tiles_per_unit; }

  // The tail tile's first step and step count in the tail's step sequence; a(i): the split point of tail unit i.
  template <class A>
  DASH_HD int32_t tile_start(int32_t tau, const A& a) const {
    if (A::kTilesPerUnit == 1) return tau * visits;
    const int32_t i = tau >> 1;
    return i * visits + ((tau & 1) ? a(i) : 0);
  }
  template <class A>
  DASH_HD int32_t tile_steps(int32_t tau, const A& a) const {
    if (A::kTilesPerUnit == 1) return visits;
    const int32_t split = a(tau >> 1);
    return (tau & 1) ? visits - split : split;
  }
  // The tail tile that runs step x of the tail.
  template <class A>
  DASH_HD int32_t tile_at(int32_t x, const A& a) const {
    const int32_t i = div_u32(x, visits);
    if (A::kTilesPerUnit == 1) return i;
    return 2 * i + (x - i * visits >= a(i) ? 1 : 0);
  }
  // Tail tiles that chunk c runs: [first_tile(c), first_tile(c) + tiles_in(c)), items whole_items() + ... of CTA c.
  template <class A>
  DASH_HD int32_t first_tile(int32_t c, const A& a) const {
    return tile_at(c * chunk, a);
  }
  template <class A>
  DASH_HD int32_t tiles_in(int32_t c, const A& a) const {
    if (c >= num_chunks()) return 0;
    return tile_at(chunk_end(c) - 1, a) - first_tile(c, a) + 1;
  }
  template <class A>
  DASH_HD int32_t tile_of_item(int32_t c, int64_t k, const A& a) const {
    return first_tile(c, a) + static_cast<int32_t>(k - whole_items());
  }
  // The steps of tail tile tau, counted from the tile's own first step, that chunk c runs.
  template <class A>
  DASH_HD StepRange steps(int32_t tau, int32_t c, const A& a) const {
    const int32_t start = tile_start(tau, a), len = tile_steps(tau, a);
    const int32_t begin = c * chunk - start, end = chunk_end(c) - start;
    return StepRange{begin > 0 ? begin : 0, end < len ? end : len};
  }
  // Chunks that run tail tile tau: [first_chunk, last_chunk]; its piece in chunk c is piece c - first_chunk.
  template <class A>
  DASH_HD int32_t first_chunk(int32_t tau, const A& a) const {
    return div_u32(tile_start(tau, a), chunk);
  }
  template <class A>
  DASH_HD int32_t last_chunk(int32_t tau, const A& a) const {
    return div_u32(tile_start(tau, a) + tile_steps(tau, a) - 1, chunk);
  }
  // When step t of tail tile tau runs: its position in its chunk.
  template <class A>
  DASH_HD int32_t position(int32_t tau, int32_t t, const A& a) const {
    return position_at(tile_start(tau, a) + t);
  }
  // The same for step x of the tail's step sequence.
  DASH_HD int32_t position_at(int32_t x) const {
    return static_cast<int32_t>(static_cast<uint32_t>(x) % static_cast<uint32_t>(chunk));
  }
  // Partial dK/dV slot of tail tile tau's piece in chunk c: pieces (tau, c) and (tau', c') with tau' > tau and the
  // same c + tau would need tile tau' to start inside chunk c' < c while tile tau still reaches into chunk c, which
  // tiles laid end to end cannot; so the slots are distinct, and below num_chunks + T * R <= max_slots.
  DASH_HD int32_t slot(int32_t tau, int32_t c) const { return c + tau; }

 private:
  DASH_HD int32_t chunk_end(int32_t c) const {
    const int32_t end = (c + 1) * chunk, total = total_steps();
    return end < total ? end : total;
  }
};

}  // namespace dash::sched
