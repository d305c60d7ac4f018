// shift_causal_runs (causal masks) and shift_runs (full masks) on packed sequences: every sequence scheduled on its
// own geometry.
//
// The packed kernels otherwise run a pack as a batch of its longest sequence, so a schedule whose walk or positions
// depend on the tile counts (shift_causal_runs pairs tile u with tile N-1-u) would give a sequence other bits beside a
// longer one. Here each sequence gets exactly the items, walks and accumulation positions it gets alone: those of
// what the mask's runs schedule resolves to on its own lengths (causal: ShiftCausalRuns; ShiftRuns where every tile
// pair is live; Descending where it has no Q rows. Full: ShiftRuns; Descending where ShiftRuns' adds would wait,
// runs.h), so its bits equal a dense call's of that sequence under that schedule, whatever it is packed with and
// wherever it sits in the pack. A launch may also give a key count `short_k` up to which a sequence runs Descending
// instead: deterministic `auto` passes the bound up to which its dense pick is descending_lanes (descending's orders),
// on full masks at every seqlen_q and on causal masks on square bands, where the sequences on mostly full bands run
// Descending too (runs_descending), so that each sequence gets its dense call's orders under `auto`. The full-mask
// kernels carry ShiftRuns' and Descending's visits (ptxas: 4 more spill bytes at hdim 64 and 128); the choice is made
// once per sequence, in the table.
//
// Layout: the sequences one after another, longest first (up to kSortedSeqsMax sequences, else in pack order), so that
// the last waves hold the shortest units; per sequence its KV heads one after another, per head the pair units in
// ShiftCausalRuns' launch order (unit_of_index), then the middle unit; a Descending sequence by KV tile index, per
// index its KV heads: its longest tiles first, which the claims balance best (head by head, the last heads' longest
// tiles would start last). Dealt to the CTAs as every static schedule deals its units (Snake). A unit is two items: the
// long and the short tile of a pair, or one tile (a middle tile; a tile of a ShiftRuns or Descending sequence) and then
// a tile index past the sequence's last KV tile, which has no visits and which the kernel skips; so a CTA's item count
// depends on the unit total alone. ShiftRuns sequences take their tiles in descending KV index, Descending ones in
// ascending index: each in the order its accumulation positions follow.
//
// The kernels claim the units at run time, in launch order (a global counter, as ScheduleKind::kDynamic does): the
// units of sequences of different lengths differ in length, and a static deal then starts some units before the
// units they add after, which wait (the DAG model: 13-24% longer makespans on packs with one long sequence). Claimed,
// a unit never starts before an earlier one. num_items / item below deal the units statically (Snake), the stand-in
// the engine enumerates; simulate(..., dispatch=greedy) runs the claims.
//
// Deadlock-free for any grid, dealt or claimed: a unit waits only for units of its own (sequence, KV head) with a
// smaller launch index (longs wait for longs of higher u, shorts for shorts of higher u, the middle tile for every
// short; ShiftRuns as in runs.h; a Descending tile waits for its head's previous tile, a row of heads earlier);
// every CTA runs its units in increasing launch index, and a claimed unit's predecessors were claimed earlier by
// CTAs that run them to the end.
//
// The table (Problem::seqs) holds one SeqEntry per sequence, then one whose first_unit is the unit total, then the
// launch order (batch int32 sequence indices, seq_at). It is built from the lengths by entry_for, units_of and
// launches_before: on the device by the backward's seq-table kernel, from the cu_seqlens/seqused the kernels read,
// and on the host by dash_attn._sched (sched_py/packed.h).
#pragma once
#include "schedule/descending.h"
#include "schedule/runs.h"

