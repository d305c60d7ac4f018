// Thin run-time wrapper around the schedule engine (csrc/schedule). The kernel never derives a schedule itself: it
// asks which KV tiles a CTA runs, how many steps each has and, per step, the query head, Q tile and dQ wait target.
// The schedule kind is a run-time value so that one kernel per (hdim, dtype, mask) serves every schedule; only these
// small integer functions are dispatched, not the kernel body.
#pragma once
#include "common/params.h"
#include "schedule/schedule.h"

namespace dash::bwd {

using KvTileRef = sched::KvTile;
using VisitRef = sched::Visit;

// The two phases in which the producer walks a CTA's items (bwd_producer.h): the whole waves, then, in the kernels
// that split it, shift's split tail (items waves .. waves + units_in(cta) - 1). Each phase compiles only its own item
// arithmetic: the tail's (a loop over the head's tiles per visit) then takes no registers from the whole waves',
// whose evaluation fills the producer warp's 24.
enum class ItemPhase { kWhole, kTail };

// `kind` is resolved at construction (host): the schedule's precondition checks, which re-derive the tile ranges
// (divisions), then never run in the producer warp, and only the schedule that actually runs is dispatched.
// `Fixed` is the kernel's traits: its kMask, kBlockM and kBlockN are what launch_bwd_main always puts into `problem`.
// As constants they fold the band arithmetic of the tile ranges away (full) or halve it (causal), and turn the
// divisions by the tile sizes into multiplications.
struct ScheduleRef {
  sched::Problem problem;
  ScheduleKind kind;
  // Shift's split tail (schedule/tail_split.h), derived once here: the tail's items never reach the dispatch below,
  // which then runs shift's whole waves unchanged.
  sched::TailSplit tail;

  ScheduleRef() = default;
  ScheduleRef(const sched::Problem& p, ScheduleKind requested)
      : problem(p),
        kind(sched::resolve_schedule(requested, p)),
        tail(kind == ScheduleKind::kShift ? sched::Shift::tail(p) : sched::TailSplit{}) {}

