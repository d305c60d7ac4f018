"""The shift schedules' split tail (csrc/schedule/tail_split.h): the last, partial wave cut into chunks that every CTA
runs; shift's units are KV tiles, shift_causal's are pairs of KV tiles (long, short) run back to back.

CPU only: the schedule engine's own C++ (dash_attn._sched), checked against the execution model for every CTA count
and against a re-derivation of the tail's accumulation order in numpy.
"""
import numpy as np
import pytest

from dash_attn import schedule

_sched = pytest.importorskip("dash_attn._sched")

SHIFT = schedule.SCHEDULE_IDS["shift"]
SHIFT_CAUSAL = schedule.SCHEDULE_IDS["shift_causal"]
MIN_CHUNK = _sched.DEFAULT_TAIL_CHUNK_MIN

# Shapes whose tail splits on many grid sizes: several Q tiles per KV tile (V = g * M > MIN_CHUNK), GQA, ragged tiles,
# seqlen_q != seqlen_k and several batch entries.
SHAPES = [
    dict(batch=1, nheads=5, nheads_k=5, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=0),
    dict(batch=2, nheads=6, nheads_k=3, seqlen_q=1000, seqlen_k=777, block_m=64, block_n=128, mask=0),
    dict(batch=3, nheads=1, nheads_k=1, seqlen_q=1023, seqlen_k=113, block_m=16, block_n=32, mask=0),
    dict(batch=1, nheads=4, nheads_k=1, seqlen_q=640, seqlen_k=2000, block_m=32, block_n=64, mask=0),
]
# Windows keep whole units (the split's code lives in the full and causal kernels only), even where shift or
# shift_causal applies: a window leaving every tile pair live, and a causal-like one (no left bound, right 0).
WINDOW_SHAPES = [
    dict(batch=1, nheads=3, nheads_k=3, seqlen_q=1500, seqlen_k=1500, block_m=64, block_n=128, mask=2,
         window_left=4000, window_right=4000),
    dict(batch=1, nheads=5, nheads_k=5, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=2,
         window_left=-1, window_right=0),
]

# Causal shapes whose pairs all have the same step count (shift_causal splits only those) and an even KV tile count:
# GQA, ragged last tiles, seqlen_q > seqlen_k (leading query rows without keys), block_m = block_n (hdim 64's tiles).
CAUSAL_SHAPES = [
    dict(batch=1, nheads=5, nheads_k=5, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=1),
    dict(batch=2, nheads=6, nheads_k=3, seqlen_q=1000, seqlen_k=1000, block_m=64, block_n=128, mask=1),
    dict(batch=1, nheads=4, nheads_k=4, seqlen_q=2048, seqlen_k=1024, block_m=64, block_n=128, mask=1),
    dict(batch=2, nheads=3, nheads_k=3, seqlen_q=3072, seqlen_k=3072, block_m=128, block_n=128, mask=1),
]


def _id(s):
    return "b{batch}-h{nheads}/{nheads_k}-{seqlen_q}x{seqlen_k}-{block_m}x{block_n}-m{mask}".format(**s)


def _problem(shape, num_ctas, split=True):
    return _sched.Problem(num_ctas=num_ctas, tail_chunk_min=_sched.DEFAULT_TAIL_CHUNK_MIN if split else 0, **shape)


CASES = ([("shift", s) for s in SHAPES] + [("shift_causal", s) for s in SHAPES[:2]]
         + [("shift_causal", s) for s in CAUSAL_SHAPES])


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{_id(s)}" for n, s in CASES])
def test_every_cta_count(name, shape):
    """Coverage, accumulation orders (a permutation per dQ tile) and no deadlock in either mode, CTA counts 1..256.
    shift_causal on full-mask shapes runs shift's split (its fallback)."""
    kind = schedule.SCHEDULE_IDS[name]
    errors = _sched.verify(kind, _problem(shape, 1), 1, 256)
    assert not errors, "\n".join(errors)
    split_grids = 0
    for ctas in range(1, 257):
        p = _problem(shape, ctas)
        items = _sched.enumerate(kind, p)["items"]
        if np.any(items["first_step"] > 0):
            split_grids += 1
        assert not _sched.simulate(kind, p, deterministic=False)["deadlock"]
    assert split_grids > 0, "no grid size split the tail: the test does not exercise it"


