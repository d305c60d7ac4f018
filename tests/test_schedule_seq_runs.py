"""shift_causal_runs on packed causal sequences (csrc/schedule/seq_runs.h), on the engine the kernels compile.

Each sequence of a pack is scheduled on its own geometry: its items, walks and accumulation positions must be exactly
those of the sequence alone, whatever it is packed with, in any order, on every CTA count 1..256, and the packed
grid must be deadlock-free (dash_attn._sched.verify_packed checks all of it against the sequence's own plan).
"""
import random

import pytest

from dash_attn import _sched
from captured_varlen_cases import BOUND, INVALID, NHEADS, NHEADS_K, TOTAL, kernel_lengths

CTA_RANGE = (1, 256)
# (block_m, block_n) of the backward kernels of hdim 64, 128 and 256.
TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
PACKS = [  # (lens_q, lens_k): ragged, odd tile counts, single tiles, empty sequences, seqlen_q != seqlen_k
    ([333, 1500, 64, 777, 333], [333, 1500, 64, 777, 333]),
    ([1, 129, 0, 700, 5], [1, 129, 5, 700, 0]),
    ([500, 830, 64], [830, 500, 300]),
    ([0, 0], [0, 0]),
]


def _pack(lens_q, lens_k, hdim, nheads, nheads_k, short_k=0):
    bm, bn = TILES[hdim]
    return _sched.PackedProblem(_sched.Problem(1, nheads, nheads_k, 1, 1, bm, bn, _sched.MASK_CAUSAL), lens_q, lens_k,
                                short_k)


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("heads", [(2, 2), (4, 1), (8, 2)], ids=lambda h: f"h{h[0]}:{h[1]}")
@pytest.mark.parametrize("pack", PACKS, ids=lambda p: "+".join(f"{q}x{k}" for q, k in zip(*p)))
def test_each_sequence_runs_as_alone(pack, heads, hdim):
    assert _sched.verify_packed(_pack(*pack, hdim, *heads), *CTA_RANGE) == []


@pytest.mark.parametrize("hdim", sorted(TILES))
def test_random_packs_in_any_order(hdim):
    rng = random.Random(hdim)
    for _ in range(6):
        n = rng.randint(1, 12)
        lens_q = [rng.choice([0, 1, rng.randint(1, 2000)]) for _ in range(n)]
        lens_k = [q if rng.random() < 0.7 else rng.randint(0, 2000) for q in lens_q]
        order = list(range(n))
        rng.shuffle(order)
        for lq, lk in ((lens_q, lens_k), ([lens_q[i] for i in order], [lens_k[i] for i in order])):
            assert _sched.verify_packed(_pack(lq, lk, hdim, 4, 2), 1, 140) == [], (lq, lk)


def test_every_sequence_takes_the_kind_it_takes_alone():
    """A sequence's own geometry picks its schedule: paired causal runs, shift_runs where every tile pair is live (one
    KV tile), descending (no units to order) without Q rows."""
    kinds = _pack([700, 100, 0], [700, 100, 300], 128, 2, 2).kinds
    assert kinds == [_sched.SHIFT_CAUSAL_RUNS, _sched.SHIFT_RUNS, _sched.DESCENDING]


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("pack", PACKS, ids=lambda p: "+".join(f"{q}x{k}" for q, k in zip(*p)))
@pytest.mark.parametrize("short_k", [0, 1000])
def test_full_mask_sequences_run_as_alone(short_k, pack, hdim):
    """Full masks: shift_runs on every sequence, descending where its adds would wait (ShiftRuns::waits_free: here
    500 x 830) and, with short_k (deterministic `auto`), on sequences of up to short_k keys, whatever their queries;
    each sequence exactly as alone, deadlock-free dealt and claimed, on every CTA count."""
    bm, bn = TILES[hdim]
    packed = _sched.PackedProblem(_sched.Problem(1, 8, 2, 1, 1, bm, bn, _sched.MASK_FULL), *pack, short_k)
    lens_q, lens_k = pack
    for kind, q, k in zip(packed.kinds, lens_q, lens_k):
        alone = _sched.Problem(1, 8, 2, q, k, bm, bn, _sched.MASK_FULL)
        if 0 < k <= short_k:
            assert kind == _sched.DESCENDING, (q, k)
        elif q > 0 and k > 0:
            assert kind == _sched.resolve(_sched.SHIFT_RUNS, alone) in (_sched.SHIFT_RUNS, _sched.DESCENDING)
    assert _sched.verify_packed(packed, *CTA_RANGE) == []


