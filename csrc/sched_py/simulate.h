// DASH cost model of the backward main loop, as a discrete-event simulation of the persistent grid.
// Each visit is compute (c) then reduction (r) on its CTA, serial per CTA; in deterministic mode the reduction into
// a dQ tile may start only after the previous one in that tile's accumulation order (semaphore == wait_target) has
// finished. In non-deterministic mode only the tile's first reduction in that order (wait_target 0, a plain store in
// the kernel, bwd_dq_writer.h) must have finished; the others run in arrival order. The makespan is the critical path
// of that DAG. Host-only; built into dash_attn._sched.
//
// No power term: every visit costs c however many CTAs are busy. The H200 runs the long rows at its 700 W cap, where
// fewer busy SMs get a higher clock, so idle CTAs cost less than the model charges (docs/tuning.md, "Cost model").
// A schedule's idle tail therefore ranks it lower here than on that GPU.
//
// Optional L2 term (l2_tiles > 0): a visit reads its Q and dO tiles and adds into the dQ accumulator tile of the same
// (batch, head, Q tile). L2 is modelled as an LRU of l2_tiles such tiles, touched in simulated time order. A visit
// whose tile is not in it fetches from DRAM, whose bandwidth the missing CTAs share: with f the fraction of misses
// among the grid's last num_ctas visits, it takes max(c + miss_latency, f * miss) instead of c (miss: a visit's DRAM
// bytes at 1/num_ctas of the bandwidth; miss_latency: what the two-stage load pipeline does not hide of a DRAM fetch
// when bandwidth is not the limit, which is what separates the schedules at causal 4k-16k, where only a quarter of
// descending's visits miss). Without this term the model cannot tell a schedule whose concurrent CTAs share Q tiles
// (shift: a head's KV tiles run side by side) from one whose CTAs each stream their own (tile-major descending at
// seqlen 1k), which on the H200 moves several times the DRAM bytes and runs far longer (docs/tuning.md, "Cost model").
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <list>
#include <queue>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sched_py/enumerate.h"

namespace dash::sched::host {

enum class Dispatch : int32_t {
  kStatic = 0,  // what the kernel does for the static schedules: CTA c runs item(c, 0), item(c, 1), ...
  kGreedy = 1,  // an idle CTA takes the next work unit in the schedule's launch order (the kernel's Dynamic)
  kGreedyHeadMajor = 2,  // model only: an idle CTA takes the next KV tile in (batch, head, KV index) order, the
                         // dispatch the DASH closed form for m heads on n SMs assumes
};

struct SimOptions {
  double c = 1.0, r = 0.5;
  int64_t l2_tiles = 0;  // (Q, dO, dQ accumulator) tile sets that fit in L2; 0 = no L2 term
  double miss = 0.0;     // duration of a visit whose tile is not in L2, bandwidth-bound
  double miss_latency = 0.0;  // time a miss adds to a visit when bandwidth is not the limit
  bool deterministic = true;
  Dispatch dispatch = Dispatch::kStatic;
  bool record = false;  // keep per-visit timings and the critical path
  // Packed sequences (the varlen kernels: a batch of the longest sequence): Q tiles inside each batch entry's
  // sequence. A visit to a Q tile past it is skipped at no cost, as the kernel's producer skips it; visits of KV tiles
  // past the sequence's end to Q tiles inside still run (all keys masked). Empty: every tile is inside.
  std::vector<int32_t> live_m;
};

struct SimResult {
  double makespan = 0.0;
  bool deadlock = false;
  int64_t visits_done = 0, visits_total = 0;
  int64_t l2_misses = 0;  // visits whose tile was not in the modelled L2 (l2_tiles > 0)
  std::vector<double> cta_busy, cta_wait, cta_end;  // per CTA: working time, time spent stalled on semaphores, finish
  std::vector<int32_t> blocked_ctas;               // CTAs stuck on a semaphore when a deadlock was found
  // Recorded visits (record = true), in the order the simulator resolved them.
  std::vector<VisitRecord> visits;
  std::vector<double> compute_start, reduce_start, reduce_end;
  std::vector<int64_t> critical_path;  // indices into visits, first to last
};

template <class S>
class Simulator {
 public:
  // Greedy dispatch hands out whole units: a split tail (tail_split.h) is a construct of the static grid.
  Simulator(const Problem& p, const SimOptions& o) : p_(p), o_(o), M_(num_m_blocks(p)) {
    if (o_.dispatch != Dispatch::kStatic) p_.tail_chunk_min = 0;
  }

