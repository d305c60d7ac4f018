// Head dims with compiled kernels (DASH_ENABLE_HDIM_*) and the kernel that runs a call of another head dim. Included
// only by the TUs that see those defines (the binding and the two dispatchers), never by kernel instantiations.
#pragma once
#include <cstdint>

#include "common/params.h"

namespace dash {

inline constexpr int32_t kBuiltHeadDims[] = {
#ifdef DASH_ENABLE_HDIM_64
    64,
#endif
#ifdef DASH_ENABLE_HDIM_128
    128,
#endif
#ifdef DASH_ENABLE_HDIM_256
    256,
#endif
    0,  // sentinel, so that the array is never empty
};

// Head dims are multiples of this: the kernels move rows in 16-byte pieces and TMA needs 16-byte strides.
inline constexpr int32_t kHeadDimMultiple = 8;

// The compiled head dim that runs a call whose tensors have head dim `headdim`: the smallest built one >= headdim,
// 0 if there is none or headdim is not a positive multiple of kHeadDimMultiple. A smaller call runs in the larger
// kernel with its missing columns zero: TMA fills them with zeros on loads and drops them on stores, and the plain
// global accesses stop at AttnShape::headdim. It costs what the larger head dim costs, without copies.
inline constexpr int32_t kernel_head_dim(int32_t headdim) {
  if (headdim <= 0 || headdim % kHeadDimMultiple != 0) return 0;
  int32_t best = 0;
  for (int32_t d : kBuiltHeadDims) {
    if (d != 0 && d >= headdim && (best == 0 || d < best)) best = d;
  }
  return best;
}

// The kernel of a call: the one that holds both its q/k and its v head dims (common/params.h), 0 if none.
inline int32_t kernel_head_dim(const AttnShape& s) {
  const int32_t dv = value_head_dim(s);
  if (kernel_head_dim(s.headdim) == 0 || kernel_head_dim(dv) == 0) return 0;
  return kernel_head_dim(s.headdim > dv ? s.headdim : dv);
}

}  // namespace dash
