"""The schedule engine against the kernel's execution model, for every schedule x mask x shape x CTA count 1..256.

Proven here (the same C++ headers the kernels include, through dash_attn._sched):
  coverage     every live (Q tile, KV tile, query head) is visited exactly once, masked pairs never, every KV tile of
               every KV head is run exactly once (fully masked ones too: they still write dK = dV = 0);
  fixed order  the wait targets of each dQ tile are a permutation 0..k-1 of its k contributors, identical when
               planned again;
  no deadlock  the static persistent grid (CTA c runs its items in order, spinning on each semaphore) finishes, and
               so does the grid that claims the units in launch order where the kernels claim them (dynamic, and
               shift_causal_runs in the batched causal kernels, whose claimed units must hold the dealt items);
The bulk sweep uses the C++ checker (its live-tile table is rebuilt element by element, independently of the
schedules' range arithmetic); a smaller sweep re-derives everything here in numpy/Python.
"""
import random

import numpy as np
import pytest

import dash_attn._sched as _sched
from dash_attn import schedule, schedules_table

# dynamic: its static stand-in (the engine's checks) and, in verify, its claimed non-deterministic run.
SCHEDULE_NAMES = schedule.SCHEDULES + schedule.NONDETERMINISTIC_SCHEDULES
ALL_CTAS = (1, 256)


def _shapes(seed: int, count: int, max_len: int):
    """Random small shapes per mask plus hand-picked edge cases (1 tile, odd counts, sq != sk, GQA, windows that
    mask whole KV tiles)."""
    rng = random.Random(seed)
    out = [
        dict(mask=1, seqlen_q=1, seqlen_k=1, block_m=64, block_n=64),          # one tile, one row
        dict(mask=1, seqlen_q=5 * 32, seqlen_k=5 * 32, block_m=32, block_n=32),  # odd tile count, square
        dict(mask=1, seqlen_q=40, seqlen_k=300, block_m=16, block_n=32),        # sq << sk
        dict(mask=1, seqlen_q=300, seqlen_k=40, block_m=16, block_n=32),        # sq >> sk: top rows see nothing
        dict(mask=0, seqlen_q=7 * 16, seqlen_k=3 * 16, block_m=16, block_n=16),  # more Q tiles than KV tiles
        dict(mask=0, seqlen_q=2 * 16, seqlen_k=9 * 16, block_m=16, block_n=16),  # more KV tiles than Q tiles
        dict(mask=2, seqlen_q=200, seqlen_k=200, block_m=16, block_n=16, window_left=0, window_right=0),
        dict(mask=2, seqlen_q=64, seqlen_k=400, block_m=16, block_n=32, window_left=8, window_right=8),
        dict(mask=2, seqlen_q=150, seqlen_k=150, block_m=32, block_n=16, window_left=-1, window_right=20),
        dict(mask=2, seqlen_q=150, seqlen_k=150, block_m=32, block_n=16, window_left=20, window_right=-1),
    ]
    for mask in (0, 1, 2):
        for _ in range(count):
            bm, bn = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
            sq = rng.randint(1, max_len)
            sk = rng.choice([sq, rng.randint(1, max_len)])
            shape = dict(mask=mask, seqlen_q=sq, seqlen_k=sk, block_m=bm, block_n=bn)
            if mask == 2:
                shape.update(window_left=rng.choice([-1, 0, 3, 40, 1000]), window_right=rng.choice([-1, 0, 7, 64]))
            out.append(shape)
    for shape in out:
        hk, g = rng.choice([1, 2]), rng.choice([1, 2, 3])
        shape.update(batch=rng.choice([1, 2, 3]), nheads_k=hk, nheads=hk * g)
    return out


def _problem(shape, num_ctas=1):
    return _sched.Problem(num_ctas=num_ctas, **shape)


def _shape_id(s):
    return "m{mask}-{seqlen_q}x{seqlen_k}-{block_m}x{block_n}".format(**s)