def test_short_full_mask_sequences_take_the_dense_orders_of_descending_lanes():
    """Full masks: a sequence of up to short_k keys gets the visits of its dense call under descending_lanes,
    deterministic `auto`'s dense pick there, at every seqlen_q."""
    lens_q, lens_k = [333, 1500, 64, 777, 200], [333, 1500, 900, 700, 3000]
    bm, bn = TILES[128]
    pack = _sched.PackedProblem(_sched.Problem(1, 4, 2, 1, 1, bm, bn, _sched.MASK_FULL), lens_q, lens_k, 1000)
    packed = _sched.enumerate_packed(_sched.SHIFT_RUNS, pack, 132)["visits"]
    checked = 0
    for b, (q, k) in enumerate(zip(lens_q, lens_k)):
        if k <= 1000:
            _assert_descending_lanes_visits(packed, b, q, k, _sched.MASK_FULL)
            checked += 1
    assert checked == 3


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)], ids=lambda h: f"h{h[0]}:{h[1]}")
@pytest.mark.parametrize("short_k", [700, 1500, 2**31 - 1])
def test_short_sequences_run_descending(short_k, heads, hdim):
    """With short_k (deterministic `auto`), sequences of up to short_k keys run descending's orders beside the others'
    runs: still each exactly as alone, deadlock-free dealt and claimed, on every CTA count."""
    pack = PACKS[0]
    packed = _pack(*pack, hdim, *heads, short_k)
    assert _sched.verify_packed(packed, *CTA_RANGE) == []
    alone = [_pack([q], [k], hdim, *heads).kinds[0] for q, k in zip(*pack)]
    assert packed.kinds == [_sched.DESCENDING if k <= short_k else kind for k, kind in zip(pack[1], alone)]


def test_short_sequences_take_the_dense_orders_of_descending_lanes():
    """A sequence of up to short_k keys gets the visits (head, Q tile, KV tile, accumulation position) of its dense
    call under descending_lanes, deterministic `auto`'s dense pick there."""
    lens = [333, 1500, 64, 777]
    packed = _sched.enumerate_packed(_sched.SHIFT_CAUSAL_RUNS, _pack(lens, lens, 128, 4, 2, 1000), 132)["visits"]
    for b, n in enumerate(lens):
        if n <= 1000:
            _assert_descending_lanes_visits(packed, b, n, n)


def test_long_packs_launch_in_pack_order():
    """Past kSortedSeqsMax sequences the table keeps the pack order (the device sorts in one CTA): still exact."""
    lens = [64 * (1 + i % 5) for i in range(1100)]
    assert _sched.verify_packed(_pack(lens, lens, 128, 2, 1), 132, 133) == []


def test_the_table_requires_a_causal_or_full_mask():
    with pytest.raises(ValueError, match="causal or full"):
        _sched.PackedProblem(_sched.Problem(1, 2, 2, 1, 1, 64, 128, _sched.MASK_WINDOW, 16, 0), [100], [100])
    with pytest.raises(ValueError, match="one length per sequence"):
        _sched.PackedProblem(_sched.Problem(1, 2, 2, 1, 1, 64, 128, _sched.MASK_CAUSAL), [100], [100, 3])