  // Kernels that carry the split tail's code: batched full masks (Shift::tail splits nothing else; packed sequences
  // run with Problem::tail_chunk_min = 0).
  template <class Fixed>
  static constexpr bool splits_tail() {
    return !Fixed::kPacked && Fixed::kMask == MaskKind::kFull;
  }
  // Kernels that claim their units at run time (ScheduleKind::kDynamic, schedule/dynamic.h, and shift_causal_runs'
  // units, runs.h): the batched causal ones, where units differ in length or a static deal starts some of a head's
  // units a wave late. The claim and election code cost the producer warp (24 registers) a few spill bytes in the
  // full and window kernels, which gain nothing from it (equal units) or were not measured with it; launch_bwd_main
  // runs shift_causal for kDynamic there, and the window kernels deal shift_causal_runs' units.
  template <class Fixed>
  static constexpr bool claims_units() {
    return !Fixed::kPacked && Fixed::kMask == MaskKind::kCausal;
  }
  template <class Fixed>
  DASH_HD bool dynamic() const {
    return claims_units<Fixed>() && kind == ScheduleKind::kDynamic;
  }
  // shift_causal_runs' units claimed at run time, two items each (ShiftCausalRuns::claimed_item): the bits of the
  // static deal.
  template <class Fixed>
  DASH_HD bool claims_runs_units() const {
    return claims_units<Fixed>() && kind == ScheduleKind::kShiftCausalRuns;
  }
  // Kernels that run descending_lanes' layout: the full and causal ones, batched and packed, where deterministic
  // `auto` picks it (dash_attn/schedules_table.py); the window kernels run it as descending, with the same bits, and
  // carry none of its unit arithmetic in the producer warp.
  template <class Fixed>
  static constexpr bool runs_lanes() {
    return Fixed::kMask != MaskKind::kWindow;
  }
  // Kernels that may get a sequence table (problem.seqs) and schedule each sequence on its own geometry
  // (schedule/seq_runs.h): the packed causal and full ones, the only kernels launch_bwd gives one (seq_table_call).
  template <class Fixed>
  static constexpr bool takes_seq_table() {
    return Fixed::kPacked && Fixed::kMask != MaskKind::kWindow;
  }
  // The sequence table's schedule, whose units the kernels claim at run time (seq_runs.h): item k is tile k mod 2 of
  // the unit of launch index k / 2.
  template <class Fixed>
  DASH_HD bool claims_seq_units() const {
    return takes_seq_table<Fixed>() && kind == ScheduleKind::kSeqCausalRuns;
  }
  // Units of two items claimed at run time (shift_causal_runs' and the sequence table's): the producer claims one at
  // every even item index.
  template <class Fixed>
  DASH_HD bool claims_item_pairs() const {
    return claims_runs_units<Fixed>() || claims_seq_units<Fixed>();
  }
  // The schedule of `kind`, applied (schedule.h): kernels that never claim units compile no Dynamic code, full-mask
  // kernels none of the paired causal schedules (a full mask never resolves to them).
  template <class Fixed, class F>
  DASH_HD auto dispatch(F&& f) const {
    constexpr bool kWithDynamic = claims_units<Fixed>(), kWithCausal = Fixed::kMask != MaskKind::kFull;
    return sched::dispatch_resolved<kWithDynamic, kWithCausal, runs_lanes<Fixed>(), takes_seq_table<Fixed>()>(kind, f);
  }
  template <class Fixed, ItemPhase kPhase = ItemPhase::kWhole>
  DASH_HD int64_t num_items(int32_t cta) const {
    const sched::Problem pm = fixed<Fixed>();
    if constexpr (kPhase == ItemPhase::kTail) {
      return tail.active ? sched::Shift::num_items_with(pm, tail, cta) : 0;
    } else {
      if constexpr (splits_tail<Fixed>()) {
        if (tail.active) return tail.waves;
      }
      // Claimed units: item k is the unit of launch index k, whichever CTA claimed it (two-item units: of index k / 2).
      if (dynamic<Fixed>()) return sched::Dynamic::num_units(pm);
      if (claims_runs_units<Fixed>()) return 2 * sched::ShiftCausalRuns::num_claimed_units(pm);
      if (claims_seq_units<Fixed>()) return 2 * int64_t{sched::SeqCausalRuns::total_units(pm)};
      return dispatch<Fixed>([&](auto s) { return decltype(s)::num_items(pm, cta); });
    }
  }
  template <class Fixed, ItemPhase kPhase = ItemPhase::kWhole>
  DASH_HD KvTileRef item(int32_t cta, int64_t k) const {
    const sched::Problem pm = fixed<Fixed>();
    if constexpr (kPhase == ItemPhase::kTail) {
      return sched::Shift::Units::tile_of_unit(pm, tail.unit_of_item(cta, k));
    } else {
      if (dynamic<Fixed>()) return sched::Dynamic::unit(pm, k);
      if (claims_runs_units<Fixed>()) return sched::ShiftCausalRuns::claimed_item(pm, k >> 1, (k & 1) != 0);
      if (claims_seq_units<Fixed>()) return sched::SeqCausalRuns::unit_item(pm, k >> 1, (k & 1) != 0);
      return dispatch<Fixed>([&](auto s) { return decltype(s)::item(pm, cta, k); });
    }
  }
  template <class Fixed>
  DASH_HD int32_t num_visits(const KvTileRef& t) const {
    const sched::Problem pm = fixed<Fixed>();
    return dispatch<Fixed>([&](auto s) { return decltype(s)::num_visits(pm, t); });
  }
  // Steps [lo, hi) of item k (its tile having nv visits) that the CTA runs: all of them in the whole waves, a piece of
  // the tile in the split tail where that is not all of its visits.
  template <ItemPhase kPhase>
  DASH_HD sched::StepRange item_steps(int32_t cta, int64_t k, int32_t nv) const {
    if constexpr (kPhase == ItemPhase::kTail) {
      return sched::Shift::tail_steps(tail, cta, k);
    } else {
      return sched::StepRange{0, nv};
    }
  }
  // Step `step` of tile t = item(cta, k).
  template <class Fixed, ItemPhase kPhase = ItemPhase::kWhole>
  DASH_HD VisitRef visit(int32_t cta, int64_t k, const KvTileRef& t, int32_t step) const {
    const sched::Problem pm = fixed<Fixed>();
    if constexpr (kPhase == ItemPhase::kTail) {
      return sched::Shift::tail_visit(pm, tail, t, step);
    } else {
      return dispatch<Fixed>([&](auto s) {
        return decltype(s)::visit_at(pm, t, step, decltype(s)::slot_of_item(pm, cta, k));
      });
    }
  }

 private:
  template <class Fixed>
  DASH_HD sched::Problem fixed() const {
    sched::Problem pm = problem;
    pm.mask = Fixed::kMask;
    pm.block_m = Fixed::kBlockM;
    pm.block_n = Fixed::kBlockN;
    return pm;
  }
};

}  // namespace dash::bwd
