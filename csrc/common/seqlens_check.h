// cu_seqlens checked on the GPU, for packed-sequence calls whose prefix sums the host never reads (a captured CUDA
// graph replays the kernels with whatever the tensors hold at replay time). A kernel cannot raise, so the check
// writes a flag and a second kernel turns the call's results into NaN when the flag says invalid: invalid lengths
// then surface in the loss instead of as plausible numbers. When the flag says valid, every CTA of the second kernel
// returns after one load, so a valid call pays two tiny launches. dash_attn/device_seqlens.py holds the same rule
// in torch ops (the reference the GPU tests compare this one with).
#pragma once
#include <cstdint>

namespace dash {

struct SeqlensCheck {
  const int32_t* cu_seqlens_q = nullptr;  // batch + 1 entries each
  const int32_t* cu_seqlens_k = nullptr;
  // Optional (null: every row in use): batch entries each, within [0, the sequence's length]; the length limits and
  // the band rule below apply to the rows in use.
  const int32_t* seqused_q = nullptr;
  const int32_t* seqused_k = nullptr;
  int32_t batch = 0;
  int32_t total_q = 0, total_k = 0;  // rows of the packed tensors
  int32_t max_q = 0, max_k = 0;      // the lengths the kernels tile for
  // The mask's band (causal: right only). The packed kernels schedule a batch of the longest sequences, whose band
  // lies around the diagonal max_k - max_q: a right bound needs no sequence diagonal right of it, a left bound none
  // left of it.
  bool right_bounded = false, left_bounded = false;
  int32_t* ok = nullptr;  // out: 1 valid, 0 invalid
};

// Results to poison: `words` elements of `word_bytes` (2 or 4) each from `data`, set to `nan_bits`.
struct PoisonTarget {
  void* data = nullptr;
  int64_t words = 0;
  int32_t word_bytes = 4;
  uint32_t nan_bits = 0;
};

constexpr int kMaxPoisonTargets = 4;

struct PoisonTargets {
  PoisonTarget targets[kMaxPoisonTargets];
  int32_t count = 0;
  const int32_t* ok = nullptr;  // the flag of a SeqlensCheck launched before on the same stream
};

}  // namespace dash

extern "C" {
// Both return a cudaError_t as int (0: launched).
int dash_check_seqlens(const dash::SeqlensCheck* check, void* stream);
int dash_poison_unless_ok(const dash::PoisonTargets* targets, int32_t num_sms, void* stream);
}