FAST_SHAPES = _shapes(seed=3, count=4, max_len=200)
SLOW_SHAPES = _shapes(seed=11, count=25, max_len=600)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("shape", FAST_SHAPES, ids=_shape_id)
def test_every_cta_count_fast(name, shape):
    errors = _sched.verify(schedule.SCHEDULE_IDS[name], _problem(shape), *ALL_CTAS)
    assert not errors, "\n".join(errors)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("shape", SLOW_SHAPES, ids=_shape_id)
def test_every_cta_count_slow(name, shape):
    errors = _sched.verify(schedule.SCHEDULE_IDS[name], _problem(shape), *ALL_CTAS)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_many_tiles_and_heads(name):
    """Thousands of KV tiles per head and heads spanning many waves (int64 unit indices, wave boundaries)."""
    for shape in (dict(mask=1, seqlen_q=41, seqlen_k=5001, block_m=8, block_n=2),
                  dict(mask=0, seqlen_q=9, seqlen_k=2500, block_m=4, block_n=1)):
        p = _sched.Problem(batch=2, nheads=2, nheads_k=1, num_ctas=1, **shape)
        for ctas in (1, 7, 132, 256):
            errors = _sched.verify(schedule.SCHEDULE_IDS[name], p, ctas, ctas)
            assert not errors, "\n".join(errors)


# ----------------------------------------------------------------------------------------------------------------------
# Independent re-derivation in Python on a subset
# ----------------------------------------------------------------------------------------------------------------------

