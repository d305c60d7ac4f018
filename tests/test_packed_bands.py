"""Varlen calls whose sequences' causal or window bands differ (seqused_q/k with diagonals seqused_k - seqused_q that
differ, FlashAttention-3's rule: each sequence bottom-right aligned on its own rows in use), on the CPU.

The packed kernels' backward schedules a call as a batch of its bounds' lengths (dash_attn/_seq_bands.py): its bounds
must put every sequence's band inside the schedule's band, or the call is split into launches of groups that one band
holds. Checked here: the rule itself element by element; the schedule engine (dash_attn._sched, the kernels' own
headers) on the planned bounds: coverage of every sequence's live tiles for every schedule, each sequence's
deterministic orders those of the sequence alone (invariance), no deadlock; and the whole CUDA branch of the varlen ops
on CPU tensors against the reference, with a stand-in extension whose backward computes exactly the tile pairs the
schedule engine says the kernel visits (masked per sequence, as the kernel masks them).
"""
import itertools
import math
import random

import pytest
import torch

from dash_attn import _sched, _seq_bands, interface
from dash_attn import schedule as S
from dash_attn.reference import attention_bwd_ref_varlen, attention_ref_varlen, visibility_mask
from dash_attn.schedules_table import (DETERMINISTIC_SCHEDULES, NONDETERMINISTIC_SCHEDULES, runs_per_sequence,
                                      varlen_invariant_schedule)

from api_common import cu, patch_interface

MASK_NAMES = {0: "full", 1: "causal", 2: "window"}
# (mask, window) of the cases: causal, one-sided windows, two-sided windows (narrow enough to need several launches).
BANDS = [(1, (-1, 0)), (2, (3, -1)), (2, (-1, 2)), (2, (4, 1)), (2, (0, 0)), (2, (6, 9))]


def _window(mask, window):
    return (-1, 0) if mask == 1 else window


def _live_elements_inside(lq, lk, mask, window, max_q, max_k):
    """Whether every element of the sequence's band lies in the band of the bounds' diagonal."""
    left, right = _window(mask, window)
    if lq == 0 or lk == 0:
        return True
    own = visibility_mask(lq, lk, left, right)
    rows, cols = torch.nonzero(own, as_tuple=True)
    offsets = cols - rows - (max_k - max_q)
    return bool(((left < 0) | (offsets >= -left)).all() and ((right < 0) | (offsets <= right)).all())


def _random_lengths(rng, batch, longest=40):
    lens_q = [rng.choice([0, 1, rng.randint(1, longest)]) for _ in range(batch)]
    lens_k = [rng.choice([0, 1, lq, rng.randint(1, longest)]) for lq in lens_q]
    return lens_q, lens_k


@pytest.mark.parametrize("mask, window", BANDS)
def test_planned_bounds_hold_every_band(mask, window):
    """Every sequence of every launch: its band inside the launch's; each sequence with elements in one launch."""
    rng = random.Random(mask * 100 + window[0] * 10 + window[1])
    for _ in range(300):
        lens_q, lens_k = _random_lengths(rng, rng.randint(1, 7))
        launches = _seq_bands.bwd_launches(lens_q, lens_k, mask, *window)
        seen = []
        for launch in launches:
            members = range(len(lens_q)) if launch.members is None else launch.members
            assert launch.max_q >= max(lens_q[b] for b in members) and launch.max_k >= max(lens_k[b] for b in members)
            for b in members:
                assert _live_elements_inside(lens_q[b], lens_k[b], mask, window, launch.max_q, launch.max_k)
            seen += list(members)
        with_elements = [b for b in range(len(lens_q)) if lens_q[b] and lens_k[b]]
        assert sorted(seen) == sorted(set(seen)) and set(with_elements) <= set(seen)
        if len(launches) > 1:
            assert mask == 2 and min(window) >= 0  # one band always holds one-sided bands


def test_bounds_move_the_diagonal_by_the_least():
    # Causal: diagonals 100 and 0 (longest lengths 700 / 700): max_k grows to 828 for the diagonal 128 of (129, 257).
    assert _seq_bands.bwd_launches([100, 700, 129], [200, 700, 257], 1, -1, 0) == [(None, 700, 828)]
    # A left bound: the diagonal moves left by raising max_q.
    assert _seq_bands.bwd_launches([10, 20], [5, 20], 2, 2, -1) == [(None, 25, 20)]
    # Bands inside the longest ones' and full masks keep the longest lengths.
    assert _seq_bands.bwd_launches([3, 6], [3, 6], 1, -1, 0) == [(None, 6, 6)]
    assert _seq_bands.bwd_launches([3, 9], [8, 6], 0, -1, -1) == [(None, 9, 8)]
    # The sequence's own last key ends its band before the right bound does: its elements reach j - i = 39, not
    # its diagonal 36 + 10, so the diagonal moves to 29 only; with a right bound of 45 it need not move at all.
    assert _seq_bands.bwd_launches([4, 50], [40, 50], 2, -1, 10) == [(None, 50, 79)]
    assert _seq_bands.bwd_launches([4, 50], [40, 50], 2, -1, 45) == [(None, 50, 50)]


