// The forward's persistent tile order (fwd/fwd_tile_scheduler.h, the kernel's own header) in dash_attn._sched: the
// tiles every CTA of a grid runs, in order, for the CPU tests and models.
#pragma once

#include <pybind11/pybind11.h>

namespace dash::sched::host {

void bind_fwd_tiles(pybind11::module_& m);

}  // namespace dash::sched::host
