// dash_bench: times the kernel library through its C ABI (csrc/common/params.h) without torch or Python, so kernel
// work is measured without framework overhead. For every (hdim built, mask, seqlen) it times the forward, the
// non-deterministic backward and the deterministic backward of every schedule (those timed round-robin, call by
// call), and prints ms, TFLOPS (FLOPs as in benchmarks/flops.py) and the det/non-det ratio. Deterministic rows are
// also run twice and compared bitwise.
// Backward rows also time each of the backward's kernels alone (preprocess, main, postprocess; --no-stages skips it)
// through dash_bwd_stages, so a change to the main kernel can be told apart from the fixed cost around it.
//
//   build/bench/dash_bench --help
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_flops.h"
#include "bench/bench_problem.h"
#include "bench/bench_timer.h"
#include "common/params.h"

namespace {

using dash::BwdStage;
using dash::DType;
using dash::MaskKind;
using dash::ScheduleKind;
using namespace dash::bench;

constexpr int kExitUsage = 2;
constexpr int kHiddenSize = 2048;  // heads x hdim of the standard grid: 16 x 128, 32 x 64 (targets.md)

struct NamedSchedule {
  const char* name;
  ScheduleKind kind;
};
// kAuto is resolved by the Python binding's cost model and never reaches the kernels, so it is not listed here.
constexpr NamedSchedule kSchedules[] = {
    {"ascending", ScheduleKind::kAscending}, {"descending", ScheduleKind::kDescending}, {"spt", ScheduleKind::kSpt},
    {"shift", ScheduleKind::kShift},         {"shift_causal", ScheduleKind::kShiftCausal},
    {"shift_runs", ScheduleKind::kShiftRuns}, {"shift_causal_runs", ScheduleKind::kShiftCausalRuns},
    {"descending_lanes", ScheduleKind::kDescendingLanes},
};
// Orders only the non-deterministic backward can run (no accumulation order).
constexpr NamedSchedule kNondetOnlySchedules[] = {{"dynamic", ScheduleKind::kDynamic}};

std::vector<int> built_hdims() {
  std::vector<int> h;
#ifdef DASH_ENABLE_HDIM_64
  h.push_back(64);
#endif
#ifdef DASH_ENABLE_HDIM_128
  h.push_back(128);
#endif
#ifdef DASH_ENABLE_HDIM_256
  h.push_back(256);
#endif
  return h;
}

std::vector<DType> built_dtypes() {
  std::vector<DType> d;
#ifdef DASH_ENABLE_BF16
  d.push_back(DType::kBFloat16);
#endif
#ifdef DASH_ENABLE_FP16
  d.push_back(DType::kFloat16);
#endif
  return d;
}

const char* dtype_name(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp16"; }
const char* mask_name(MaskKind m) {
  return m == MaskKind::kCausal ? "causal" : m == MaskKind::kWindow ? "window" : "full";
}

struct Options {
  std::vector<int> hdims;
  std::vector<int> seqlens = {1024, 2048, 4096, 8192, 16384};
  std::vector<MaskKind> masks = {MaskKind::kFull, MaskKind::kCausal};
  int window_left = 1024, window_right = 0;  // --masks window
  float softcap = 0.f;                       // > 0: the soft-capped kernels (ScoreMod::kSoftcap)
  std::vector<NamedSchedule> schedules{std::begin(kSchedules), std::end(kSchedules)};
  std::vector<NamedSchedule> nondet_schedules;  // empty: the one `auto` gives the non-deterministic backward
  DType dtype = DType::kBFloat16;
  int tokens = 16384;
  int nheads = 0;  // 0: kHiddenSize / hdim
  int gqa = 1;
  int sm_margin = 0;
  int device = 0;
  bool run_fwd = true;
  bool run_bwd = true;
  bool det_check = true;
  bool stages = true;  // also time the backward's preprocess, main kernel and postprocess one by one
  std::vector<int> tail_chunks;  // BwdParams::tail_chunk_min of each copy of the backward variants; empty: default
  std::vector<dash::ShiftSpacing> shift_spacings;  // BwdParams::shift_spacing of each copy; empty: default
  std::string csv_path;
  TimingConfig timing;
};

void usage(const char* argv0) {
  std::printf(
      "usage: %s [options]\n"
      "  --hdims 64,128        head dims (default: all built into this binary)\n"
      "  --seqlens 1024,...    sequence lengths (default 1024,2048,4096,8192,16384)\n"
      "  --tokens N            batch x seqlen per row (default 16384)\n"
      "  --masks full,causal   masks (default both; also window)\n"
      "  --window L,R          the window mask's bounds around the diagonal, -1 = unbounded (default 1024,0)\n"
      "  --schedules a,b       deterministic schedules: ascending,descending,spt,shift,shift_causal (default all)\n"
      "  --nondet-schedules a,b  visit orders of the non-deterministic backward, one row each (default: auto's);\n"
      "                        also dynamic (units claimed at run time)\n"
      "  --heads N             query heads (default %d / hdim)\n"
      "  --gqa R               query heads per KV head (default 1)\n"
      "  --softcap C           soft-capped scores, C * tanh(scores / C) (default 0: off; needs a SOFTCAP=1 build)\n"
      "  --dtype bf16|fp16     element type (default bf16 when built)\n"
      "  --warmup N            untimed calls per row (default 5)\n"
      "  --iters N             timed calls per row, median reported (default 20)\n"
      "  --sm-margin N         SMs the backward leaves free (default 0)\n"
      "  --device N            CUDA device (default 0)\n"
      "  --fwd-only | --bwd-only\n"
      "  --no-det-check        skip the bitwise repeat check of deterministic rows\n"
      "  --tail-chunks a,b     time each backward variant once per shortest chunk of the split last wave (0:\n"
      "                        whole), in one round robin: an A/B of the split tail (default: 16 only)\n"
      "  --shift-spacings a,b  time each backward variant once per start-tile spacing of shift (spread, adjacent),\n"
      "                        in one round robin (default: spread only)\n"
      "  --stages | --no-stages\n"
      "                        also time the backward's preprocess, main kernel and postprocess alone (default:\n"
      "                        on; --no-stages takes about half as long per backward row)\n"
      "  --no-flush            do not flush L2 before timed calls\n"
      "  --csv FILE            also write every row to FILE\n",
      argv0, kHiddenSize);
}

[[noreturn]] void bad_arg(const char* argv0, const std::string& msg) {
  std::fprintf(stderr, "dash_bench: %s\n", msg.c_str());
  usage(argv0);
  std::exit(kExitUsage);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

int parse_int(const char* argv0, const std::string& flag, const std::string& text, int min_value) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v < min_value || v > (1L << 30)) {
    bad_arg(argv0, flag + ": expected an integer >= " + std::to_string(min_value) + ", got '" + text + "'");
  }
  return static_cast<int>(v);
}

// The values of a comma list of names, each looked up in `names`; an unknown name is a usage error.
template <class V>
std::vector<V> parse_names(const char* argv0, const std::string& flag, const std::string& text,
                           const std::vector<std::pair<const char*, V>>& names) {
  std::vector<V> out;
  for (const auto& item : split(text)) {
    const auto it = std::find_if(names.begin(), names.end(), [&](const auto& n) { return item == n.first; });
    if (it == names.end()) {
      std::string known;
      for (const auto& n : names) known += (known.empty() ? "" : ", ") + std::string(n.first);
      bad_arg(argv0, flag + ": unknown value '" + item + "' (" + known + ")");
    }
    out.push_back(it->second);
  }
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  o.hdims = built_hdims();
  const std::vector<DType> dtypes = built_dtypes();
  if (!dtypes.empty()) o.dtype = dtypes.front();
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) bad_arg(argv[0], std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage(argv[0]);
      std::exit(0);
    } else if (a == "--hdims") {
      o.hdims.clear();
      for (const auto& s : split(value(i))) o.hdims.push_back(parse_int(argv[0], a, s, 1));
    } else if (a == "--seqlens") {
      o.seqlens.clear();
      for (const auto& s : split(value(i))) o.seqlens.push_back(parse_int(argv[0], a, s, 1));
    } else if (a == "--masks") {
      o.masks = parse_names<MaskKind>(
          argv[0], a, value(i),
          {{"full", MaskKind::kFull}, {"causal", MaskKind::kCausal}, {"window", MaskKind::kWindow}});
    } else if (a == "--window") {
      const std::vector<std::string> lr = split(value(i));
      if (lr.size() != 2) bad_arg(argv[0], "--window takes LEFT,RIGHT");
      o.window_left = parse_int(argv[0], a, lr[0], -1);
      o.window_right = parse_int(argv[0], a, lr[1], -1);
      if (o.window_left < 0 && o.window_right < 0) bad_arg(argv[0], "--window -1,-1 is the full mask");
    } else if (a == "--schedules" || a == "--nondet-schedules") {
      std::vector<NamedSchedule>& list = a == "--schedules" ? o.schedules : o.nondet_schedules;
      std::vector<std::pair<const char*, NamedSchedule>> names;
      for (const NamedSchedule& s : kSchedules) names.emplace_back(s.name, s);
      if (a == "--nondet-schedules") {
        for (const NamedSchedule& s : kNondetOnlySchedules) names.emplace_back(s.name, s);
      }
      list = parse_names(argv[0], a, value(i), names);
    } else if (a == "--dtype") {
      const std::string d = value(i);
      if (d == "bf16") o.dtype = DType::kBFloat16;
      else if (d == "fp16") o.dtype = DType::kFloat16;
      else bad_arg(argv[0], "--dtype: expected bf16 or fp16");
    } else if (a == "--tokens") {
      o.tokens = parse_int(argv[0], a, value(i), 1);
    } else if (a == "--heads") {
      o.nheads = parse_int(argv[0], a, value(i), 1);
    } else if (a == "--gqa") {
      o.gqa = parse_int(argv[0], a, value(i), 1);
    } else if (a == "--softcap") {
      const std::string text = value(i);
      char* end = nullptr;
      o.softcap = std::strtof(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !(o.softcap >= 0.f) || !std::isfinite(o.softcap)) {
        bad_arg(argv[0], "--softcap: expected a finite number >= 0, got '" + text + "'");
      }
    } else if (a == "--warmup") {
      o.timing.warmup = parse_int(argv[0], a, value(i), 0);
    } else if (a == "--iters") {
      o.timing.iters = parse_int(argv[0], a, value(i), 1);
    } else if (a == "--sm-margin") {
      o.sm_margin = parse_int(argv[0], a, value(i), 0);
    } else if (a == "--device") {
      o.device = parse_int(argv[0], a, value(i), 0);
    } else if (a == "--fwd-only") {
      o.run_bwd = false;
    } else if (a == "--bwd-only") {
      o.run_fwd = false;
    } else if (a == "--no-det-check") {
      o.det_check = false;
    } else if (a == "--stages") {
      o.stages = true;
    } else if (a == "--no-stages") {
      o.stages = false;
    } else if (a == "--tail-chunks") {
      o.tail_chunks.clear();
      for (const auto& t : split(value(i))) o.tail_chunks.push_back(parse_int(argv[0], a, t, 0));
    } else if (a == "--shift-spacings") {
      o.shift_spacings = parse_names<dash::ShiftSpacing>(
          argv[0], a, value(i), {{"spread", dash::ShiftSpacing::kSpread}, {"adjacent", dash::ShiftSpacing::kAdjacent}});
    } else if (a == "--no-flush") {
      o.timing.flush_l2 = false;
    } else if (a == "--csv") {
      o.csv_path = value(i);
    } else {
      bad_arg(argv[0], "unknown option '" + a + "'");
    }
  }
  if (!o.run_fwd && !o.run_bwd) bad_arg(argv[0], "--fwd-only and --bwd-only exclude each other");
  if (o.hdims.empty()) bad_arg(argv[0], "no head dim to run: none built (DASH_ENABLE_HDIM_*) or --hdims empty");
  const std::vector<int> built = built_hdims();
  for (int h : o.hdims) {
    bool ok = false;
    for (int b : built) ok = ok || b == h;
    if (!ok) bad_arg(argv[0], "hdim " + std::to_string(h) + " is not built into this binary (make bench-build H=...)");
  }
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || d == o.dtype;
  if (!dtype_ok) bad_arg(argv[0], std::string("dtype ") + dtype_name(o.dtype) + " is not built (DT=...)");
  return o;
}

