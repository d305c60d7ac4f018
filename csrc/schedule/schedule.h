// Umbrella header of the backward schedule engine: every schedule type and the run-time dispatch the kernel uses so
// that one kernel instantiation serves every schedule.
//
// Execution model every schedule is proven against (tests/test_schedule_*.py, every CTA count 1..256): a static
// persistent grid of p.num_ctas CTAs; CTA c runs item(p, c, 0), item(p, c, 1), ... and, inside an item, visits
// t = 0 .. num_visits - 1 in order; in deterministic mode each visit spins until the dQ tile's semaphore equals
// wait_target before adding.
#pragma once
#include "schedule/ascending.h"
#include "schedule/descending.h"
#include "schedule/problem.h"
#include "schedule/shift.h"
#include "schedule/shift_causal.h"
#include "schedule/spt.h"
#include "schedule/waves.h"

namespace dash::sched {

// Calls f(Sched{}) for the run-time kind. kAuto must be resolved on the host first; it maps to Descending here so
// that a stray kAuto cannot select undefined behaviour. The exec-check pragma lets a __device__-only functor (the
// kernel's) and a host-only one (the simulator's) both pass through this __host__ __device__ template.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class F>
DASH_HD auto dispatch_schedule(ScheduleKind kind, F&& f) {
  switch (kind) {
    case ScheduleKind::kAscending:
      return f(Ascending{});
    case ScheduleKind::kSpt:
      return f(Spt{});
    case ScheduleKind::kShift:
      return f(Shift{});
    case ScheduleKind::kShiftCausal:
      return f(ShiftCausal{});
    case ScheduleKind::kDescending:
    default:
      return f(Descending{});
  }
}

}  // namespace dash::sched