def test_claimed_units_start_in_launch_order():
    """The kernels claim the units in launch order (seq_runs.h): on a pack with one long sequence the model's static
    deal starts units before those they add after, which then wait; claimed, the makespan nears the arrival-order
    one."""
    pack = _pack([1548, 5725, 3153, 4894, 131, 933], [1548, 5725, 3153, 4894, 131, 933], 64, 32, 32)
    static = _sched.simulate_packed(_sched.SHIFT_CAUSAL_RUNS, pack, 132)
    claimed = _sched.simulate_packed(_sched.SHIFT_CAUSAL_RUNS, pack, 132, dispatch=1)
    arrival = _sched.simulate_packed(_sched.SHIFT_CAUSAL_RUNS, pack, 132, deterministic=False)
    assert not claimed["deadlock"] and claimed["makespan"] < 0.8 * static["makespan"]
    assert claimed["makespan"] < 1.02 * arrival["makespan"]


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("short_k", [0, 700])
def test_mostly_full_bands_run_descending(short_k, hdim):
    """With short_k (deterministic `auto`) a mostly full causal sequence (mostly_full_band: more than 13/16 of its KV
    tiles fully live where Q tiles are at most half as tall as KV tiles, else more than 3/4) runs descending's orders
    whatever its key count, as its dense call under `auto` does; the named shift_causal_runs (short_k 0) keeps its
    runs. Each exactly as alone, deadlock-free, on every CTA count."""
    bm, bn = TILES[hdim]
    sixteenths = 13 if 2 * bm <= bn else 12
    # 512 x 2048: exactly 3/4 of the KV tiles fully live at every tile width, which is not mostly full; 384 x 2048:
    # 13/16 at 128-key tiles and 26/32 at 64-key ones, mostly full only where the bound is 3/4.
    lens_q, lens_k = [150, 600, 40, 1000, 2000, 512, 384], [1500, 5000, 3000, 1000, 2600, 2048, 2048]
    packed = _pack(lens_q, lens_k, hdim, 4, 2, short_k)
    assert _sched.verify_packed(packed, *CTA_RANGE) == []
    for kind, q, k in zip(packed.kinds, lens_q, lens_k):
        alone = _sched.Problem(1, 4, 2, q, k, bm, bn, _sched.MASK_CAUSAL)
        mostly_full = _sched.mostly_full_band(alone)
        assert mostly_full == (16 * ((k - q + 1) // bn) > sixteenths * -(-k // bn)), (q, k)
        if short_k and (mostly_full or k <= short_k):
            assert kind == _sched.DESCENDING, (q, k)
        else:
            assert kind == _sched.resolve(_sched.SHIFT_CAUSAL_RUNS, alone), (q, k)
    assert any(_sched.mostly_full_band(_sched.Problem(1, 4, 2, q, k, bm, bn, _sched.MASK_CAUSAL)) and k > 700
               for q, k in zip(lens_q, lens_k))
    assert not _sched.mostly_full_band(_sched.Problem(1, 4, 2, 512, 2048, bm, bn, _sched.MASK_CAUSAL))
    assert _sched.mostly_full_band(_sched.Problem(1, 4, 2, 384, 2048, bm, bn, _sched.MASK_CAUSAL)) == (hdim != 128)


def test_mostly_full_bands_take_the_dense_orders_of_descending_lanes():
    """A mostly full causal sequence in a pack under `auto` gets the visits of its dense call, descending_lanes
    (unpaired there)."""
    lens_q, lens_k = [150, 333, 600], [1500, 333, 5000]
    bm, bn = TILES[128]
    packed = _sched.enumerate_packed(_sched.SHIFT_CAUSAL_RUNS, _pack(lens_q, lens_k, 128, 4, 2, 300), 132)["visits"]
    for b, (q, k) in enumerate(zip(lens_q, lens_k)):
        if _sched.mostly_full_band(_sched.Problem(1, 4, 2, q, k, bm, bn, _sched.MASK_CAUSAL)):
            _assert_descending_lanes_visits(packed, b, q, k)


def _assert_descending_lanes_visits(packed, b, seqlen_q, seqlen_k, mask=_sched.MASK_CAUSAL):
    """Sequence b's packed visits (head, Q tile, KV tile, accumulation position) equal its dense call's under
    descending_lanes (hdim 128 tiles, 4 query heads on 2 KV heads, 132 CTAs)."""
    bm, bn = TILES[128]
    problem = _sched.Problem(1, 4, 2, seqlen_q, seqlen_k, bm, bn, mask, num_ctas=132)
    dense = _sched.enumerate(_sched.DESCENDING_LANES, problem)["visits"]
    keys = ("head", "m_block", "n_block", "run", "wait_target")
    mine = sorted(tuple(int(packed[c][i]) for c in keys)
                  for i in range(len(packed["batch"])) if packed["batch"][i] == b)
    theirs = sorted(tuple(int(dense[c][i]) for c in keys) for i in range(len(dense["batch"])))
    assert mine == theirs, (seqlen_q, seqlen_k)


@pytest.mark.parametrize("mask", [_sched.MASK_CAUSAL, _sched.MASK_FULL], ids=["causal", "full"])
@pytest.mark.parametrize("cu_seqlens", INVALID.values(), ids=INVALID.keys())
def test_invalid_cu_seqlens_stay_inside_the_launch(cu_seqlens, mask):
    """The invalid cu_seqlens of the captured varlen GPU test, as its kernels read them (clamped to the packed rows):
    a device table may then hold lengths past the call's max_seqlen (the results become NaN). Held to the bounds,
    every visit stays inside the launch's Q and KV tiles, whose workspace holds num_m_blocks(bound) Q tiles per head:
    one past them would be another head's tile, where two dQ chains would share a semaphore. Each sequence still
    runs as alone on its held lengths, deadlock-free, on every CTA count."""
    bm, bn = TILES[128]
    problem = _sched.Problem(1, NHEADS, NHEADS_K, 1, 1, bm, bn, mask)
    lens = kernel_lengths(cu_seqlens, TOTAL)
    pack = _sched.PackedProblem(problem, lens, lens, 0, BOUND, BOUND)
    assert _sched.verify_packed(pack, *CTA_RANGE) == []
    held_lens = [min(n, BOUND) for n in lens]
    held = _sched.PackedProblem(problem, held_lens, held_lens, 0, BOUND, BOUND)
    assert pack.units == held.units and pack.kinds == held.kinds


def test_the_invalid_cases_reach_past_the_bound():
    # what the test above is for: without the bounds two of them would schedule tiles past the launch
    assert sum(max(kernel_lengths(cu, TOTAL)) > BOUND for cu in INVALID.values()) == 2


def test_bounds_below_one_are_refused():
    with pytest.raises(ValueError, match="bounds"):
        _sched.PackedProblem(_sched.Problem(1, 2, 2, 1, 1, 64, 128, _sched.MASK_CAUSAL), [5], [5], 0, 0, 5)