  SimResult run() {
    Enumeration e = enumerate_schedule<S>(p_, false);
    const int32_t C = p_.num_ctas;
    ctas_.assign(C, CtaState{});
    res_.cta_busy.assign(C, 0.0);
    res_.cta_wait.assign(C, 0.0);
    res_.cta_end.assign(C, 0.0);
    for (const ItemRecord& it : e.items) res_.visits_total += it.num_visits;
    if (o_.dispatch == Dispatch::kStatic) {
      for (int32_t c = 0; c < C; ++c) {
        const auto first = e.items.begin();
        ctas_[c].items.assign(first + e.cta_item_offsets[c], first + e.cta_item_offsets[c + 1]);
      }
    } else {
      units_ = e.items;
      if (o_.dispatch == Dispatch::kGreedyHeadMajor) {
        const int64_t N = num_n_blocks(p_);
        for (ItemRecord& it : units_) {
          it.unit = (static_cast<int64_t>(it.batch) * p_.nheads_k + it.head_k) * N + it.n_block;
        }
      }
      std::stable_sort(units_.begin(), units_.end(),
                       [](const ItemRecord& a, const ItemRecord& b) { return a.unit < b.unit; });
    }
    for (int32_t c = 0; c < C; ++c) ready_.push({0.0, c});
    while (!ready_.empty()) {
      const auto [time, c] = ready_.top();
      ready_.pop();
      step(c, time);
    }
    finish();
    return std::move(res_);
  }

 private:
  struct CtaState {
    std::vector<ItemRecord> items;  // static dispatch: the CTA's list; greedy: the unit it holds now
    size_t next_item = 0;
    bool has_tile = false;
    KvTile tile{};
    int32_t item_index = -1, end_visit = 0, next_visit = 0;  // the item runs steps [next_visit, end_visit)
    // A visit whose compute is done and whose reduction waits on a semaphore.
    bool blocked = false;
    Visit pending{};
    double compute_time = 0.0, compute_end = 0.0;
    int64_t last_record = -1;
  };
  struct TileState {
    int32_t count = 0;
    double ready = 0.0;
    int64_t last_record = -1;
    bool elected = false;  // Dynamic, non-deterministic: a visit of the tile has started (it stores)
    // Non-deterministic mode: the tile's first reduction (wait_target 0) has been resolved, its end and record.
    bool first_done = false;
    double first_end = 0.0;
    int64_t first_record = -1;
  };

  // One chain per accumulator: (batch, head, Q tile, run).
  int64_t tile_key(int32_t batch, int32_t head, int32_t m, int32_t run) const {
    return ((static_cast<int64_t>(batch) * p_.nheads + head) * M_ + m) * kMaxDqRuns + run;
  }

  // Loads the CTA's next item with at least one visit; false when the CTA has no work left.
  bool next_tile(int32_t c) {
    CtaState& s = ctas_[c];
    for (;;) {
      if (s.next_item >= s.items.size()) {
        if (o_.dispatch == Dispatch::kStatic || next_unit_ >= units_.size()) return false;
        s.items.clear();
        s.next_item = 0;
        const int64_t unit = units_[next_unit_].unit;
        while (next_unit_ < units_.size() && units_[next_unit_].unit == unit) s.items.push_back(units_[next_unit_++]);
      }
      const ItemRecord& it = s.items[s.next_item++];
      ++s.item_index;
      if (it.num_visits == 0) continue;  // a fully masked KV tile only writes zero dK/dV: no time in the model
      s.tile = KvTile{it.batch, it.head_k, it.n_block};
      s.end_visit = it.first_step + it.num_visits;
      s.next_visit = it.first_step;
      s.has_tile = true;
      return true;
    }
  }