namespace dash::sched {

DASH_HD inline ScheduleKind resolve_schedule(ScheduleKind kind, const Problem& p);  // schedule.h

// The packed launches that schedule every sequence on its own geometry: shift_causal_runs under a causal mask,
// shift_runs under a full one.
DASH_HD inline bool runs_per_sequence(ScheduleKind kind, MaskKind mask) {
  return (kind == ScheduleKind::kShiftCausalRuns && mask == MaskKind::kCausal) ||
         (kind == ScheduleKind::kShiftRuns && mask == MaskKind::kFull);
}
// The schedule each sequence of such a launch runs on its own lengths (resolved per sequence).
DASH_HD inline ScheduleKind per_sequence_kind(MaskKind mask) {
  return mask == MaskKind::kCausal ? ScheduleKind::kShiftCausalRuns : ScheduleKind::kShiftRuns;
}

struct SeqCausalRuns {
  // A word of the table, which nothing writes while a kernel reads it: through the read-only cache on the device.
  DASH_HD static int32_t load(const int32_t* word) {
#if defined(__CUDA_ARCH__)
    return __ldg(word);
#else
    return *word;
#endif
  }
  // Entry b of the table (b = batch: first_unit is the unit total).
  DASH_HD static SeqEntry entry(const Problem& p, int32_t b) {
#if defined(__CUDA_ARCH__)
    const int4 v = __ldg(reinterpret_cast<const int4*>(p.seqs) + b);
    return SeqEntry{v.x, v.y, v.z, static_cast<ScheduleKind>(v.w)};
#else
    return p.seqs[b];
#endif
  }
  DASH_HD static int32_t first_unit(const Problem& p, int32_t b) { return load(&p.seqs[b].first_unit); }
  // Sequence at launch position i (the launch order after the entries).
  DASH_HD static int32_t seq_at(const Problem& p, int32_t i) {
    return load(reinterpret_cast<const int32_t*>(p.seqs + p.batch + 1) + i);
  }
  // Packs of up to this many sequences launch longest first; larger ones in pack order (the device sorts in one CTA).
  static constexpr int32_t kSortedSeqsMax = 1024;
  // Whether sequence a launches before sequence b (a != b): more Q rows first (a unit's length), then more keys,
  // then the lower index.
  DASH_HD static bool launches_before(const SeqEntry& a, int32_t ia, const SeqEntry& b, int32_t ib) {
    if (a.len_q != b.len_q) return a.len_q > b.len_q;
    if (a.len_k != b.len_k) return a.len_k > b.len_k;
    return ia < ib;
  }
  // The sequence alone: a batch of one with its own lengths.
  DASH_HD static Problem alone(const Problem& p, int32_t len_q, int32_t len_k) {
    Problem s = p;
    s.batch = 1;
    s.seqlen_q = len_q;
    s.seqlen_k = len_k;
    s.seqs = nullptr;
    return s;
  }
  // Whether a sequence runs Descending under the launch's short_k (0: never), as its dense call under `auto` runs
  // descending_lanes: on full masks up to short_k keys; on causal masks on square or taller bands of up to short_k
  // keys, where descending_lanes' pairs measured faster than the runs (docs/tuning.md), and on mostly full bands
  // (problem.h). Causal bands with fewer queries than keys that are neither keep the runs, at every GQA ratio: there
  // a KV tile's rows are partly masked and the pairs of descending_lanes are unequal (measured, hdim 128, 1024-3072
  // queries against 2048-4096 keys, GQA 1 and 4: shift_causal_runs 2-20% faster on all but one row, docs/tuning.md).
  DASH_HD static bool runs_descending(const Problem& s, int32_t short_k) {
    if (short_k <= 0) return false;
    if (s.mask == MaskKind::kFull) return s.seqlen_k <= short_k;
    return mostly_full_band(s) || (s.seqlen_k <= short_k && s.seqlen_q >= s.seqlen_k);
  }
  // A sequence's entry before the scan fills first_unit: Descending where runs_descending, as its dense call under
  // `auto`; else what the mask's per-sequence schedule resolves to on its lengths. The lengths are held to the
  // launch's bounds (p.seqlen_q, p.seqlen_k: the max_seqlen the workspace's Q tiles and the postprocess grid are sized
  // for). A valid call has none longer; the device table reads cu_seqlens the host never saw (a captured graph), and a
  // sequence past the bound would otherwise address Q tiles of the next head or past the workspace, where two dQ
  // chains share a semaphore and may wait for each other forever. Such a call's results are NaN (device_seqlens).
  DASH_HD static SeqEntry entry_for(const Problem& p, int32_t len_q, int32_t len_k, int32_t short_k) {
    len_q = len_q < p.seqlen_q ? len_q : p.seqlen_q;
    len_k = len_k < p.seqlen_k ? len_k : p.seqlen_k;
    const Problem s = alone(p, len_q, len_k);
    if (runs_descending(s, short_k)) return SeqEntry{0, len_q, len_k, ScheduleKind::kDescending};
    return SeqEntry{0, len_q, len_k, resolve_schedule(per_sequence_kind(p.mask), s)};
  }
  // Units of one KV head of a sequence with N KV tiles: pairs and the middle tile, or one per tile.
  DASH_HD static int32_t units_per_head(int32_t N, ScheduleKind kind) {
    return kind == ScheduleKind::kShiftCausalRuns ? (N + 1) / 2 : N;
  }
  DASH_HD static int32_t units_of(const Problem& p, const SeqEntry& e) {
    return p.nheads_k * units_per_head(num_n_blocks(alone(p, e.len_q, e.len_k)), e.kind);
  }

