// Host-only enumeration of a schedule: what every CTA of the static persistent grid executes, plus the launch order
// of work units (used by the greedy-dispatch model). Built only into dash_attn._sched, never into kernels.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "schedule/schedule.h"

namespace dash::sched::host {

// One executed step, flattened over the whole grid.
struct VisitRecord {
  int32_t cta, item, batch, head, head_k, n_block, m_block, step, wait_target, run;
};

struct ItemRecord {
  int32_t cta, batch, head_k, n_block, num_visits;
  int32_t first_step;   // the item runs steps [first_step, first_step + num_visits) of its tile (item_steps)
  int64_t unit;        // launch index of the work unit the item belongs to (items of one unit run back to back)
  int64_t first_visit;  // index into the visit list (visits of an item are contiguous)
};

struct Enumeration {
  std::vector<ItemRecord> items;    // grouped by CTA, in execution order
  std::vector<VisitRecord> visits;  // grouped by CTA, then item, then step
  std::vector<int64_t> cta_item_offsets;  // items of CTA c: [cta_item_offsets[c], cta_item_offsets[c + 1])
};

// Launch index of the unit holding item k of CTA `cta` (mirrors the item layout of each schedule).
template <class S>
int64_t unit_of_item(const Problem& p, int32_t cta, int64_t k) {
  if constexpr (std::is_same_v<S, Shift> || std::is_same_v<S, ShiftCausal>) {
    // shift's split tail (shift_causal falls back to shift): a CTA's tail items are consecutive units.
    const TailSplit ts = Shift::applies(p) ? Shift::tail(p) : TailSplit{};
    if (Shift::in_tail(ts, k)) return ts.unit_of_item(cta, k);
  }
  if constexpr (std::is_same_v<S, ShiftCausal> || std::is_same_v<S, ShiftCausalRuns>) {
    if (ShiftCausal::applies(p)) {
      const auto l = ShiftCausal::layout(p);
      const int64_t pairs = Snake::units_on(l.pair_units, p.num_ctas, cta);
      const int64_t unit_k = k < 2 * pairs ? k / 2 : pairs + (k - 2 * pairs);
      return Snake::unit_at(p.num_ctas, cta, unit_k);
    }
  }
  if constexpr (std::is_same_v<S, SeqCausalRuns>) return Snake::unit_at(p.num_ctas, cta, k / 2);  // two items a unit
  return Snake::unit_at(p.num_ctas, cta, k);
}

template <class S>
Enumeration enumerate_schedule(const Problem& p, bool with_visits) {
  Enumeration e;
  e.cta_item_offsets.reserve(static_cast<size_t>(p.num_ctas) + 1);
  for (int32_t c = 0; c < p.num_ctas; ++c) {
    e.cta_item_offsets.push_back(static_cast<int64_t>(e.items.size()));
    const int64_t n_items = S::num_items(p, c);
    for (int64_t k = 0; k < n_items; ++k) {
      const KvTile tile = S::item(p, c, k);
      const StepRange steps = item_steps_of<S>(p, c, k, tile);
      e.items.push_back(ItemRecord{c, tile.batch, tile.head_k, tile.n_block, steps.hi - steps.lo, steps.lo,
                                   unit_of_item<S>(p, c, k), static_cast<int64_t>(e.visits.size())});
      if (!with_visits) continue;
      for (int32_t t = steps.lo; t < steps.hi; ++t) {
        const Visit v = S::visit(p, tile, t);
        e.visits.push_back(VisitRecord{c, static_cast<int32_t>(k), tile.batch, v.head, tile.head_k, tile.n_block,
                                       v.m_block, t, v.wait_target, v.run});
      }
    }
  }
  e.cta_item_offsets.push_back(static_cast<int64_t>(e.items.size()));
  return e;
}

// The kind the host entry points run: the kinds resolved_before_use are resolved here as the kernel resolves them;
// the others keep their own fallback (dynamic's static stand-in included).
inline ScheduleKind host_kind(ScheduleKind kind, const Problem& p) {
  return resolved_before_use(kind) ? resolve_schedule(kind, p) : kind;
}

inline Enumeration enumerate(ScheduleKind kind, const Problem& p, bool with_visits) {
  return dispatch_schedule(host_kind(kind, p), [&](auto s) { return enumerate_schedule<decltype(s)>(p, with_visits); });
}

}  // namespace dash::sched::host