def test_two_sided_windows_of_different_diagonals_split_into_groups():
    lens_q, lens_k = [30, 30, 30, 30, 0], [30, 40, 30, 40, 9]
    launches = _seq_bands.bwd_launches(lens_q, lens_k, 2, 2, 2)
    assert [launch.members for launch in launches] == [[0, 2], [1, 3]]
    assert [launch[1:] for launch in launches] == [(30, 30), (30, 40)]
    assert _seq_bands.bands_inside(lens_q, lens_k, 2, 2, 2) is False


# ----------------------------------------------------------------------------------------------------------------------
# The schedule engine on the planned bounds
# ----------------------------------------------------------------------------------------------------------------------

PACKS = [  # (lens_q, lens_k): rows in use
    ((100, 1, 0, 130, 64, 129), (200, 64, 9, 130, 65, 257)),
    ((37, 5, 90, 90), (37, 80, 20, 90)),
    ((64, 64, 17), (128, 8, 17)),
]
TILES = ((64, 128), (128, 128), (64, 64), (16, 32))


def _tile_pairs(plan, batch=None):
    """(batch, head, m_block, n_block) of every visit (of one batch entry)."""
    v = plan.visits
    return [tuple(int(x) for x in t) for t in zip(v["batch"], v["head"], v["m_block"], v["n_block"])
            if batch is None or t[0] == batch]


def _orders(plan, batch, keep):
    """Sequence `batch`'s dQ orders ((head, m) -> KV tiles in order) and walks ((head_k, n) -> (head, m) in order),
    restricted to the (head, m, n) in `keep`."""
    v = plan.visits
    dq, walks = {}, {}
    for key, blocks in plan.accumulation_orders().items():
        if key[0] == batch:
            got = tuple(int(n) for n in blocks if (key[1], key[2], int(n)) in keep)
            if got:
                dq[key[1:]] = got
    for b, hk, n, h, m in zip(v["batch"], v["head_k"], v["n_block"], v["head"], v["m_block"]):
        if b == batch and (int(h), int(m), int(n)) in keep:
            walks.setdefault((int(hk), int(n)), []).append((int(h), int(m)))
    return dq, {key: tuple(w) for key, w in walks.items()}


def _varlen_picks(mask_name):
    """The schedule deterministic `auto` runs a varlen call of this mask with."""
    return {varlen_invariant_schedule(mask_name)}


def _packed(mask_name, lens_q, lens_k, block_m, block_n, nheads, nheads_k, short_k=0):
    """The pack as the kernels see it where they schedule every sequence on its own geometry."""
    p = _sched.Problem(1, nheads, nheads_k, 1, 1, block_m, block_n, S.MASKS[mask_name])
    return _sched.PackedProblem(p, list(lens_q), list(lens_k), short_k)


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("mask, window", BANDS)
def test_planned_launches_cover_every_sequence_and_keep_its_deterministic_orders(mask, window, tiles):
    """For every schedule: each sequence's live tile pairs (those of the sequence alone) visited exactly once per
    query head. For the deterministic varlen pick: its orders restricted to them equal those of the sequence alone."""
    bm, bn = tiles
    nheads, nheads_k = 4, 2
    mask_name, win = MASK_NAMES[mask], (window if mask == 2 else None)
    picks = _varlen_picks(mask_name)
    for (lens_q, lens_k), by_length in itertools.product(PACKS, (False, True)):
        for name in DETERMINISTIC_SCHEDULES:
            if runs_per_sequence(mask_name, name):  # one launch; each sequence's orders those of it alone
                pack = _packed(mask_name, lens_q, lens_k, bm, bn, nheads, nheads_k)
                assert _sched.verify_packed(pack, 1, 140) == [], (name, lens_q, lens_k)
        for launch in _seq_bands.bwd_launches(lens_q, lens_k, mask, *window, by_length=by_length):
            members = range(len(lens_q)) if launch.members is None else launch.members
            for name in DETERMINISTIC_SCHEDULES + NONDETERMINISTIC_SCHEDULES:
                if runs_per_sequence(mask_name, name):
                    continue
                ctas = 132 if name in picks else 7
                plan = S.plan(name, mask_name, launch.max_q, launch.max_k, bm, bn, nheads, len(lens_q), ctas,
                              window=win, nheads_k=nheads_k)
                visited = _tile_pairs(plan)
                for b in members:
                    if lens_q[b] == 0 or lens_k[b] == 0:
                        continue
                    alone = S.plan(name if name in picks else "descending", mask_name, lens_q[b], lens_k[b], bm, bn,
                                   nheads, 1, 1, window=win, nheads_k=nheads_k)
                    live = {t[1:] for t in _tile_pairs(alone)}
                    mine = [t[1:] for t in visited if t[0] == b and t[1:] in live]
                    assert sorted(mine) == sorted(live), (name, lens_q[b], lens_k[b], launch)
                    if name in picks:
                        assert _orders(plan, b, live) == _orders(alone, 0, live), (name, b, launch)


