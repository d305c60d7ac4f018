"""The backward schedules' names and ids: the one Python registry, which every other module reads.

The names and ids come from dash_attn._sched's SCHEDULE_TABLE (csrc/sched_py/sched_module.cpp), one entry per
dash::ScheduleKind of csrc/common/params.h but kAuto; the tables below that name schedules (the picks of `auto`, the
model's measured ranking, the benchmark's labels) are the only other places a schedule's name is spelled in Python.
"""
from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional, Tuple

from . import _sched

__all__ = ["AUTO", "MASK_IDS", "SCHEDULE_IDS", "DETERMINISTIC_SCHEDULES", "NONDETERMINISTIC_SCHEDULES", "SCHEDULES",
           "DYNAMIC", "INVARIANT_SCHEDULES", "INVARIANT_VARLEN_SCHEDULES", "LANES_SCHEDULE", "SHORT_SEQLEN_K",
           "LANES_GQA_RATIO", "LANES_ORDER", "ANY_LENGTH", "NondetRunsBound", "NONDET_RUNS_BOUNDS",
           "gqa_takes_invariant_pick", "nondet_invariant_rule", "short_keys",
           "invariant_schedule", "varlen_invariant_schedule", "varlen_runs_lanes_order", "runs_per_sequence",
           "invariant_picks", "mask_id", "problem", "FALLBACK_SCHEDULE", "MEASURED_RANKING", "SHORT_NAMES"]

_TABLE = sorted(_sched.SCHEDULE_TABLE, key=lambda entry: entry[1])  # (name, id, deterministic), in id order

# The engine's mask ids by name (dash::MaskKind).
MASK_IDS: Dict[str, int] = {"full": _sched.MASK_FULL, "causal": _sched.MASK_CAUSAL, "window": _sched.MASK_WINDOW}
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
# The one schedule without a fixed dQ accumulation order (csrc/schedule/dynamic.h).
(DYNAMIC,) = NONDETERMINISTIC_SCHEDULES

# `auto` with deterministic=True: a function of the mask, the kernel's head dim, seqlen_k and the GQA ratio alone
# (never the SM count, sm_margin or the batch), so that its bits are invariant: every schedule here orders each dQ
# tile's adds by the sequence's own geometry (csrc/schedule/runs.h, lanes.h). LANES_SCHEDULE runs up to
# SHORT_SEQLEN_K[(mask, kernel head dim)] keys, and at any length where nheads / nheads_k reaches
# LANES_GQA_RATIO[kernel head dim] (there in both modes: gqa_takes_invariant_pick), measured faster there, on causal
# masks square or taller bands only (and mostly full ones at any length); elsewhere INVARIANT_SCHEDULES[mask]
# (benchmarks/RESULTS.md has the columns). Read through invariant_schedule().
INVARIANT_SCHEDULES = {"full": "shift_runs", "causal": "shift_causal_runs", "window": "descending"}
LANES_SCHEDULE = "descending_lanes"
SHORT_SEQLEN_K = {("full", 64): 4096, ("full", 128): 2048, ("causal", 64): 1024, ("causal", 128): 1024}
LANES_GQA_RATIO = {128: 4}
# The schedule whose orders (and so bits) descending_lanes runs on another layout.
LANES_ORDER = "descending"
# short_keys() where square bands of every length run LANES_ORDER's orders (the kernels take the bound as an int32).
ANY_LENGTH = 2**31 - 1
# (block_m, block_n) of the backward kernel of each kernel head dim (csrc/bwd/bwd_config.h). The torch binding asks
# the compiled kernel (dash_bwd_tile_shape) when it is present; this table is the CPU-side default.
BWD_TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}

# Varlen calls run a pack in one launch of the packed kernels or per run of equal lengths: a sequence must get the
# same walk and orders whatever it is packed with. The pick is a function of the mask alone (with the kernel's head
# dim, which fixes the tiles, and, per sequence, short_keys(), that fixes the bits). Read through
# varlen_invariant_schedule().
# - Causal bands: shift_causal_runs, which the packed kernels run on every sequence's own geometry
#   (runs_per_sequence, csrc/schedule/seq_runs.h), each sequence of up to short_keys() keys in LANES_ORDER's orders:
#   so every sequence gets the orders of its dense call under `auto` (dash_attn._launch._with_varlen_schedule).
# - Full masks: shift_runs, on every sequence's own geometry too, each sequence of up to short_keys() keys in
#   LANES_ORDER's orders, as its dense call under `auto` (descending_lanes there); shift_runs' walk depends on the
#   tile shape alone, so a longer sequence gets the bits of its dense shift_runs call.
# - Windows: descending.
INVARIANT_VARLEN_SCHEDULES = {"full": "shift_runs", "causal": "shift_causal_runs", "window": "descending"}


def runs_per_sequence(mask: str, schedule: str) -> bool:
    """Whether the packed kernels schedule every sequence of a varlen call on its own geometry (any pack then runs in
    one launch, whatever its sequences' bands): the engine's rule (csrc/schedule/seq_runs.h)."""
    return schedule in SCHEDULE_IDS and _sched.runs_per_sequence(SCHEDULE_IDS[schedule], MASK_IDS[mask])