// Replaces the backward variants with `settings` copies of them (none: left as they are), copy c set by
// apply(variant, c), which returns the suffix of its name; all copies are timed in one round robin (an A/B in one
// binary: --tail-chunks, --shift-spacings).
template <class Apply>
void copies_per_setting(std::vector<dash::BwdParams>& variants, std::vector<std::string>& names, size_t settings,
                        Apply&& apply) {
  if (settings == 0) return;
  const std::vector<dash::BwdParams> base = variants;
  const std::vector<std::string> base_names = names;
  variants.clear();
  names.clear();
  for (size_t c = 0; c < settings; ++c) {
    for (size_t i = 0; i < base.size(); ++i) {
      variants.push_back(base[i]);
      names.push_back(base_names[i] + apply(variants.back(), c));
    }
  }
}

// ------------------------------------------------------------------------------------------------ reporting

// Times of the backward's kernels launched alone through dash_bwd_stages (backward rows with --stages only).
struct StageTimes {
  std::string status;  // "" = not measured, "ok", or why there is no time
  float pre_ms = 0.f;
  float main_ms = 0.f;
  float post_ms = 0.f;
  double main_tflops = 0.0;  // the whole backward's FLOPs over the main kernel's time
  bool ok() const { return status == "ok"; }
};

struct Row {
  Problem problem;
  std::string variant;  // "fwd", "bwd non-det", "bwd <schedule>"
  std::string status;   // "ok" or why there is no time
  float ms = 0.f;
  double tflops = 0.0;
  double ratio = 0.0;       // det / non-det, deterministic backward rows only
  std::string repeat = "";  // "bitwise", "DIFFERS", "NONFINITE" or "" when not checked
  StageTimes stages{};
};

