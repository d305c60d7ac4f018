// C ABI of the backward (common/params.h): picks the (hdim, dtype, mask, score transform) instantiation. The kernels
// themselves live in csrc/instantiations/bwd_*.cu; this TU only declares the launch template, so it compiles in
// seconds.
// Build-time subsets: DASH_ENABLE_HDIM_{64,128,256}, DASH_ENABLE_{FP16,BF16}, DASH_ENABLE_SOFTCAP (the
// soft-capped kernels) and DASH_ENABLE_PACKED (packed sequences); anything not built returns -1.
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include "bwd/bwd_config.h"
#include "common/head_dims.h"
#include "common/params.h"

namespace dash::bwd {
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_bwd_(const dash::BwdParams&, cudaStream_t, int32_t stages);
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_bwd_packed_(const dash::BwdParams&, cudaStream_t, int32_t stages);
}  // namespace dash::bwd

namespace {

// The instantiation for (head dim, dtype, mask, score transform) in the call's sequence layout.
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
int launch(const dash::BwdParams& p, cudaStream_t stream, int32_t stages) {
  if (p.packed.cu_seqlens_q == nullptr) {
    dash::bwd::run_bwd_<kHeadDim, Element, kMask, kScoreMod>(p, stream, stages);
    return static_cast<int>(cudaGetLastError());
  }
#ifdef DASH_ENABLE_PACKED
  dash::bwd::run_bwd_packed_<kHeadDim, Element, kMask, kScoreMod>(p, stream, stages);
  return static_cast<int>(cudaGetLastError());
#else
  return -1;
#endif
}

template <int kHeadDim, class Element, dash::MaskKind kMask>
int run_score_mod(const dash::BwdParams& p, cudaStream_t stream, int32_t stages) {
  if (p.shape.softcap == 0.f) return launch<kHeadDim, Element, kMask, dash::ScoreMod::kNone>(p, stream, stages);
#ifdef DASH_ENABLE_SOFTCAP
  return launch<kHeadDim, Element, kMask, dash::ScoreMod::kSoftcap>(p, stream, stages);
#else
  return -1;
#endif
}

template <int kHeadDim, class Element>
int run_masked(const dash::BwdParams& p, cudaStream_t stream, int32_t stages) {
  // Packed sequences: q's head dim a kernel's own and v's the same.
  if (p.packed.cu_seqlens_q != nullptr) {
    const dash::AttnShape& s = p.shape;
    if (s.headdim != kHeadDim || dash::value_head_dim(s) != kHeadDim) return -1;
    if (p.packed.cu_seqlens_k == nullptr || p.packed.total_q < 0 || p.packed.total_k < 0) return -1;
  }
  switch (p.shape.mask) {
    case dash::MaskKind::kFull:
      return run_score_mod<kHeadDim, Element, dash::MaskKind::kFull>(p, stream, stages);
    case dash::MaskKind::kCausal:
      return run_score_mod<kHeadDim, Element, dash::MaskKind::kCausal>(p, stream, stages);
    case dash::MaskKind::kWindow:
      return run_score_mod<kHeadDim, Element, dash::MaskKind::kWindow>(p, stream, stages);
    default:
      return -1;
  }
}

template <int kHeadDim>
int run_typed(const dash::BwdParams& p, cudaStream_t stream, int32_t stages) {
  switch (p.shape.dtype) {
#ifdef DASH_ENABLE_FP16
    case dash::DType::kFloat16:
      return run_masked<kHeadDim, cutlass::half_t>(p, stream, stages);
#endif
#ifdef DASH_ENABLE_BF16
    case dash::DType::kBFloat16:
      return run_masked<kHeadDim, cutlass::bfloat16_t>(p, stream, stages);
#endif
    default:
      return -1;
  }
}

}  // namespace

extern "C" {

size_t dash_bwd_workspace_bytes(const dash::BwdParams* params) {
  if (params == nullptr) return 0;
  const dash::AttnShape& s = params->shape;
  return dash::bwd::bwd_workspace_layout(*params, dash::kernel_head_dim(s)).total;
}

void dash_bwd_tile_shape(int32_t headdim, int32_t /*mask: same tiles for every mask*/, int32_t* block_m,
                         int32_t* block_n) {
  const dash::bwd::BwdTileConfig cfg = dash::bwd::bwd_tile_config(dash::kernel_head_dim(headdim));
  if (block_m != nullptr) *block_m = cfg.block_m;
  if (block_n != nullptr) *block_n = cfg.block_n;
}

int dash_bwd(const dash::BwdParams* params, void* stream) {
  return dash_bwd_stages(params, dash::BwdStage::kAll, stream);
}

int dash_bwd_stages(const dash::BwdParams* params, int32_t stages, void* stream) {
  if (params == nullptr || stages <= 0 || (stages & ~int32_t{dash::BwdStage::kAll}) != 0) return -1;
  const dash::BwdParams& p = *params;
  const dash::AttnShape& s = p.shape;
  if (!(s.softcap >= 0.f)) return -1;
  if (!dash::concrete_schedule(static_cast<int64_t>(p.schedule)) ||
      !dash::schedule_runs_in_mode(p.schedule, p.deterministic)) {
    return -1;
  }
  if (s.batch <= 0 || s.nheads <= 0 || !dash::heads_grouped(s)) return -1;
  if (s.seqlen_q < 0 || s.seqlen_k < 0 || p.num_sms <= 0) return -1;
  if ((p.sink == nullptr) != (p.dsink == nullptr)) return -1;
  if (p.workspace_bytes < dash::bwd::bwd_workspace_layout(p, dash::kernel_head_dim(s)).total) {
    return -1;
  }
  if (dash::bwd::seq_table_call(p) && !dash::bwd::seq_units_fit(p)) return -1;
  // dQ is written at least two elements (4 bytes) at a time. dK and dV leave by TMA where the kernel stages them
  // (DkDvEpilogue::kTmaStaged*) and get TMA's rule everywhere: 16-byte bases and strides, as the inputs (which arrive
  // by TMA). The binding asks 16 bytes of every tensor.
  if (reinterpret_cast<uintptr_t>(p.dq) % 4 != 0 || !dash::strides_multiple_of(p.dq_stride, 2) ||
      !dash::aligned16(p.dk, p.dk_stride) || !dash::aligned16(p.dv, p.dv_stride)) {
    return -1;
  }
  auto st = static_cast<cudaStream_t>(stream);
  switch (dash::kernel_head_dim(s)) {
#ifdef DASH_ENABLE_HDIM_64
    case 64:
      return run_typed<64>(p, st, stages);
#endif
#ifdef DASH_ENABLE_HDIM_128
    case 128:
      return run_typed<128>(p, st, stages);
#endif
#ifdef DASH_ENABLE_HDIM_256
    case 256:
      return run_typed<256>(p, st, stages);
#endif
    default:
      return -1;
  }
}

}  // extern "C"
