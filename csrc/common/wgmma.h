// WGMMA widths of CuTe tiled MMAs, for the traits' static checks, and the scheduling fence a mainloop can put before
// a WGMMA wait.
#pragma once

#include <cute/tensor.hpp>

namespace dash {

// N of one WGMMA of a tiled MMA. The traits assert that it spans each warpgroup's N of every GEMM: CuTe's selector
// picks the widest instruction that divides the tile's N among the shapes it is built for, and without
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (csrc/build_config.py) a tile N outside 8-16-32-64-96-128-192-256 would be
// issued as several narrow WGMMAs (176 keys: 11 of N = 16).
template <class TiledMma>
constexpr int wgmma_n() {
  return cute::size<1>(typename TiledMma::AtomShape_MNK{});
}

// Ends ptxas's scheduling block once `value` is computed: a branch on a bit pattern no arithmetic result has (the
// all-ones NaN; the hardware's NaN is 0x7fffffff) around a side effect that cannot be dropped. ptxas schedules within
// a block and places a WGMMA wait (WARPGROUP.DEPBAR) as early in its block as it can; without the fence the wait on a
// GEMM still running goes above the register math meant to overlap it, which then runs after the GEMM instead of
// beside it. The branch is never taken, so results are those of the unfenced code.
CUTLASS_DEVICE void schedule_fence(float value) {
  if (__float_as_uint(value) == 0xffffffffu) { asm volatile("nanosleep.u32 0;"); }
}

}  // namespace dash