void print_header(bool stages) {
  std::printf("%-5s %-6s %7s %5s %7s  %-18s %8s %9s %8s", "hdim", "mask", "seqlen", "batch", "heads", "variant", "ms",
              "TFLOPS", "det/nd");
  if (stages) std::printf(" %8s %8s %8s %9s", "pre ms", "main ms", "post ms", "main TF");
  std::printf("  %s\n", "repeat");
}

void print_row(const Row& r, bool stages) {
  const Problem& p = r.problem;
  char heads[32];
  std::snprintf(heads, sizeof(heads), "%d/%d", p.nheads, p.nheads_k);
  if (r.status != "ok") {
    std::printf("%-5d %-6s %7d %5d %7s  %-18s %s\n", p.headdim, mask_name(p.mask), p.seqlen, p.batch, heads,
                r.variant.c_str(), r.status.c_str());
    std::fflush(stdout);
    return;
  }
  char ratio[16] = "";
  if (r.ratio > 0) std::snprintf(ratio, sizeof(ratio), "%.3f", r.ratio);
  std::printf("%-5d %-6s %7d %5d %7s  %-18s %8.3f %9.1f %8s", p.headdim, mask_name(p.mask), p.seqlen, p.batch, heads,
              r.variant.c_str(), r.ms, r.tflops, ratio);
  const StageTimes& st = r.stages;
  if (stages && st.ok()) {
    std::printf(" %8.3f %8.3f %8.3f %9.1f", st.pre_ms, st.main_ms, st.post_ms, st.main_tflops);
  } else if (stages) {
    std::printf(" %8s %8s %8s %9s", "", "", "", "");
  }
  std::printf("  %s", r.repeat.c_str());
  if (!st.status.empty() && !st.ok()) std::printf("  stages: %s", st.status.c_str());
  std::printf("\n");
  std::fflush(stdout);
}