  DASH_HD static bool applies(const Problem& p) { return p.seqs != nullptr && p.mask != MaskKind::kWindow; }

  DASH_HD static int32_t total_units(const Problem& p) { return first_unit(p, p.batch); }
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) {
    return 2 * Snake::units_on(total_units(p), p.num_ctas, cta);
  }
  // The sequence holding launch index `unit`: that at the last launch position i whose first unit is <= unit (the
  // unit total, past the last position, is > unit).
  DASH_HD static int32_t seq_of_unit(const Problem& p, int64_t unit) {
    int32_t lo = 0, hi = p.batch;
    while (hi - lo > 1) {
      const int32_t mid = (lo + hi) >> 1;
      if (first_unit(p, seq_at(p, mid)) <= unit) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    return seq_at(p, lo);
  }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) {
    return unit_item(p, Snake::unit_at(p.num_ctas, cta, k >> 1), (k & 1) != 0);
  }
  // The first (long, middle or only) or the second tile of the unit of launch index `unit`.
  DASH_HD static KvTile unit_item(const Problem& p, int64_t unit, bool second) {
    const int32_t b = seq_of_unit(p, unit);
    const SeqEntry e = entry(p, b);
    const int32_t N = num_n_blocks(alone(p, e.len_q, e.len_k)), per = units_per_head(N, e.kind);
    const int32_t local = static_cast<int32_t>(unit - e.first_unit);  // < units of the sequence (int32)
    int32_t head_k, r;  // the unit's KV head and its index among the head's units
    if (e.kind == ScheduleKind::kDescending) {
      r = div_u32(local, p.nheads_k);
      head_k = local - r * p.nheads_k;
    } else {
      head_k = div_u32(local, per);
      r = local - head_k * per;
    }
    int32_t n;
    if (e.kind == ScheduleKind::kShiftCausalRuns) {
      const ShiftCausalRuns::Layout l = ShiftCausalRuns::layout(alone(p, e.len_q, e.len_k));
      if (r < l.Q) {
        const int32_t u = ShiftCausalRuns::unit_of_index(l, r);
        n = second ? N - 1 - u : u;
      } else {
        n = second ? N : l.Q;  // the middle tile, then nothing
      }
    } else {
      n = second ? N : (e.kind == ScheduleKind::kShiftRuns ? N - 1 - r : r);
    }
    return KvTile{b, head_k, n};
  }
  DASH_HD static int32_t num_visits(const Problem& p, const KvTile& t) {
    const SeqEntry e = entry(p, t.batch);
    const Problem s = alone(p, e.len_q, e.len_k);
    return group_size(s) * m_block_range(s, t.n_block).size();
  }
  DASH_HD static Visit visit(const Problem& p, const KvTile& t, int32_t step) {
    const SeqEntry e = entry(p, t.batch);
    const Problem s = alone(p, e.len_q, e.len_k);
    if (e.kind == ScheduleKind::kShiftRuns) return ShiftRuns::visit(s, t, step);
    // Never on full masks, whose kernels then carry no ShiftCausalRuns walk.
    if (p.mask != MaskKind::kFull && e.kind == ScheduleKind::kShiftCausalRuns) {
      return ShiftCausalRuns::visit(s, t, step);
    }
    return Descending::visit(s, t, step);
  }
  // Adds into accumulator `run` of Q tile m of sequence b (what the postprocess waits for).
  DASH_HD static int32_t contributors(const Problem& p, int32_t b, int32_t m, int32_t run) {
    const SeqEntry e = entry(p, b);
    return run_contributors(e.kind, alone(p, e.len_q, e.len_k), m, run);
  }
};

}  // namespace dash::sched
