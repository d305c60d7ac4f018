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

struct ScheduleRef {
  sched::Problem problem;
  ScheduleKind kind;

  DASH_HD int64_t num_items(int32_t cta) const {
    return sched::dispatch_schedule(kind, [&](auto s) { return decltype(s)::num_items(problem, cta); });
  }
  DASH_HD KvTileRef item(int32_t cta, int64_t k) const {
    return sched::dispatch_schedule(kind, [&](auto s) { return decltype(s)::item(problem, cta, k); });
  }
  DASH_HD int32_t num_visits(const KvTileRef& t) const {
    return sched::dispatch_schedule(kind, [&](auto s) { return decltype(s)::num_visits(problem, t); });
  }
  DASH_HD VisitRef visit(const KvTileRef& t, int32_t step) const {
    return sched::dispatch_schedule(kind, [&](auto s) { return decltype(s)::visit(problem, t, step); });
  }
};

}  // namespace dash::bwd
