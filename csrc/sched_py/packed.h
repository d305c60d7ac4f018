// Host-only: packed launches scheduled per sequence (schedule/seq_runs.h). The sequence table built from lengths as
// the kernels' seq-table kernel builds it, and the check that every sequence of a pack gets exactly the items, walks
// and accumulation positions it gets alone, deadlock-free, for every CTA count. Built only into dash_attn._sched.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "sched_py/simulate.h"

namespace dash::sched::host {

// A pack: the launch's Problem (batch = sequences, lengths the bounds) and its sequence table, which the Problem points
// to (so the holder is neither copied nor moved once built). The bounds are the longest sequence's lengths unless
// given: below a sequence's, they model a launch whose device table reads lengths past the caller's max_seqlen (an
// invalid call inside a captured graph), which entry_for holds to the bounds.
class PackedProblem {
 public:
  PackedProblem(const Problem& p, const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k,
                int32_t short_k = 0, std::optional<int32_t> max_q = std::nullopt,
                std::optional<int32_t> max_k = std::nullopt)
      : p_(p) {
    if (lens_q.size() != lens_k.size() || lens_q.empty()) {
      throw std::invalid_argument("lens_q and lens_k must hold one length per sequence (at least one)");
    }
    if (p.mask == MaskKind::kWindow) throw std::invalid_argument("sequences are scheduled on their own geometry "
                                                                 "under a causal or full mask only");
    p_.batch = static_cast<int32_t>(lens_q.size());
    if ((max_q && *max_q < 1) || (max_k && *max_k < 1)) throw std::invalid_argument("bounds must be >= 1");
    p_.seqlen_q = max_q.value_or(*std::max_element(lens_q.begin(), lens_q.end()));
    p_.seqlen_k = max_k.value_or(*std::max_element(lens_k.begin(), lens_k.end()));
    const int32_t B = p_.batch;
    for (int32_t b = 0; b < B; ++b) {
      if (lens_q[b] < 0 || lens_k[b] < 0) throw std::invalid_argument("negative sequence length");
      table_.push_back(SeqCausalRuns::entry_for(p_, lens_q[b], lens_k[b], short_k));
    }
    std::vector<int32_t> order(B);
    for (int32_t b = 0; b < B; ++b) order[b] = b;
    if (B <= SeqCausalRuns::kSortedSeqsMax) {
      std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
        return a != b && SeqCausalRuns::launches_before(table_[a], a, table_[b], b);
      });
    }
    int64_t units = 0;
    for (int32_t b : order) {
      table_[b].first_unit = static_cast<int32_t>(units);
      units += SeqCausalRuns::units_of(p_, table_[b]);
      if (units > INT32_MAX) throw std::invalid_argument("more than 2^31 - 1 work units");
    }
    table_.push_back(SeqEntry{static_cast<int32_t>(units), 0, 0, ScheduleKind::kDescending});
    // The launch order, as int32 after the entries (SeqCausalRuns::seq_at).
    table_.resize(table_.size() + (B + 3) / 4);
    std::copy(order.begin(), order.end(), reinterpret_cast<int32_t*>(table_.data() + B + 1));
    p_.seqs = table_.data();
  }
  PackedProblem(const PackedProblem&) = delete;
  PackedProblem& operator=(const PackedProblem&) = delete;

  // The launch on `ctas` CTAs (the table stays this holder's).
  Problem launch(int32_t ctas) const {
    if (ctas <= 0) throw std::invalid_argument("num_ctas must be >= 1");
    Problem p = p_;
    p.num_ctas = ctas;
    return p;
  }
  const std::vector<SeqEntry>& table() const { return table_; }  // entries [0, batch], then the launch order
  int32_t units() const { return table_[p_.batch].first_unit; }

 private:
  Problem p_;
  std::vector<SeqEntry> table_;
};

