// Host launch template of the forward: builds the TMA descriptors and kernel parameters, sizes the persistent grid
// from the SM count, and launches. The generated TUs in csrc/instantiations/ instantiate run_fwd_ once each.
#pragma once

#include <cuda_runtime.h>

#include "common/params.h"
#include "fwd/fwd_config.h"
#include "fwd/fwd_kernel.h"

namespace dash::fwd {

inline int device_sm_count() {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) { return 1; }
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) { return 1; }
  return sms;
}

// Errors are reported through the CUDA error state (the caller reads cudaGetLastError()).
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod, dash::SeqLayout kLayout,
          FwdTileSize kTileSize>
void launch_fwd_tile(const dash::FwdParams& params, cudaStream_t stream) {
  using Traits = FwdKernelTraits<kHeadDim, Element, kMask, kScoreMod, kLayout, kTileSize>;
  using Kernel = FwdKernel<Traits>;
  AttnShape const& s = params.shape;
  if (s.batch <= 0 || s.seqlen_q <= 0 || s.nheads <= 0) { return; }

  int const num_sms = params.num_sms > 0 ? params.num_sms : device_sm_count();
  typename Kernel::Params kernel_params{
      Kernel::Mainloop::make_params(params),
      Kernel::Epilogue::make_params(params),
      Kernel::Scheduler::make_params(s.seqlen_q, Traits::kBlockM, s.nheads, s.batch, num_sms),
      params.packed,
  };
  int const grid = Kernel::Scheduler::grid_size(kernel_params.scheduler, num_sms);

  auto kernel = fwd_kernel<Traits>;
  constexpr int kSmemBytes = Traits::kSharedStorageBytes;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess) {
    return;
  }
  kernel<<<grid, Traits::kNumThreads, kSmemBytes, stream>>>(kernel_params);
}

// The call's tile config: the short one where the head dim has one for this mask and score transform and the call's
// query rows (a packed call's bound) are few enough (FwdTileConfig::short_tile_max_seqlen_q).
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod, dash::SeqLayout kLayout>
void launch_fwd(const dash::FwdParams& params, cudaStream_t stream) {
  constexpr int kShortMax = FwdTileConfig<kHeadDim>::short_tile_max_seqlen_q(kMask, kScoreMod);
  if constexpr (kShortMax > 0) {
    if (params.shape.seqlen_q <= kShortMax) {
      launch_fwd_tile<kHeadDim, Element, kMask, kScoreMod, kLayout, FwdTileSize::kShort>(params, stream);
      return;
    }
  }
  launch_fwd_tile<kHeadDim, Element, kMask, kScoreMod, kLayout, FwdTileSize::kDefault>(params, stream);
}

template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_fwd_(const dash::FwdParams& params, cudaStream_t stream) {
  launch_fwd<kHeadDim, Element, kMask, kScoreMod, SeqLayout::kBatched>(params, stream);
}

// Packed sequences (params.packed set; shape.batch sequences of at most shape.seqlen_q / seqlen_k rows).
template <int kHeadDim, class Element, dash::MaskKind kMask, dash::ScoreMod kScoreMod>
void run_fwd_packed_(const dash::FwdParams& params, cudaStream_t stream) {
  launch_fwd<kHeadDim, Element, kMask, kScoreMod, SeqLayout::kPacked>(params, stream);
}

}  // namespace dash::fwd
