// dash_attn._sched: the schedule headers (csrc/schedule/) exposed to Python for planning, verification and the DASH
// cost model. The kernels include the very same headers, so everything here is what the GPU executes.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <stdexcept>
#include <string>
#include <vector>

#include "sched_py/fwd_tiles.h"
#include "sched_py/packed.h"
#include "sched_py/verify.h"

namespace py = pybind11;
using namespace dash;
using namespace dash::sched;

namespace {

// The schedules a launch can run, in dash::ScheduleKind order (csrc/common/params.h), with the name the Python API
// gives each; kAuto is resolved before a launch and is none of them. The one list of names and ids: dash_attn's
// Python tables (dash_attn/schedules_table.py) are built from its export SCHEDULE_TABLE.
struct ScheduleEntry {
  ScheduleKind kind;
  const char* name;
  bool deterministic;  // false: no fixed dQ accumulation order, the non-deterministic backward only
};

constexpr ScheduleEntry kSchedules[] = {
    {ScheduleKind::kAscending, "ascending", true},
    {ScheduleKind::kDescending, "descending", true},
    {ScheduleKind::kSpt, "spt", true},
    {ScheduleKind::kShift, "shift", true},
    {ScheduleKind::kShiftCausal, "shift_causal", true},
    {ScheduleKind::kDynamic, "dynamic", false},
    {ScheduleKind::kShiftRuns, "shift_runs", true},
    {ScheduleKind::kShiftCausalRuns, "shift_causal_runs", true},
    {ScheduleKind::kDescendingLanes, "descending_lanes", true},
};

ScheduleKind to_kind(int32_t id) {
  for (const ScheduleEntry& s : kSchedules) {
    if (static_cast<int32_t>(s.kind) == id) return s.kind;
  }
  throw std::invalid_argument("unknown schedule id " + std::to_string(id) + " (kAuto must be resolved first)");
}

Problem make_problem(int32_t batch, int32_t nheads, int32_t nheads_k, int32_t seqlen_q, int32_t seqlen_k,
                     int32_t block_m, int32_t block_n, int32_t mask, int32_t window_left, int32_t window_right,
                     int32_t num_ctas, int32_t tail_chunk_min, int32_t shift_spacing) {
  if (batch < 0 || seqlen_q < 0 || seqlen_k < 0) throw std::invalid_argument("negative batch or sequence length");
  if (nheads <= 0 || nheads_k <= 0 || nheads % nheads_k != 0) {
    throw std::invalid_argument("nheads must be a positive multiple of nheads_k");
  }
  if (block_m <= 0 || block_n <= 0) throw std::invalid_argument("block sizes must be positive");
  if (num_ctas <= 0) throw std::invalid_argument("num_ctas must be >= 1");
  if (mask < 0 || mask > 2) throw std::invalid_argument("mask must be 0 (full), 1 (causal) or 2 (window)");
  if (window_left < -1 || window_right < -1) throw std::invalid_argument("window bounds must be >= -1");
  if (tail_chunk_min < 0) throw std::invalid_argument("tail_chunk_min must be >= 0 (0: no split tail)");
  if (shift_spacing < 0 || shift_spacing > 1) {
    throw std::invalid_argument("shift_spacing must be 0 (spread) or 1 (adjacent, the DASH paper's)");
  }
  return Problem{batch,       nheads,       nheads_k, seqlen_q,       seqlen_k,
                 block_m,     block_n,      static_cast<MaskKind>(mask), window_left,
                 window_right, num_ctas,    tail_chunk_min,              static_cast<ShiftSpacing>(shift_spacing)};
}

template <class T, class F>
py::array_t<T> column(size_t n, F&& get) {
  py::array_t<T> a(static_cast<py::ssize_t>(n));
  T* out = a.mutable_data();
  for (size_t i = 0; i < n; ++i) out[i] = get(i);
  return a;
}

py::dict visits_dict(const std::vector<host::VisitRecord>& v) {
  py::dict d;
  const size_t n = v.size();
  d["cta"] = column<int32_t>(n, [&](size_t i) { return v[i].cta; });
  d["item"] = column<int32_t>(n, [&](size_t i) { return v[i].item; });
  d["batch"] = column<int32_t>(n, [&](size_t i) { return v[i].batch; });
  d["head"] = column<int32_t>(n, [&](size_t i) { return v[i].head; });
  d["head_k"] = column<int32_t>(n, [&](size_t i) { return v[i].head_k; });
  d["n_block"] = column<int32_t>(n, [&](size_t i) { return v[i].n_block; });
  d["m_block"] = column<int32_t>(n, [&](size_t i) { return v[i].m_block; });
  d["step"] = column<int32_t>(n, [&](size_t i) { return v[i].step; });
  d["wait_target"] = column<int32_t>(n, [&](size_t i) { return v[i].wait_target; });
  d["run"] = column<int32_t>(n, [&](size_t i) { return v[i].run; });
  return d;
}

py::dict enumerate_py(int32_t kind, const Problem& p) {
  host::Enumeration e;
  {
    py::gil_scoped_release release;
    e = host::enumerate(to_kind(kind), p, true);
  }
  py::dict d;
  d["visits"] = visits_dict(e.visits);
  const auto& it = e.items;
  const size_t n = it.size();
  py::dict items;
  items["cta"] = column<int32_t>(n, [&](size_t i) { return it[i].cta; });
  items["batch"] = column<int32_t>(n, [&](size_t i) { return it[i].batch; });
  items["head_k"] = column<int32_t>(n, [&](size_t i) { return it[i].head_k; });
  items["n_block"] = column<int32_t>(n, [&](size_t i) { return it[i].n_block; });
  items["num_visits"] = column<int32_t>(n, [&](size_t i) { return it[i].num_visits; });
  items["first_step"] = column<int32_t>(n, [&](size_t i) { return it[i].first_step; });
  items["unit"] = column<int64_t>(n, [&](size_t i) { return it[i].unit; });
  items["first_visit"] = column<int64_t>(n, [&](size_t i) { return it[i].first_visit; });
  d["items"] = items;
  d["cta_item_offsets"] = column<int64_t>(e.cta_item_offsets.size(), [&](size_t i) { return e.cta_item_offsets[i]; });
  return d;
}

py::dict simulate_py(int32_t kind, const Problem& p, double c, double r, bool deterministic, int32_t dispatch,
                     bool record, int64_t l2_tiles, double miss, double miss_latency, std::vector<int32_t> live_m);

// A packed launch scheduled per sequence (schedule/seq_runs.h) on `ctas` CTAs; the other entry points as for a Problem.
py::dict enumerate_packed_py(int32_t kind, const host::PackedProblem& pack, int32_t ctas) {
  return enumerate_py(kind, pack.launch(ctas));
}
py::dict simulate_packed_py(int32_t kind, const host::PackedProblem& pack, int32_t ctas, double c, double r,
                            bool deterministic, int32_t dispatch, bool record, int64_t l2_tiles, double miss,
                            double miss_latency) {
  return simulate_py(kind, pack.launch(ctas), c, r, deterministic, dispatch, record, l2_tiles, miss, miss_latency, {});
}

py::dict simulate_py(int32_t kind, const Problem& p, double c, double r, bool deterministic, int32_t dispatch,
                     bool record, int64_t l2_tiles, double miss, double miss_latency, std::vector<int32_t> live_m) {
  if (dispatch < 0 || dispatch > 2) {
    throw std::invalid_argument("dispatch must be 0 (static), 1 (greedy), 2 (greedy head-major)");
  }
  host::SimOptions o;
  o.c = c;
  o.r = r;
  if (l2_tiles < 0 || miss < 0.0 || miss_latency < 0.0) {
    throw std::invalid_argument("l2_tiles, miss and miss_latency must be >= 0");
  }
  o.l2_tiles = l2_tiles;
  o.miss = miss;
  o.miss_latency = miss_latency;
  o.deterministic = deterministic;
  o.dispatch = static_cast<host::Dispatch>(dispatch);
  o.record = record;
  if (!live_m.empty() && static_cast<int64_t>(live_m.size()) != p.batch) {
    throw std::invalid_argument("live_m must hold one Q tile count per batch entry (or be empty)");
  }
  o.live_m = std::move(live_m);
  host::SimResult s;
  {
    py::gil_scoped_release release;
    s = host::simulate(to_kind(kind), p, o);
  }
  py::dict d;
  d["makespan"] = s.makespan;
  d["l2_misses"] = s.l2_misses;
  d["deadlock"] = s.deadlock;
  d["visits_done"] = s.visits_done;
  d["visits_total"] = s.visits_total;
  d["cta_busy"] = column<double>(s.cta_busy.size(), [&](size_t i) { return s.cta_busy[i]; });
  d["cta_wait"] = column<double>(s.cta_wait.size(), [&](size_t i) { return s.cta_wait[i]; });
  d["cta_end"] = column<double>(s.cta_end.size(), [&](size_t i) { return s.cta_end[i]; });
  d["blocked_ctas"] = s.blocked_ctas;
  if (record) {
    d["visits"] = visits_dict(s.visits);
    d["compute_start"] = column<double>(s.compute_start.size(), [&](size_t i) { return s.compute_start[i]; });
    d["reduce_start"] = column<double>(s.reduce_start.size(), [&](size_t i) { return s.reduce_start[i]; });
    d["reduce_end"] = column<double>(s.reduce_end.size(), [&](size_t i) { return s.reduce_end[i]; });
    d["critical_path"] = column<int64_t>(s.critical_path.size(), [&](size_t i) { return s.critical_path[i]; });
  }
  return d;
}

std::vector<std::string> verify_py(int32_t kind, const Problem& p, int32_t cta_lo, int32_t cta_hi) {
  if (cta_lo < 1 || cta_hi < cta_lo) throw std::invalid_argument("need 1 <= cta_lo <= cta_hi");
  py::gil_scoped_release release;
  return host::verify(to_kind(kind), p, cta_lo, cta_hi);
}

py::tuple range_tuple(BlockRange r) { return py::make_tuple(r.lo, r.hi); }

}  // namespace

