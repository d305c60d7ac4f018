"""The backward schedules' names and ids: the one Python registry, which every other module reads.

The names and ids come from dash_attn._sched's SCHEDULE_TABLE (csrc/sched_py/sched_module.cpp), one entry per
dash::ScheduleKind of csrc/common/params.h but kAuto; the tables below that name schedules (the picks of `auto`, the
model's measured ranking, the benchmark's labels) are the only other places a schedule's name is spelled in Python.
"""
from __future__ import annotations

from typing import Dict, Tuple

from . import _sched

__all__ = ["AUTO", "SCHEDULE_IDS", "DETERMINISTIC_SCHEDULES", "NONDETERMINISTIC_SCHEDULES", "SCHEDULES", "DYNAMIC",
           "INVARIANT_SCHEDULES", "INVARIANT_VARLEN_SCHEDULES", "SHORT_INVARIANT_SCHEDULE", "SHORT_SEQLEN_K",
           "invariant_schedule", "invariant_picks", "FALLBACK_SCHEDULE", "MEASURED_RANKING",
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

# `auto` with deterministic=True: a function of the mask, the kernel's head dim and seqlen_k alone (never the SM count,
# sm_margin or the batch), so that its bits are invariant: every schedule here orders each dQ tile's adds by the
# sequence's own geometry (csrc/schedule/runs.h, lanes.h). Up to SHORT_SEQLEN_K[(mask, kernel head dim)] keys it is
# SHORT_INVARIANT_SCHEDULE, measured faster there; above, or for other masks and head dims, INVARIANT_SCHEDULES[mask]
# (benchmarks/RESULTS.md has both columns). Read through invariant_schedule().
INVARIANT_SCHEDULES = {"full": "shift_runs", "causal": "shift_causal_runs", "window": "descending"}
SHORT_INVARIANT_SCHEDULE = "descending_lanes"
SHORT_SEQLEN_K = {("full", 64): 4096, ("full", 128): 4096, ("causal", 64): 1024, ("causal", 128): 4096}
# Varlen calls run a causal or window band as a batch of the longest sequence (or per run of equal lengths): there
# only descending's order gives a sequence the same walk and order whatever its neighbours.
INVARIANT_VARLEN_SCHEDULES = {"full": "shift_runs", "causal": "descending", "window": "descending"}


def invariant_schedule(mask: str, kernel_head_dim: int, seqlen_k: int) -> str:
    """Deterministic `auto`'s pick for a dense call (mask name, the head dim of the kernel that runs, keys)."""
    if seqlen_k <= SHORT_SEQLEN_K.get((mask, kernel_head_dim), 0):
        return SHORT_INVARIANT_SCHEDULE
    return INVARIANT_SCHEDULES[mask]


def invariant_picks(mask: str) -> Tuple[str, ...]:
    """Every schedule deterministic `auto` can run for a mask, dense or varlen (what the invariance proofs cover)."""
    picks = {INVARIANT_SCHEDULES[mask], INVARIANT_VARLEN_SCHEDULES[mask]}
    picks.update(SHORT_INVARIANT_SCHEDULE for m, _ in SHORT_SEQLEN_K if m == mask)
    return tuple(sorted(picks))


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
               "shift_causal": "shiftc", "shift_runs": "shiftr", "shift_causal_runs": "shiftcr",
               "descending_lanes": "descl", "dynamic": "dyn"}
