// CUDA-event timing for the C++ benchmark: warm-up, then one event pair per timed call, median over the calls.
// Before every timed call an L2-sized buffer is overwritten (outside the events), so each call starts from a cold L2
// as it would inside a training step, instead of re-reading the inputs the previous call left in cache.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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

  // `launch` enqueues one call on the stream and returns 0 or an error code (the C ABI's convention).
  template <class Launch>
  TimingResult time(Launch&& launch, const TimingConfig& cfg) {
    return time(launch, cfg, [] { return 0; });
  }

  // Same, with `prepare` (same convention) enqueued before every call, warm-up included, after the L2 flush and
  // before the start event: a launch that needs fresh state from another kernel (the backward's main kernel needs
  // its preprocess) is timed alone, yet finds the cache as that kernel leaves it, as it would inside the whole call.
  template <class Launch, class Prepare>
  TimingResult time(Launch&& launch, const TimingConfig& cfg, Prepare&& prepare) {
    TimingResult result;
    for (int i = 0; i < cfg.warmup; ++i) {
      if ((result.status = prepare()) != 0 || (result.status = launch()) != 0) return result;
    }
    const int iters = std::max(1, cfg.iters);
    std::vector<cudaEvent_t> starts(iters), ends(iters);
    for (int i = 0; i < iters; ++i) {
      DASH_BENCH_CUDA(cudaEventCreate(&starts[i]));
      DASH_BENCH_CUDA(cudaEventCreate(&ends[i]));
    }
    for (int i = 0; i < iters && result.status == 0; ++i) {
      if (cfg.flush_l2 && flush_buf_ != nullptr) {
        DASH_BENCH_CUDA(cudaMemsetAsync(flush_buf_, i & 0xff, flush_bytes_, stream_));
      }
      if ((result.status = prepare()) != 0) break;
      DASH_BENCH_CUDA(cudaEventRecord(starts[i], stream_));
      result.status = launch();
      DASH_BENCH_CUDA(cudaEventRecord(ends[i], stream_));
    }
    DASH_BENCH_CUDA(cudaStreamSynchronize(stream_));
    if (result.status == 0) {
      std::vector<float> ms(iters);
      for (int i = 0; i < iters; ++i) DASH_BENCH_CUDA(cudaEventElapsedTime(&ms[i], starts[i], ends[i]));
      std::sort(ms.begin(), ms.end());
      result.median_ms = ms[iters / 2];
      result.min_ms = ms.front();
    }
    for (int i = 0; i < iters; ++i) {
      cudaEventDestroy(starts[i]);
      cudaEventDestroy(ends[i]);
    }
    return result;
  }

 private:
  cudaStream_t stream_;
  size_t flush_bytes_;
  void* flush_buf_ = nullptr;
};

}  // namespace dash::bench
