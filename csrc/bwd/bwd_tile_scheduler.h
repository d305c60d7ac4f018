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

// `kind` is resolved at construction (host): the schedule's precondition checks, which re-derive the tile ranges
// (divisions), then never run in the producer warp, and only the schedule that actually runs is dispatched.
// `Fixed` is the kernel's traits: its kMask, kBlockM and kBlockN are what launch_bwd_main always puts into `problem`.
// As constants they fold the band arithmetic of the tile ranges away (full) or halve it (causal), and turn the
// divisions by the tile sizes into multiplications.
struct ScheduleRef {
  sched::Problem problem;
  ScheduleKind kind;
  // The split tail of shift or shift_causal (schedule/tail_split.h), derived once here: the tail's items never reach
  // the dispatch below, which then runs the schedule's whole waves exactly as without a split.
  sched::TailSplit tail;

  ScheduleRef() = default;
  ScheduleRef(const sched::Problem& p, ScheduleKind requested)
      : problem(p), kind(sched::resolve_schedule(requested, p)), tail(tail_of(kind, p)) {}

  // Kernels that carry split-tail code: batched full (shift's split) and causal (shift_causal's) masks. Packed
  // sequences (Problem::tail_chunk_min = 0) and windows (Shift::tail, ShiftCausal::tail) never split.
  template <class Fixed>
  static constexpr bool splits_tail() {
    return !Fixed::kPacked && (Fixed::kMask == MaskKind::kFull || Fixed::kMask == MaskKind::kCausal);
  }
  // Item k of a CTA is one of the split tail's (then its tile may be run in pieces by consecutive CTAs).
  template <class Fixed>
  DASH_HD bool in_tail(int64_t k) const {
    if constexpr (splits_tail<Fixed>()) {
      return tail.in_tail(k);
    } else {
      return false;
    }
  }

  template <class Fixed>
  DASH_HD int64_t num_items(int32_t cta) const {
    const sched::Problem pm = fixed<Fixed>();
    if constexpr (splits_tail<Fixed>()) {
      if (tail.active) {
        return with_tail_schedule<Fixed>([&](auto s) { return decltype(s)::num_items_with(pm, tail, cta); });
      }
    }
    return sched::dispatch_resolved(kind, [&](auto s) { return decltype(s)::num_items(pm, cta); });
  }
  template <class Fixed>
  DASH_HD KvTileRef item(int32_t cta, int64_t k) const {
    const sched::Problem pm = fixed<Fixed>();
    if (in_tail<Fixed>(k)) {
      return with_tail_schedule<Fixed>([&](auto s) { return decltype(s)::item_with(pm, tail, cta, k); });
    }
    return sched::dispatch_resolved(kind, [&](auto s) { return decltype(s)::item(pm, cta, k); });
  }
  template <class Fixed>
  DASH_HD int32_t num_visits(const KvTileRef& t) const {
    const sched::Problem pm = fixed<Fixed>();
    return sched::dispatch_resolved(kind, [&](auto s) { return decltype(s)::num_visits(pm, t); });
  }
  // Steps [lo, hi) of item k's tile that a tail item runs (in_tail(k)).
  template <class Fixed>
  DASH_HD sched::StepRange tail_steps(int32_t cta, int64_t k) const {
    const sched::Problem pm = fixed<Fixed>();
    return with_tail_schedule<Fixed>([&](auto s) { return decltype(s)::tail_steps(pm, tail, cta, k); });
  }
  // Step `step` of tile t = item(cta, k).
  template <class Fixed>
  DASH_HD VisitRef visit(int32_t cta, int64_t k, const KvTileRef& t, int32_t step) const {
    const sched::Problem pm = fixed<Fixed>();
    if (in_tail<Fixed>(k)) {
      return with_tail_schedule<Fixed>([&](auto s) { return decltype(s)::tail_visit(pm, tail, t, step); });
    }
    return sched::dispatch_resolved(kind, [&](auto s) {
      return decltype(s)::visit_at(pm, t, step, decltype(s)::slot_of_item(pm, cta, k));
    });
  }
  // The pieces of a tail tile (bwd_epilogue.h): its index in the tail and the chunks [first, last] that run it.
  struct Pieces {
    int32_t tile, first, last;
  };
  template <class Fixed>
  DASH_HD Pieces pieces(const KvTileRef& t) const {
    const sched::Problem pm = fixed<Fixed>();
    return with_tail_schedule<Fixed>([&](auto s) {
      using S = decltype(s);
      const auto a = S::tail_points(pm, tail);
      const int32_t tau = S::tail_tile(pm, tail, t);
      return Pieces{tau, tail.first_chunk(tau, a), tail.last_chunk(tau, a)};
    });
  }

 private:
  static sched::TailSplit tail_of(ScheduleKind resolved, const sched::Problem& p) {
    if (resolved == ScheduleKind::kShift) return sched::Shift::tail(p);
    if (resolved == ScheduleKind::kShiftCausal) return sched::ShiftCausal::tail(p);
    return sched::TailSplit{};
  }
  // f(Shift{}) in full-mask kernels, f(ShiftCausal{}) in causal ones: the schedule whose tail can be split there
  // (Shift::tail, ShiftCausal::tail), so a kernel carries one schedule's tail code.
  template <class Fixed, class F>
  DASH_HD auto with_tail_schedule(F&& f) const {
    if constexpr (Fixed::kMask == MaskKind::kCausal) {
      return f(sched::ShiftCausal{});
    } else {
      return f(sched::Shift{});
    }
  }

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
