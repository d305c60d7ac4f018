// Standalone GPU harness of the forward kernel (no torch): correctness against a CPU float reference on odd shapes,
// run-to-run bitwise identity, and a TFLOPS table. Links fwd_dispatch.cu plus whichever instantiations were built;
// configurations not built report SKIP.
//
//   test_fwd                 correctness cases, then the benchmark
//   test_fwd --no-bench      correctness only
//   test_fwd --bench-only    benchmark only
//   test_fwd --small         a few tiny cases (for compute-sanitizer)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/params.h"

namespace {

#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t err_ = (expr);                                                                    \
    if (err_ != cudaSuccess) {                                                                    \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

using dash::DType;
using dash::MaskKind;

// 16-bit storage <-> float on the host.
uint16_t to_bits(float x, DType t) {
  uint16_t bits;
  if (t == DType::kBFloat16) {
    __nv_bfloat16 v = __float2bfloat16_rn(x);
    std::memcpy(&bits, &v, 2);
  } else {
    __half v = __float2half_rn(x);
    std::memcpy(&bits, &v, 2);
  }
  return bits;
}
float from_bits(uint16_t bits, DType t) {
  if (t == DType::kBFloat16) {
    __nv_bfloat16 v;
    std::memcpy(&v, &bits, 2);
    return __bfloat162float(v);
  }
  __half v;
  std::memcpy(&v, &bits, 2);
  return __half2float(v);
}

struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float uniform() {  // [-1, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>((state >> 40) & 0xFFFFFF) / 8388608.f - 1.f;
  }
};

struct Case {
  int batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim;
  DType dtype;
  MaskKind mask;
  bool packed_qkv;  // q, k, v are slices of one (batch, seqlen, 3, nheads, d) buffer: non-trivial strides
};

std::string describe(Case const& c) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "d%d %s %s b%d sq%d sk%d h%d hk%d%s", c.headdim,
                c.dtype == DType::kBFloat16 ? "bf16" : "fp16", c.mask == MaskKind::kCausal ? "causal" : "full",
                c.batch, c.seqlen_q, c.seqlen_k, c.nheads, c.nheads_k, c.packed_qkv ? " packed" : "");
  return buf;
}

// Device buffers and parameters of one problem.
struct Problem {
  Case c;
  std::vector<uint16_t> q, k, v;  // host copies (in the device layout)
  dash::FwdParams params;
  void* d_qkv[3] = {nullptr, nullptr, nullptr};
  void* d_o = nullptr;
  float* d_lse = nullptr;
  size_t o_elems = 0, lse_elems = 0;

