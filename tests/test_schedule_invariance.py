"""Invariance proofs of the deterministic backward's schedules, on the engine the kernels compile (dash_attn._sched).

A sequence's dQ bits are fixed by the order in which KV tiles add into each of its dQ tiles (and, for the invariant
schedules, by which of the tile's two accumulators each add goes to); its dK/dV bits by the order in which each KV
tile walks its Q tiles. For every schedule that deterministic `auto` can pick (schedules_table.invariant_picks),
both must be the same for every CTA count 1..256 (what sm_margin and the GPU model
change), every batch size and position in the batch, and, for varlen, whatever the sequence is packed with. Every
such plan must also be deadlock-free (the engine's verifier simulates the static grid).
"""
import functools
import itertools

import numpy as np
import pytest

from dash_attn import _sched
from dash_attn import schedule as S
from dash_attn.schedules_table import (INVARIANT_SCHEDULES, invariant_picks, runs_per_sequence, short_keys,
                                      varlen_invariant_schedule)

ALL_CTAS = range(1, 257)
BATCHES = (1, 2, 5, 8)
# (block_m, block_n) of the backward kernels of hdim 64, 128 and 256.
TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
# (mask, seqlen_q, seqlen_k, nheads, nheads_k, window): small enough that 1..256 CTAs stay fast, ragged on purpose.
SHAPES = [
    ("full", 700, 700, 2, 2, None),
    ("full", 450, 900, 4, 2, None),
    ("full", 900, 450, 2, 1, None),
    ("causal", 700, 700, 2, 2, None),
    ("causal", 500, 830, 4, 1, None),
    ("causal", 830, 500, 2, 2, None),
    ("causal", 150, 1500, 2, 1, None),  # most KV tiles fully live: descending_lanes runs them unpaired
    ("window", 700, 700, 2, 2, (200, 0)),
    ("window", 700, 700, 2, 1, (150, 150)),
]


def _plan(schedule, mask, sq, sk, hdim, nheads, nheads_k, window, batch, ctas):
    bm, bn = TILES[hdim]
    return S.plan(schedule, mask, sq, sk, bm, bn, nheads, batch, ctas, window=window, nheads_k=nheads_k)


def signature(plan, batch_index, live_q=None, live_k=None):
    """What fixes sequence `batch_index`'s bits: per dQ tile its adds as (run, KV tile) in order, per KV tile its
    walk as (head, Q tile) in order. live_q / live_k: the sequence's own tile counts inside a packed plan (tiles past
    them are the pack's padding: Q tiles there are skipped, KV tiles there add zeros)."""
    v = plan.visits
    sel = v["batch"] == batch_index
    dq = {}
    orders = plan.accumulation_orders()
    for key, runs in plan.accumulation_runs().items():
        if key[0] != batch_index or (live_q is not None and key[2] >= live_q):
            continue
        blocks = orders[key]
        dq[key[1:]] = tuple((int(r), int(n)) for r, n in zip(runs, blocks) if live_k is None or n < live_k)
    walks = {}
    order = np.lexsort((v["step"][sel], v["n_block"][sel], v["head_k"][sel]))
    for hk, n, h, m in zip(v["head_k"][sel][order], v["n_block"][sel][order], v["head"][sel][order],
                           v["m_block"][sel][order]):
        if (live_k is not None and n >= live_k) or (live_q is not None and m >= live_q):
            continue
        walks.setdefault((int(hk), int(n)), []).append((int(h), int(m)))
    return dq, {k: tuple(w) for k, w in walks.items()}