def _rederive(kind, p, pairs):
    """Checks an enumeration's tail against the layout of tail_split.h, re-derived from the items alone: the tail's
    units laid end to end, CTA c running steps [c S, (c + 1) S); returns whether the tail was split."""
    N = _sched.num_n_blocks(p)
    units = int(p.batch) * int(p.nheads_k) * (N // 2 if pairs else N)
    waves, rem = divmod(units, p.num_ctas)
    e = _sched.enumerate(kind, p)
    it, v = e["items"], e["visits"]
    if rem == 0 or not np.any(it["first_step"] > 0):
        return False
    first_unit = units - rem
    # The tail: items of the last rem units; tail tile tau = (unit index in the tail, long before short).
    tail_item = it["unit"] >= first_unit
    tau_of_item = (it["unit"] - first_unit) * (2 if pairs else 1) + ((it["n_block"] >= N // 2) if pairs else 0)
    item_index = e["cta_item_offsets"][v["cta"]] + v["item"]
    tail = tail_item[item_index]
    tau = tau_of_item[item_index]
    # Steps per unit are equal (V): the tail's steps split evenly over its units.
    steps_per_tile = np.bincount(tau[tail])
    per_unit = steps_per_tile.reshape(-1, 2).sum(1) if pairs else steps_per_tile
    assert per_unit.size == rem and np.all(per_unit == per_unit[0])
    V = int(per_unit[0])
    chunk = max(-(-rem * V // p.num_ctas), MIN_CHUNK)
    # CTA c's k-th tail visit is tail step c * chunk + k; laid end to end, tile tau's steps are contiguous, in order.
    tail_idx = np.flatnonzero(tail)
    cta = v["cta"][tail_idx]
    k_in_cta = np.arange(tail_idx.size) - np.searchsorted(cta, cta)
    linear = cta.astype(np.int64) * chunk + k_in_cta
    assert np.array_equal(np.sort(linear), np.arange(rem * V)), "the chunks do not cover the tail's steps once"
    order = np.lexsort((v["step"][tail_idx], tau[tail_idx]))
    assert np.array_equal(linear[order], np.arange(rem * V)), "tiles are not laid end to end in tail order"
    # Wait targets: the dQ tile's visits of the whole waves, then the tail's by (position in chunk, tail tile).
    M = _sched.num_m_blocks(p)
    key = (v["batch"].astype(np.int64) * p.nheads + v["head"]) * M + v["m_block"]
    whole = np.bincount(key[~tail], minlength=int(key.max()) + 1)
    position = k_in_cta
    for k in np.unique(key[tail_idx]):
        sel = np.flatnonzero(key[tail_idx] == k)
        rank = np.lexsort((tau[tail_idx][sel], position[sel]))
        expected = np.empty(sel.size, np.int64)
        expected[rank] = whole[k] + np.arange(sel.size)
        assert np.array_equal(v["wait_target"][tail_idx][sel], expected), f"dQ tile {k}"
    return True


@pytest.mark.parametrize("name,shape", [("shift", s) for s in SHAPES] + [("shift_causal", s) for s in CAUSAL_SHAPES],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
@pytest.mark.parametrize("ctas", [7, 20, 33, 132])
def test_tail_order_rederived(name, shape, ctas):
    """Pieces tile each tail tile's steps once, chunk by chunk; a tail visit's wait target is the number of its dQ
    tile's whole-wave visits plus the tail visits of that dQ tile earlier in their chunks (ties: lower tail tile)."""
    _rederive(schedule.SCHEDULE_IDS[name], _problem(shape, ctas), pairs=(name == "shift_causal"))


def test_rederivation_exercises_both_schedules():
    """The re-derivation above is not vacuous: both schedules split on some of its grids."""
    for name, shapes in (("shift", SHAPES), ("shift_causal", CAUSAL_SHAPES)):
        kind = schedule.SCHEDULE_IDS[name]
        hits = sum(_rederive(kind, _problem(s, c), name == "shift_causal") for s in shapes for c in (7, 20, 33, 132))
        assert hits >= len(shapes), (name, hits)


@pytest.mark.parametrize("name", ["shift", "shift_causal"])
def test_windows_keep_whole_units(name):
    kind = schedule.SCHEDULE_IDS[name]
    for shape in WINDOW_SHAPES:
        for ctas in (7, 20, 33, 132):
            items = _sched.enumerate(kind, _problem(shape, ctas))["items"]
            assert not np.any(items["first_step"] > 0), (shape, ctas)
    errors = _sched.verify(kind, _problem(WINDOW_SHAPES[1], 1), 1, 64)
    assert not errors, "\n".join(errors)


def test_causal_pairs_of_unequal_steps_stay_whole():
    """shift_causal splits only where every pair has the same step count: seqlen_k > seqlen_q leaves the early KV
    tiles seen by every row, so pairs differ, and an odd KV tile count leaves middle tiles."""
    for sq, sk in ((1024, 2048), (1000, 1100)):
        shape = dict(batch=1, nheads=4, nheads_k=4, seqlen_q=sq, seqlen_k=sk, block_m=64, block_n=128, mask=1)
        for ctas in (7, 20, 33):
            items = _sched.enumerate(SHIFT_CAUSAL, _problem(shape, ctas))["items"]
            assert not np.any(items["first_step"] > 0), (sq, sk, ctas)


def test_standard_rows_split_and_model_gain():
    """The issue-5 grids: 2048 (hdim 128) and 4096 (hdim 64) KV-tile units on 132 SMs. Every CTA gets a chunk, and
    the model's makespan drops by most of the idle half (quarter) wave; 128 SMs divide the units evenly: no split."""
    for block_m, nheads, V, gain in ((64, 16, 256, 0.025), (128, 32, 128, 0.02)):
        shape = dict(batch=1, nheads=nheads, nheads_k=nheads, seqlen_q=16384, seqlen_k=16384, block_m=block_m,
                     block_n=128, mask=0)
        p = _problem(shape, 132)
        items = _sched.enumerate(SHIFT, p)["items"]
        pieces = items["first_step"] > 0
        assert pieces.any()
        assert np.all(items["first_step"] + items["num_visits"] <= V)
        for det in (True, False):
            split = _sched.simulate(SHIFT, p, deterministic=det)["makespan"]
            whole = _sched.simulate(SHIFT, _problem(shape, 132, split=False), deterministic=det)["makespan"]
            assert split <= (1 - gain) * whole, (block_m, det, split, whole)
        assert not np.any(_sched.enumerate(SHIFT, _problem(shape, 128))["items"]["first_step"] > 0)


@pytest.mark.parametrize("seqlen", [4096, 16384])
def test_standard_causal_rows_split_and_model_gain(seqlen):
    """Causal rows of issue 5: 1024 pair units at hdim 128 (7.76 waves on 132 SMs), 2048 at hdim 64 (15.5). The
    model's makespan drops by 2% or more in both modes."""
    for block_m, nheads in ((64, 16), (128, 32)):
        shape = dict(batch=16384 // seqlen, nheads=nheads, nheads_k=nheads, seqlen_q=seqlen, seqlen_k=seqlen,
                     block_m=block_m, block_n=128, mask=1)
        p = _problem(shape, 132)
        assert np.any(_sched.enumerate(SHIFT_CAUSAL, p)["items"]["first_step"] > 0)
        for det in (True, False):
            split = _sched.simulate(SHIFT_CAUSAL, p, deterministic=det)["makespan"]
            whole = _sched.simulate(SHIFT_CAUSAL, _problem(shape, 132, split=False), deterministic=det)["makespan"]
            assert split <= 0.98 * whole, (block_m, det, split, whole)


def test_greedy_model_runs_whole_units():
    """The greedy-dispatch models hand out whole units: they never see the static grid's pieces."""
    p = _problem(SHAPES[0], 33)
    for dispatch in (1, 2):
        r = _sched.simulate(SHIFT, p, dispatch=dispatch)
        assert not r["deadlock"] and r["visits_done"] == r["visits_total"]