  explicit Problem(Case const& cs, uint64_t seed) : c(cs) {
    auto& s = params.shape;
    s.batch = c.batch;
    s.seqlen_q = c.seqlen_q;
    s.seqlen_k = c.seqlen_k;
    s.nheads = c.nheads;
    s.nheads_k = c.nheads_k;
    s.headdim = c.headdim;
    s.dtype = c.dtype;
    s.mask = c.mask;
    s.softmax_scale = 1.f / std::sqrt(static_cast<float>(c.headdim));
    int64_t const d = c.headdim;
    Rng rng(seed);
    auto fill = [&](std::vector<uint16_t>& buf, size_t n) {
      buf.resize(n);
      for (auto& x : buf) { x = to_bits(rng.uniform(), c.dtype); }
    };
    if (c.packed_qkv) {
      // One buffer (batch, seqlen, 3, nheads, d); requires seqlen_q == seqlen_k and nheads == nheads_k.
      int64_t const row = 3 * c.nheads * d;
      size_t const n = size_t(c.batch) * c.seqlen_q * row;
      fill(q, n);
      CUDA_CHECK(cudaMalloc(&d_qkv[0], n * 2));
      CUDA_CHECK(cudaMemcpy(d_qkv[0], q.data(), n * 2, cudaMemcpyHostToDevice));
      dash::TensorStrides st{int64_t(c.seqlen_q) * row, row, d};
      params.q = d_qkv[0];
      params.k = static_cast<uint16_t*>(d_qkv[0]) + c.nheads * d;
      params.v = static_cast<uint16_t*>(d_qkv[0]) + 2 * c.nheads * d;
      params.q_stride = params.k_stride = params.v_stride = st;
      k = q;
      v = q;
    } else {
      size_t const nq = size_t(c.batch) * c.seqlen_q * c.nheads * d;
      size_t const nk = size_t(c.batch) * c.seqlen_k * c.nheads_k * d;
      fill(q, nq);
      fill(k, nk);
      fill(v, nk);
      std::vector<uint16_t>* host[3] = {&q, &k, &v};
      for (int i = 0; i < 3; ++i) {
        size_t const n = host[i]->size();
        CUDA_CHECK(cudaMalloc(&d_qkv[i], std::max<size_t>(n, 1) * 2));
        CUDA_CHECK(cudaMemcpy(d_qkv[i], host[i]->data(), n * 2, cudaMemcpyHostToDevice));
      }
      params.q = d_qkv[0];
      params.k = d_qkv[1];
      params.v = d_qkv[2];
      params.q_stride = {int64_t(c.seqlen_q) * c.nheads * d, c.nheads * d, d};
      params.k_stride = params.v_stride = {int64_t(c.seqlen_k) * c.nheads_k * d, c.nheads_k * d, d};
    }
    o_elems = size_t(c.batch) * c.seqlen_q * c.nheads * d;
    lse_elems = size_t(c.batch) * c.nheads * c.seqlen_q;
    CUDA_CHECK(cudaMalloc(&d_o, o_elems * 2));
    CUDA_CHECK(cudaMalloc(&d_lse, lse_elems * 4));
    params.o = d_o;
    params.lse = d_lse;
    params.o_stride = {int64_t(c.seqlen_q) * c.nheads * d, c.nheads * d, d};
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&params.num_sms, cudaDevAttrMultiProcessorCount, dev));
  }
  ~Problem() {
    for (auto* p : d_qkv) { cudaFree(p); }
    cudaFree(d_o);
    cudaFree(d_lse);
  }
  Problem(Problem const&) = delete;
  Problem& operator=(Problem const&) = delete;

  // Fill the outputs with NaN so that any element the kernel forgets to write fails the check.
  void poison() {
    CUDA_CHECK(cudaMemset(d_o, 0xFF, o_elems * 2));
    CUDA_CHECK(cudaMemset(d_lse, 0xFF, lse_elems * 4));
  }
  int run(cudaStream_t stream = nullptr) { return dash_fwd(&params, stream); }

  float qv(int b, int s, int h, int i) const {
    auto const& st = params.q_stride;
    return from_bits(q[b * st.batch + s * st.row + h * st.head + i], c.dtype);
  }
  float kv(std::vector<uint16_t> const& buf, int b, int s, int h, int i) const {
    auto const& st = params.k_stride;
    int64_t off = b * st.batch + s * st.row + h * st.head + i;
    if (c.packed_qkv) { off += (&buf == &k ? 1 : 2) * int64_t(c.nheads) * c.headdim; }
    return from_bits(buf[off], c.dtype);
  }
};

// Reference for rows [row_begin, row_end) of every (batch, head), rows stepping by row_step.
void reference_rows(Problem const& pb, std::vector<float>& o_ref, std::vector<float>& lse_ref, int row_step) {
  Case const& c = pb.c;
  int const d = c.headdim;
  float const scale = pb.params.shape.softmax_scale;
  int const ratio = c.nheads / c.nheads_k;
  std::vector<int> rows;
  for (int i = 0; i < c.seqlen_q; i += row_step) { rows.push_back(i); }
  // The last rows carry the ragged tile and the causal diagonal's end: always check them.
  for (int i = std::max(0, c.seqlen_q - 200); i < c.seqlen_q; ++i) {
    if (i % row_step != 0) { rows.push_back(i); }
  }
  struct Job { int b, h; };
  std::vector<Job> jobs;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.nheads; ++h) { jobs.push_back({b, h}); }
  }
  auto work = [&](size_t first, size_t step) {
    std::vector<double> s(c.seqlen_k);
    std::vector<float> qrow(d);
    for (size_t jb = first; jb < jobs.size() * rows.size(); jb += step) {
      Job const job = jobs[jb / rows.size()];
      int const i = rows[jb % rows.size()];
      int const hk = job.h / ratio;
      for (int x = 0; x < d; ++x) { qrow[x] = pb.qv(job.b, i, job.h, x); }
      int limit = c.seqlen_k;
      if (c.mask == MaskKind::kCausal) { limit = std::min(limit, i + c.seqlen_k - c.seqlen_q + 1); }
      size_t const lse_idx = (size_t(job.b) * c.nheads + job.h) * c.seqlen_q + i;
      float* orow = &o_ref[((size_t(job.b) * c.seqlen_q + i) * c.nheads + job.h) * d];
      if (limit <= 0) {
        std::fill(orow, orow + d, 0.f);
        lse_ref[lse_idx] = -INFINITY;
        continue;
      }
      double m = -INFINITY;
      for (int j = 0; j < limit; ++j) {
        double dot = 0;
        for (int x = 0; x < d; ++x) { dot += double(qrow[x]) * pb.kv(pb.k, job.b, j, hk, x); }
        s[j] = dot * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (int j = 0; j < limit; ++j) {
        s[j] = std::exp(s[j] - m);
        l += s[j];
      }
      for (int x = 0; x < d; ++x) {
        double acc = 0;
        for (int j = 0; j < limit; ++j) { acc += s[j] * pb.kv(pb.v, job.b, j, hk, x); }
        orow[x] = static_cast<float>(acc / l);
      }
      lse_ref[lse_idx] = static_cast<float>(m + std::log(l));
    }
  };
  unsigned const nthreads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < nthreads; ++t) { pool.emplace_back(work, t, nthreads); }
  for (auto& t : pool) { t.join(); }
  // Mark unchecked rows so the comparison skips them.
  std::vector<char> checked(c.seqlen_q, 0);
  for (int i : rows) { checked[i] = 1; }
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.nheads; ++h) {
      for (int i = 0; i < c.seqlen_q; ++i) {
        if (!checked[i]) { lse_ref[(size_t(b) * c.nheads + h) * c.seqlen_q + i] = NAN; }
      }
    }
  }
}