PYBIND11_MODULE(_sched, m) {
  m.doc() =
      "dash_attn backward schedules and forward tile order (the kernels' own C++ headers) for planning and the DASH "
      "cost model";
  py::class_<Problem>(m, "Problem")
      .def(py::init(&make_problem), py::arg("batch"), py::arg("nheads"), py::arg("nheads_k"), py::arg("seqlen_q"),
           py::arg("seqlen_k"), py::arg("block_m"), py::arg("block_n"), py::arg("mask"), py::arg("window_left") = -1,
           py::arg("window_right") = -1, py::arg("num_ctas") = 1, py::arg("tail_chunk_min") = kDefaultTailChunkMin,
           py::arg("shift_spacing") = static_cast<int32_t>(ShiftSpacing::kSpread))
      .def_readonly("batch", &Problem::batch)
      .def_readonly("nheads", &Problem::nheads)
      .def_readonly("nheads_k", &Problem::nheads_k)
      .def_readonly("seqlen_q", &Problem::seqlen_q)
      .def_readonly("seqlen_k", &Problem::seqlen_k)
      .def_readonly("block_m", &Problem::block_m)
      .def_readonly("block_n", &Problem::block_n)
      .def_property_readonly("mask", [](const Problem& p) { return static_cast<int32_t>(p.mask); })
      .def_readonly("window_left", &Problem::window_left)
      .def_readonly("window_right", &Problem::window_right)
      .def_readonly("num_ctas", &Problem::num_ctas)
      .def_readonly("tail_chunk_min", &Problem::tail_chunk_min)
      .def_property_readonly("shift_spacing", [](const Problem& p) { return static_cast<int32_t>(p.shift_spacing); });

  // SCHEDULE_TABLE: (name, id, deterministic) per schedule of kSchedules, in id order; each also as a constant
  // named like its enumerator (ASCENDING, ..., SHIFT_CAUSAL_RUNS).
  py::list table;
  for (const ScheduleEntry& s : kSchedules) {
    const int32_t id = static_cast<int32_t>(s.kind);
    table.append(py::make_tuple(s.name, id, s.deterministic));
    std::string constant(s.name);
    for (char& ch : constant) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    m.attr(constant.c_str()) = id;
  }
  m.attr("SCHEDULE_TABLE") = py::tuple(table);
  m.attr("AUTO") = static_cast<int32_t>(ScheduleKind::kAuto);
  // Resolved only (never requested): shift_causal_runs / shift_runs on a PackedProblem (schedule/seq_runs.h).
  m.attr("SEQ_CAUSAL_RUNS") = static_cast<int32_t>(ScheduleKind::kSeqCausalRuns);
  m.attr("DEFAULT_TAIL_CHUNK_MIN") = kDefaultTailChunkMin;
  m.attr("MASK_FULL") = static_cast<int32_t>(MaskKind::kFull);
  m.attr("MASK_CAUSAL") = static_cast<int32_t>(MaskKind::kCausal);
  m.attr("MASK_WINDOW") = static_cast<int32_t>(MaskKind::kWindow);

  m.def("resolve", [](int32_t kind, const Problem& p) {
    return static_cast<int32_t>(resolve_schedule(to_kind(kind), p));
  }, "The schedule the kernels run for `kind` on this problem (fallbacks applied; schedule.h).");
  m.def("runs_per_sequence", [](int32_t kind, int32_t mask) {
    return runs_per_sequence(to_kind(kind), static_cast<MaskKind>(mask));
  }, "Whether the packed kernels schedule every sequence of a varlen call on its own geometry (seq_runs.h).");
  m.def("dq_runs", [](int32_t kind) { return dq_runs(to_kind(kind)); },
        "Accumulators per dQ tile of a resolved schedule (2 for the invariant ones, runs.h).");
  m.def("run_contributors", [](int32_t kind, const Problem& p, int32_t m_block, int32_t run) {
    return run_contributors(resolve_schedule(to_kind(kind), p), p, m_block, run);
  }, "Adds into accumulator `run` of Q tile m_block (what the postprocess waits for).");
  m.def("mostly_full_band", &mostly_full_band,
        "A causal band with at least 3/4 of its KV tiles fully live (problem.h): auto runs descending's orders there.");
  m.def("num_m_blocks", &num_m_blocks);
  m.def("num_n_blocks", &num_n_blocks);
  m.def("m_block_range", [](const Problem& p, int32_t n) { return range_tuple(m_block_range(p, n)); });
  m.def("n_block_range", [](const Problem& p, int32_t mb) { return range_tuple(n_block_range(p, mb)); });
  m.def("num_items", [](int32_t kind, const Problem& p, int32_t cta) {
    return dispatch_schedule(host::host_kind(to_kind(kind), p), [&](auto s) { return decltype(s)::num_items(p, cta); });
  });
  m.def("item", [](int32_t kind, const Problem& p, int32_t cta, int64_t k) {
    const KvTile t =
        dispatch_schedule(host::host_kind(to_kind(kind), p), [&](auto s) { return decltype(s)::item(p, cta, k); });
    return py::make_tuple(t.batch, t.head_k, t.n_block);
  });
  m.def("item_steps", [](int32_t kind, const Problem& p, int32_t cta, int64_t k) {
    const StepRange r = dispatch_schedule(host::host_kind(to_kind(kind), p), [&](auto s) {
      using S = decltype(s);
      return item_steps_of<S>(p, cta, k, S::item(p, cta, k));
    });
    return py::make_tuple(r.lo, r.hi);
  });
  m.def("num_visits", [](int32_t kind, const Problem& p, int32_t batch, int32_t head_k, int32_t n_block) {
    const KvTile t{batch, head_k, n_block};
    return dispatch_schedule(host::host_kind(to_kind(kind), p), [&](auto s) { return decltype(s)::num_visits(p, t); });
  });
  m.def("visit", [](int32_t kind, const Problem& p, int32_t batch, int32_t head_k, int32_t n_block, int32_t step) {
    const KvTile t{batch, head_k, n_block};
    const Visit v =
        dispatch_schedule(host::host_kind(to_kind(kind), p), [&](auto s) { return decltype(s)::visit(p, t, step); });
    return py::make_tuple(v.head, v.m_block, v.wait_target, v.run);
  });
  m.def("enumerate", &enumerate_py, py::arg("kind"), py::arg("problem"),
        "Everything the static persistent grid executes: per-visit and per-item columns (numpy).");
  m.def("simulate", &simulate_py, py::arg("kind"), py::arg("problem"), py::arg("c") = 1.0, py::arg("r") = 0.5,
        py::arg("deterministic") = true, py::arg("dispatch") = 0, py::arg("record") = false, py::arg("l2_tiles") = 0,
        py::arg("miss") = 0.0, py::arg("miss_latency") = 0.0, py::arg("live_m") = std::vector<int32_t>{},
        "DASH DAG cost model of the persistent grid. dispatch: 0 static (the kernel), 1 greedy in launch order, "
        "2 greedy head-major (model only). l2_tiles > 0: L2 as an LRU of that many (Q, dO, dQ) tiles; a visit "
        "that misses takes max(c + miss_latency, f * miss) (see simulate.h). live_m: per batch entry, the Q tiles "
        "inside its sequence, for a varlen pack run as a batch of its longest sequence (empty: dense).");
  py::class_<host::PackedProblem>(m, "PackedProblem",
                                  "A varlen pack whose sequences are scheduled each on its own geometry (causal masks "
                                  "shift_causal_runs, full masks shift_runs; schedule/seq_runs.h): the launch's "
                                  "tiling and heads from `problem`, one length per sequence; on causal masks "
                                  "sequences of up to `short_k` keys run descending. max_q, max_k: the launch's "
                                  "bounds (default the longest lengths); below a sequence's, the lengths a device "
                                  "table reads past the caller's max_seqlen, which the table holds to them.")
      .def(py::init<const Problem&, const std::vector<int32_t>&, const std::vector<int32_t>&, int32_t,
                    std::optional<int32_t>, std::optional<int32_t>>(),
           py::arg("problem"), py::arg("lens_q"), py::arg("lens_k"), py::arg("short_k") = 0,
           py::arg("max_q") = py::none(), py::arg("max_k") = py::none())
      .def_property_readonly("units", &host::PackedProblem::units)
      .def_property_readonly("kinds", [](const host::PackedProblem& pk) {
        std::vector<int32_t> kinds;
        for (int32_t b = 0; b < pk.launch(1).batch; ++b) kinds.push_back(static_cast<int32_t>(pk.table()[b].kind));
        return kinds;
      }, "Per sequence, the schedule id it runs: descending up to short_k keys (causal masks), else what its own "
         "geometry resolves the mask's runs schedule to.");
  m.def("enumerate_packed", &enumerate_packed_py, py::arg("kind"), py::arg("pack"), py::arg("num_ctas"));
  m.def("simulate_packed", &simulate_packed_py, py::arg("kind"), py::arg("pack"), py::arg("num_ctas"),
        py::arg("c") = 1.0, py::arg("r") = 0.5, py::arg("deterministic") = true, py::arg("dispatch") = 0,
        py::arg("record") = false, py::arg("l2_tiles") = 0, py::arg("miss") = 0.0, py::arg("miss_latency") = 0.0);
  m.def("verify_packed", [](const host::PackedProblem& pack, int32_t cta_lo, int32_t cta_hi) {
    if (cta_lo < 1 || cta_hi < cta_lo) throw std::invalid_argument("need 1 <= cta_lo <= cta_hi");
    py::gil_scoped_release release;
    return host::verify_packed(pack, cta_lo, cta_hi);
  }, py::arg("pack"), py::arg("cta_lo"), py::arg("cta_hi"),
        "Per-sequence items, walks and accumulation positions equal to the sequence's alone, coverage, the "
        "postprocess's counts and deadlock-freedom for every CTA count in [cta_lo, cta_hi]; returns errors.");
  m.def("verify", &verify_py, py::arg("kind"), py::arg("problem"), py::arg("cta_lo"), py::arg("cta_hi"),
        "Coverage, accumulation-order and deadlock checks for every CTA count in [cta_lo, cta_hi]; returns errors.");
  host::bind_fwd_tiles(m);
}
