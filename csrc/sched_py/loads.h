// Host-only static work per CTA of a varlen pack that the packed kernels run as a batch of its longest sequence: the
// visits each CTA makes inside the sequences (Q tiles and KV tiles past a sequence's end are skipped by the kernel and
// cost next to nothing). The varlen backward compares the busiest CTA of two layouts of one order with it
// (dash_attn/_launch.py); the DAG model (simulate.h) is the slower, fuller measure. Built only into dash_attn._sched.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "sched_py/enumerate.h"

namespace dash::sched::host {

// The most visits any CTA makes inside the sequences, live_m[b] / live_n[b] being sequence b's Q / KV tiles.
template <class S>
int64_t max_cta_live_visits(const Problem& p, const std::vector<int32_t>& live_m, const std::vector<int32_t>& live_n) {
  const int32_t g = group_size(p);
  int64_t most = 0;
  for (int32_t c = 0; c < p.num_ctas; ++c) {
    int64_t visits = 0;
    const int64_t n_items = S::num_items(p, c);
    for (int64_t k = 0; k < n_items; ++k) {
      const KvTile t = S::item(p, c, k);
      if (t.n_block >= live_n[t.batch]) continue;
      const StepRange steps = item_steps_of<S>(p, c, k, t);
      if (steps.lo == 0 && steps.hi == S::num_visits(p, t)) {  // the whole tile: its Q tiles inside the sequence
        const BlockRange r = m_block_range(p, t.n_block);
        const int32_t hi = r.hi < live_m[t.batch] ? r.hi : live_m[t.batch];
        if (hi > r.lo) visits += static_cast<int64_t>(hi - r.lo) * g;
        continue;
      }
      for (int32_t s = steps.lo; s < steps.hi; ++s) visits += S::visit(p, t, s).m_block < live_m[t.batch] ? 1 : 0;
    }
    if (visits > most) most = visits;
  }
  return most;
}

inline int64_t max_cta_live_visits(ScheduleKind kind, const Problem& p, const std::vector<int32_t>& live_m,
                                   const std::vector<int32_t>& live_n) {
  if (static_cast<int64_t>(live_m.size()) != p.batch || static_cast<int64_t>(live_n.size()) != p.batch) {
    throw std::invalid_argument("live_m and live_n must hold one tile count per batch entry");
  }
  return dispatch_schedule(host_kind(kind, p),
                           [&](auto s) { return max_cta_live_visits<decltype(s)>(p, live_m, live_n); });
}

}  // namespace dash::sched::host