int g_failures = 0;

void check_case(Case const& c, uint64_t seed) {
  Problem pb(c, seed);
  pb.poison();
  int const rc = pb.run();
  std::string const name = describe(c);
  if (rc == -1) {
    std::printf("SKIP %s (not built)\n", name.c_str());
    return;
  }
  if (rc != 0) {
    std::printf("FAIL %s launch error %d (%s)\n", name.c_str(), rc, cudaGetErrorString(cudaError_t(rc)));
    ++g_failures;
    return;
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> o(pb.o_elems), o2(pb.o_elems);
  std::vector<float> lse(pb.lse_elems), lse2(pb.lse_elems);
  CUDA_CHECK(cudaMemcpy(o.data(), pb.d_o, o.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(lse.data(), pb.d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));

  pb.poison();
  if (pb.run() != 0) { ++g_failures; }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(o2.data(), pb.d_o, o2.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(lse2.data(), pb.d_lse, lse2.size() * 4, cudaMemcpyDeviceToHost));
  bool const bitwise = std::memcmp(o.data(), o2.data(), o.size() * 2) == 0 &&
                       std::memcmp(lse.data(), lse2.data(), lse.size() * 4) == 0;

  int64_t const work = int64_t(c.seqlen_q) * c.seqlen_k;
  int const row_step = work > (1 << 22) ? 16 : 1;
  std::vector<float> o_ref(pb.o_elems, 0.f), lse_ref(pb.lse_elems, 0.f);
  reference_rows(pb, o_ref, lse_ref, row_step);

  double o_err = 0, lse_err = 0;
  bool bad = false;
  int const d = c.headdim;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.nheads; ++h) {
      for (int i = 0; i < c.seqlen_q; ++i) {
        size_t const li = (size_t(b) * c.nheads + h) * c.seqlen_q + i;
        float const ref_lse = lse_ref[li];
        if (std::isnan(ref_lse)) { continue; }  // row not sampled
        if (std::isinf(ref_lse)) {
          bad |= !(std::isinf(lse[li]) && lse[li] < 0);
        } else {
          double const e = std::fabs(double(lse[li]) - ref_lse);
          bad |= !(e == e);
          lse_err = std::max(lse_err, e);
        }
        size_t const oi = ((size_t(b) * c.seqlen_q + i) * c.nheads + h) * d;
        for (int x = 0; x < d; ++x) {
          double const e = std::fabs(double(from_bits(o[oi + x], c.dtype)) - o_ref[oi + x]);
          bad |= !(e == e);
          o_err = std::max(o_err, e);
        }
      }
    }
  }
  double const o_tol = c.dtype == DType::kBFloat16 ? 1.5e-2 : 3e-3;
  double const lse_tol = 2e-3;
  bool const pass = !bad && o_err <= o_tol && lse_err <= lse_tol && bitwise;
  if (!pass) { ++g_failures; }
  std::printf("%s %s  o_err %.3e (tol %.1e)  lse_err %.3e  bitwise %s%s\n", pass ? "PASS" : "FAIL", name.c_str(),
              o_err, o_tol, lse_err, bitwise ? "yes" : "NO", bad ? "  NaN/-inf mismatch" : "");
  std::fflush(stdout);
}

