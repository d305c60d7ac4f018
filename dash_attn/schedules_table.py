"""The backward schedules' names and ids: the one Python registry, which every other module reads.

The names and ids come from dash_attn._sched's SCHEDULE_TABLE (csrc/sched_py/sched_module.cpp), one entry per
dash::ScheduleKind of csrc/common/params.h but kAuto; the tables below that name schedules (the picks of `auto`, the
model's measured ranking, the benchmark's labels) are the only other places a schedule's name is spelled in Python.
"""
from __future__ import annotations

from typing import Dict, Tuple

from . import _sched

__all__ = ["AUTO", "SCHEDULE_IDS", "DETERMINISTIC_SCHEDULES", "NONDETERMINISTIC_SCHEDULES", "SCHEDULES", "DYNAMIC",
           "INVARIANT_SCHEDULES", "INVARIANT_VARLEN_SCHEDULES", "LANES_SCHEDULE", "SHORT_SEQLEN_K", "LANES_GQA_RATIO",
           "LANES_ORDER", "VARLEN_HEAD_DIM_SCHEDULES", "VARLEN_LANES_SEQLEN_K", "gqa_runs_lanes", "invariant_schedule",
           "varlen_invariant_schedule", "invariant_picks", "FALLBACK_SCHEDULE", "MEASURED_RANKING", "SHORT_NAMES"]

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

# `auto` with deterministic=True: a function of the mask, the kernel's head dim, seqlen_k and the GQA ratio alone
# (never the SM count, sm_margin or the batch), so that its bits are invariant: every schedule here orders each dQ
# tile's adds by the sequence's own geometry (csrc/schedule/runs.h, lanes.h). LANES_SCHEDULE runs up to
# SHORT_SEQLEN_K[(mask, kernel head dim)] keys, and at any length where nheads / nheads_k reaches
# LANES_GQA_RATIO[kernel head dim] (there in both modes: gqa_runs_lanes), measured faster there; elsewhere
# INVARIANT_SCHEDULES[mask] (benchmarks/RESULTS.md has the columns). Read through invariant_schedule().
INVARIANT_SCHEDULES = {"full": "shift_runs", "causal": "shift_causal_runs", "window": "descending"}
LANES_SCHEDULE = "descending_lanes"
SHORT_SEQLEN_K = {("full", 64): 4096, ("full", 128): 4096, ("causal", 64): 1024, ("causal", 128): 4096}
LANES_GQA_RATIO = {128: 4}
# descending_lanes runs descending's orders (the same bits) on another layout; where its layout is slower a varlen call
# runs this name instead.
LANES_ORDER = "descending"

# Varlen calls run a band as a batch of the longest sequence (or per run of equal lengths): a sequence must get the
# same walk and orders whatever that longest length is. On causal bands and windows only descending's order does;
# on full masks shift_runs' does too. The pick is a function of the mask and the kernel's head dim (which fix the
# bits); the longest sequence chooses only between descending's two layouts. Read through varlen_invariant_schedule().
# - Full masks: descending_lanes, except at hdim 256 (VARLEN_HEAD_DIM_SCHEDULES), where its groups of N lanes leave
#   132 mod N CTAs idle.
# - Causal bands: descending_lanes' layout; with square tiles (hdim 64, 256) past VARLEN_LANES_SEQLEN_K keys, where its
#   paired short tiles wait, descending's.
# - Windows: descending (the window kernels carry no lanes).
INVARIANT_VARLEN_SCHEDULES = {"full": "descending_lanes", "causal": "descending_lanes", "window": "descending"}
VARLEN_HEAD_DIM_SCHEDULES = {("full", 256): "shift_runs"}
VARLEN_LANES_SEQLEN_K = {("causal", 64): 4096, ("causal", 256): 4096}


def gqa_runs_lanes(mask: str, kernel_head_dim: int, gqa_ratio: int) -> bool:
    """Whether `auto` runs LANES_SCHEDULE for its GQA ratio (nheads // nheads_k), deterministic or not: with a KV
    head's tiles on one group of lanes it measured faster than every other schedule of either mode there."""
    return mask != "window" and gqa_ratio >= LANES_GQA_RATIO.get(kernel_head_dim, gqa_ratio + 1)


def invariant_schedule(mask: str, kernel_head_dim: int, seqlen_k: int, gqa_ratio: int = 1) -> str:
    """Deterministic `auto`'s pick for a dense call (mask name, the head dim of the kernel that runs, keys,
    nheads // nheads_k)."""
    if seqlen_k <= SHORT_SEQLEN_K.get((mask, kernel_head_dim), 0) or gqa_runs_lanes(mask, kernel_head_dim, gqa_ratio):
        return LANES_SCHEDULE
    return INVARIANT_SCHEDULES[mask]


def varlen_invariant_schedule(mask: str, kernel_head_dim: int, max_seqlen_k: int) -> str:
    """Deterministic `auto`'s pick for a varlen call (mask name, the head dim of the kernel that runs, the longest
    sequence's keys): its bits depend on the mask and the head dim alone."""
    name = VARLEN_HEAD_DIM_SCHEDULES.get((mask, kernel_head_dim), INVARIANT_VARLEN_SCHEDULES[mask])
    if name == LANES_SCHEDULE and max_seqlen_k > VARLEN_LANES_SEQLEN_K.get((mask, kernel_head_dim), max_seqlen_k):
        return LANES_ORDER
    return name


def invariant_picks(mask: str) -> Tuple[str, ...]:
    """Every schedule deterministic `auto` can run for a mask, dense or varlen (what the invariance proofs cover)."""
    picks = {INVARIANT_SCHEDULES[mask], INVARIANT_VARLEN_SCHEDULES[mask]}
    picks.update(name for (m, _), name in VARLEN_HEAD_DIM_SCHEDULES.items() if m == mask)
    picks.update(LANES_SCHEDULE for m, _ in SHORT_SEQLEN_K if m == mask)
    picks.update(LANES_ORDER for m, _ in VARLEN_LANES_SEQLEN_K if m == mask)
    picks.update(LANES_SCHEDULE for hdim, ratio in LANES_GQA_RATIO.items() if gqa_runs_lanes(mask, hdim, ratio))
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
