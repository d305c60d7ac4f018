"""The backward schedules' names and ids: the one Python registry, which every other module reads.

The names and ids come from dash_attn._sched's SCHEDULE_TABLE (csrc/sched_py/sched_module.cpp), one entry per
dash::ScheduleKind of csrc/common/params.h but kAuto; the tables below that name schedules (the picks of `auto`, the
model's measured ranking, the benchmark's labels) are the only other places a schedule's name is spelled in Python.
"""
from __future__ import annotations

from typing import Dict, Tuple

from . import _sched

__all__ = ["AUTO", "SCHEDULE_IDS", "DETERMINISTIC_SCHEDULES", "NONDETERMINISTIC_SCHEDULES", "SCHEDULES", "DYNAMIC",
           "INVARIANT_SCHEDULES", "INVARIANT_VARLEN_SCHEDULES", "FALLBACK_SCHEDULE", "MEASURED_RANKING",
           "SHORT_NAMES"]

_TABLE = sorted(_sched.SCHEDULE_TABLE, key=lambda entry: entry[1])  # (name, id, deterministic), in id order

# `schedule=` value resolved before any launch (dash::ScheduleKind::kAuto never reaches the kernels).
AUTO = "auto"
# Mirrors dash::ScheduleKind (csrc/common/params.h): every schedule a launch can run, by name.
SCHEDULE_IDS: Dict[str, int] = {name: int(kind) for name, kind, _ in _TABLE}
# Schedules with a fixed dQ accumulation order, in id order: what the deterministic backward (and the engine) runs.
DETERMINISTIC_SCHEDULES: Tuple[str, ...] = tuple(name for name, _, deterministic in _TABLE if deterministic)
# Schedules without a fixed dQ accumulation order: the non-deterministic backward only.
NONDETERMINISTIC_SCHEDULES: Tuple[str, ...] = tuple(name for name, _, deterministic in _TABLE if not deterministic)
# Backward schedule names accepted by `schedule=`.
SCHEDULES: Tuple[str, ...] = (AUTO,) + DETERMINISTIC_SCHEDULES + NONDETERMINISTIC_SCHEDULES
# The one schedule whose units are claimed at run time (csrc/schedule/dynamic.h).
(DYNAMIC,) = NONDETERMINISTIC_SCHEDULES

# `auto` with deterministic=True, by mask and nothing else (not the SM count, sm_margin or batch), so that its bits are
# invariant (csrc/schedule/runs.h): every schedule here orders each dQ tile's adds by the sequence's own geometry.
# Varlen calls run a causal or window band as a batch of the longest sequence (or per run of equal lengths): there
# only descending gives a sequence the same walk and order whatever its neighbours.
INVARIANT_SCHEDULES = {"full": "shift_runs", "causal": "shift_causal_runs", "window": "descending"}
INVARIANT_VARLEN_SCHEDULES = {"full": "shift_runs", "causal": "descending", "window": "descending"}
# The non-deterministic `auto` pick where the cost model (dash_attn.schedule) cannot be imported: safe everywhere.
FALLBACK_SCHEDULE = "descending"
# The measured ranking per mask, by which dash_attn.schedule.choose breaks the cost model's near-ties (the measurements
# are described there). Windows: spt measured 0-3.6% faster than descending on all ten rows of the H200 window suite
# (hdim 128 and 64; (1024, 0), (512, 512), (4096, 0); 4k and 16k; docs/tuning.md).
MEASURED_RANKING = {
    "full": ("shift", "shift_causal", "descending", "spt", "ascending"),
    "causal": ("shift_causal", "shift", "descending", "spt", "ascending"),
    "window": ("spt", "descending", "shift", "shift_causal", "ascending"),
}
# Short labels of the benchmark tables (benchmarks/peers.py), one per name of SCHEDULES.
SHORT_NAMES = {"auto": "auto", "ascending": "asc", "descending": "desc", "spt": "spt", "shift": "shift",
               "shift_causal": "shiftc", "shift_runs": "shiftr", "shift_causal_runs": "shiftcr", "descending_lanes": "descl",
               "dynamic": "dyn"}