@pytest.mark.parametrize("mask, window", BANDS)
def test_planned_bounds_are_deadlock_free(mask, window):
    mask_name, win = MASK_NAMES[mask], (window if mask == 2 else None)
    for lens_q, lens_k in PACKS:
        for launch in _seq_bands.bwd_launches(lens_q, lens_k, mask, *window):
            p = S._problem(mask_name, launch.max_q, launch.max_k, 64, 128, 4, len(lens_q), 1, win, 2)
            for name in DETERMINISTIC_SCHEDULES:
                assert _sched.verify(S.SCHEDULE_IDS[name], p, 1, 160) == [], (name, launch)


# ----------------------------------------------------------------------------------------------------------------------
# The CUDA branch of the varlen ops, on CPU tensors, with a stand-in for the packed backward
# ----------------------------------------------------------------------------------------------------------------------

class PackedBwdStandIn:
    """ext.varlen_bwd as the packed kernels compute it: the schedule engine's visits of the launch's problem (tiles
    block_m x block_n) decide which (Q tile, KV tile, head) pairs contribute, each element masked by its sequence's
    own band and lengths; every row in use of each sequence is written (zeros where nothing contributes), nothing
    else. Float64 math."""

    def __init__(self, block_m, block_n, num_ctas=7):
        self.block_m, self.block_n, self.num_ctas = block_m, block_n, num_ctas
        self.launches = []

    def __call__(self, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, mask,
                 window_left, window_right, softcap, deterministic, schedule_id, short_k, sm_margin, *sink_args):
        assert softcap == 0.0
        self.launches.append((None if used_q is None else used_q.tolist(),
                              None if used_k is None else used_k.tolist(), max_q, max_k))
        name = next(n for n, i in S.SCHEDULE_IDS.items() if i == schedule_id)
        nheads, nheads_k = q.shape[1], k.shape[1]
        batch = cu_q.shape[0] - 1
        window = (window_left, window_right) if mask == 2 else None
        lens = [(min(int(cu_q[b + 1] - cu_q[b]), math.inf if used_q is None else int(used_q[b])),
                 min(int(cu_k[b + 1] - cu_k[b]), math.inf if used_k is None else int(used_k[b]))) for b in range(batch)]
        if runs_per_sequence(MASK_NAMES[mask], name):
            pack = _packed(MASK_NAMES[mask], [n[0] for n in lens], [n[1] for n in lens], self.block_m, self.block_n,
                           nheads, nheads_k, short_k)
            e = _sched.enumerate_packed(schedule_id, pack, self.num_ctas)["visits"]
            visited = {tuple(int(x) for x in t) for t in zip(e["batch"], e["head"], e["m_block"], e["n_block"])}
        else:
            plan = S.plan(name, MASK_NAMES[mask], max_q, max_k, self.block_m, self.block_n, nheads, batch,
                          self.num_ctas, window=window, nheads_k=nheads_k)
            visited = set(_tile_pairs(plan))
        left, right = window_left, window_right  # the ops pass causal as (-1, 0), full masks as (-1, -1)
        g = nheads // nheads_k
        for b in range(batch):
            fq, fk = int(cu_q[b]), int(cu_k[b])
            lq, lk = lens[b]
            rows_q, rows_k = slice(fq, fq + lq), slice(fk, fk + lk)
            dk[rows_k] = 0
            dv[rows_k] = 0
            dq[rows_q] = 0
            if lq == 0 or lk == 0:
                continue
            seen = visibility_mask(lq, lk, left, right)
            for h in range(nheads):
                tiles = torch.tensor([[(b, h, i // self.block_m, j // self.block_n) in visited for j in range(lk)]
                                      for i in range(lq)])
                qh, kh, vh = q[rows_q, h].double(), k[rows_k, h // g].double(), v[rows_k, h // g].double()
                do, o = dout[rows_q, h].double(), out[rows_q, h].double()
                row_lse = lse[h, rows_q].double().unsqueeze(1)
                p = torch.where(seen & tiles & torch.isfinite(row_lse), torch.exp(qh @ kh.T * scale - row_lse), 0.0)
                ds = p * (do @ vh.T - (do * o).sum(-1, keepdim=True))
                dq[rows_q, h] = (ds @ kh * scale).to(dq.dtype)
                dk[rows_k, h // g] += (ds.T @ qh * scale).to(dk.dtype)
                dv[rows_k, h // g] += (p.T @ do).to(dv.dtype)


@pytest.fixture
def packed_stand_in(fake_cuda, monkeypatch):
    """fake_cuda whose varlen_bwd is a PackedBwdStandIn of small tiles (tiles of a few rows resolve the bands
    finely), with CPU tensors taking the CUDA branches; float64 passes the element-type check, so that the stand-in's
    gradients match the reference's to 1e-9."""
    patch_interface(monkeypatch, "_on_cuda", lambda t: True)
    patch_interface(monkeypatch, "_supported_dtypes", lambda: (torch.float64,))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    fake_cuda.varlen_bwd = PackedBwdStandIn(4, 8)
    return fake_cuda


def _inputs(lens_q, lens_k, nheads=4, nheads_k=2, headdim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((sum(lens_q), nheads, headdim), (sum(lens_k), nheads_k, headdim), (sum(lens_k), nheads_k, headdim),
              (sum(lens_q), nheads, headdim))
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


CASES = {  # cu_seqlens lengths (q, k) and rows in use (q, k): every sequence's diagonal its own
    "seqused_both": ((40, 9, 33, 0, 64), (50, 64, 33, 7, 64), (25, 1, 33, 0, 20), (50, 64, 3, 7, 61)),
    "seqused_q": ((40, 9, 33, 64), (50, 64, 33, 64), (25, 1, 33, 17), None),
    "seqused_k": ((40, 9, 33, 64), (50, 64, 33, 64), None, (50, 5, 3, 64)),
}


def _call_bwd(case, mask, window, deterministic, schedule="auto"):
    lens_q, lens_k, used_q, used_k = CASES[case]
    q, k, v, dout = _inputs(lens_q, lens_k)
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    seqused = [None if u is None else torch.tensor(u, dtype=torch.int32) for u in (used_q, used_k)]
    window = _window(mask, window)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, 0.125, False, window, return_lse=True,
                                    compute_dtype=torch.float64, seqused_q=seqused[0], seqused_k=seqused[1])
    grads = interface._varlen_bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, *seqused, max(lens_q), max(lens_k),
                                       0.125, mask, *window, 0.0, deterministic, schedule, 0)
    ref = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 0.125, False, window,
                                   compute_dtype=torch.float64, seqused_q=seqused[0], seqused_k=seqused[1])
    return grads, ref


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mask, window", BANDS)
def test_seqused_with_different_diagonals_matches_the_reference(packed_stand_in, mask, window, case, deterministic):
    grads, ref = _call_bwd(case, mask, window, deterministic)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("tiles", [(4, 8), (8, 4), (16, 32)], ids=lambda t: f"{t[0]}x{t[1]}")
@pytest.mark.parametrize("schedule", DETERMINISTIC_SCHEDULES + NONDETERMINISTIC_SCHEDULES)
def test_every_schedule_reaches_every_band(packed_stand_in, schedule, tiles):
    packed_stand_in.varlen_bwd = PackedBwdStandIn(*tiles)
    for mask, window in ((1, (-1, 0)), (2, (4, 1)), (2, (-1, 2))):
        grads, ref = _call_bwd("seqused_both", mask, window, schedule not in NONDETERMINISTIC_SCHEDULES, schedule)
        for got, want in zip(grads, ref):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_the_stand_in_sees_a_band_the_schedule_misses(packed_stand_in, monkeypatch):
    # The longest lengths' bounds (what the packed kernels ran before the bands were planned) miss part of the bands
    # of the sequences whose diagonal lies right of the longest ones' under a schedule of the batch of the longest:
    # the stand-in must show it. (Per sequence, as deterministic `auto` runs causal packs, nothing is missed.)
    monkeypatch.setattr(_seq_bands, "bwd_launches", lambda lens_q, lens_k, *band, by_length=False:
                        [_seq_bands.BwdLaunch(None, max(lens_q), max(lens_k))])
    grads, ref = _call_bwd("seqused_both", 1, (-1, 0), True, "descending")
    assert not all(torch.allclose(got, want) for got, want in zip(grads, ref))
    grads, ref = _call_bwd("seqused_both", 1, (-1, 0), True)
    assert all(torch.allclose(got, want) for got, want in zip(grads, ref))


def test_groups_run_one_launch_each_with_the_others_rows_unused(packed_stand_in):
    _call_bwd("seqused_both", 2, (0, 0), True)
    lens_q, lens_k, used_q, used_k = CASES["seqused_both"]
    launches = packed_stand_in.varlen_bwd.launches
    assert len(launches) > 1
    for b in range(len(lens_q)):
        runs_in = [i for i, launch in enumerate(launches) if launch[0][b] or launch[1][b]]
        assert len(runs_in) == (1 if used_q[b] and used_k[b] else 0)
        for i in runs_in:
            assert (launches[i][0][b], launches[i][1][b]) == (used_q[b], used_k[b])


def test_length_classes_differ_by_less_than_twice():
    lens = [3000, 700, 5000, 1200, 2000, 4484, 0, 2501, 2500]
    classes = _seq_bands.length_classes(range(len(lens)), lens, lens)
    assert sorted(b for c in classes for b in c) == [b for b, n in enumerate(lens) if n]
    assert [sorted(lens[b] for b in c) for c in classes] == [[2501, 3000, 4484, 5000], [2000, 2500], [700, 1200]]
    assert _seq_bands.bwd_launches([64] * 3, [64] * 3, 0, -1, -1, by_length=True)[0].members is None
    assert _seq_bands.bwd_launches(lens, lens, 1, -1, 0, by_length=True)[0].members is None


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("mask", [0, 1])
def test_a_pack_of_mixed_lengths_runs_one_launch_per_class(packed_stand_in, mask, deterministic):
    """A planned call (no seqused) whose lengths span several length classes: on a full mask under a schedule that
    runs a batch's geometry (`shift`, non-deterministic) one launch per class, each given its members' rows, together
    equal to the reference; on a causal mask, and under `auto` (every sequence on its own geometry, which the
    non-deterministic `auto` takes on packs of unequal lengths too) on a full one, one launch."""
    lens = [40, 9, 64, 17, 33, 0]
    q, k, v, dout = _inputs(lens, lens)
    cu_q = cu_k = cu(lens)
    window = (-1, 0) if mask == 1 else (-1, -1)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, 0.125, mask == 1, (-1, -1), return_lse=True,
                                    compute_dtype=torch.float64)
    grads = interface._varlen_bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max(lens), max(lens), 0.125,
                                       mask, *window, 0.0, deterministic, "auto" if deterministic else "shift", 0)
    ref = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 0.125, mask == 1, (-1, -1),
                                   compute_dtype=torch.float64)
    for got, want in zip(grads, ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    launches = packed_stand_in.varlen_bwd.launches
    if mask == 1 or deterministic:
        assert len(launches) == 1
    else:
        assert [launch[0] for launch in launches] == [[40, 0, 64, 0, 33, 0], [0, 0, 0, 17, 0, 0], [0, 9, 0, 0, 0, 0]]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("mask", [0, 1])
def test_one_kv_head_runs_as_mha_and_matches_the_reference(packed_stand_in, mask, deterministic):
    """GQA with one KV head (dash_attn/_kv_heads.py): the kernel sees a KV head per query head, and the summed dK and
    dV equal the reference's."""
    lens = [40, 9, 64, 17]
    q, k, v, dout = _inputs(lens, lens, nheads=4, nheads_k=1)
    cu_q = cu_k = cu(lens)
    window = (-1, 0) if mask == 1 else (-1, -1)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, 0.125, mask == 1, (-1, -1), return_lse=True,
                                    compute_dtype=torch.float64)
    seen = []
    stand_in = packed_stand_in.varlen_bwd

    def recording(dout, q, k, *rest):
        seen.append((q.shape[1], k.shape[1]))
        return stand_in(dout, q, k, *rest)

    packed_stand_in.varlen_bwd = recording
    grads = interface._varlen_bwd_impl(dout, q, k, v, out, lse, cu_q, cu_k, None, None, max(lens), max(lens), 0.125,
                                       mask, *window, 0.0, deterministic, "auto", 0)
    ref = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 0.125, mask == 1, (-1, -1),
                                   compute_dtype=torch.float64)
    assert seen and all(heads == (4, 4) for heads in seen)
    for got, want in zip(grads, ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