def gqa_takes_invariant_pick(mask: str, kernel_head_dim: int, gqa_ratio: int) -> bool:
    """Whether `auto` takes invariant_schedule()'s pick for its GQA ratio (nheads // nheads_k), deterministic or not,
    with short_keys() unbounded: LANES_SCHEDULE, a KV head's tiles on one group of lanes, measured faster than every
    other schedule of either mode there on full masks and square causal bands; causal bands with fewer queries than
    keys that are not mostly full keep the runs schedule (csrc/schedule/seq_runs.h, runs_descending)."""
    return mask != "window" and gqa_ratio >= LANES_GQA_RATIO.get(kernel_head_dim, gqa_ratio + 1)


class NondetRunsBound(NamedTuple):
    """Where the non-deterministic `auto` takes the invariant pick on square (or taller) bands of one (mask, kernel head
    dim): from min_seqlen_k keys, or from min_gqa_ratio query heads per KV head of the launch, at any length (None:
    no such bound). ordered_adds: it runs the pick with the kernel's ordered dQ adds (the deterministic mode's),
    measured faster there than the arrival-order adds of the same schedule."""
    min_seqlen_k: Optional[int] = None
    min_gqa_ratio: Optional[int] = None
    ordered_adds: bool = False


# Where the non-deterministic `auto` runs `shift_causal_runs` (the invariant pick) instead of the cost model's pick, by
# (mask, kernel head dim), on square or taller bands only (bands with fewer queries than keys were not measured):
# - hdim 128 causal from 8192 keys: there `shift_causal_runs` ran ahead of the model's pick (`shift_causal`)
#   non-deterministically; at hdim 64 it did not (docs/tuning.md, "Schedules").
# - hdim 256 causal with 4 query heads per KV head: the deterministic shift_causal_runs, which walks the group's query
#   heads outermost there (runs.h), ran 1.17-1.71x the model's non-deterministic pick (benchmarks/RESULTS.md, GQA),
#   and 1.05-1.09x the same schedule with arrival-order adds (concurrent adds into one tile, likely; not profiled),
#   hence ordered_adds.
#   Larger causal groups run on copies of 2 query heads (_kv_heads), which the model keeps.
#   Not taken yet: a key bound at hdim 256 (from 2048 keys the ordered pick ran 1-4% ahead of the model's with MHA and
#   up to 1.42x with GQA 2, at 2k and 16k keys), because the CPU model puts odd KV tile counts, whose middle tile adds
#   last in run 1 and waits for every short tile, at 1.1-1.2x the model's pick (benchmarks/RESULTS.md, hdim 256).
# The GQA ratios of gqa_takes_invariant_pick come first (LANES_GQA_RATIO: both modes there, and the deterministic key
# bound too, so that table stays apart).
NONDET_RUNS_BOUNDS: Dict[Tuple[str, int], NondetRunsBound] = {
    ("causal", 128): NondetRunsBound(min_seqlen_k=8192),
    ("causal", 256): NondetRunsBound(min_gqa_ratio=4, ordered_adds=True),
}


def nondet_invariant_rule(mask: str, kernel_head_dim: int, gqa_ratio: int, seqlen_q: int,
                          seqlen_k: int) -> Optional[NondetRunsBound]:
    """The rule under which the non-deterministic `auto` runs invariant_schedule()'s pick instead of asking the cost
    model, or None: at the GQA ratios of gqa_takes_invariant_pick a rule without ordered adds, else the
    NONDET_RUNS_BOUNDS entry whose bound this square (or taller) band passes. Its ordered_adds says whether the kernel
    then adds dQ in the pick's order (the gradients are then the deterministic call's)."""
    if gqa_takes_invariant_pick(mask, kernel_head_dim, gqa_ratio):
        return NondetRunsBound()
    bound = NONDET_RUNS_BOUNDS.get((mask, kernel_head_dim))
    if bound is None or seqlen_q < seqlen_k:
        return None
    if ((bound.min_seqlen_k is not None and seqlen_k >= bound.min_seqlen_k)
            or (bound.min_gqa_ratio is not None and gqa_ratio >= bound.min_gqa_ratio)):
        return bound
    return None


def short_keys(mask: str, kernel_head_dim: int, gqa_ratio: int = 1) -> int:
    """Keys up to which deterministic `auto` runs LANES_ORDER's orders (mask name, the head dim of the kernel that
    runs, nheads // nheads_k): SHORT_SEQLEN_K, or every length where gqa_takes_invariant_pick."""
    if gqa_takes_invariant_pick(mask, kernel_head_dim, gqa_ratio):
        return ANY_LENGTH
    return SHORT_SEQLEN_K.get((mask, kernel_head_dim), 0)