// Stage columns are empty where they were not measured (forward rows, --no-stages, a failed stage).
void write_csv(const std::string& path, const std::vector<Row>& rows) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "dash_bench: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    return;
  }
  std::fprintf(f, "hdim,dtype,mask,seqlen,batch,nheads,nheads_k,variant,status,ms,tflops,det_over_nondet,repeat,"
                  "pre_ms,main_ms,post_ms,main_tflops\n");
  for (const Row& r : rows) {
    const Problem& p = r.problem;
    std::fprintf(f, "%d,%s,%s,%d,%d,%d,%d,%s,%s,%.5f,%.2f,%.4f,%s,", p.headdim, dtype_name(p.dtype),
                 mask_name(p.mask), p.seqlen, p.batch, p.nheads, p.nheads_k, r.variant.c_str(), r.status.c_str(),
                 r.ms, r.tflops, r.ratio, r.repeat.c_str());
    const StageTimes& st = r.stages;
    if (st.ok()) {
      std::fprintf(f, "%.5f,%.5f,%.5f,%.2f\n", st.pre_ms, st.main_ms, st.post_ms, st.main_tflops);
    } else {
      std::fprintf(f, ",,,\n");
    }
  }
  std::fclose(f);
  std::printf("wrote %s\n", path.c_str());
}