@functools.lru_cache(maxsize=None)
def alone(schedule, mask, sq, sk, hdim, nheads, nheads_k, window):
    return signature(_plan(schedule, mask, sq, sk, hdim, nheads, nheads_k, window, 1, 1), 0)


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}-h{s[3]}:{s[4]}")
def test_deterministic_picks_are_invariant(shape, hdim):
    """Every CTA count 1..256 and batch sizes 1..8: each sequence's orders equal those of the sequence alone."""
    mask, sq, sk, nheads, nheads_k, window = shape
    for schedule in invariant_picks(mask):
        ref = alone(schedule, mask, sq, sk, hdim, nheads, nheads_k, window)
        for ctas in ALL_CTAS:
            batch = BATCHES[ctas % len(BATCHES)]
            plan = _plan(schedule, mask, sq, sk, hdim, nheads, nheads_k, window, batch, ctas)
            for b in {0, batch - 1}:
                assert signature(plan, b) == ref, f"{schedule}: sequence {b} of {batch} on {ctas} CTAs"


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_deterministic_picks_are_deadlock_free(mask, hdim):
    for shape in SHAPES:
        if shape[0] != mask:
            continue
        _, sq, sk, nheads, nheads_k, window = shape
        bm, bn = TILES[hdim]
        for schedule in invariant_picks(mask):
            for batch in (1, 3):
                p = S._problem(mask, sq, sk, bm, bn, nheads, batch, 1, window, nheads_k)
                assert _sched.verify(S.SCHEDULE_IDS[schedule], p, 1, 256) == [], (schedule, shape, batch)


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_varlen_pick_is_invariant_to_packing(mask, hdim):
    """A sequence must get its own orders whatever it is packed with, in any position. On causal masks the packed
    kernels schedule each sequence on its own geometry (dash_attn._sched.verify_packed compares every sequence with
    itself alone); on full masks they schedule a batch of the longest sequence and skip what lies past each
    sequence's end."""
    bm, bn = TILES[hdim]
    own = 333
    schedule = varlen_invariant_schedule(mask)
    ref = alone(schedule, mask, own, own, hdim, 2, 1, None)
    for longest in (333, 500, 1024, 1500, 5000):
        if runs_per_sequence(mask, schedule):
            # Deterministic `auto` adds short_k (its dense pick's orders up to short_keys keys); a named schedule not.
            # Square sequences, and sequences with fewer queries than keys (on causal masks under short_k: mostly
            # full bands run descending's orders, the others the runs', seq_runs.h runs_descending).
            for lens, short_k in itertools.product(([own, longest, own], [longest, own, 64], [own, 1, longest]),
                                                   {0, short_keys(mask, hdim)}):
                for lens_q in (lens, [max(1, n // 2) for n in lens], [max(1, n // 8) for n in lens]):
                    pack = _sched.PackedProblem(S._problem(mask, 1, 1, bm, bn, 2, 1, 1, None, 1), lens_q, lens,
                                                short_k)
                    assert _sched.verify_packed(pack, 1, 256) == [], (schedule, lens_q, lens, short_k)
            continue
        for ctas in (1, 7, 66, 132, 256):
            plan = _plan(schedule, mask, longest, longest, hdim, 2, 1, None, 3, ctas)
            for b in range(3):
                got = signature(plan, b, live_q=-(-own // bm), live_k=-(-own // bn))
                assert got == ref, f"{schedule}: packed with {longest}, position {b}, {ctas} CTAs"


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_runs_schedules_wait_for_nobody_when_heads_run_together(mask):
    """The model's deterministic makespan of the invariant schedule equals the arrival-order one at the standard
    shapes (16 heads, one wave of heads or more): invariance costs no waits."""
    schedule = INVARIANT_SCHEDULES[mask]
    for seqlen, batch in ((1024, 16), (4096, 4)):
        p = S._problem(mask, seqlen, seqlen, 64, 128, 16, batch, 132, None, 16)
        det = _sched.simulate(S.SCHEDULE_IDS[schedule], p, deterministic=True)
        nondet = _sched.simulate(S.SCHEDULE_IDS[schedule], p, deterministic=False)
        assert det["makespan"] == nondet["makespan"]


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_wave_order_schedules_are_not_invariant(mask):
    """shift and shift_causal order by wave (the deterministic mode of those names): sm_margin may change their bits,
    never their run-to-run determinism. `auto` does not pick them in deterministic mode."""
    name = "shift" if mask == "full" else "shift_causal"
    ref = signature(_plan(name, mask, 1013, 1013, 128, 32, 16, None, 2, 132), 1)
    assert any(signature(_plan(name, mask, 1013, 1013, 128, 32, 16, None, 2, c), 1) != ref for c in (128, 114, 78))
