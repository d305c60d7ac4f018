"""The forward kernel's persistent tile order (csrc/fwd/fwd_tile_scheduler.h, through dash_attn._sched.fwd_tiles).

Proven here for every CTA count 1..256 on small shapes and on the benchmark shapes at real SM counts:
  coverage   every (batch, head, query tile) runs exactly once, whatever the mask;
  causal     phase 1 runs pairs (M - 1 - j, j) of one head back to back, head-major, also at odd tile counts M;
             the CTA loads (key tiles) stay within one pair of the mean; the modelled K/V traffic
             (dash_attn.fwd_schedule.kv_traffic) stays near the compulsory bytes at odd M.
"""
import collections
import math

import pytest

import dash_attn._sched as _sched
from dash_attn import fwd_schedule

MASKS = (_sched.MASK_FULL, _sched.MASK_CAUSAL, _sched.MASK_WINDOW)
# (seqlen_q, block_m, nheads, batch): one tile, odd and even tile counts, a ragged last tile.
SMALL = [(1, 64, 1, 1), (64, 64, 3, 1), (200, 64, 2, 3), (5 * 64, 64, 4, 2), (11 * 16, 16, 5, 3), (1000, 192, 7, 2)]
# hdim 64 (192-row tiles, 32 heads) and hdim 128 (128-row tiles, 16 heads) at 16k tokens: 2k and 8k give hdim 64 an
# odd tile count (11 and 43).
BENCH = [(seqlen, block_m, heads, 16384 // seqlen) for seqlen in (1024, 2048, 4096, 8192, 16384)
         for block_m, heads in ((192, 32), (128, 16))]


def _tiles(mask, shape, sms):
    d = _sched.fwd_tiles(mask, *shape, sms)
    assert len(d["ctas"]) == d["grid"] <= sms
    return d


def _check_coverage(d, shape):
    seqlen_q, block_m, nheads, batch = shape
    m_blocks = math.ceil(seqlen_q / block_m)
    seen = collections.Counter(t for cta in d["ctas"] for t in cta)
    want = {(b, h, m) for b in range(batch) for h in range(nheads) for m in range(m_blocks)}
    assert set(seen) == want and max(seen.values()) == 1


def _check_causal(d, shape):
    seqlen_q, block_m, nheads, batch = shape
    m_blocks = d["num_m_blocks"]
    pairs_per_head = m_blocks // 2
    paired = d["paired_heads"]
    assert d["pair_units"] == paired * pairs_per_head
    # Phase 1: every CTA starts with whole pairs of paired heads (their middle tile aside at odd M), in ascending
    # head order; those tiles never come later.
    mid = (m_blocks - 1) // 2 if m_blocks % 2 else -1
    for cta in d["ctas"]:
        in_pairs = [b * nheads + h < paired and m != mid for b, h, m in cta]
        n = in_pairs.index(False) if False in in_pairs else len(cta)
        assert n % 2 == 0 and not any(in_pairs[n:])
        heads = []
        for (b0, h0, hi), (b1, h1, lo) in zip(cta[0:n:2], cta[1:n:2]):
            assert (b0, h0) == (b1, h1) and hi + lo == m_blocks - 1 and hi > lo
            heads.append(b0 * nheads + h0)
        assert heads == sorted(heads)
    # Load balance: key tiles per CTA (query tile m sees about m + 1 of them) within one pair of the mean.
    loads = [sum(m + 1 for _, _, m in cta) for cta in d["ctas"]]
    assert max(loads) <= sum(loads) / len(loads) + m_blocks + 1


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SMALL, ids=str)
def test_every_cta_count(mask, shape):
    for sms in range(1, 257):
        d = _tiles(mask, shape, sms)
        _check_coverage(d, shape)
        if mask == _sched.MASK_CAUSAL:
            _check_causal(d, shape)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", BENCH, ids=str)
def test_benchmark_shapes(mask, shape):
    for sms in (78, 114, 132):
        d = _tiles(mask, shape, sms)
        _check_coverage(d, shape)
        if mask == _sched.MASK_CAUSAL:
            _check_causal(d, shape)


@pytest.mark.parametrize("seqlen", [2048, 8192])
def test_odd_tile_counts_keep_kv_in_l2(seqlen):
    """hdim 64 causal at 2k and 8k (11 and 43 query tiles a head): most heads run as pairs, and the modelled K/V
    traffic stays under 2x the compulsory bytes (with every tile in the tail, tile-major, it was 5.6x and 9.8x)."""
    nheads, batch = 32, 16384 // seqlen
    d = fwd_schedule.tiles("causal", seqlen, 192, nheads, batch, 132)
    assert d["num_m_blocks"] % 2 == 1 and d["paired_heads"] >= nheads * batch * 3 // 4
    dram, compulsory, balance = fwd_schedule.kv_traffic("causal", seqlen, 192, 128, 64, nheads, batch, 132, 50 << 20)
    assert dram < 2 * compulsory and balance < 1.03
