// FLOPs convention of benchmarks/flops.py, mirrored for the torch-free C++ benchmark; change both together.
// Forward = 4 * batch * nheads * (unmasked score area) * headdim; backward = 2.5 x forward. Causal is half the square
// when seqlen_q == seqlen_k (the convention FlashAttention and cuDNN report with); otherwise the bottom-right aligned
// causal area is counted exactly.
#pragma once
#include <algorithm>
#include <cstdint>

namespace dash::bench {

constexpr double kBwdFlopsPerFwd = 2.5;

inline double causal_area(int64_t seqlen_q, int64_t seqlen_k) {
  if (seqlen_q == seqlen_k) return static_cast<double>(seqlen_q) * static_cast<double>(seqlen_k) / 2.0;
  // Row i sees clamp(i + c, 0, seqlen_k) keys, c = seqlen_k - seqlen_q + 1: rows before first_partial see nothing,
  // rows in [first_partial, first_full) see i + c keys, the rest see every key.
  const int64_t c = seqlen_k - seqlen_q + 1;
  const int64_t first_partial = std::min(seqlen_q, std::max<int64_t>(0, 1 - c));
  const int64_t first_full = std::min(seqlen_q, std::max(first_partial, seqlen_k - c));
  const int64_t partial_rows = first_full - first_partial;
  const int64_t partial = partial_rows * c + (first_partial + first_full - 1) * partial_rows / 2;
  return static_cast<double>(partial) + static_cast<double>(seqlen_q - first_full) * static_cast<double>(seqlen_k);
}

// Sliding window: row i sees keys [i + d - left, i + d + right] within [0, seqlen_k), d = seqlen_k - seqlen_q; a
// negative bound is absent. Counted row by row (no half-square convention exists for bands).
inline double band_area(int64_t seqlen_q, int64_t seqlen_k, int64_t left, int64_t right) {
  const int64_t d = seqlen_k - seqlen_q;
  double area = 0.0;
  for (int64_t i = 0; i < seqlen_q; ++i) {
    const int64_t lo = left < 0 ? 0 : std::max<int64_t>(0, i + d - left);
    const int64_t hi = right < 0 ? seqlen_k - 1 : std::min(seqlen_k - 1, i + d + right);
    area += static_cast<double>(std::max<int64_t>(0, hi - lo + 1));
  }
  return area;
}

inline double fwd_flops_of_area(int64_t batch, int64_t nheads, double area, int64_t headdim) {
  return 4.0 * static_cast<double>(batch) * static_cast<double>(nheads) * area * static_cast<double>(headdim);
}

inline double fwd_flops(int64_t batch, int64_t nheads, int64_t seqlen_q, int64_t seqlen_k, int64_t headdim,
                        bool causal) {
  const double area = causal ? causal_area(seqlen_q, seqlen_k)
                             : static_cast<double>(seqlen_q) * static_cast<double>(seqlen_k);
  return fwd_flops_of_area(batch, nheads, area, headdim);
}

inline double bwd_flops(int64_t batch, int64_t nheads, int64_t seqlen_q, int64_t seqlen_k, int64_t headdim,
                        bool causal) {
  return kBwdFlopsPerFwd * fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal);
}

inline double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; }

}  // namespace dash::bench
