// WGMMA widths of CuTe tiled MMAs, for the traits' static checks.
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

}  // namespace dash
