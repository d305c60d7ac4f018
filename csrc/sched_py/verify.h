// Host-only self-check of a schedule against the execution model: coverage, accumulation orders and deadlock-freedom.
// The live-tile table is rebuilt element by element, independently of m_block_range/n_block_range.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sched_py/simulate.h"

namespace dash::sched::host {

// live[m * N + n]: Q tile m and KV tile n share at least one unmasked element.
inline std::vector<uint8_t> live_tiles_bruteforce(const Problem& p) {
  const int32_t M = num_m_blocks(p), N = num_n_blocks(p);
  std::vector<uint8_t> live(static_cast<size_t>(M) * N, 0);
  const Band b = band_of(p);
  const int64_t d = static_cast<int64_t>(p.seqlen_k) - p.seqlen_q;
  for (int64_t i = 0; i < p.seqlen_q; ++i) {
    // Keys visible from row i: [i + d - left, i + d + right] clipped to [0, seqlen_k).
    const int64_t k_lo = b.has_left ? std::max<int64_t>(0, i + d - b.left) : 0;
    const int64_t k_hi = b.has_right ? std::min<int64_t>(p.seqlen_k - 1, i + d + b.right) : p.seqlen_k - 1;
    if (k_lo > k_hi) continue;
    const int64_t m = i / p.block_m;
    for (int64_t n = k_lo / p.block_n; n <= k_hi / p.block_n; ++n) live[m * N + n] = 1;
  }
  return live;
}

// The batched causal kernels claim shift_causal_runs' units at run time (ShiftCausalRuns::claimed_item,
// bwd_tile_scheduler.h): each claimed unit must hold the items the static deal gives that unit, in the same order (so
// the bits are the deal's), its second item past the last KV tile where the deal has one item.
inline void check_claimed_runs(const Problem& p, const Enumeration& e,
                               const std::function<void(const std::string&)>& fail) {
  const int32_t N = num_n_blocks(p);
  const int64_t units = ShiftCausalRuns::num_claimed_units(p);
  std::vector<std::vector<KvTile>> dealt(static_cast<size_t>(units));
  for (const ItemRecord& it : e.items) {
    if (it.unit < 0 || it.unit >= units) {
      fail("item of unit " + std::to_string(it.unit) + " outside the claimed units");
      return;
    }
    dealt[static_cast<size_t>(it.unit)].push_back(KvTile{it.batch, it.head_k, it.n_block});
  }
  auto same = [](const KvTile& a, const KvTile& b) {
    return a.batch == b.batch && a.head_k == b.head_k && a.n_block == b.n_block;
  };
  for (int64_t u = 0; u < units; ++u) {
    const KvTile first = ShiftCausalRuns::claimed_item(p, u, false), second = ShiftCausalRuns::claimed_item(p, u, true);
    const auto& d = dealt[static_cast<size_t>(u)];
    const bool ok = second.n_block == N ? d.size() == 1 && same(d[0], first) &&
                                              ShiftCausalRuns::num_visits(p, second) == 0
                                        : d.size() == 2 && same(d[0], first) && same(d[1], second);
    if (!ok) {
      fail("claimed unit " + std::to_string(u) + " differs from the dealt one");
      return;
    }
  }
}

// Checks one schedule for CTA counts [cta_lo, cta_hi]; returns human-readable errors (at most max_errors).
inline std::vector<std::string> verify(ScheduleKind kind, Problem p, int32_t cta_lo, int32_t cta_hi,
                                       size_t max_errors = 20) {
  std::vector<std::string> errors;
  auto fail = [&](int32_t ctas, const std::string& what) {
    if (errors.size() < max_errors) errors.push_back("num_ctas=" + std::to_string(ctas) + ": " + what);
  };
  const int32_t M = num_m_blocks(p), N = num_n_blocks(p), g = group_size(p);
  const std::vector<uint8_t> live = live_tiles_bruteforce(p);
  std::vector<int32_t> live_per_n(N, 0), live_per_m(M, 0);
  for (int32_t m = 0; m < M; ++m) {
    for (int32_t n = 0; n < N; ++n) {
      live_per_n[n] += live[static_cast<size_t>(m) * N + n];
      live_per_m[m] += live[static_cast<size_t>(m) * N + n];
    }
  }
  const int64_t heads_total = num_kv_heads_total(p);
  for (int32_t ctas = cta_lo; ctas <= cta_hi && errors.size() < max_errors; ++ctas) {
    p.num_ctas = ctas;
    const Enumeration e = enumerate(kind, p, true);
    // Steps each KV tile's items run; a tile run in pieces (shift's tail) has several items whose step ranges must
    // tile [0, num_visits) exactly once, which the per-dQ-tile coverage check below also sees.
    std::vector<int32_t> item_seen(static_cast<size_t>(heads_total) * N, 0), items_of(item_seen.size(), 0);
    for (const ItemRecord& it : e.items) {
      const size_t key = (static_cast<size_t>(it.batch) * p.nheads_k + it.head_k) * N + it.n_block;
      if (it.batch < 0 || it.batch >= p.batch || it.head_k < 0 || it.head_k >= p.nheads_k || it.n_block < 0 ||
          it.n_block >= N) {
        fail(ctas, "item out of range");
        continue;
      }
      item_seen[key] += it.num_visits;
      ++items_of[key];
      if (it.first_step < 0 || it.num_visits < 0 || it.first_step + it.num_visits > g * live_per_n[it.n_block]) {
        fail(ctas, "item steps outside the live Q tiles of the KV tile");
      }
      if (it.num_visits == 0 && g * live_per_n[it.n_block] != 0) fail(ctas, "an item without steps");
    }
    for (size_t k = 0; k < item_seen.size(); ++k) {
      const int32_t want = g * live_per_n[k % N];
      if (items_of[k] == 0) fail(ctas, "KV tile " + std::to_string(k) + " never run");
      if (item_seen[k] != want) {
        fail(ctas, "KV tile " + std::to_string(k) + " ran " + std::to_string(item_seen[k]) + " of its " +
                       std::to_string(want) + " steps");
      }
    }
    // Per dQ tile (batch, head, m): which KV tiles visited it; per accumulator run, which positions they took.
    const size_t dq_tiles = static_cast<size_t>(p.batch) * p.nheads * M;
    const ScheduleKind resolved = resolve_schedule(kind, p);
    std::vector<std::vector<int32_t>> seen_n(dq_tiles), seen_pos(dq_tiles * kMaxDqRuns);
    for (const VisitRecord& v : e.visits) {
      if (v.m_block < 0 || v.m_block >= M || v.head / g != v.head_k || v.run < 0 || v.run >= dq_runs(resolved)) {
        fail(ctas, "visit out of range");
        continue;
      }
      if (!live[static_cast<size_t>(v.m_block) * N + v.n_block]) fail(ctas, "visit of a masked tile pair");
      const size_t key = (static_cast<size_t>(v.batch) * p.nheads + v.head) * M + v.m_block;
      seen_n[key].push_back(v.n_block);
      seen_pos[key * kMaxDqRuns + v.run].push_back(v.wait_target);
    }
    for (size_t key = 0; key < dq_tiles && errors.size() < max_errors; ++key) {
      const int32_t m = static_cast<int32_t>(key % M);
      auto ns = seen_n[key];
      std::sort(ns.begin(), ns.end());
      if (static_cast<int32_t>(ns.size()) != live_per_m[m] || std::adjacent_find(ns.begin(), ns.end()) != ns.end()) {
        fail(ctas, "dQ tile " + std::to_string(key) + ": coverage " + std::to_string(ns.size()) + " visits for " +
                       std::to_string(live_per_m[m]) + " live KV tiles");
      }
      for (int32_t run = 0; run < kMaxDqRuns; ++run) {
        auto pos = seen_pos[key * kMaxDqRuns + run];
        std::sort(pos.begin(), pos.end());
        for (size_t i = 0; i < pos.size(); ++i) {
          if (pos[i] != static_cast<int32_t>(i)) {
            fail(ctas, "dQ tile " + std::to_string(key) + ": wait targets are not a permutation of 0..k-1");
            break;
          }
        }
        // The postprocess waits for this many adds (dynamic's static stand-in is not what its kernel counts).
        if (kind != ScheduleKind::kDynamic &&
            static_cast<int32_t>(pos.size()) != run_contributors(resolved, p, m, run)) {
          fail(ctas, "dQ tile " + std::to_string(key) + " run " + std::to_string(run) + ": " +
                         std::to_string(pos.size()) + " adds, run_contributors says " +
                         std::to_string(run_contributors(resolved, p, m, run)));
        }
      }
    }
    SimOptions o;
    const SimResult s = simulate(kind, p, o);
    if (s.deadlock) fail(ctas, "deadlock after " + std::to_string(s.visits_done) + " visits");
    if (resolved == ScheduleKind::kShiftCausalRuns) {
      // What the batched causal kernels run: the same units, claimed in launch order.
      check_claimed_runs(p, e, [&](const std::string& what) { fail(ctas, what); });
      SimOptions claimed;
      claimed.dispatch = Dispatch::kGreedy;
      const SimResult d = simulate(kind, p, claimed);
      if (d.deadlock) fail(ctas, "claimed units: deadlock after " + std::to_string(d.visits_done) + " visits");
    }
    if (kind == ScheduleKind::kDynamic) {
      // What the kernel runs: claims in launch order, each tile's first add elected at load time (simulate.h).
      o.deterministic = false;
      o.dispatch = Dispatch::kGreedy;
      const SimResult d = simulate(kind, p, o);
      if (d.deadlock) fail(ctas, "claimed (greedy) run: deadlock after " + std::to_string(d.visits_done) + " visits");
    }
  }
  return errors;
}

}  // namespace dash::sched::host