// ------------------------------------------------------------------------------------------------ measuring

// Explains a non-zero return of the C ABI; returns false when the CUDA context is unusable afterwards.
bool describe_failure(int rc, std::string* status) {
  if (rc == -1) {
    *status = "unsupported configuration (C ABI returned -1)";
    return true;
  }
  const auto err = static_cast<cudaError_t>(rc);
  *status = std::string("CUDA error ") + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  // A sticky error (illegal address, trap from a hang guard) poisons every later launch; the sync surfaces it.
  return cudaDeviceSynchronize() == cudaSuccess;
}

// Copies dq/dk/dv to the host so two runs of a deterministic schedule can be compared byte for byte.
std::vector<uint8_t> snapshot_grads(ProblemBuffers& b) {
  std::vector<uint8_t> host(b.dq.bytes + b.dk.bytes + b.dv.bytes);
  DASH_BENCH_CUDA(cudaMemcpy(host.data(), b.dq.ptr, b.dq.bytes, cudaMemcpyDeviceToHost));
  DASH_BENCH_CUDA(cudaMemcpy(host.data() + b.dq.bytes, b.dk.ptr, b.dk.bytes, cudaMemcpyDeviceToHost));
  DASH_BENCH_CUDA(cudaMemcpy(host.data() + b.dq.bytes + b.dk.bytes, b.dv.ptr, b.dv.bytes, cudaMemcpyDeviceToHost));
  return host;
}

// bf16 and fp16 both mark Inf/NaN with an all-ones exponent field.
bool all_finite(const std::vector<uint8_t>& bytes, DType dtype) {
  const uint16_t exp_mask = dtype == DType::kBFloat16 ? 0x7f80 : 0x7c00;
  for (size_t i = 0; i + 1 < bytes.size(); i += 2) {
    const uint16_t bits = static_cast<uint16_t>(bytes[i] | (bytes[i + 1] << 8));
    if ((bits & exp_mask) == exp_mask) return false;
  }
  return true;
}

class Bench {
 public:
  Bench(const Options& o, cudaStream_t stream, int num_sms, size_t flush_bytes)
      : opt_(o), stream_(stream), num_sms_(num_sms), timer_(stream, o.timing.flush_l2 ? flush_bytes : 0) {}