  void step(int32_t c, double now) {
    CtaState& s = ctas_[c];
    if (!s.has_tile && !next_tile(c)) {
      res_.cta_end[c] = now;
      return;
    }
    Visit v = S::visit(p_, s.tile, s.next_visit);
    if (!o_.live_m.empty() && v.m_block >= o_.live_m[s.tile.batch]) {
      ++res_.visits_done;
      if (++s.next_visit == s.end_visit) s.has_tile = false;
      ready_.push({now, c});
      return;
    }
    const int64_t key = tile_key(s.tile.batch, v.head, v.m_block, v.run);
    TileState& t = tiles_[key];
    // Dynamic's kernel elects each tile's first add when a visit is loaded (schedule/dynamic.h): here, the first
    // visit of the tile to start computing stores, the others wait for it.
    if constexpr (std::is_same_v<S, Dynamic>) {
      if (!o_.deterministic) {
        v.wait_target = t.elected ? 1 : 0;
        t.elected = true;
      }
    }
    s.pending = v;
    s.compute_time = o_.c;
    if (o_.l2_tiles > 0) {
      const bool hit = touch_l2(key / kMaxDqRuns);  // the Q/dO tile set, whichever run
      const double f = record_miss(!hit);
      res_.l2_misses += !hit;
      if (!hit) s.compute_time = std::max(o_.c + o_.miss_latency, f * o_.miss);
    }
    s.compute_end = now + s.compute_time;
    const bool must_wait = o_.deterministic ? t.count != v.wait_target : v.wait_target != 0 && !t.first_done;
    if (must_wait) {
      s.blocked = true;
      waiting_[key].push_back(c);
      return;
    }
    reduce(c, key, now);
  }

  // LRU of the tiles in L2: true if `key` was there; either way it is now the most recently used.
  bool touch_l2(int64_t key) {
    auto it = l2_pos_.find(key);
    const bool hit = it != l2_pos_.end();
    if (hit) {
      l2_lru_.splice(l2_lru_.begin(), l2_lru_, it->second);
      return true;
    }
    l2_lru_.push_front(key);
    l2_pos_[key] = l2_lru_.begin();
    if (static_cast<int64_t>(l2_lru_.size()) > o_.l2_tiles) {
      l2_pos_.erase(l2_lru_.back());
      l2_lru_.pop_back();
    }
    return false;
  }

  // Fraction of misses among the last num_ctas visits, this one included.
  double record_miss(bool miss) {
    const size_t n = static_cast<size_t>(p_.num_ctas);
    if (recent_.size() < n) {
      recent_.push_back(miss);
    } else {
      recent_misses_ -= recent_[recent_pos_];
      recent_[recent_pos_] = miss;
      recent_pos_ = (recent_pos_ + 1) % n;
    }
    recent_misses_ += miss;
    return static_cast<double>(recent_misses_) / static_cast<double>(n);
  }

  // Runs the pending reduction of CTA c into tile `key`, then wakes whoever it releases: in deterministic mode the
  // CTA holding the tile's next position, in non-deterministic mode (after the tile's first reduction) every waiter.
  void reduce(int32_t c, int64_t key, double compute_start) {
    for (;;) {
      CtaState& s = ctas_[c];
      TileState& t = tiles_[key];
      const bool first = s.pending.wait_target == 0;
      const double after = o_.deterministic ? t.ready : (first ? 0.0 : t.first_end);
      const double rs = std::max(s.compute_end, after);
      const double re = rs + o_.r;
      res_.cta_busy[c] += s.compute_time + o_.r;
      res_.cta_wait[c] += rs - s.compute_end;
      if (o_.record) record(c, compute_start, rs, re, o_.deterministic || first ? t.last_record : t.first_record);
      ++t.count;
      t.ready = std::max(t.ready, re);
      ++res_.visits_done;
      s.blocked = false;
      if (++s.next_visit == s.end_visit) s.has_tile = false;
      ready_.push({re, c});
      if (!o_.deterministic) {
        if (!first) return;
        t.first_done = true;
        t.first_end = re;
        t.first_record = s.last_record;
        auto w = waiting_.find(key);
        if (w == waiting_.end()) return;
        const std::vector<int32_t> woken = std::move(w->second);
        waiting_.erase(w);
        // Their reductions release nothing further, so this recursion is one level deep.
        for (const int32_t x : woken) reduce(x, key, ctas_[x].compute_end - ctas_[x].compute_time);
        return;
      }
      // Hand the tile to the CTA holding the next accumulation position, if it is already waiting.
      auto w = waiting_.find(key);
      if (w == waiting_.end()) return;
      auto& list = w->second;
      auto hit = std::find_if(list.begin(), list.end(),
                              [&](int32_t x) { return ctas_[x].pending.wait_target == t.count; });
      if (hit == list.end()) return;
      const int32_t next = *hit;
      list.erase(hit);
      if (list.empty()) waiting_.erase(w);
      c = next;
      compute_start = ctas_[c].compute_end - ctas_[c].compute_time;
    }
  }

