// Umbrella header of the backward schedule engine: every schedule type and the run-time dispatch the kernel uses so
// that one kernel instantiation serves every schedule.
//
// Execution model every schedule is proven against (tests/test_schedule_*.py, every CTA count 1..256): a static
// persistent grid of p.num_ctas CTAs; CTA c runs item(p, c, 0), item(p, c, 1), ... and, inside an item, visits
// t = 0 .. num_visits - 1 in order; in deterministic mode each visit spins until the dQ tile's semaphore equals
// wait_target before adding.
#pragma once
#include <type_traits>
#include <utility>

#include "schedule/ascending.h"
#include "schedule/descending.h"
#include "schedule/dynamic.h"
#include "schedule/lanes.h"
#include "schedule/problem.h"
#include "schedule/runs.h"
#include "schedule/seq_runs.h"
#include "schedule/shift.h"
#include "schedule/shift_causal.h"
#include "schedule/spt.h"
#include "schedule/waves.h"

namespace dash::sched {

// Calls f(Sched{}) for the run-time kind. kAuto must be resolved on the host first; it maps to Descending here so
// that a stray kAuto cannot select undefined behaviour. kWithCausal = false leaves out the paired causal schedules,
// which never resolve on a full mask (resolve_schedule: they need a band that leaves some tile pair masked), so
// that full-mask kernels carry none of their code (mapped to Descending like kAuto). kWithDynamic = false leaves
// Dynamic out (it maps to Descending too): kernels that never claim units (bwd_tile_scheduler.h) then carry none of
// its code. kWithLanes = false runs DescendingLanes as Descending, whose bits it has (lanes.h): kernels where
// deterministic `auto` never picks it carry none of its code. kWithSeqs = false leaves SeqCausalRuns out (it maps to
// Descending, through the switch's default): only the packed causal kernels schedule sequences on their own geometry
// (seq_runs.h). The exec-check pragma lets a __device__-only functor (the kernel's) and a host-only one (the
// simulator's) both pass through this __host__ __device__ template.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <bool kWithDynamic = true, bool kWithCausal = true, bool kWithLanes = true, bool kWithSeqs = true, class F>
DASH_HD auto dispatch_schedule(ScheduleKind kind, F&& f) {
  if constexpr (kWithSeqs) {
    if (kind == ScheduleKind::kSeqCausalRuns) return f(SeqCausalRuns{});
  }
  switch (kind) {
    case ScheduleKind::kAscending:
      return f(Ascending{});
    case ScheduleKind::kSpt:
      return f(Spt{});
    case ScheduleKind::kShift:
      return f(Shift{});
    case ScheduleKind::kShiftCausal:
      if constexpr (kWithCausal) return f(ShiftCausal{});
      return f(Descending{});
    case ScheduleKind::kShiftRuns:
      return f(ShiftRuns{});
    case ScheduleKind::kShiftCausalRuns:
      if constexpr (kWithCausal) return f(ShiftCausalRuns{});
      return f(Descending{});
    case ScheduleKind::kDescendingLanes:
      if constexpr (kWithLanes) return f(DescendingLanes{});
      return f(Descending{});
    case ScheduleKind::kDynamic:
      if constexpr (kWithDynamic) return f(Dynamic{});
      [[fallthrough]];
    case ScheduleKind::kDescending:
    default:
      return f(Descending{});
  }
}

// The schedule that `kind` runs on problem p once its preconditions are checked: shift_causal falls back to shift,
// shift to descending (exactly what their own num_items / item / visit do on every call), kAuto maps to descending.
// The invariant schedules (runs.h) have no fallback of their own: shift_causal_runs falls back to shift_runs, that
// to descending, and only resolved kinds reach them (the kernel's ScheduleRef, the CPU module's entry points). On a
// packed causal launch with a sequence table (Problem::seqs) shift_causal_runs runs per sequence (seq_runs.h).
// The kernels claim units on causal masks only (Dynamic::applies); elsewhere dynamic runs what shift_causal runs.
DASH_HD inline ScheduleKind resolve_schedule(ScheduleKind kind, const Problem& p) {
  switch (kind) {
    case ScheduleKind::kAscending:
    case ScheduleKind::kSpt:
      return kind;
    case ScheduleKind::kDynamic:
      if (Dynamic::applies(p)) return kind;
      [[fallthrough]];
    case ScheduleKind::kShiftCausal:
      if (ShiftCausal::applies(p)) return ScheduleKind::kShiftCausal;
      return Shift::applies(p) ? ScheduleKind::kShift : ScheduleKind::kDescending;
    case ScheduleKind::kShift:
      return Shift::applies(p) ? kind : ScheduleKind::kDescending;
    case ScheduleKind::kSeqCausalRuns:
    case ScheduleKind::kShiftCausalRuns:
      if (SeqCausalRuns::applies(p)) return ScheduleKind::kSeqCausalRuns;
      if (ShiftCausalRuns::applies(p)) return ScheduleKind::kShiftCausalRuns;
      [[fallthrough]];
    case ScheduleKind::kShiftRuns:
      if (p.mask == MaskKind::kFull && SeqCausalRuns::applies(p)) return ScheduleKind::kSeqCausalRuns;
      return ShiftRuns::applies(p) ? ScheduleKind::kShiftRuns : ScheduleKind::kDescending;
    case ScheduleKind::kDescendingLanes:  // otherwise descending: the same bits
      return DescendingLanes::applies(p) ? kind : ScheduleKind::kDescending;
    case ScheduleKind::kDescending:
    default:
      return ScheduleKind::kDescending;
  }
}

// Adds into accumulator `run` of Q tile m of batch entry `batch` under the resolved kind (what the postprocess waits
// for before it reads the run): the sequence's own geometry where each sequence is scheduled on its own (seq_runs.h),
// else the launch's (runs.h).
DASH_HD inline int32_t tile_contributors(ScheduleKind kind, const Problem& p, int32_t batch, int32_t m, int32_t run) {
  if (kind == ScheduleKind::kSeqCausalRuns) return SeqCausalRuns::contributors(p, batch, m, run);
  return run_contributors(kind, p, m, run);
}

// Kinds whose num_items / item assume their preconditions (the invariant schedules, runs.h and lanes.h): every entry
// point resolves them first (resolve_schedule); the others carry their own fallback.
DASH_HD inline bool resolved_before_use(ScheduleKind kind) {
  return kind == ScheduleKind::kShiftRuns || kind == ScheduleKind::kShiftCausalRuns ||
         kind == ScheduleKind::kDescendingLanes || kind == ScheduleKind::kSeqCausalRuns;
}

// Steps [lo, hi) of item k of CTA `cta`, tile t = S::item(p, cta, k): all of the tile's visits, except where a
// schedule runs a unit in pieces (shift's tail, tail_split.h), which then defines S::item_steps.
template <class S, class = void>
struct HasItemSteps : std::false_type {};
template <class S>
struct HasItemSteps<S, std::void_t<decltype(S::item_steps(std::declval<const Problem&>(), 0, int64_t{0}))>>
    : std::true_type {};
template <class S>
DASH_HD StepRange item_steps_of(const Problem& p, int32_t cta, int64_t k, const KvTile& t) {
  if constexpr (HasItemSteps<S>::value) {
    return S::item_steps(p, cta, k);
  } else {
    return StepRange{0, S::num_visits(p, t)};
  }
}

// A schedule's operations without the precondition checks, for a kind that resolve_schedule returned, plus
// visit_at(p, t, step, r): visit() for a tile whose wave slot r came from slot_of_item (the kernel knows it from the
// CTA and item index; visit() re-derives it from the tile with a 64-bit division).
template <class S>
struct Applied : S {
  DASH_HD static int32_t slot_of_item(const Problem&, int32_t, int64_t) { return 0; }  // not used by S
  DASH_HD static Visit visit_at(const Problem& p, const KvTile& t, int32_t step, int32_t) {
    return S::visit(p, t, step);
  }
};
template <>
struct Applied<Spt> : Spt {};  // its own slot_of_item / visit_at (waves.h, spt.h)
// The kernel's shift covers the whole waves only: bwd_tile_scheduler.h keeps the split tail (tail_split.h) from the
// host and routes the tail's items to Shift's tail_* functions before it dispatches.
template <>
struct Applied<Shift> : Shift {
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) { return Units::num_items(p, cta); }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) { return Units::item(p, cta, k); }
  DASH_HD static int32_t slot_of_item(const Problem& p, int32_t cta, int64_t k) {
    return Units::slot_of_item(p, cta, k);
  }
  DASH_HD static Visit visit_at(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    return whole_visit(p, t, step, r);
  }
};
template <>
struct Applied<ShiftCausal> : ShiftCausal {
  DASH_HD static int64_t num_items(const Problem& p, int32_t cta) { return num_items_applied(p, cta); }
  DASH_HD static KvTile item(const Problem& p, int32_t cta, int64_t k) { return item_applied(p, cta, k); }
  DASH_HD static Visit visit_at(const Problem& p, const KvTile& t, int32_t step, int32_t r) {
    return visit_applied(p, t, step, r);
  }
};

// dispatch_schedule for a resolved kind: f(Applied<Sched>{}).
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <bool kWithDynamic = true, bool kWithCausal = true, bool kWithLanes = true, bool kWithSeqs = true, class F>
DASH_HD auto dispatch_resolved(ScheduleKind resolved, F&& f) {
  return dispatch_schedule<kWithDynamic, kWithCausal, kWithLanes, kWithSeqs>(
      resolved, [&](auto s) { return f(Applied<decltype(s)>{}); });
}

}  // namespace dash::sched