  // Returns false when the CUDA context is lost and nothing more can be measured.
  bool run_problem(const Problem& p) {
    ProblemBuffers buf(p, stream_);
    dash::FwdParams fwd = make_fwd_params(p, buf, num_sms_);
    // The backward needs the forward's O and LSE, not random ones, or its softmax would be meaningless.
    const int fwd_rc = dash_fwd(&fwd, stream_);
    if (fwd_rc != 0) {
      Row r{p, "fwd", ""};
      const bool alive = describe_failure(fwd_rc, &r.status);
      emit(r);
      return alive;
    }
    DASH_BENCH_CUDA(cudaStreamSynchronize(stream_));
    if (opt_.run_fwd && !measure(p, "fwd", [&] { return dash_fwd(&fwd, stream_); }, fwd_flops_of(p))) return false;
    if (!opt_.run_bwd) return true;

    const double bwd_flops_p = kBwdFlopsPerFwd * fwd_flops_of(p);
    // The non-deterministic backward first, then every deterministic schedule; all timed round-robin (see
    // EventTimer::time_round_robin). The non-deterministic visit order is the one `auto` gives it
    // (dash_attn.schedule ranks it like the deterministic one): shift on full masks, shift_causal on causal ones at
    // every standard shape, spt on windows (ranked first there on ties, without the L2 term).
    std::vector<dash::BwdParams> variants;
    std::vector<std::string> names;
    dash::BwdParams bwd = make_bwd_params(p, buf, num_sms_, opt_.sm_margin);
    bwd.deterministic = false;
    bwd.schedule = p.causal() ? ScheduleKind::kShiftCausal
                   : p.mask == MaskKind::kWindow ? ScheduleKind::kSpt
                                                 : ScheduleKind::kShift;
    if (opt_.nondet_schedules.empty()) {
      variants.push_back(bwd);
      names.push_back("bwd non-det");
    }
    for (const NamedSchedule& s : opt_.nondet_schedules) {  // the first is the reference of the det/non-det ratios
      bwd.schedule = s.kind;
      variants.push_back(bwd);
      names.push_back(std::string("bwd non-det:") + s.name);
    }
    for (const NamedSchedule& s : opt_.schedules) {
      bwd.deterministic = true;
      bwd.schedule = s.kind;
      variants.push_back(bwd);
      names.push_back(std::string("bwd ") + s.name);
    }
    copies_per_setting(variants, names, opt_.tail_chunks.size(), [&](dash::BwdParams& v, size_t c) {
      v.tail_chunk_min = opt_.tail_chunks[c];
      return " tail" + std::to_string(opt_.tail_chunks[c]);
    });
    copies_per_setting(variants, names, opt_.shift_spacings.size(), [&](dash::BwdParams& v, size_t c) {
      v.shift_spacing = opt_.shift_spacings[c];
      return std::string(opt_.shift_spacings[c] == dash::ShiftSpacing::kSpread ? " spread" : " adjacent");
    });
    // One workspace for every variant: the largest they ask (a split tail adds regions to its calls only).
    size_t ws = 0;
    for (const dash::BwdParams& v : variants) ws = std::max(ws, dash_bwd_workspace_bytes(&v));
    buf.workspace.grow(ws);
    std::vector<std::function<int()>> launches;
    for (dash::BwdParams& v : variants) {
      v.workspace = buf.workspace.ptr;
      v.workspace_bytes = ws;
      launches.push_back([this, &v] { return dash_bwd(&v, stream_); });
    }
    const std::vector<TimingResult> times = timer_.time_round_robin(launches, opt_.timing);
    const float nondet_ms = times.front().status == 0 ? times.front().median_ms : 0.f;
    for (size_t i = 0; i < variants.size(); ++i) {
      if (!report_bwd(p, buf, variants[i], names[i], bwd_flops_p, times[i], nondet_ms)) return false;
    }
    return true;
  }

  const std::vector<Row>& rows() const { return rows_; }

 private:
  double fwd_flops_of(const Problem& p) const {
    if (p.mask == MaskKind::kWindow) {
      return fwd_flops_of_area(p.batch, p.nheads, band_area(p.seqlen, p.seqlen, p.window_left, p.window_right),
                               p.headdim);
    }
    return fwd_flops(p.batch, p.nheads, p.seqlen, p.seqlen, p.headdim, p.causal());
  }

  void emit(const Row& r) {
    rows_.push_back(r);
    print_row(r, opt_.stages);
  }

  // The row of one timing result; *alive turns false when the CUDA context is lost.
  Row timed_row(const Problem& p, const std::string& variant, const TimingResult& t, double flops, bool* alive) {
    Row r{p, variant, "ok"};
    *alive = true;
    if (t.status != 0) {
      *alive = describe_failure(t.status, &r.status);
    } else {
      r.ms = t.median_ms;
      r.tflops = tflops(flops, t.median_ms);
    }
    return r;
  }

  template <class Launch>
  bool measure(const Problem& p, const std::string& variant, Launch&& launch, double flops) {
    bool alive = true;
    emit(timed_row(p, variant, timer_.time(launch, opt_.timing), flops, &alive));
    return alive;
  }

  // One backward row from its round-robin timing, then (if asked) its kernels alone and the bitwise repeat check.
  bool report_bwd(const Problem& p, ProblemBuffers& buf, const dash::BwdParams& bwd, const std::string& variant,
                  double flops, const TimingResult& t, float nondet_ms) {
    bool alive = true;
    Row r = timed_row(p, variant, t, flops, &alive);
    if (alive && r.status == "ok") {
      if (bwd.deterministic && nondet_ms > 0) r.ratio = nondet_ms / r.ms;
      if (opt_.stages) alive = measure_stages(bwd, flops, &r.stages);
      if (alive && bwd.deterministic && opt_.det_check) r.repeat = repeat_check(bwd, buf);
    }
    emit(r);
    return alive;
  }

