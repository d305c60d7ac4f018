"""descending_lanes (csrc/schedule/lanes.h) runs descending's orders on another layout: for every CTA count 1..256,
batch size and position in the batch, each sequence's dQ accumulation orders and dK/dV walks must equal descending's
for the sequence alone (so its bits are descending's, and invariant), and every plan must be deadlock-free."""
import pytest

from dash_attn import _sched
from dash_attn import schedule as S
from dash_attn.schedules_table import LANES_GQA_RATIO, SHORT_SEQLEN_K, gqa_takes_invariant_pick, invariant_schedule
from test_schedule_invariance import ALL_CTAS, BATCHES, SHAPES, TILES, _plan, alone, signature


@pytest.mark.parametrize("hdim", sorted(TILES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}-h{s[3]}:{s[4]}")
def test_lanes_orders_are_descendings(shape, hdim):
    mask, sq, sk, nheads, nheads_k, window = shape
    ref = alone("descending", mask, sq, sk, hdim, nheads, nheads_k, window)
    for ctas in ALL_CTAS:
        batch = BATCHES[ctas % len(BATCHES)]
        plan = _plan("descending_lanes", mask, sq, sk, hdim, nheads, nheads_k, window, batch, ctas)
        for b in {0, batch - 1}:
            assert signature(plan, b) == ref, f"sequence {b} of {batch} on {ctas} CTAs"


@pytest.mark.parametrize("hdim", sorted(TILES))
def test_lanes_are_deadlock_free(hdim):
    bm, bn = TILES[hdim]
    for mask, sq, sk, nheads, nheads_k, window in SHAPES:
        for batch in (1, 3):
            p = S._problem(mask, sq, sk, bm, bn, nheads, batch, 1, window, nheads_k)
            assert _sched.verify(S.SCHEDULE_IDS["descending_lanes"], p, 1, 256) == [], (mask, sq, sk, batch)


def test_lane_keeps_its_kv_tile():
    """Lane l of a group runs KV tile l of one head after another (full, where whole groups of N lanes fill the grid
    best), or the pair (l, N-1-l) (causal)."""
    full = _plan("descending_lanes", "full", 1024, 1024, 128, 4, 4, None, 4, 132)  # N = 8: 16 groups, 4 CTAs idle
    items = full.items
    for cta in range(132):
        tiles = set(items["n_block"][items["cta"] == cta].tolist())
        assert tiles == ({cta % 8} if cta < 128 else set())
    causal = _plan("descending_lanes", "causal", 1024, 1024, 128, 4, 4, None, 33, 132)  # 4 lanes of pairs, 132 heads
    items = causal.items
    for cta in range(132):
        tiles = items["n_block"][items["cta"] == cta].tolist()
        assert tiles == [cta % 4, 7 - cta % 4] * 4  # 33 groups, four heads each
    # N = 9: lanes 0-3 hold the pairs (l, 8-l), lane 4 the middle tile alone; 26 groups, 2 CTAs idle.
    odd = _plan("descending_lanes", "causal", 1100, 1100, 128, 4, 4, None, 13, 132).items
    for cta in range(132):
        tiles = odd["n_block"][odd["cta"] == cta].tolist()
        lane, heads = cta % 5, (2 if cta < 130 else 0)
        assert tiles == ([lane, 8 - lane] * heads if lane < 4 else [4] * heads)


def test_lanes_take_several_tiles_where_whole_groups_leave_ctas_idle():
    """Full mask, N = 47 KV tiles, 16 heads on 132 CTAs: groups of 47 lanes keep 94 CTAs busy for 8 rounds of
    heads; 16 lanes of 3 tiles (tiles l, l + 16, l + 32) keep 128 busy for 2 rounds of 3 tiles."""
    plan = _plan("descending_lanes", "full", 6000, 6000, 128, 16, 16, None, 1, 132)
    items = plan.items
    for cta in range(132):
        tiles = items["n_block"][items["cta"] == cta].tolist()
        lane = cta % 16
        want = [n for n in (lane, lane + 16, lane + 32) if n < 47] * 2
        assert tiles == (want if cta < 128 else [])
    assert signature(plan, 0) == alone("descending", "full", 6000, 6000, 128, 16, 16, None)
    bm, bn = TILES[128]
    p = S._problem("full", 6000, 6000, bm, bn, 16, 1, 1, None, 16)
    assert _sched.verify(S.SCHEDULE_IDS["descending_lanes"], p, 1, 256) == []


def test_lanes_give_way_where_rounds_of_heads_leave_the_grid_idle():
    """8 heads of 24 lanes of pairs (causal, 6000 keys) on 132 CTAs: 5 groups, 2 rounds, 73% of the grid busy, under
    kMinBusyPercent: descending's layout runs instead (same bits); 40 heads (8 rounds, 91% busy) keep the lanes."""
    bm, bn = TILES[128]
    lanes = S.SCHEDULE_IDS["descending_lanes"]
    few = S._problem("causal", 6000, 6000, bm, bn, 4, 2, 132, None, 4)
    many = S._problem("causal", 6000, 6000, bm, bn, 4, 10, 132, None, 4)
    assert _sched.resolve(lanes, few) == S.SCHEDULE_IDS["descending"]
    assert _sched.resolve(lanes, many) == lanes


@pytest.mark.parametrize("mask, hdim", sorted(SHORT_SEQLEN_K))
def test_invariant_pick_switches_at_the_bound(mask, hdim):
    """Deterministic `auto` runs descending_lanes up to the key-length bound, the runs schedule past it."""
    bound = SHORT_SEQLEN_K[(mask, hdim)]
    assert invariant_schedule(mask, hdim, 1) == invariant_schedule(mask, hdim, bound) == "descending_lanes"
    assert invariant_schedule(mask, hdim, bound + 1) == {"full": "shift_runs", "causal": "shift_causal_runs"}[mask]
    assert invariant_schedule(mask, 256, 1) != "descending_lanes"  # not measured at hdim 256: the long pick
    assert invariant_schedule("window", hdim, 1) == "descending"


@pytest.mark.parametrize("hdim", sorted(TILES))
def test_invariant_pick_where_shift_runs_would_wait(hdim):
    """Where shift_runs would fall back to descending (full masks, seqlen_q below seqlen_k, ShiftRuns::waits_free),
    deterministic `auto` runs descending_lanes, whose orders are descending's: the pick changes the layout, not the
    bits. Mostly full causal bands (mostly_full_band) run descending_lanes too, unpaired (at hdim 64 and 128, which have
    a lanes bound that varlen calls can carry)."""
    long = max(SHORT_SEQLEN_K.values()) + 1
    for mask in ("full", "causal", "window"):
        tile = S.tile_shape(hdim, mask)
        for seqlen_q in (64, 1000, long - 1, long, 3 * long):
            pick = invariant_schedule(mask, hdim, long, seqlen_q=seqlen_q, tile=tile)
            plain = invariant_schedule(mask, hdim, long)
            p = S._problem(mask, seqlen_q, long, *tile, 1, 1, 1, (256, 0) if mask == "window" else None, 1)
            waits = plain != "descending" and _sched.resolve(S.SCHEDULE_IDS[plain], p) == S.SCHEDULE_IDS["descending"]
            band = mask == "causal" and hdim != 256 and _sched.mostly_full_band(p)
            assert pick == ("descending_lanes" if (waits and mask == "full") or band else plain), (mask, seqlen_q)
            if seqlen_q >= long or mask == "window":
                assert not waits, (mask, seqlen_q)
            elif mask == "full" and seqlen_q <= 1000:
                assert waits, (mask, seqlen_q)
    tile = S.tile_shape(hdim, "causal")
    one_tile = S.plan("shift_causal_runs", "causal", 40, long, *tile, 16, 8, 132)
    lanes = S.plan("descending_lanes", "causal", 40, long, *tile, 16, 8, 132)
    assert S.simulate(lanes, record=False).makespan <= 1.05 * S.simulate(one_tile, record=False).makespan
    for ctas in (1, 7, 132):
        lanes = _plan("descending_lanes", "full", 1000, long, hdim, 4, 4, None, 3, ctas)
        runs = _plan("shift_runs", "full", 1000, long, hdim, 4, 4, None, 3, ctas)
        assert signature(lanes, 0) == signature(runs, 0) == alone("descending", "full", 1000, long, hdim, 4, 4, None)


@pytest.mark.parametrize("hdim", [64, 128])
def test_causal_short_bound_holds_for_square_bands(hdim):
    """Under the key bound, causal bands with fewer queries than keys that are not mostly full keep the runs schedule
    (descending_lanes' pairs are unequal there: measured 2-20% slower at hdim 128), at GQA ratios of LANES_GQA_RATIO
    too, where the bound is every length; square and taller bands and mostly full bands run descending_lanes."""
    bound = SHORT_SEQLEN_K[("causal", hdim)]
    tile = S.tile_shape(hdim, "causal")
    for seqlen_q, seqlen_k in ((bound, bound), (bound + 512, bound), (bound // 8, bound)):
        assert invariant_schedule("causal", hdim, seqlen_k, seqlen_q=seqlen_q, tile=tile) == "descending_lanes"
    for seqlen_q in (bound // 2, 3 * bound // 4, bound - tile[1]):
        p = S._problem("causal", seqlen_q, bound, *tile, 1, 1, 1, None, 1)
        assert not _sched.mostly_full_band(p)
        assert invariant_schedule("causal", hdim, bound, seqlen_q=seqlen_q, tile=tile) == "shift_causal_runs"


def test_causal_gqa_bound_holds_for_square_bands():
    """With LANES_GQA_RATIO (hdim 128) the bound is every length, for square and taller bands only: bands with fewer
    queries than keys that are not mostly full keep the runs schedule there too."""
    tile, ratio = S.tile_shape(128, "causal"), LANES_GQA_RATIO[128]
    for seqlen_k in (SHORT_SEQLEN_K[("causal", 128)], 4 * SHORT_SEQLEN_K[("causal", 128)]):
        assert invariant_schedule("causal", 128, seqlen_k, ratio, seqlen_q=seqlen_k, tile=tile) == "descending_lanes"
        for seqlen_q in (seqlen_k // 2, 3 * seqlen_k // 4, seqlen_k - tile[1]):
            assert invariant_schedule("causal", 128, seqlen_k, ratio, seqlen_q=seqlen_q, tile=tile) == \
                "shift_causal_runs"


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_invariant_pick_of_gqa(mask):
    """At hdim 128 with 4 or more query heads per KV head, descending_lanes at every length (LANES_GQA_RATIO)."""
    long = max(SHORT_SEQLEN_K.values()) + 1
    assert invariant_schedule(mask, 128, long, 4) == invariant_schedule(mask, 128, long, 8) == "descending_lanes"
    assert invariant_schedule(mask, 128, long, 2) != "descending_lanes"
    assert invariant_schedule(mask, 64, long, 4) != "descending_lanes"
    assert invariant_schedule("window", 128, long, 4) == "descending"
    assert gqa_takes_invariant_pick(mask, 128, 4)
    assert not gqa_takes_invariant_pick(mask, 128, 2) and not gqa_takes_invariant_pick(mask, 256, 8)
