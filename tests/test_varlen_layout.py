"""The schedule of a planned varlen call (dash_attn/_launch.py, _with_varlen_schedule; dash_attn/_varlen.py): the
deterministic `auto` pick depends on the mask alone, and where the packed kernels schedule every sequence on its own
geometry (schedules_table.runs_per_sequence) any pack runs in one launch, whatever its sequences' bands."""
import pytest
import torch

from dash_attn import _ext, _launch, _sched, _varlen
from dash_attn._args import MaskKind, OpArgs
from dash_attn.schedule import tile_shape
from dash_attn.schedules_table import (ANY_LENGTH, AUTO, LANES_ORDER, LANES_SCHEDULE, SCHEDULE_IDS, invariant_schedule,
                                       problem, runs_per_sequence, short_keys, varlen_invariant_schedule)


@pytest.fixture(autouse=True)
def _built_head_dims(monkeypatch):
    monkeypatch.setattr(_ext, "_supported_head_dims", lambda: (64, 128, 256))


def _args(mask, deterministic=True, schedule=AUTO):
    window = {MaskKind.FULL: (-1, -1), MaskKind.CAUSAL: (-1, 0), MaskKind.WINDOW: (16, 0)}[mask]
    return OpArgs(softmax_scale=1.0, mask=int(mask), window_left=window[0], window_right=window[1], softcap=0.0,
                  deterministic=deterministic, schedule=schedule, sm_margin=0)


def _tensors(hdim=128, nheads=4, nheads_k=4):
    return torch.empty(10, nheads, hdim), torch.empty(10, nheads_k, hdim), torch.empty(10, nheads_k, hdim)


@pytest.mark.parametrize("mask", list(MaskKind))
def test_deterministic_auto_takes_the_masks_pick(mask):
    assert _launch._with_varlen_schedule(_args(mask), *_tensors())[0].schedule == \
        varlen_invariant_schedule(mask.name.lower())
    assert _launch._with_varlen_schedule(_args(mask, deterministic=False), *_tensors()) == \
        (_args(mask, deterministic=False), 0)
    assert _launch._with_varlen_schedule(_args(mask, schedule="descending"), *_tensors()) == \
        (_args(mask, schedule="descending"), 0)


@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("hdim, gqa", [(64, 1), (128, 1), (128, 4), (256, 1)])
def test_deterministic_auto_gives_sequences_their_dense_pick(hdim, gqa, mask):
    """short_k: the keys up to which a causal or full-mask sequence runs LANES_ORDER's orders, as dense `auto` does;
    windows take none. A run of equal lengths launched as a batch runs dense `auto`'s pick."""
    kind = MaskKind[mask.upper()]
    runs = varlen_invariant_schedule(mask)
    short = short_keys(mask, hdim, gqa)
    assert _launch._with_varlen_schedule(_args(kind), *_tensors(hdim, 4 * gqa, 4))[1] == short
    assert short == ANY_LENGTH or invariant_schedule(mask, hdim, short + 1, gqa) == runs
    assert _launch._with_varlen_schedule(_args(MaskKind.WINDOW), *_tensors(hdim, 4 * gqa, 4))[1] == 0
    args = _args(kind, schedule=runs)
    tile = tile_shape(hdim, mask)
    for seqlen_k in (1, 1000, 1024, 1025, 4096, 4097, 20000):
        for seqlen_q in {seqlen_k, max(1, seqlen_k // 8), 3000}:
            # A sequence's dense pick under `auto`, geometry included: mostly full causal bands and full masks where
            # shift_runs would wait run LANES_ORDER's orders too (without a key bound, hdim 256, the run keeps the runs
            # schedule, which resolves to LANES_ORDER there: the same orders).
            want = invariant_schedule(mask, hdim, seqlen_k, gqa, seqlen_q=seqlen_q, tile=tile)
            got = _launch._run_schedule(args, seqlen_q, seqlen_k, short, tile).schedule
            own = problem(mask, seqlen_q, seqlen_k, *tile, 4 * gqa, 1, 1, None, 4)
            assert got == want or (want == LANES_SCHEDULE and got == runs and short == 0
                                   and _sched.resolve(SCHEDULE_IDS[runs], own) == SCHEDULE_IDS[LANES_ORDER]), \
                (seqlen_q, seqlen_k)
            assert _launch._run_schedule(args, seqlen_q, seqlen_k, 0, tile).schedule == runs


def test_causal_packs_run_per_sequence():
    assert runs_per_sequence("causal", varlen_invariant_schedule("causal"))
    assert runs_per_sequence("full", varlen_invariant_schedule("full"))
    assert not runs_per_sequence("window", "descending")
    assert not runs_per_sequence("causal", "descending") and not runs_per_sequence("causal", AUTO)


def test_per_sequence_packs_run_in_one_launch():
    """Diagonals 100, 0 and 128: descending's batch of the longest needs wider bounds; per sequence, the longest."""
    lens_q, lens_k = [100, 700, 129], [200, 700, 257]
    assert _varlen._packed_bwd_launches(lens_q, lens_k, _args(MaskKind.CAUSAL, schedule="shift_causal_runs")) == \
        [(None, 700, 700)]
    assert _varlen._packed_bwd_launches(lens_q, lens_k, _args(MaskKind.CAUSAL, schedule="descending")) == \
        [(None, 700, 828)]