  // Each kernel of the backward alone, under the whole call's rules (warm-up, L2 flush before each timed call,
  // median). Preprocess and postprocess only overwrite what they write, so they are timed by repeating them. The main
  // kernel cannot be: it accumulates into the dQ workspace and counts on semaphores that only the preprocess zeroes.
  // So every main launch, warm-up included, follows an untimed preprocess enqueued after the flush and before the
  // start event: the main kernel is measured by itself, and finds the cache as preprocess leaves it, as inside
  // dash_bwd. (Timing preprocess+main and subtracting the preprocess median would not be one measured quantity, and
  // the noise of both medians would land on a difference.) Postprocess runs on the accumulator the last main left.
  bool measure_stages(const dash::BwdParams& bwd, double flops, StageTimes* out) {
    auto only = [this, &bwd](int32_t stages) {
      return [this, &bwd, stages] { return dash_bwd_stages(&bwd, stages, stream_); };
    };
    const TimingResult pre = timer_.time(only(BwdStage::kPreprocess), opt_.timing);
    if (pre.status != 0) return describe_failure(pre.status, &out->status);
    const TimingResult main_k = timer_.time(only(BwdStage::kMain), opt_.timing, only(BwdStage::kPreprocess));
    if (main_k.status != 0) return describe_failure(main_k.status, &out->status);
    const TimingResult post = timer_.time(only(BwdStage::kPostprocess), opt_.timing);
    if (post.status != 0) return describe_failure(post.status, &out->status);
    out->status = "ok";
    out->pre_ms = pre.median_ms;
    out->main_ms = main_k.median_ms;
    out->post_ms = post.median_ms;
    out->main_tflops = tflops(flops, main_k.median_ms);
    return true;
  }

  std::string repeat_check(const dash::BwdParams& bwd, ProblemBuffers& buf) {
    std::vector<uint8_t> first, second;
    for (std::vector<uint8_t>* snap : {&first, &second}) {
      // Poison between runs so a gradient element the kernel never writes cannot look reproducible.
      for (DeviceBuffer* b : {&buf.dq, &buf.dk, &buf.dv}) {
        DASH_BENCH_CUDA(cudaMemsetAsync(b->ptr, 0xff, b->bytes, stream_));
      }
      const int rc = dash_bwd(&bwd, stream_);
      if (rc != 0) return "rc " + std::to_string(rc);
      DASH_BENCH_CUDA(cudaStreamSynchronize(stream_));
      *snap = snapshot_grads(buf);
    }
    if (!all_finite(first, bwd.shape.dtype)) return "NONFINITE";
    return first == second ? "bitwise" : "DIFFERS";
  }

  const Options& opt_;
  cudaStream_t stream_;
  int num_sms_;
  EventTimer timer_;
  std::vector<Row> rows_;
};