  // chain: the recorded reduction this one waited for (-1: none), for the critical path.
  void record(int32_t c, double cs, double rs, double re, int64_t chain) {
    CtaState& s = ctas_[c];
    const int64_t id = static_cast<int64_t>(res_.visits.size());
    res_.visits.push_back(VisitRecord{c, s.item_index, s.tile.batch, s.pending.head, s.tile.head_k, s.tile.n_block,
                                      s.pending.m_block, s.next_visit, s.pending.wait_target, s.pending.run});
    res_.compute_start.push_back(cs);
    compute_time_.push_back(s.compute_time);
    res_.reduce_start.push_back(rs);
    res_.reduce_end.push_back(re);
    cta_pred_.push_back(s.last_record);
    chain_pred_.push_back(chain);
    s.last_record = id;
    tiles_[tile_key(s.tile.batch, s.pending.head, s.pending.m_block, s.pending.run)].last_record = id;
  }

  void finish() {
    for (int32_t c = 0; c < p_.num_ctas; ++c) {
      if (ctas_[c].blocked) res_.blocked_ctas.push_back(c);
      res_.makespan = std::max(res_.makespan, res_.cta_end[c]);
    }
    res_.deadlock = res_.visits_done != res_.visits_total;
    if (o_.record && !res_.visits.empty()) trace_critical_path();
  }

  // Walks back from the last reduction: through the dQ chain when the reduction waited on it, else through the
  // CTA's previous visit.
  void trace_critical_path() {
    int64_t v = std::max_element(res_.reduce_end.begin(), res_.reduce_end.end()) - res_.reduce_end.begin();
    std::vector<int64_t> path;
    while (v >= 0) {
      path.push_back(v);
      const int64_t cp = chain_pred_[v];
      const bool chain_bound = cp >= 0 && res_.reduce_start[v] > res_.compute_start[v] + compute_time_[v] &&
                               res_.reduce_end[cp] == res_.reduce_start[v];
      v = chain_bound ? cp : cta_pred_[v];
    }
    res_.critical_path.assign(path.rbegin(), path.rend());
  }

  Problem p_;
  const SimOptions o_;
  const int32_t M_;
  std::vector<CtaState> ctas_;
  std::vector<ItemRecord> units_;
  size_t next_unit_ = 0;
  std::unordered_map<int64_t, TileState> tiles_;
  std::unordered_map<int64_t, std::vector<int32_t>> waiting_;
  std::priority_queue<std::pair<double, int32_t>, std::vector<std::pair<double, int32_t>>, std::greater<>> ready_;
  std::vector<int64_t> cta_pred_, chain_pred_;
  std::vector<double> compute_time_;  // per recorded visit
  std::list<int64_t> l2_lru_;         // most recently used first
  std::vector<char> recent_;          // miss (1) or hit of the last num_ctas visits, a ring
  size_t recent_pos_ = 0;
  int64_t recent_misses_ = 0;
  std::unordered_map<int64_t, std::list<int64_t>::iterator> l2_pos_;
  SimResult res_;
};

inline SimResult simulate(ScheduleKind kind, const Problem& p, const SimOptions& o) {
  return dispatch_schedule(host_kind(kind, p), [&](auto s) { return Simulator<decltype(s)>(p, o).run(); });
}

}  // namespace dash::sched::host
