"""Backward schedules: planning, the DASH cost model, the `auto` rule, Gantt charts and a CLI.

Everything here comes from `dash_attn._sched`, a CPU build of the very C++ headers (csrc/schedule/) that the backward
kernels include, so a plan is exactly what the GPU executes: which KV tiles each persistent CTA runs, the order in
which each KV tile visits Q tiles, and the position at which each partial dQ is accumulated (the semaphore wait
target).

Cost model (DASH): a visit is compute `c` then reduction `r` on its CTA, serial per CTA; in deterministic mode the
reductions into one dQ tile are chained in their accumulation order. The makespan is the critical path of that DAG.

    python -m dash_attn.schedule --mask causal --seqlen 8192 --hdim 128 --heads 16 --plot out.png
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _sched
from .schedules_table import DETERMINISTIC_SCHEDULES, DYNAMIC, MEASURED_RANKING, NONDETERMINISTIC_SCHEDULES
from .schedules_table import BWD_TILES, MASK_IDS, SCHEDULE_IDS, invariant_schedule
from .schedules_table import problem as _problem
from ._gantt import gantt, gantt_compare

__all__ = ["SCHEDULES", "NONDETERMINISTIC_SCHEDULES", "SCHEDULE_IDS", "MASKS", "Plan", "SimResult", "tile_shape",
           "plan", "simulate", "choose", "gantt", "gantt_compare", "main"]

# The schedules the engine plans in deterministic mode, and the names and ids of all (dash::ScheduleKind,
# csrc/common/params.h): dash_attn/schedules_table.py.
SCHEDULES = DETERMINISTIC_SCHEDULES
# NONDETERMINISTIC_SCHEDULES (the API's list): orders of the non-deterministic backward only.
# `dynamic` claims its units at run time (csrc/schedule/dynamic.h); its plan is the static stand-in the engine
# enumerates (ascending KV index as the accumulation order); what the kernel runs is simulate(...,
# deterministic=False, dispatch="greedy").
MASKS: Dict[str, int] = MASK_IDS
DISPATCH = {"static": 0, "greedy": 1, "greedy_head_major": 2}

# `choose` ranks by predicted makespan. The DAG alone (c, r) ties the schedules on most standard shapes, while the
# H200 separates them by up to 1.5x at short sequences: there a tile-major order gives each concurrent CTA its own
# head, so every visit streams its Q, dO and dQ accumulator tiles from DRAM (ncu, seqlen 1k full: descending 3.35 GB
# of DRAM traffic against 0.52 GB for shift, L2 hit rate 32% against 88%; docs/tuning.md). The L2
# term of the simulator (simulate.h: an LRU of tiles plus a bandwidth-shared miss cost and a latency per miss,
# calibrated below) reproduces that ranking when `choose` knows the L2 size and head dim. What is left are near-ties
# that the GPU does not separate either (shift and shift_causal on full masks), so makespans within _MODEL_TOLERANCE
# of the best count as ties, and ties follow the measured ranking of the mask.
_MODEL_TOLERANCE = 0.05
# The measured ranking per mask (dash_attn/schedules_table.py).
_PREFERENCE = MEASURED_RANKING
# Masks whose ranking uses the L2 term. It was fitted on full and causal masks; on windows both candidate orders take
# the same compulsory misses (one per tile set) and the term only moves when they happen, which ranked descending
# 3-9% ahead of spt at 16k where the H200 measured spt 0-2.7% ahead. Without it the model ties the two on all ten
# rows (spt / descending 1.00-1.02) and the measured ranking decides.
_L2_TERM_MASKS = ("full", "causal")
# L2 term: time of a visit whose (Q, dO, dQ accumulator) tile set comes from DRAM at 1/num_ctas of the bandwidth, in
# units of c, for 128-wide KV tiles (bytes per visit over FLOPs per visit scale as 1 / block_n). Calibrated on the
# H200 (hdim 128, seqlen 1k/2k: measured descending / shift 1.43 / 1.55, model 1.52 / 1.50); the nominal ratio of the
# bytes to the FLOPs at 550 TFLOPS and 4 TB/s gives 1.3.
_L2_MISS_COST = 1.8
# ... and what a miss adds to a visit when bandwidth is not the limit (the DRAM latency the two-stage load pipeline
# does not hide), in units of c: without it the model ranks descending ahead of shift_causal at causal 4k-16k, where
# the H200 runs descending 7-20% slower. 0.3 ranks all 20 measured descending-vs-shift(_causal) rows like the GPU
# (fit: docs/tuning.md).
_L2_MISS_LATENCY = 0.3
# The non-deterministic backward claims its units at run time (`dynamic`) on causal masks with KV tiles at most
# _DYNAMIC_MAX_BLOCK_N wide and at least _DYNAMIC_MIN_KV_TILES of them per head: there (hdim 256) it beats non-det
# shift_causal by 3-5% on the H200, while with 128-wide tiles it is neutral or slower (docs/tuning.md). The model
# (greedy dispatch, no power cap) gives it 2-3% at every length: a static grid's idle last-wave SMs let the busy ones
# clock higher under the 700 W cap, which the model does not see.
_DYNAMIC_MAX_BLOCK_N = 64
_DYNAMIC_MIN_KV_TILES = 64
# The non-deterministic backward where seqlen_q is at most half of seqlen_k, by mask. The ranking by the
# deterministic simulation misleads there: it has shift's adds wait (the walk wraps before its KV tiles are done) and
# ranks tile-major descending or causal-mask shift first, which the H100 ran at 0.45-0.55 of these picks (hdim 64 and
# 128, 512-4096 queries against 2048 and 8192 keys, the range measured; docs/tuning.md). `dynamic` was the fastest or
# within 2% of it on every causal row of that grid, `shift` within 3% of the fastest on every full one.
_SHORT_QUERY_PICKS = {"full": "shift", "causal": DYNAMIC}
# `choose` simulates at most this many visits per schedule; larger problems are scaled down proportionally
# (fewer (batch, KV head) pairs and CTAs, same tile geometry) so that `auto` stays fast.
_CHOOSE_VISIT_BUDGET = 400_000


def _kernel_hdim(hdim: int) -> int:
    """The head dim of the kernel a call of head dim `hdim` runs in, all kernels built (csrc/common/head_dims.h)."""
    return min((d for d in BWD_TILES if d >= hdim), default=max(BWD_TILES))


def tile_shape(hdim: int, mask: str = "full") -> Tuple[int, int]:
    """(block_m, block_n) of the backward kernel for a head dimension (BWD_TILES)."""
    del mask  # the tiles depend on the head dim alone; the argument mirrors dash_bwd_tile_shape's (headdim, mask)
    return BWD_TILES[_kernel_hdim(hdim)]


def _schedule_id(schedule: str) -> int:
    try:
        return SCHEDULE_IDS[schedule]
    except KeyError:
        raise ValueError(f"schedule must be one of {SCHEDULES + NONDETERMINISTIC_SCHEDULES}, got {schedule!r} "
                         "(resolve 'auto' with choose())") from None


@dataclasses.dataclass
class Plan:
    """What the static persistent grid executes for one schedule.

    `visits`: per-visit numpy columns in execution order (grouped by CTA, then item, then step): cta, item (index in
    the CTA's list), batch, head, head_k, n_block, m_block, step, wait_target, run (the dQ tile's accumulator:
    0, or 1 in the invariant schedules' second one, csrc/schedule/runs.h). `items`: per KV-tile columns (cta,
    batch, head_k, n_block, num_visits, first_step, unit, first_visit; an item runs steps [first_step, first_step +
    num_visits) of its KV tile: all of them except in shift's split tail). CTA c's visits are
    visits[cta_visit_offsets[c]:cta_visit_offsets[c + 1]]. For varlen, `sequences` holds one Plan per sequence and
    the top level is empty.
    """
    schedule: str
    mask: str
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    nheads: int
    nheads_k: int
    batch: int
    num_ctas: int
    window: Optional[Tuple[int, int]]
    visits: Dict[str, np.ndarray]
    items: Dict[str, np.ndarray]
    cta_item_offsets: np.ndarray
    sequences: List["Plan"] = dataclasses.field(default_factory=list)

    @property
    def problem(self) -> "_sched.Problem":
        return _problem(self.mask, self.seqlen_q, self.seqlen_k, self.block_m, self.block_n, self.nheads, self.batch,
                        self.num_ctas, self.window, self.nheads_k)

    @property
    def num_m_blocks(self) -> int:
        return _sched.num_m_blocks(self.problem)

    @property
    def num_n_blocks(self) -> int:
        return _sched.num_n_blocks(self.problem)

    @property
    def cta_visit_offsets(self) -> np.ndarray:
        counts = np.bincount(self.visits["cta"], minlength=self.num_ctas)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def cta_visits(self, cta: int) -> Dict[str, np.ndarray]:
        """Visit columns of one CTA, in the order it runs them."""
        off = self.cta_visit_offsets
        return {k: v[off[cta]:off[cta + 1]] for k, v in self.visits.items()}

    def dq_tile_keys(self) -> np.ndarray:
        """Linear dQ-tile index (batch, head, m_block) of every visit."""
        v = self.visits
        return (v["batch"].astype(np.int64) * self.nheads + v["head"]) * max(self.num_m_blocks, 1) + v["m_block"]

    def chain_keys(self) -> np.ndarray:
        """The accumulator each visit adds into: dq_tile_keys() and the run (each run has its own semaphore chain)."""
        return self.dq_tile_keys() * 2 + self.visits["run"]

    def accumulation_orders(self) -> Dict[Tuple[int, int, int], np.ndarray]:
        """(batch, head, m_block) -> KV tile indices in the order they add into that dQ tile: by accumulator run,
        then wait target. The postprocess adds run 0 then run 1, so this with accumulation_runs() is the whole
        summation order of the tile."""
        return self._per_tile("n_block")

    def accumulation_runs(self) -> Dict[Tuple[int, int, int], np.ndarray]:
        """(batch, head, m_block) -> the accumulator run of each entry of accumulation_orders()."""
        return self._per_tile("run")

    def _per_tile(self, column: str) -> Dict[Tuple[int, int, int], np.ndarray]:
        v = self.visits
        keys = self.dq_tile_keys()
        order = np.lexsort((v["wait_target"], v["run"], keys))
        keys_sorted = keys[order]
        bounds = np.flatnonzero(np.diff(keys_sorted)) + 1
        out = {}
        for idx in np.split(order, bounds):
            if idx.size:
                i = idx[0]
                out[(int(v["batch"][i]), int(v["head"][i]), int(v["m_block"][i]))] = v[column][idx]
        return out


def plan(schedule: str, mask: str, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int,
         batch: int, num_sms: int, window: Optional[Tuple[int, int]] = None, nheads_k: Optional[int] = None,
         cu_seqlens: Optional[Tuple[Sequence[int], Sequence[int]]] = None) -> Plan:
    """Enumerate a schedule on a persistent grid of `num_sms` CTAs.

    cu_seqlens=(cu_seqlens_q, cu_seqlens_k) plans each sequence of a varlen batch on its own (batch=1, the whole
    grid). The packed-sequence kernels schedule a varlen batch as a batch of its longest sequence instead (what
    tests/test_schedule_invariance.py models with padding tiles).
    `dynamic` off causal masks plans what the kernels run for it there: shift_causal (then shift or descending).
    """
    schedule_id = _schedule_id(schedule)
    nheads_k = nheads if nheads_k is None else nheads_k
    if cu_seqlens is not None:
        cu_q, cu_k = (np.asarray(c, dtype=np.int64) for c in cu_seqlens)
        if cu_q.shape != cu_k.shape or cu_q.ndim != 1 or cu_q.size < 1:
            raise ValueError("cu_seqlens must be (cu_seqlens_q, cu_seqlens_k) of equal length >= 1")
        seqs = [plan(schedule, mask, int(cu_q[i + 1] - cu_q[i]), int(cu_k[i + 1] - cu_k[i]), block_m, block_n,
                     nheads, 1, num_sms, window, nheads_k) for i in range(cu_q.size - 1)]
        empty = {k: np.zeros(0, np.int32) for k in ("cta", "item", "batch", "head", "head_k", "n_block", "m_block",
                                                     "step", "wait_target", "run")}
        return Plan(schedule, mask, 0, 0, block_m, block_n, nheads, nheads_k, 0, num_sms, window, empty, {},
                    np.zeros(num_sms + 1, np.int64), seqs)
    p = _problem(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k)
    if schedule in NONDETERMINISTIC_SCHEDULES:
        # Off causal masks the kernels run shift_causal's order for it (csrc/schedule/schedule.h: resolve_schedule).
        schedule_id = _sched.resolve(schedule_id, p)
        schedule = next(name for name, i in SCHEDULE_IDS.items() if i == schedule_id)
    e = _sched.enumerate(schedule_id, p)
    return Plan(schedule, mask, seqlen_q, seqlen_k, block_m, block_n, nheads, nheads_k, batch, num_sms, window,
                dict(e["visits"]), dict(e["items"]), np.asarray(e["cta_item_offsets"]))


@dataclasses.dataclass
class SimResult:
    """Outcome of the DAG model. Times are in units of the cost parameters c and r.

    visits/compute_start/reduce_start/reduce_end describe every simulated visit (in resolution order, not the plan's
    order); critical_path indexes into them, first to last. cta_idle = makespan - busy time (semaphore stalls plus
    the tail after the CTA's last visit); cta_wait is the stall part only.
    """
    makespan: float
    deadlock: bool
    lower_bound: float
    cta_busy: np.ndarray
    cta_wait: np.ndarray
    cta_idle: np.ndarray
    critical_path: np.ndarray
    visits: Dict[str, np.ndarray]
    compute_start: np.ndarray
    reduce_start: np.ndarray
    reduce_end: np.ndarray
    blocked_ctas: List[int]
    c: float
    r: float

    @property
    def critical_path_length(self) -> float:
        return self.makespan

    @property
    def critical_path_chain_steps(self) -> int:
        """Edges of the critical path that are dQ-chain waits rather than CTA-serial steps."""
        p = self.critical_path
        if p.size < 2:
            return 0
        return int(np.count_nonzero(self.visits["cta"][p[1:]] != self.visits["cta"][p[:-1]]))


def _lower_bound(p: "_sched.Problem", items: Dict[str, np.ndarray], c: float, r: float, num_ctas: int) -> float:
    nv = items["num_visits"].astype(np.int64)
    if nv.size == 0:
        return 0.0
    total = float(nv.sum())
    return max(total * (c + r) / num_ctas, float(nv.max()) * (c + r))


@dataclasses.dataclass(frozen=True)
class L2Model:
    """The simulator's L2 term: how many (Q, dO, dQ accumulator) tile sets fit in L2, and the time of a visit whose
    set comes from DRAM (see simulate.h), and what a miss adds when bandwidth is not the limit. l2_tiles = 0 turns the
    term off."""
    l2_tiles: int = 0
    miss: float = 0.0
    latency: float = 0.0


def l2_model(l2_bytes: int, block_m: int, block_n: int, headdim: int) -> L2Model:
    """L2 term for a device with `l2_bytes` of L2 and 16-bit inputs: a visit touches block_m x headdim elements of Q
    and of dO (2 bytes each) and of the fp32 dQ accumulator."""
    if l2_bytes <= 0 or block_m <= 0 or block_n <= 0 or headdim <= 0:
        raise ValueError("l2_bytes, block_m, block_n and headdim must be positive")
    tile_set_bytes = block_m * headdim * (2 + 2 + 4)
    return L2Model(max(1, l2_bytes // tile_set_bytes), _L2_MISS_COST * 128 / block_n, _L2_MISS_LATENCY)


def _simulate_problem(schedule: str, p, c: float, r: float, deterministic: bool, dispatch: str,
                      record: bool, l2: L2Model = L2Model()) -> dict:
    if dispatch not in DISPATCH:
        raise ValueError(f"dispatch must be one of {sorted(DISPATCH)}")
    return _sched.simulate(_schedule_id(schedule), p, c=c, r=r, deterministic=deterministic,
                           dispatch=DISPATCH[dispatch], record=record, l2_tiles=l2.l2_tiles, miss=l2.miss,
                           miss_latency=l2.latency)


def simulate(plan: Plan, c: float = 1.0, r: float = 0.5, deterministic: bool = True, dispatch: str = "static",
             record: bool = True, l2: L2Model = L2Model()) -> SimResult:
    """Run the DASH DAG model on a plan. dispatch='static' deals the units as most kernels do; 'greedy' (idle CTAs
    take the next work unit in launch order) is what the kernels run where they claim units at run time (`dynamic`;
    `shift_causal_runs` in the batched causal kernels; the packed kernels' sequence runs); 'greedy_head_major' (next
    KV tile in (batch, head, KV index) order) is a model-only reference. `l2` adds the L2 term (l2_model). A varlen
    plan is simulated as one launch per sequence, back to back."""
    if plan.sequences:
        parts = [simulate(s, c, r, deterministic, dispatch, record=False, l2=l2) for s in plan.sequences]
        zeros = np.zeros(plan.num_ctas)
        return SimResult(sum(x.makespan for x in parts), any(x.deadlock for x in parts),
                         sum(x.lower_bound for x in parts), sum((x.cta_busy for x in parts), zeros),
                         sum((x.cta_wait for x in parts), zeros), sum((x.cta_idle for x in parts), zeros),
                         np.zeros(0, np.int64), {}, np.zeros(0), np.zeros(0), np.zeros(0),
                         sorted({b for x in parts for b in x.blocked_ctas}), c, r)
    p = plan.problem
    s = _simulate_problem(plan.schedule, p, c, r, deterministic, dispatch, record, l2)
    busy = np.asarray(s["cta_busy"])
    empty = np.zeros(0)
    return SimResult(
        makespan=float(s["makespan"]), deadlock=bool(s["deadlock"]),
        lower_bound=_lower_bound(p, plan.items, c, r, plan.num_ctas),
        cta_busy=busy, cta_wait=np.asarray(s["cta_wait"]), cta_idle=float(s["makespan"]) - busy,
        critical_path=np.asarray(s.get("critical_path", np.zeros(0, np.int64))),
        visits=dict(s["visits"]) if record else {},
        compute_start=np.asarray(s.get("compute_start", empty)), reduce_start=np.asarray(s.get("reduce_start", empty)),
        reduce_end=np.asarray(s.get("reduce_end", empty)), blocked_ctas=list(s["blocked_ctas"]), c=c, r=r)


def _visits_per_kv_head(p) -> int:
    g = p.nheads // p.nheads_k
    n_blocks = _sched.num_n_blocks(p)
    return g * sum(hi - lo for lo, hi in (_sched.m_block_range(p, n) for n in range(n_blocks)))


def _scaled_for_choose(mask: str, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int,
                       batch: int, num_sms: int, window, nheads_k: int):
    """The problem `choose` simulates: the real one, or for very large problems a proportional slice of it (fewer
    (batch, KV head) pairs and CTAs in the same ratio, so the number of waves is kept)."""
    p = _problem(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k)
    per_head = max(_visits_per_kv_head(p), 1)
    heads_total = batch * nheads_k
    keep = max(1, min(heads_total, _CHOOSE_VISIT_BUDGET // per_head))
    if keep >= heads_total:
        return p
    ctas = max(1, round(num_sms * keep / heads_total))
    return _problem(mask, seqlen_q, seqlen_k, block_m, block_n, (nheads // nheads_k), keep, ctas, window, 1)


@functools.lru_cache(maxsize=4096)
def _choose_cached(mask: str, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int, batch: int,
                   num_sms: int, window: Optional[Tuple[int, int]], nheads_k: int, c: float, r: float,
                   l2: L2Model) -> str:
    p = _scaled_for_choose(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k)
    # A scaled-down problem has fewer CTAs; it gets the same share of L2 per CTA.
    l2_tiles = max(1, l2.l2_tiles * p.num_ctas // num_sms) if l2.l2_tiles > 0 and mask in _L2_TERM_MASKS else 0
    preference = _PREFERENCE[mask]
    makespan = {}
    for name in preference:
        # Both modes are ranked by the deterministic simulation: the non-deterministic kernel walks the same order,
        # and the model's arrival-order run keeps its CTAs in lockstep where the GPU's drift apart, which makes it
        # overrate tile-major orders (with the latency term it picked descending at causal 16k, hdim 128, where the
        # H200 runs non-det shift_causal 2-5% faster).
        s = _sched.simulate(SCHEDULE_IDS[name], p, c=c, r=r, deterministic=True, dispatch=0, record=False,
                            l2_tiles=l2_tiles, miss=l2.miss, miss_latency=l2.latency)
        if not s["deadlock"]:  # cannot happen for static dispatch (tested); guarded so `auto` never picks a hang
            makespan[name] = s["makespan"]
    best_time = min(makespan.values())
    return next(name for name in preference if makespan.get(name, math.inf) <= best_time * (1 + _MODEL_TOLERANCE))


def choose(mask: str, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int, batch: int,
           num_sms: int, window: Optional[Tuple[int, int]] = None, nheads_k: Optional[int] = None,
           deterministic: bool = True, c: float = 1.0, r: float = 0.5, l2: L2Model = L2Model()) -> str:
    """The `auto` rule: the schedule with the smallest predicted makespan on `num_sms` CTAs (cached per shape),
    with the L2 term when `l2` is given (l2_model). Makespans within _MODEL_TOLERANCE of the best are ties, broken
    by the measured ranking of the mask. Both modes get the deterministic ranking (see _choose_cached), except that
    the non-deterministic backward of a causal mask with KV tiles at most _DYNAMIC_MAX_BLOCK_N wide and at least
    _DYNAMIC_MIN_KV_TILES of them per head claims its units at run time (`dynamic`), and that with seqlen_q at most
    half of seqlen_k takes _SHORT_QUERY_PICKS."""
    if not deterministic and 2 * int(seqlen_q) <= int(seqlen_k) and mask in _SHORT_QUERY_PICKS:
        return _SHORT_QUERY_PICKS[mask]
    if (not deterministic and mask == "causal" and int(block_n) <= _DYNAMIC_MAX_BLOCK_N
            and -(-int(seqlen_k) // int(block_n)) >= _DYNAMIC_MIN_KV_TILES):
        return DYNAMIC
    window = None if window is None else (int(window[0]), int(window[1]))
    return _choose_cached(mask, int(seqlen_q), int(seqlen_k), int(block_m), int(block_n), int(nheads), int(batch),
                          int(num_sms), window, int(nheads if nheads_k is None else nheads_k), float(c), float(r),
                          l2)


def _predict_all(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k, c, r, l2):
    p = _problem(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k)
    rows = []
    for name in SCHEDULES:
        s = _sched.simulate(SCHEDULE_IDS[name], p, c=c, r=r, deterministic=True, dispatch=0, record=False,
                            l2_tiles=l2.l2_tiles, miss=l2.miss, miss_latency=l2.latency)
        wait = float(np.sum(s["cta_wait"]))
        rows.append((name, float(s["makespan"]), wait, bool(s["deadlock"])))
    # The non-deterministic kernel walks the visit order `auto` picks; the fastest one stands in for it here.
    fastest = min(rows, key=lambda row: row[1])[0]
    nd = _sched.simulate(SCHEDULE_IDS[fastest], p, c=c, r=r, deterministic=False, dispatch=0, record=False,
                         l2_tiles=l2.l2_tiles, miss=l2.miss, miss_latency=l2.latency)
    # `dynamic` as the kernel runs it: units claimed in launch order, each dQ tile's first add elected.
    dyn = _sched.simulate(SCHEDULE_IDS[DYNAMIC], p, c=c, r=r, deterministic=False,
                          dispatch=DISPATCH["greedy"], record=False, l2_tiles=l2.l2_tiles, miss=l2.miss,
                          miss_latency=l2.latency)
    return rows, float(nd["makespan"]), float(dyn["makespan"])


_H200_L2_MB = 60


def _device_l2_mb() -> float:
    """The L2 size `auto` models on this machine's GPU, or the H200's without one."""
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size / 2**20
    except Exception:  # no usable CUDA runtime: model the H200
        pass
    return float(_H200_L2_MB)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dash_attn.schedule",
                                 description="Predicted backward makespan of every schedule (DASH cost model) and "
                                             "the auto pick; optional Gantt chart.")
    ap.add_argument("--mask", choices=sorted(MASKS), default="causal")
    ap.add_argument("--seqlen", type=int, default=8192, help="query length (and key length unless --seqlen-k)")
    ap.add_argument("--seqlen-k", type=int, default=None)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-k", type=int, default=None, help="KV heads (GQA); default = --heads")
    ap.add_argument("--batch", type=int, default=None, help="default 16384 // seqlen (at least 1)")
    ap.add_argument("--num-sms", type=int, default=132, help="persistent CTAs (SM count minus any margin)")
    ap.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), default=None)
    ap.add_argument("--block", type=int, nargs=2, metavar=("BLOCK_M", "BLOCK_N"), default=None,
                    help="override the tile shape of --hdim")
    ap.add_argument("--c", type=float, default=1.0, help="compute cost of one visit")
    ap.add_argument("--r", type=float, default=0.5, help="dQ reduction cost of one visit")
    ap.add_argument("--l2-mb", type=float, default=None,
                    help="L2 size in MiB for the model's L2 term, as `auto` models it on the GPU (default: this "
                         f"machine's GPU, else the H200's {_H200_L2_MB}); 0 = off")
    ap.add_argument("--plot", default=None, help="write a Gantt chart of --plot-schedule (default: the auto pick)")
    ap.add_argument("--plot-schedule", choices=SCHEDULES, default=None)
    args = ap.parse_args(argv)

    seqlen_k = args.seqlen if args.seqlen_k is None else args.seqlen_k
    batch = args.batch if args.batch is not None else max(1, 16384 // args.seqlen)
    block_m, block_n = args.block if args.block else tile_shape(args.hdim, args.mask)
    window = tuple(args.window) if args.window else None
    if args.mask == "window" and window is None:
        ap.error("--mask window needs --window LEFT RIGHT")
    nheads_k = args.heads if args.heads_k is None else args.heads_k
    l2_mb = _device_l2_mb() if args.l2_mb is None else args.l2_mb
    l2 = l2_model(int(l2_mb * 2**20), block_m, block_n, args.hdim) if l2_mb > 0 else L2Model()
    rows, nondet, dynamic = _predict_all(args.mask, args.seqlen, seqlen_k, block_m, block_n, args.heads, batch,
                                         args.num_sms, window, nheads_k, args.c, args.r, l2)
    pick = choose(args.mask, args.seqlen, seqlen_k, block_m, block_n, args.heads, batch, args.num_sms, window,
                  nheads_k, True, args.c, args.r, l2)
    print(f"mask={args.mask} seqlen_q={args.seqlen} seqlen_k={seqlen_k} hdim={args.hdim} "
          f"tile=({block_m},{block_n}) heads={args.heads}/{nheads_k} batch={batch} CTAs={args.num_sms} "
          f"c={args.c:g} r={args.r:g} L2 tiles={l2.l2_tiles} miss={l2.miss:g} latency={l2.latency:g}")
    det_pick = invariant_schedule(args.mask, _kernel_hdim(args.hdim), seqlen_k, args.heads // nheads_k,
                                  seqlen_q=args.seqlen, tile=(block_m, block_n))
    print(f"{'schedule':<18}{'makespan':>12}{'vs best':>9}{'vs non-det':>12}{'stall (CTA-sum)':>18}")
    best = min(t for _, t, _, _ in rows)
    for name, t, wait, dead in rows:
        flag = "  DEADLOCK" if dead else ("  <- deterministic auto" if name == det_pick else "")
        print(f"{name:<18}{t:>12.1f}{t / best:>9.3f}{t / nondet:>12.3f}{wait:>18.1f}{flag}")
    print(f"non-deterministic (arrival order after each tile's first add): {nondet:.1f}; dynamic (claimed): "
          f"{dynamic:.1f}")
    nd_pick = choose(args.mask, args.seqlen, seqlen_k, block_m, block_n, args.heads, batch, args.num_sms, window,
                     nheads_k, False, args.c, args.r, l2)
    print(f"auto: deterministic {det_pick} (by mask, head dim and key length: invariant bits; the model ranks "
          f"{pick} first), non-deterministic {nd_pick}")
    if args.plot:
        name = args.plot_schedule or det_pick
        pl = plan(name, args.mask, args.seqlen, seqlen_k, block_m, block_n, args.heads, batch, args.num_sms, window,
                  nheads_k)
        gantt(pl, args.plot, args.c, args.r)
        print(f"wrote {args.plot} ({name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
