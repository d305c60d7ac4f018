// CUDA-event timing for the C++ benchmark: warm-up, then one event pair per timed call, median over the calls.
// Before every timed call an L2-sized buffer is overwritten (outside the events), so each call starts from a cold L2
// as it would inside a training step, instead of re-reading the inputs the previous call left in cache.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace dash::bench {

// Prints what failed and exits: the benchmark cannot go on after a CUDA runtime error it does not understand.
inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "dash_bench: %s failed at %s:%d: %s (%s)\n", what, file, line, cudaGetErrorName(err),
               cudaGetErrorString(err));
  std::exit(1);
}
#define DASH_BENCH_CUDA(expr) ::dash::bench::check_cuda((expr), #expr, __FILE__, __LINE__)

struct TimingConfig {
  int warmup = 5;
  int iters = 20;
  bool flush_l2 = true;
};

struct TimingResult {
  int status = 0;      // 0, or the first non-zero return code of the launch
  float median_ms = 0.f;
  float min_ms = 0.f;
};

class EventTimer {
 public:
  EventTimer(cudaStream_t stream, size_t flush_bytes) : stream_(stream), flush_bytes_(flush_bytes) {
    if (flush_bytes_ > 0) DASH_BENCH_CUDA(cudaMalloc(&flush_buf_, flush_bytes_));
  }
  ~EventTimer() {
    if (flush_buf_ != nullptr) cudaFree(flush_buf_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // A launch enqueues one call on the stream and returns 0 or an error code (the C ABI's convention); `prepare` (same
  // convention) is enqueued before every call, warm-up included, after the L2 flush and before the start event: a
  // launch that needs fresh state from another kernel (the backward's main kernel needs its preprocess) is timed
  // alone, yet finds the cache as that kernel leaves it, as it would inside the whole call.
  //
  // Several launches are timed round-robin: each is warmed up, then every round flushes L2 before each launch and
  // times each launch once, in order; one median per launch. Timed one after the other instead, a slow spell of the
  // GPU falls on whichever launch it meets (on the H200 such spells recur at the same point of a run, whatever
  // schedule sits there; docs/tuning.md). Round-robin spreads it over all launches, so their ratios (deterministic /
  // non-deterministic) stay fair. A failing call stops the timing of all.
  std::vector<TimingResult> time_round_robin(const std::vector<std::function<int()>>& launches,
                                             const TimingConfig& cfg,
                                             const std::function<int()>& prepare = [] { return 0; }) {
    const size_t n = launches.size();
    const int iters = std::max(1, cfg.iters);
    std::vector<TimingResult> results(n);
    auto failed = [&](int rc) {
      for (TimingResult& r : results) r.status = rc;
      return results;
    };
    for (size_t v = 0; v < n; ++v) {
      for (int i = 0; i < cfg.warmup; ++i) {
        int rc = prepare();
        if (rc == 0) rc = launches[v]();
        if (rc != 0) return failed(rc);
      }
    }
    std::vector<cudaEvent_t> events(2 * n * iters);
    for (cudaEvent_t& e : events) DASH_BENCH_CUDA(cudaEventCreate(&e));
    int status = 0;
    for (int i = 0; i < iters && status == 0; ++i) {
      for (size_t v = 0; v < n && status == 0; ++v) {
        if (cfg.flush_l2 && flush_buf_ != nullptr) {
          DASH_BENCH_CUDA(cudaMemsetAsync(flush_buf_, i & 0xff, flush_bytes_, stream_));
        }
        if ((status = prepare()) != 0) break;
        const size_t e = 2 * (static_cast<size_t>(i) * n + v);
        DASH_BENCH_CUDA(cudaEventRecord(events[e], stream_));
        status = launches[v]();
        DASH_BENCH_CUDA(cudaEventRecord(events[e + 1], stream_));
      }
    }
    DASH_BENCH_CUDA(cudaStreamSynchronize(stream_));
    if (status != 0) {
      for (cudaEvent_t e : events) cudaEventDestroy(e);
      return failed(status);
    }
    for (size_t v = 0; v < n; ++v) {
      std::vector<float> ms(iters);
      for (int i = 0; i < iters; ++i) {
        const size_t e = 2 * (static_cast<size_t>(i) * n + v);
        DASH_BENCH_CUDA(cudaEventElapsedTime(&ms[i], events[e], events[e + 1]));
      }
      std::sort(ms.begin(), ms.end());
      results[v].median_ms = ms[iters / 2];
      results[v].min_ms = ms.front();
    }
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    return results;
  }

  // One launch alone (a round of one).
  TimingResult time(const std::function<int()>& launch, const TimingConfig& cfg,
                    const std::function<int()>& prepare = [] { return 0; }) {
    return time_round_robin({launch}, cfg, prepare).front();
  }

 private:
  cudaStream_t stream_;
  size_t flush_bytes_;
  void* flush_buf_ = nullptr;
};

}  // namespace dash::bench
