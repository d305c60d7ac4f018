"""Shift's split tail (csrc/schedule/tail_split.h): the last, partial wave cut into chunks that every CTA runs.

CPU only: the schedule engine's own C++ (dash_attn._sched), checked against the execution model for every CTA count
and against a re-derivation of the tail's accumulation order in numpy.
"""
import numpy as np
import pytest

from dash_attn import schedule

_sched = pytest.importorskip("dash_attn._sched")

SHIFT = schedule.SCHEDULE_IDS["shift"]
MIN_CHUNK = _sched.DEFAULT_TAIL_CHUNK_MIN

# Shapes whose tail splits on many grid sizes: several Q tiles per KV tile (V = g * M > MIN_CHUNK), GQA, ragged tiles,
# seqlen_q != seqlen_k and several batch entries.
SHAPES = [
    dict(batch=1, nheads=5, nheads_k=5, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=0),
    dict(batch=2, nheads=6, nheads_k=3, seqlen_q=1000, seqlen_k=777, block_m=64, block_n=128, mask=0),
    dict(batch=3, nheads=1, nheads_k=1, seqlen_q=1023, seqlen_k=113, block_m=16, block_n=32, mask=0),
    dict(batch=1, nheads=4, nheads_k=1, seqlen_q=640, seqlen_k=2000, block_m=32, block_n=64, mask=0),
]
# Shapes that keep whole units: a window leaving every tile pair live (shift applies, but the split's code lives in
# the full-mask kernels only) and causal (shift_causal: its split measured slower on the H200).
WHOLE_SHAPES = [
    dict(batch=1, nheads=3, nheads_k=3, seqlen_q=1500, seqlen_k=1500, block_m=64, block_n=128, mask=2,
         window_left=4000, window_right=4000),
    dict(batch=1, nheads=5, nheads_k=5, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=1),
]


def _id(s):
    return "b{batch}-h{nheads}/{nheads_k}-{seqlen_q}x{seqlen_k}-{block_m}x{block_n}-m{mask}".format(**s)


def _problem(shape, num_ctas, split=True):
    return _sched.Problem(num_ctas=num_ctas, tail_chunk_min=_sched.DEFAULT_TAIL_CHUNK_MIN if split else 0, **shape)


@pytest.mark.parametrize("name", ["shift", "shift_causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_id)
def test_every_cta_count(name, shape):
    """Coverage, accumulation orders (a permutation per dQ tile) and no deadlock in either mode, CTA counts 1..256."""
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


def _tail_layout(p, V):
    units = int(p.batch) * int(p.nheads_k) * _sched.num_n_blocks(p)
    waves, rem = divmod(units, p.num_ctas)
    chunk = max(-(-rem * V // p.num_ctas), MIN_CHUNK)
    return waves, rem, chunk, units - rem


@pytest.mark.parametrize("shape", SHAPES, ids=_id)
@pytest.mark.parametrize("ctas", [7, 20, 33, 132])
def test_tail_order_rederived(shape, ctas):
    """Pieces tile each tail unit's steps once; a tail visit's wait target is the number of the head's whole-wave
    tiles plus the tail visits of its dQ tile that sit earlier in their chunks (ties: lower tail unit)."""
    p = _problem(shape, ctas)
    M, N = _sched.num_m_blocks(p), _sched.num_n_blocks(p)
    g = p.nheads // p.nheads_k
    V = g * M
    waves, rem, chunk, first_unit = _tail_layout(p, V)
    e = _sched.enumerate(SHIFT, p)
    it, v = e["items"], e["visits"]
    if rem == 0 or chunk >= V:
        assert np.all(it["first_step"] == 0)
        return
    # Items past the whole waves are the tail's pieces: CTA c runs steps [c * chunk, (c + 1) * chunk) of the tail.
    head_index = v["batch"].astype(np.int64) * p.nheads_k + v["head_k"]
    unit = head_index * N + v["n_block"]
    tail = unit >= first_unit
    i = (unit - first_unit)[tail]
    linear = i * V + v["step"][tail]
    assert np.array_equal(linear // chunk, v["cta"][tail]), "a tail step ran outside its CTA's chunk"
    assert np.unique(linear).size == linear.size == rem * V
    position = linear % chunk
    # Re-derive the targets of every tail visit from its dQ tile's contributors.
    key = (v["batch"].astype(np.int64) * p.nheads + v["head"]) * M + v["m_block"]
    tail_idx = np.flatnonzero(tail)
    whole = np.bincount(key[~tail], minlength=int(key.max()) + 1)
    for k in np.unique(key[tail]):
        sel = tail_idx[key[tail_idx] == k]
        pos = position[np.searchsorted(tail_idx, sel)]
        order = np.lexsort((unit[sel], pos))
        expected = np.empty(sel.size, np.int64)
        expected[order] = whole[k] + np.arange(sel.size)
        assert np.array_equal(v["wait_target"][sel], expected), f"dQ tile {k}"


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


@pytest.mark.parametrize("name", ["shift", "shift_causal"])
def test_windows_and_causal_keep_whole_units(name):
    kind = schedule.SCHEDULE_IDS[name]
    for shape in WHOLE_SHAPES:
        for ctas in (7, 20, 33, 132):
            items = _sched.enumerate(kind, _problem(shape, ctas))["items"]
            assert not np.any(items["first_step"] > 0), (shape, ctas)


def test_greedy_model_runs_whole_units():
    """The greedy-dispatch models hand out whole units: they never see the static grid's pieces."""
    p = _problem(SHAPES[0], 33)
    for dispatch in (1, 2):
        r = _sched.simulate(SHIFT, p, dispatch=dispatch)
        assert not r["deadlock"] and r["visits_done"] == r["visits_total"]