std::vector<Case> correctness_cases(bool small) {
  std::vector<Case> cases;
  for (int d : {128, 64, 256}) {
    for (DType t : {DType::kBFloat16, DType::kFloat16}) {
      for (MaskKind m : {MaskKind::kFull, MaskKind::kCausal}) {
        auto add = [&](int b, int sq, int sk, int h, int hk, bool packed = false) {
          cases.push_back({b, sq, sk, h, hk, d, t, m, packed});
        };
        add(2, 17, 17, 2, 2);
        add(1, 113, 1023, 2, 1);
        if (small) { continue; }
        add(1, 1, 1, 1, 1);
        add(3, 113, 113, 2, 2);
        add(1, 1023, 1023, 2, 2);
        add(1, 4097, 4097, 1, 1);
        add(1, 1023, 113, 2, 2);   // seqlen_q > seqlen_k: causal rows that see nothing
        add(2, 17, 4097, 1, 1);
        add(2, 257, 300, 8, 2);    // GQA 4:1
        add(1, 500, 500, 6, 1, false);  // MQA
        add(2, 333, 333, 4, 4, true);   // strided q/k/v slices of a packed buffer
      }
    }
  }
  return cases;
}

void bench() {
  std::printf("\nBENCH bf16 forward, batch*seqlen = 16384, median of 30 runs (CUDA events)\n");
  std::printf("%-6s %-7s %-8s %-6s %-6s %10s %10s\n", "hdim", "mask", "seqlen", "batch", "heads", "ms", "TFLOPS");
  for (int d : {128, 64}) {
    int const heads = d == 128 ? 16 : 32;
    for (MaskKind m : {MaskKind::kFull, MaskKind::kCausal}) {
      for (int s : {1024, 2048, 4096, 8192, 16384}) {
        int const b = 16384 / s;
        Problem pb({b, s, s, heads, heads, d, DType::kBFloat16, m, false}, 7);
        if (pb.run() != 0) {
          std::printf("%-6d %-7s %-8d SKIP\n", d, m == MaskKind::kCausal ? "causal" : "full", s);
          continue;
        }
        for (int w = 0; w < 5; ++w) { pb.run(); }
        // All timed launches are queued back to back (one event pair each) so that host-side launch cost overlaps
        // the previous kernel instead of showing up as gaps.
        constexpr int kRuns = 30;
        std::vector<cudaEvent_t> ev(2 * kRuns);
        for (auto& e : ev) { CUDA_CHECK(cudaEventCreate(&e)); }
        for (int r = 0; r < kRuns; ++r) {
          CUDA_CHECK(cudaEventRecord(ev[2 * r]));
          pb.run();
          CUDA_CHECK(cudaEventRecord(ev[2 * r + 1]));
        }
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> times;
        for (int r = 0; r < kRuns; ++r) {
          float ms = 0;
          CUDA_CHECK(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
          times.push_back(ms);
        }
        for (auto& e : ev) { CUDA_CHECK(cudaEventDestroy(e)); }
        CUDA_CHECK(cudaGetLastError());
        std::sort(times.begin(), times.end());
        double const ms = times[times.size() / 2];
        double flops = 4.0 * b * heads * double(s) * s * d;
        if (m == MaskKind::kCausal) { flops /= 2; }
        std::printf("%-6d %-7s %-8d %-6d %-6d %10.3f %10.1f\n", d, m == MaskKind::kCausal ? "causal" : "full", s,
                    b, heads, ms, flops / (ms * 1e-3) / 1e12);
        std::fflush(stdout);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool run_tests = true, run_bench = true, small = false;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--no-bench") { run_bench = false; }
    if (a == "--bench-only") { run_tests = false; }
    if (a == "--small") { small = true, run_bench = false; }
  }
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  if (run_tests) {
    uint64_t seed = 1;
    for (Case const& c : correctness_cases(small)) { check_case(c, seed++); }
    std::printf("%s: %d failure(s)\n", g_failures == 0 ? "ALL PASS" : "SOME FAILED", g_failures);
  }
  if (run_bench) { bench(); }
  return g_failures == 0 ? 0 : 1;
}