void print_summary(const std::vector<Row>& rows) {
  std::printf("\nsummary: best deterministic schedule vs non-deterministic backward\n");
  std::printf("%-5s %-6s %7s  %12s  %-14s %12s  %8s\n", "hdim", "mask", "seqlen", "nondet TF", "best det",
              "det TF", "det/nd");
  // "bwd non-det" or, with --nondet-schedules, "bwd non-det:<order>"; the first of a problem is the ratios' reference.
  auto is_nondet = [](const Row& r) { return r.variant.rfind("bwd non-det", 0) == 0; };
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!is_nondet(rows[i]) || rows[i].status != "ok" || (i > 0 && is_nondet(rows[i - 1]))) continue;
    const Row* best = nullptr;
    for (size_t j = i + 1; j < rows.size() && rows[j].variant.rfind("bwd ", 0) == 0; ++j) {
      if (is_nondet(rows[j]) && !is_nondet(rows[j - 1])) break;  // the next problem's rows
      if (is_nondet(rows[j])) continue;
      if (rows[j].status == "ok" && (best == nullptr || rows[j].tflops > best->tflops)) best = &rows[j];
    }
    const Problem& p = rows[i].problem;
    if (best == nullptr) {
      std::printf("%-5d %-6s %7d  %12.1f  %-14s\n", p.headdim, mask_name(p.mask), p.seqlen, rows[i].tflops, "n/a");
    } else {
      std::printf("%-5d %-6s %7d  %12.1f  %-14s %12.1f  %8.3f\n", p.headdim, mask_name(p.mask), p.seqlen,
                  rows[i].tflops, best->variant.substr(4).c_str(), best->tflops, best->ratio);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parse_args(argc, argv);

  int device_count = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&device_count);
  if (count_err != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "dash_bench: no CUDA device (%s)\n",
                 count_err != cudaSuccess ? cudaGetErrorString(count_err) : "device count is 0");
    return kExitUsage;
  }
  if (opt.device >= device_count) {
    std::fprintf(stderr, "dash_bench: --device %d but only %d device(s)\n", opt.device, device_count);
    return kExitUsage;
  }
  DASH_BENCH_CUDA(cudaSetDevice(opt.device));
  int num_sms = 0, l2_bytes = 0, major = 0, minor = 0;
  DASH_BENCH_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, opt.device));
  DASH_BENCH_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, opt.device));
  DASH_BENCH_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, opt.device));
  DASH_BENCH_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, opt.device));
  cudaDeviceProp prop{};
  DASH_BENCH_CUDA(cudaGetDeviceProperties(&prop, opt.device));
  if (major != 9 || minor != 0) {
    std::fprintf(stderr, "dash_bench: the kernels are built for sm_90a; device %d is sm_%d%d (%s)\n", opt.device,
                 major, minor, prop.name);
    return kExitUsage;
  }
  if (opt.sm_margin >= num_sms) {
    std::fprintf(stderr, "dash_bench: --sm-margin %d leaves no SM of %d\n", opt.sm_margin, num_sms);
    return kExitUsage;
  }

  std::printf("dash_bench: %s, %d SMs (backward grid uses %d: margin %d), %s, L2 %d MiB %s, warm-up %d, "
              "median of %d\n",
              prop.name, num_sms, num_sms - opt.sm_margin, opt.sm_margin, dtype_name(opt.dtype), l2_bytes >> 20,
              opt.timing.flush_l2 ? "flushed before each timed call" : "not flushed", opt.timing.warmup,
              opt.timing.iters);
  std::printf("note: backward ms/TFLOPS time dash_bwd as a whole (preprocess + main + postprocess).%s\n",
              opt.stages ? " pre/main/post ms time each kernel alone (dash_bwd_stages; main after an untimed "
                           "preprocess); main TF = the backward's FLOPs / main ms."
                         : "");
  for (int h : opt.hdims) {
    for (MaskKind m : opt.masks) {
      int32_t bm = 0, bn = 0;
      dash_bwd_tile_shape(h, static_cast<int32_t>(m), &bm, &bn);
      std::printf("note: hdim %d %s backward tile %d x %d (block_m x block_n)\n", h, mask_name(m), bm, bn);
    }
  }
  if (std::find(opt.masks.begin(), opt.masks.end(), MaskKind::kWindow) != opt.masks.end()) {
    std::printf("note: window mask (left, right) = (%d, %d) around the bottom-right diagonal; FLOPs count the band\n",
                opt.window_left, opt.window_right);
  }
  if (opt.softcap > 0.f) std::printf("note: soft-capped scores, softcap %g\n", opt.softcap);
  std::printf("\n");

  cudaStream_t stream;
  DASH_BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Twice the L2 so that overwriting it evicts every line the previous call left behind.
  Bench bench(opt, stream, num_sms, 2 * static_cast<size_t>(l2_bytes));
  print_header(opt.stages);
  bool alive = true;
  for (int h : opt.hdims) {
    const int nheads = opt.nheads > 0 ? opt.nheads : std::max(1, kHiddenSize / h);
    if (nheads % opt.gqa != 0) {
      std::fprintf(stderr, "dash_bench: %d heads are not divisible by --gqa %d; skipping hdim %d\n", nheads, opt.gqa,
                   h);
      continue;
    }
    for (MaskKind m : opt.masks) {
      for (int s : opt.seqlens) {
        const Problem p{std::max(1, opt.tokens / s), s, nheads, nheads / opt.gqa, h, m, opt.dtype,
                        opt.window_left, opt.window_right, opt.softcap};
        alive = alive && bench.run_problem(p);
        if (!alive) break;
      }
    }
  }
  if (!alive) std::fprintf(stderr, "dash_bench: the CUDA context is lost after the error above; stopping.\n");
  if (opt.run_bwd) print_summary(bench.rows());
  if (!opt.csv_path.empty()) write_csv(opt.csv_path, bench.rows());
  cudaStreamDestroy(stream);
  return alive ? 0 : 1;
}