// Checks the pack for CTA counts [cta_lo, cta_hi]: per sequence, the visits (head, Q tile, KV tile, run, position) are
// those of the sequence alone (one CTA); every visit's tiles lie inside the launch's bounds; every KV tile of every
// sequence runs once, whole; items past a sequence's tiles have no visits; the adds per accumulator are what the
// postprocess waits for; no deadlock, with the units dealt statically or claimed in launch order.
inline std::vector<std::string> verify_packed(const PackedProblem& pack, int32_t cta_lo, int32_t cta_hi,
                                              size_t max_errors = 20) {
  using Key = std::tuple<int32_t, int32_t, int32_t, int32_t, int32_t>;  // head_k, head, m, n, (run, position)
  std::vector<std::string> errors;
  auto fail = [&](int32_t ctas, const std::string& what) {
    if (errors.size() < max_errors) errors.push_back("num_ctas=" + std::to_string(ctas) + ": " + what);
  };
  const Problem base = pack.launch(1);
  const int32_t B = base.batch;
  const ScheduleKind kind = per_sequence_kind(base.mask);
  // Each sequence alone, under the schedule its entry resolved to: its visits and its KV tiles' step counts.
  std::vector<std::vector<Key>> alone_visits(B);
  std::vector<std::vector<int32_t>> alone_steps(B);
  for (int32_t b = 0; b < B; ++b) {
    const SeqEntry& e = pack.table()[b];
    const Problem s = SeqCausalRuns::alone(base, e.len_q, e.len_k);
    const Enumeration a = enumerate(e.kind, s, true);
    for (const VisitRecord& v : a.visits) {
      alone_visits[b].emplace_back(v.head_k, v.head, v.m_block, v.n_block, v.run * (1 << 20) + v.wait_target);
    }
    std::sort(alone_visits[b].begin(), alone_visits[b].end());
    alone_steps[b].assign(static_cast<size_t>(s.nheads_k) * num_n_blocks(s), 0);
    for (const ItemRecord& it : a.items) {
      alone_steps[b][static_cast<size_t>(it.head_k) * num_n_blocks(s) + it.n_block] = it.num_visits;
    }
  }
  for (int32_t ctas = cta_lo; ctas <= cta_hi && errors.size() < max_errors; ++ctas) {
    const Problem p = pack.launch(ctas);
    if (resolve_schedule(kind, p) != ScheduleKind::kSeqCausalRuns) {
      fail(ctas, "the mask's runs schedule does not resolve to the per-sequence schedule");
      return errors;
    }
    const Enumeration e = enumerate(kind, p, true);
    std::vector<std::vector<Key>> seen(B);
    std::vector<std::vector<int32_t>> runs_of(B);
    for (int32_t b = 0; b < B; ++b) {
      const SeqEntry& s = pack.table()[b];
      runs_of[b].assign(static_cast<size_t>(p.nheads_k) * num_n_blocks(SeqCausalRuns::alone(p, s.len_q, s.len_k)), 0);
    }
    for (const ItemRecord& it : e.items) {
      if (it.batch < 0 || it.batch >= B || it.head_k < 0 || it.head_k >= p.nheads_k) {
        fail(ctas, "item out of range");
        continue;
      }
      const SeqEntry& s = pack.table()[it.batch];
      const int32_t N = num_n_blocks(SeqCausalRuns::alone(p, s.len_q, s.len_k));
      if (it.n_block >= N) {
        if (it.num_visits != 0) fail(ctas, "an item past its sequence's KV tiles with visits");
        continue;
      }
      const size_t key = static_cast<size_t>(it.head_k) * N + it.n_block;
      ++runs_of[it.batch][key];
      if (it.first_step != 0 || it.num_visits != alone_steps[it.batch][key]) {
        fail(ctas, "sequence " + std::to_string(it.batch) + " KV tile " + std::to_string(it.n_block) +
                       " does not run the steps it runs alone");
      }
    }
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t r : runs_of[b]) {
        if (r != 1) fail(ctas, "sequence " + std::to_string(b) + ": a KV tile ran " + std::to_string(r) + " times");
      }
    }
    // The workspace and the postprocess grid hold num_m_blocks(p) Q tiles per head: a visit past them would add
    // into another head's tile (q_tile_index) or past the workspace.
    const int32_t launch_m = num_m_blocks(p), launch_n = num_n_blocks(p);
    bool inside = true;
    for (const VisitRecord& v : e.visits) {
      if (inside && (v.m_block >= launch_m || v.n_block >= launch_n)) {
        fail(ctas, "sequence " + std::to_string(v.batch) + ": a visit past the launch's bounds");
        inside = false;
      }
      seen[v.batch].emplace_back(v.head_k, v.head, v.m_block, v.n_block, v.run * (1 << 20) + v.wait_target);
    }
    for (int32_t b = 0; b < B && errors.size() < max_errors; ++b) {
      std::sort(seen[b].begin(), seen[b].end());
      if (seen[b] != alone_visits[b]) fail(ctas, "sequence " + std::to_string(b) + ": visits differ from alone");
      // The postprocess's counts, per Q tile and run, against the adds made.
      const SeqEntry& s = pack.table()[b];
      const int32_t M = num_m_blocks(SeqCausalRuns::alone(p, s.len_q, s.len_k));
      std::vector<int32_t> adds(static_cast<size_t>(p.nheads) * M * kMaxDqRuns, 0);
      for (const Key& k : seen[b]) {
        ++adds[(static_cast<size_t>(std::get<1>(k)) * M + std::get<2>(k)) * kMaxDqRuns + (std::get<4>(k) >> 20)];
      }
      for (int32_t h = 0; h < p.nheads; ++h) {
        for (int32_t m = 0; m < M; ++m) {
          for (int32_t run = 0; run < kMaxDqRuns; ++run) {
            const int32_t want = tile_contributors(ScheduleKind::kSeqCausalRuns, p, b, m, run);
            if (adds[(static_cast<size_t>(h) * M + m) * kMaxDqRuns + run] != want) {
              fail(ctas, "sequence " + std::to_string(b) + ": adds differ from the postprocess's count");
            }
          }
        }
      }
    }
    const SimResult sim = simulate(kind, p, SimOptions{});
    if (sim.deadlock) fail(ctas, "deadlock after " + std::to_string(sim.visits_done) + " visits");
    // What the kernels run: the units claimed in launch order (seq_runs.h).
    SimOptions claimed;
    claimed.dispatch = Dispatch::kGreedy;
    const SimResult run = simulate(kind, p, claimed);
    if (run.deadlock) fail(ctas, "claimed units: deadlock after " + std::to_string(run.visits_done) + " visits");
  }
  return errors;
}

}  // namespace dash::sched::host
