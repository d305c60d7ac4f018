#include "sched_py/fwd_tiles.h"

#include <stdexcept>
#include <string>

#include "fwd/fwd_tile_scheduler.h"

namespace py = pybind11;

namespace dash::sched::host {
namespace {

template <fwd::TileOrder kOrder>
py::dict fwd_tiles_of(int32_t seqlen_q, int32_t block_m, int32_t nheads, int32_t batch, int32_t num_sms) {
  using S = fwd::FwdTileScheduler<kOrder>;
  typename S::Params const p = S::make_params(seqlen_q, block_m, nheads, batch, num_sms);
  int const grid = S::grid_size(p, num_sms);
  py::list ctas;
  for (int cta = 0; cta < grid; ++cta) {
    py::list tiles;
    for (auto cur = S::first(cta); S::valid(p, cur, grid); cur = S::next(p, cur, grid)) {
      typename S::WorkTile const t = S::decode(p, cur, grid);
      tiles.append(py::make_tuple(t.batch, t.head, t.m_block));
    }
    ctas.append(tiles);
  }
  py::dict d;
  d["grid"] = grid;
  d["num_m_blocks"] = p.num_m_blocks;
  d["ctas"] = ctas;
  d["pair_units"] = p.num_pair_units;
  d["paired_heads"] = kOrder == fwd::TileOrder::kPairedHeavyFirst ? p.tail_first_head : 0;
  return d;
}

py::dict fwd_tiles(int32_t mask, int32_t seqlen_q, int32_t block_m, int32_t nheads, int32_t batch, int32_t num_sms) {
  if (seqlen_q < 1 || block_m < 1 || nheads < 1 || batch < 1 || num_sms < 1) {
    throw std::invalid_argument("fwd_tiles: seqlen_q, block_m, nheads, batch and num_sms must be >= 1");
  }
  switch (static_cast<MaskKind>(mask)) {
    case MaskKind::kFull:
      return fwd_tiles_of<fwd::tile_order(MaskKind::kFull)>(seqlen_q, block_m, nheads, batch, num_sms);
    case MaskKind::kCausal:
      return fwd_tiles_of<fwd::tile_order(MaskKind::kCausal)>(seqlen_q, block_m, nheads, batch, num_sms);
    case MaskKind::kWindow:
      return fwd_tiles_of<fwd::tile_order(MaskKind::kWindow)>(seqlen_q, block_m, nheads, batch, num_sms);
  }
  throw std::invalid_argument("fwd_tiles: unknown mask id " + std::to_string(mask));
}

}  // namespace

void bind_fwd_tiles(py::module_& m) {
  m.def("fwd_tiles", &fwd_tiles, py::arg("mask"), py::arg("seqlen_q"), py::arg("block_m"), py::arg("nheads"),
        py::arg("batch"), py::arg("num_sms"),
        "The forward kernel's tile order: per CTA of the persistent grid, the (batch, head, m_block) tiles it runs in "
        "order; `pair_units` and `paired_heads`: the causal order's first phase.");
}

}  // namespace dash::sched::host
