// Score transform of the soft-capped kernels (ScoreMod::kSoftcap), shared by the forward and the backward.
//
// With softcap c and softmax scale s the kernels take t = tanh(S * s / c) of the raw score S, and the softmax runs on
// c * t: the exponent's factor becomes c instead of s, so LSE (natural log) = c * max(t) + log(sum). The backward
// recomputes t, and the chain rule through c * tanh(S * s / c) multiplies dS by s * (1 - t^2): the s is the factor
// every dS already gets (dK scale, dQ postprocess), so the step multiplies by 1 - t^2 only.
#pragma once
#include "common/params.h"

namespace dash {

struct ScoreScales {
  float pre_tanh;  // factor of the raw score inside tanh: s / c (ScoreMod::kSoftcap only, else 0)
  float softmax;   // factor of the (transformed) score in the softmax exponent: s, or c after tanh
};

inline ScoreScales score_scales(const AttnShape& s) {
  if (s.softcap > 0.f) return {s.softmax_scale / s.softcap, s.softcap};
  return {0.f, s.softmax_scale};
}

#ifdef __CUDACC__
// MUFU.TANH, one instruction (what FlashAttention's soft-capping uses): max relative error about 2^-11, far below
// the rounding of P and dS to 16 bits that follows.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

}  // namespace dash