def invariant_schedule(mask: str, kernel_head_dim: int, seqlen_k: int, gqa_ratio: int = 1,
                       seqlen_q: Optional[int] = None, tile: Optional[Tuple[int, int]] = None) -> str:
    """Deterministic `auto`'s pick for a dense call (mask name, the head dim of the kernel that runs, keys,
    nheads // nheads_k; with seqlen_q and the backward tile (block_m, block_n), the call's geometry). Where shift_runs
    would fall back to LANES_ORDER on a full mask's geometry (csrc/schedule/schedule.h: its adds would wait,
    ShiftRuns::waits_free, i.e. seqlen_q below seqlen_k), LANES_SCHEDULE runs the same orders: on an H100 it ran
    1.4-2x faster than descending there (hdim 64/128, 512-4096 queries against 8192 keys, docs/tuning.md). On causal
    masks LANES_SCHEDULE wherever the packed kernels run a sequence of these lengths in LANES_ORDER's orders under
    short_keys() (varlen_runs_lanes_order: seq_runs.h's runs_descending, square or taller bands up to that many keys
    and mostly full bands, problem.h's mostly_full_band, run unpaired there as on a full mask, lanes.h), so that
    dense and varlen calls keep one set of bits; on full masks that is every sequence of up to short_keys() keys.
    Without the geometry the band is taken as square, on the kernel's tile."""
    if seqlen_q is None or tile is None:
        seqlen_q, tile = seqlen_k, BWD_TILES[kernel_head_dim]
    pick = INVARIANT_SCHEDULES[mask]
    if varlen_runs_lanes_order(mask, seqlen_q, seqlen_k, tile, short_keys(mask, kernel_head_dim, gqa_ratio)):
        return LANES_SCHEDULE
    if mask == "full" and _falls_back_to_lanes_order(pick, mask, seqlen_q, seqlen_k, tile):
        return LANES_SCHEDULE
    return pick


def mask_id(mask: str) -> int:
    """The engine's id of a mask name (ValueError naming the choices otherwise)."""
    try:
        return MASK_IDS[mask]
    except KeyError:
        raise ValueError(f"mask must be one of {sorted(MASK_IDS)}, got {mask!r}") from None


def problem(mask: str, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int, batch: int,
            num_ctas: int, window: Optional[Tuple[int, int]], nheads_k: Optional[int]) -> "_sched.Problem":
    """The engine's Problem of a launch (mask name; window (left, right) for mask "window", else None; nheads_k None:
    MHA)."""
    kind = mask_id(mask)
    if mask == "window" and window is None:
        raise ValueError("mask='window' needs window=(left, right)")
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    return _sched.Problem(batch=batch, nheads=nheads, nheads_k=nheads if nheads_k is None else nheads_k,
                          seqlen_q=seqlen_q, seqlen_k=seqlen_k, block_m=block_m, block_n=block_n,
                          mask=kind, window_left=left, window_right=right, num_ctas=num_ctas)


def _one_head(mask: str, seqlen_q: int, seqlen_k: int, tile: Tuple[int, int]) -> "_sched.Problem":
    return problem(mask, seqlen_q, seqlen_k, *tile, 1, 1, 1, None, 1)


# The engine queries below are cached per shape: every backward call of a training step asks them for the same
# shapes (as `_launch._choose_schedule` is cached).
@functools.lru_cache(maxsize=4096)
def _falls_back_to_lanes_order(schedule: str, mask: str, seqlen_q: int, seqlen_k: int, tile: Tuple[int, int]) -> bool:
    """Whether the kernels run LANES_ORDER for `schedule` on one head of this geometry (the engine's resolve)."""
    resolved = _sched.resolve(SCHEDULE_IDS[schedule], _one_head(mask, seqlen_q, seqlen_k, tile))
    return resolved == SCHEDULE_IDS[LANES_ORDER]


@functools.lru_cache(maxsize=4096)
def varlen_runs_lanes_order(mask: str, seqlen_q: int, seqlen_k: int, tile: Tuple[int, int], short_k: int) -> bool:
    """Whether the packed kernels run a sequence of these lengths in LANES_ORDER's orders under the launch's short_k
    (csrc/schedule/seq_runs.h, entry_for, read through the engine): a varlen run of equal lengths launched as a
    batch then takes LANES_SCHEDULE, so that both paths, and the dense call, give one set of bits."""
    if short_k <= 0:
        return False
    pack = _sched.PackedProblem(_one_head(mask, 1, 1, tile), [seqlen_q], [seqlen_k], short_k)
    return pack.kinds[0] == SCHEDULE_IDS[LANES_ORDER]


def varlen_invariant_schedule(mask: str) -> str:
    """Deterministic `auto`'s pick for a varlen call (mask name): its bits depend on the mask and the head dim alone
    (and, where it runs every sequence on its own geometry, on the sequence's own keys through short_keys())."""
    return INVARIANT_VARLEN_SCHEDULES[mask]


def invariant_picks(mask: str) -> Tuple[str, ...]:
    """Every schedule deterministic `auto` can run for a mask, dense or varlen (what the invariance proofs cover)."""
    picks = {INVARIANT_SCHEDULES[mask], INVARIANT_VARLEN_SCHEDULES[mask]}
    picks.update(LANES_SCHEDULE for m, _ in SHORT_SEQLEN_K if m == mask)
    picks.update(LANES_SCHEDULE for hdim, ratio in LANES_GQA_RATIO.items()
                 if gqa_takes_invariant_pick(mask, hdim, ratio))
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