def _live_table(shape):
    """live[m, n] from the element-level mask rule of params.h (bottom-right aligned band)."""
    sq, sk, bm, bn = shape["seqlen_q"], shape["seqlen_k"], shape["block_m"], shape["block_n"]
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    rel = j - i - (sk - sq)
    if shape["mask"] == 0:
        visible = np.ones((sq, sk), bool)
    elif shape["mask"] == 1:
        visible = rel <= 0
    else:
        wl, wr = shape.get("window_left", -1), shape.get("window_right", -1)
        visible = np.ones((sq, sk), bool)
        if wl >= 0:
            visible &= rel >= -wl
        if wr >= 0:
            visible &= rel <= wr
    M, N = -(-sq // bm), -(-sk // bn)
    live = np.zeros((M, N), bool)
    rows, cols = np.nonzero(visible)
    live[rows // bm, cols // bn] = True
    return live


def _python_deadlock_free(pl) -> bool:
    """Static persistent grid: each CTA advances while the semaphore of its next visit equals the wait target."""
    v = pl.visits
    off = pl.cta_visit_offsets
    keys = pl.chain_keys()
    sem = {}
    pos = off[:-1].copy()
    progress = True
    while progress:
        progress = False
        for c in range(pl.num_ctas):
            while pos[c] < off[c + 1] and sem.get(keys[pos[c]], 0) == v["wait_target"][pos[c]]:
                sem[keys[pos[c]]] = sem.get(keys[pos[c]], 0) + 1
                pos[c] += 1
                progress = True
    return bool(np.all(pos == off[1:]))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_python_rederivation(name):
    mask_names = {0: "full", 1: "causal", 2: "window"}
    for shape in FAST_SHAPES[:10]:
        live = _live_table(shape)
        for ctas in (1, 2, 3, 5, 8, 13, 64, 200):
            window = (shape["window_left"], shape["window_right"]) if shape["mask"] == 2 else None
            pl = schedule.plan(name, mask_names[shape["mask"]], shape["seqlen_q"], shape["seqlen_k"],
                               shape["block_m"], shape["block_n"], shape["nheads"], shape["batch"], ctas,
                               window=window, nheads_k=shape["nheads_k"])
            v = pl.visits
            g = shape["nheads"] // shape["nheads_k"]
            # Coverage: every (batch, head, m, n) live pair exactly once, nothing else.
            counts = np.zeros((shape["batch"], shape["nheads"]) + live.shape, np.int64)
            np.add.at(counts, (v["batch"], v["head"], v["m_block"], v["n_block"]), 1)
            assert np.array_equal(counts, np.broadcast_to(live, counts.shape).astype(np.int64))
            assert np.all(v["head"] // g == v["head_k"])
            # Every KV tile of every KV head is an item exactly once.
            it = pl.items
            tiles = np.zeros((shape["batch"], shape["nheads_k"], live.shape[1]), np.int64)
            np.add.at(tiles, (it["batch"], it["head_k"], it["n_block"]), 1)
            assert np.all(tiles == 1)
            # Fixed order: wait targets of each dQ tile are 0..k-1.
            for key, order in pl.accumulation_orders().items():
                assert order.size == live[key[2]].sum()
            keys = pl.chain_keys()
            srt = np.lexsort((v["wait_target"], keys))
            k_s, w_s = keys[srt], v["wait_target"][srt]
            starts = np.r_[0, np.flatnonzero(np.diff(k_s)) + 1]
            rank = np.arange(k_s.size) - np.repeat(starts, np.diff(np.r_[starts, k_s.size]))
            assert np.array_equal(w_s, rank)
            assert _python_deadlock_free(pl)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_order_identical_when_planned_again(name):
    a = schedule.plan(name, "causal", 700, 650, 64, 128, 6, 3, 37, nheads_k=2)
    b = schedule.plan(name, "causal", 700, 650, 64, 128, 6, 3, 37, nheads_k=2)
    for k in a.visits:
        assert np.array_equal(a.visits[k], b.visits[k])


@pytest.mark.parametrize("name", ["ascending", "descending"])
def test_batch_invariant_orders(name):
    """ascending/descending accumulation orders depend on the KV index only: the same for every batch element,
    batch size and CTA count."""
    ref = {}
    for batch, ctas in ((1, 1), (3, 7), (5, 132)):
        orders = schedule.plan(name, "causal", 900, 900, 64, 128, 2, batch, ctas).accumulation_orders()
        for (_, h, m), order in orders.items():
            ref.setdefault((h, m), order)
            assert np.array_equal(ref[(h, m)], order)


def test_fallbacks_are_descending():
    """shift outside a full mask, and shift_causal with a left-bounded window, run Descending exactly."""
    for name, mask, window in (("shift", "causal", None), ("shift", "window", (30, 0)),
                               ("shift_causal", "window", (30, 5))):
        a = schedule.plan(name, mask, 500, 500, 32, 32, 2, 2, 9, window=window)
        b = schedule.plan("descending", mask, 500, 500, 32, 32, 2, 2, 9, window=window)
        for k in a.visits:
            assert np.array_equal(a.visits[k], b.visits[k])


def test_dynamic_off_causal_masks_plans_what_the_kernels_run():
    """The kernels claim units on causal masks only; elsewhere `dynamic` runs shift_causal's fallback."""
    for mask, window in (("full", None), ("window", (30, 5)), ("window", (-1, 20))):
        a = schedule.plan("dynamic", mask, 500, 500, 32, 32, 2, 2, 9, window=window)
        b = schedule.plan("shift_causal", mask, 500, 500, 32, 32, 2, 2, 9, window=window)
        for k in a.visits:
            assert np.array_equal(a.visits[k], b.visits[k])
    claimed = schedule.plan("dynamic", "causal", 500, 500, 32, 32, 2, 2, 9)
    paired = schedule.plan("shift_causal", "causal", 500, 500, 32, 32, 2, 2, 9)
    assert not np.array_equal(claimed.visits["n_block"], paired.visits["n_block"])


def test_schedule_ids_match_params_h():
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "common" / "params.h").read_text()
    ids = {m.group(1): int(m.group(2)) for m in re.finditer(r"k(\w+) = (\d+)", text.split("enum class ScheduleKind")[1]
                                                            .split("};")[0])}
    expected = {"ascending": ids["Ascending"], "descending": ids["Descending"], "spt": ids["Spt"],
                "shift": ids["Shift"], "shift_causal": ids["ShiftCausal"], "dynamic": ids["Dynamic"],
                "shift_runs": ids["ShiftRuns"], "shift_causal_runs": ids["ShiftCausalRuns"],
                "descending_lanes": ids["DescendingLanes"]}
    assert schedule.SCHEDULE_IDS == expected
    # The registry (sched_module.cpp's table) has every enumerator but kAuto and the resolved-only kSeqCausalRuns (what
    # shift_causal_runs runs on packed causal sequences), named in snake case: a schedule added to params.h and not
    # to the table fails here.
    snake = {re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower(): kind for name, kind in ids.items()
             if name not in ("Auto", "SeqCausalRuns")}
    assert schedules_table.SCHEDULE_IDS == snake
    assert ids["Auto"] == _sched.AUTO and "auto" not in schedules_table.SCHEDULE_IDS
    assert ids["SeqCausalRuns"] == _sched.SEQ_CAUSAL_RUNS
    assert set(schedules_table.SHORT_NAMES) == set(schedules_table.SCHEDULES)
    assert schedule.SCHEDULES == ("ascending", "descending", "spt", "shift", "shift_causal", "shift_runs",
                                  "shift_causal_runs", "descending_lanes")
    assert schedule.NONDETERMINISTIC_SCHEDULES == ("dynamic",)


@pytest.mark.parametrize("name,mask", [("shift", "full"), ("shift_causal", "causal")])
def test_wave_orders_do_not_depend_on_batch_size(name, mask):
    """shift/shift_causal launch head-major, so a (batch, head)'s order does not change when more sequences follow
    it in the batch (it may differ between batch positions when heads straddle wave boundaries). Not where the last
    wave is split (tail_split.h): which units form the tail depends on the batch size. 15 KV tiles of 15 Q visits:
    shift's units are too short to cut (V <= 16), and shift_causal never splits."""
    small = schedule.plan(name, mask, 960, 960, 64, 64, 3, 1, 20)
    large = schedule.plan(name, mask, 960, 960, 64, 64, 3, 4, 20)
    assert not np.any(small.items["first_step"] > 0) and not np.any(large.items["first_step"] > 0)
    large_orders = large.accumulation_orders()
    for key, order in small.accumulation_orders().items():
        assert np.array_equal(large_orders[key], order)


def test_shift_runs_runs_descending_where_its_adds_would_wait():
    """ShiftRuns::waits_free (k (N - 1) <= M): where shift_runs resolves to itself its adds never wait in the engine
    (one head, every tile at once); elsewhere (seqlen_q well below seqlen_k) it runs Descending exactly."""
    rng = random.Random(3)
    fell_back = 0
    for _ in range(200):
        block_m, block_n = rng.choice([(64, 128), (128, 128), (64, 64)])
        seqlen_q, seqlen_k = rng.randint(1, 3000), rng.randint(1, 3000)
        problem = _sched.Problem(batch=1, nheads=1, nheads_k=1, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                 block_m=block_m, block_n=block_n, mask=_sched.MASK_FULL, num_ctas=256)
        plan = schedule.plan("shift_runs", "full", seqlen_q, seqlen_k, block_m, block_n, 1, 1, 256)
        if _sched.resolve(_sched.SHIFT_RUNS, problem) == _sched.SHIFT_RUNS:
            assert float(sum(schedule.simulate(plan, record=False).cta_wait)) == 0, (seqlen_q, seqlen_k)
        else:
            fell_back += 1
            want = schedule.plan("descending", "full", seqlen_q, seqlen_k, block_m, block_n, 1, 1, 256)
            assert all(np.array_equal(plan.visits[k], want.visits[k]) for k in plan.visits)
    assert fell_back > 20
    # 64 x 128 tiles (k = 2), 8192 keys (N = 64): M = 126 queries tiles still shift_runs, 125 not.
    for seqlen_q, kind in ((126 * 64, _sched.SHIFT_RUNS), (125 * 64, _sched.DESCENDING), (512, _sched.DESCENDING)):
        problem = _sched.Problem(batch=1, nheads=1, nheads_k=1, seqlen_q=seqlen_q, seqlen_k=8192, block_m=64,
                                 block_n=128, mask=_sched.MASK_FULL)
        assert _sched.resolve(_sched.SHIFT_RUNS, problem) == kind
