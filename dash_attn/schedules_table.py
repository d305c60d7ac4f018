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
           "LANES_ORDER", "VARLEN_LANES_SEQLEN_K", "LANES_MIN_LOAD_RATIO", "gqa_runs_lanes", "invariant_schedule",
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
# bits); the lengths choose only between descending's two layouts. Read through varlen_invariant_schedule().
# - Full masks: shift_runs. With the packs split by length class (dash_attn/_seq_bands.py), on 11 packs of 16k tokens
#   it ran up to 1.16x (hdim 64) and 1.19x (hdim 128) ahead of descending_lanes, and trailed by more than 2% only on
#   16 x 1k at hdim 128 (419 against 448 TFLOPS; docs/tuning.md).
# - Causal bands: descending_lanes' layout; with square tiles (hdim 64, 256) past VARLEN_LANES_SEQLEN_K keys, where its
#   paired short tiles wait, descending's; and where the lengths load its lanes unevenly (LANES_MIN_LOAD_RATIO).
# - Windows: descending (the window kernels carry no lanes).
INVARIANT_VARLEN_SCHEDULES = {"full": "shift_runs", "causal": "descending_lanes", "window": "descending"}
VARLEN_LANES_SEQLEN_K = {("causal", 64): 4096, ("causal", 256): 4096}
# descending_lanes puts KV tile u of every sequence of a pack on lane u, so the lanes of a pack of unequal lengths
# carry unequal work. Where descending's layout loads its busiest CTA less than LANES_MIN_LOAD_RATIO times as much as
# the lanes' busiest (static visits inside the sequences, dash_attn._sched.max_cta_load), it runs instead (the same
# bits). H200, 16 causal packs of 16k tokens of unequal lengths at hdim 64 and 128 (32 rows): at ratios of 0.855-0.935
# the lanes ran 7-13% faster; at 0.80-0.85 the two were within 1% but once (descending's layout 9% faster); below 0.80
# descending's layout ran up to 1.6x faster or within 2%, but once (0.69: the lanes 3% faster). On packs of equal
# lengths (ratios 0.97-1.00) the lanes ran 20-30% faster. docs/tuning.md.
LANES_MIN_LOAD_RATIO = 0.85


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
    name = INVARIANT_VARLEN_SCHEDULES[mask]
    if name == LANES_SCHEDULE and max_seqlen_k > VARLEN_LANES_SEQLEN_K.get((mask, kernel_head_dim), max_seqlen_k):
        return LANES_ORDER
    return name


def invariant_picks(mask: str) -> Tuple[str, ...]:
    """Every schedule deterministic `auto` can run for a mask, dense or varlen (what the invariance proofs cover)."""
    picks = {INVARIANT_SCHEDULES[mask], INVARIANT_VARLEN_SCHEDULES[mask]}
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
