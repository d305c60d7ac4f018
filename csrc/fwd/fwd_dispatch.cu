// C ABI entry of the forward: picks the instantiation for (head dim, dtype, mask, score transform). Only the
// instantiations enabled at build time (DASH_ENABLE_HDIM_*, DASH_ENABLE_FP16/BF16, set from DASH_ATTN_HDIMS/DTYPES;
// the soft-capped kernels with DASH_ENABLE_SOFTCAP, from DASH_ATTN_SOFTCAP; packed sequences with DASH_ENABLE_PACKED,
// from DASH_ATTN_PACKED) are referenced, so a restricted build links; anything else returns -1.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "common/head_dims.h"
#include "common/params.h"

namespace dash::fwd {
// Defined in fwd/fwd_launch.h and explicitly instantiated by csrc/instantiations/fwd_*.cu; declared here only so
// this TU does not compile any kernel.
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_fwd_(const dash::FwdParams&, cudaStream_t);
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_fwd_packed_(const dash::FwdParams&, cudaStream_t);
}  // namespace dash::fwd

namespace {

// The instantiation for (head dim, dtype, mask, score transform) in the call's sequence layout.
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
int launch(const dash::FwdParams& p, cudaStream_t stream) {
  if (p.packed.cu_seqlens_q == nullptr) {
    dash::fwd::run_fwd_<kHeadDim, Element, kMask, kScoreMod>(p, stream);
    return 0;
  }
#ifdef DASH_ENABLE_PACKED
  dash::fwd::run_fwd_packed_<kHeadDim, Element, kMask, kScoreMod>(p, stream);
  return 0;
#else
  return -1;
#endif
}

template <int kHeadDim, class Element, dash::MaskKind kMask>
int dispatch_score_mod(const dash::FwdParams& p, cudaStream_t stream) {
  if (p.shape.softcap == 0.f) { return launch<kHeadDim, Element, kMask, dash::ScoreMod::kNone>(p, stream); }
#ifdef DASH_ENABLE_SOFTCAP
  return launch<kHeadDim, Element, kMask, dash::ScoreMod::kSoftcap>(p, stream);
#else
  return -1;
#endif
}

template <int kHeadDim, class Element>
int dispatch_mask(const dash::FwdParams& p, cudaStream_t stream) {
  // Packed sequences: q's head dim a kernel's own and v's the same.
  if (p.packed.cu_seqlens_q != nullptr) {
    dash::AttnShape const& s = p.shape;
    if (s.headdim != kHeadDim || dash::value_head_dim(s) != kHeadDim) { return -1; }
    if (p.packed.cu_seqlens_k == nullptr || p.packed.total_q < 0 || p.packed.total_k < 0) { return -1; }
  }
  switch (p.shape.mask) {
    case dash::MaskKind::kFull:
      return dispatch_score_mod<kHeadDim, Element, dash::MaskKind::kFull>(p, stream);
    case dash::MaskKind::kCausal:
      return dispatch_score_mod<kHeadDim, Element, dash::MaskKind::kCausal>(p, stream);
    case dash::MaskKind::kWindow:
      return dispatch_score_mod<kHeadDim, Element, dash::MaskKind::kWindow>(p, stream);
    default:
      return -1;
  }
}

template <int kHeadDim>
int dispatch_dtype(const dash::FwdParams& p, cudaStream_t stream) {
  switch (p.shape.dtype) {
#ifdef DASH_ENABLE_FP16
    case dash::DType::kFloat16:
      return dispatch_mask<kHeadDim, cutlass::half_t>(p, stream);
#endif
#ifdef DASH_ENABLE_BF16
    case dash::DType::kBFloat16:
      return dispatch_mask<kHeadDim, cutlass::bfloat16_t>(p, stream);
#endif
    default:
      return -1;
  }
}

int dispatch_headdim(const dash::FwdParams& p, cudaStream_t stream) {
  switch (dash::kernel_head_dim(p.shape)) {
#ifdef DASH_ENABLE_HDIM_64
    case 64:
      return dispatch_dtype<64>(p, stream);
#endif
#ifdef DASH_ENABLE_HDIM_128
    case 128:
      return dispatch_dtype<128>(p, stream);
#endif
#ifdef DASH_ENABLE_HDIM_256
    case 256:
      return dispatch_dtype<256>(p, stream);
#endif
    default:
      return -1;
  }
}

}  // namespace

extern "C" int dash_fwd(const dash::FwdParams* params, void* stream) {
  if (params == nullptr) { return -1; }
  dash::AttnShape const& s = params->shape;
  if (!(s.softcap >= 0.f)) { return -1; }  // 0 = off; negative or NaN is a caller bug
  if (!dash::heads_grouped(s)) { return -1; }
  if (params->lse == nullptr || params->o == nullptr) { return -1; }
  int const status = dispatch_headdim(*params, static_cast<cudaStream_t>(stream));
  if (status != 0) { return status; }
  return static_cast<int>(cudaGetLastError());
}
