"""The layout pick of a planned varlen call (dash_attn/_launch.py, _with_varlen_schedule): deterministic `auto` on a
causal pack runs descending_lanes' layout or descending's, which have the same bits (test_schedule_lanes.py), by the
static load of their busiest CTA (dash_attn._sched.max_cta_load)."""
import numpy as np
import pytest

from dash_attn import _launch, _sched
from dash_attn import schedule as S
from dash_attn._args import MaskKind, OpArgs
from dash_attn.schedules_table import AUTO, LANES_ORDER, LANES_SCHEDULE, varlen_invariant_schedule

DOCS = (6000, 3100, 2200, 1500, 1100, 800, 600, 500, 300, 284)
MIXED = (3000, 700, 5000, 1200, 2000, 4484)
TILES = {64: (128, 128), 128: (64, 128)}


def _enumerated_max_load(kind, p, live_m, live_n):
    e = _sched.enumerate(kind, p)
    v = e["visits"]
    live = (v["m_block"] < np.asarray(live_m)[v["batch"]]) & (v["n_block"] < np.asarray(live_n)[v["batch"]])
    return int(np.bincount(v["cta"][live], minlength=p.num_ctas).max())


@pytest.mark.parametrize("schedule", ["descending", "descending_lanes", "shift_runs", "shift_causal_runs"])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_max_cta_load_counts_the_visits_inside_the_sequences(mask, schedule):
    lens = [700, 333, 1500, 64]
    for ctas in (1, 7, 66, 132):
        p = S._problem(mask, max(lens), max(lens), 64, 128, 4, len(lens), ctas, None, 2)
        live_m, live_n = [-(-n // 64) for n in lens], [-(-n // 128) for n in lens]
        kind = S.SCHEDULE_IDS[schedule]
        assert _sched.max_cta_load(kind, p, live_m, live_n) == _enumerated_max_load(kind, p, live_m, live_n)


def test_max_cta_load_wants_a_length_per_sequence():
    p = S._problem("causal", 100, 100, 64, 128, 2, 3, 4, None, 2)
    with pytest.raises(ValueError, match="per batch entry"):
        _sched.max_cta_load(S.SCHEDULE_IDS["descending"], p, [1, 1], [1, 1, 1])


def _pick(monkeypatch, lens, hdim, ctas=132, sm_margin=0):
    monkeypatch.setattr(_launch, "_bwd_tile_shape", lambda headdim, mask: TILES[headdim])
    monkeypatch.setattr(_launch, "_num_sms", lambda index: ctas)
    monkeypatch.setattr(_launch, "_supported_head_dims", lambda: (64, 128))
    args = OpArgs(softmax_scale=1.0, mask=int(MaskKind.CAUSAL), window_left=-1, window_right=0, softcap=0.0,
                  deterministic=True, schedule=AUTO, sm_margin=sm_margin)
    pack = _launch.PackShape(tuple(lens), tuple(lens), 2048 // hdim, 2048 // hdim, 0)
    return _launch._with_varlen_schedule(args, hdim, max(lens), pack).schedule


@pytest.mark.parametrize("hdim", [64, 128])
def test_uneven_packs_run_descendings_layout(monkeypatch, hdim):
    """The `docs` pack puts every sequence's longest tiles on the first lanes: descending's layout ran 1.4-1.6x
    faster on the H200 (benchmarks/RESULTS.md)."""
    assert _pick(monkeypatch, DOCS, hdim) == LANES_ORDER


def test_packs_the_lanes_balance_keep_them(monkeypatch):
    assert _pick(monkeypatch, MIXED, 128) == LANES_SCHEDULE
    assert _pick(monkeypatch, (4096,) * 4, 128) == LANES_SCHEDULE
    assert _pick(monkeypatch, (1024,) * 16, 64) == LANES_SCHEDULE


@pytest.mark.parametrize("hdim", [64, 128])
@pytest.mark.parametrize("lens", [DOCS, MIXED, (4096,) * 4, (5000, 10), (1024,) * 16], ids=str)
def test_layout_pick_keeps_the_order(monkeypatch, lens, hdim):
    """Whatever the lengths, the SM count or sm_margin, the pick is one of descending's two layouts: the same bits."""
    picks = {_pick(monkeypatch, lens, hdim, ctas, margin) for ctas in (1, 78, 114, 132) for margin in (0, 18)}
    assert picks <= {LANES_SCHEDULE, LANES_ORDER}
    assert varlen_invariant_schedule("causal", hdim, max(lens)) in {LANES_SCHEDULE, LANES_ORDER}
