// Instantiates the backward traits of every head dim, dtype and mask (types only, no kernels): their static_asserts
// (staging room, warpgroup splits, operand sources) hold for head dims that check-kernels does not compile.
#include "bwd/bwd_traits.h"

namespace dash::bwd {
#define DASH_TRAITS(D)                                                     \
  template struct BwdTraits<D, cutlass::bfloat16_t, MaskKind::kFull>;     \
  template struct BwdTraits<D, cutlass::bfloat16_t, MaskKind::kCausal>;   \
  template struct BwdTraits<D, cutlass::bfloat16_t, MaskKind::kWindow>;   \
  template struct BwdTraits<D, cutlass::half_t, MaskKind::kFull>;         \
  template struct BwdTraits<D, cutlass::half_t, MaskKind::kCausal>;       \
  template struct BwdTraits<D, cutlass::half_t, MaskKind::kWindow>;
DASH_TRAITS(64)
DASH_TRAITS(128)
DASH_TRAITS(256)
#undef DASH_TRAITS
}  // namespace dash::bwd
