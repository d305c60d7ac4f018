"""Shift's start-tile spacing (csrc/schedule/shift.h, ShiftSpacing): KV tile j starts at Q tile j k, k = 2 where
M >= 2N and block_n >= 2 block_m (spread, the default), or k = 1 (adjacent, the DASH paper's). CPU only: the
schedule engine's own C++ (dash_attn._sched) against the execution model and a re-derivation of the visits."""
import numpy as np
import pytest

from dash_attn import schedule

_sched = pytest.importorskip("dash_attn._sched")

SHIFT = schedule.SCHEDULE_IDS["shift"]
SPREAD, ADJACENT = 0, 1

# M = 2N (hdim 128's tiles), M = 4N + ragged tiles, GQA, square tiles with M < 2N and with M >= 2N (both k = 1),
# several batch entries.
SHAPES = [
    dict(batch=1, nheads=3, nheads_k=3, seqlen_q=2048, seqlen_k=2048, block_m=64, block_n=128, mask=0),
    dict(batch=2, nheads=4, nheads_k=2, seqlen_q=1000, seqlen_k=490, block_m=32, block_n=128, mask=0),
    dict(batch=1, nheads=2, nheads_k=1, seqlen_q=1500, seqlen_k=1100, block_m=64, block_n=64, mask=0),
    dict(batch=1, nheads=2, nheads_k=2, seqlen_q=1500, seqlen_k=500, block_m=64, block_n=64, mask=0),
]


def _problem(shape, ctas, spacing, split=True):
    return _sched.Problem(num_ctas=ctas, shift_spacing=spacing,
                          tail_chunk_min=_sched.DEFAULT_TAIL_CHUNK_MIN if split else 0, **shape)


def _spacing(p):
    M, N = _sched.num_m_blocks(p), _sched.num_n_blocks(p)
    return 2 if p.shift_spacing == SPREAD and 2 * p.block_m <= p.block_n and M >= 2 * N else 1


@pytest.mark.parametrize("spacing", [SPREAD, ADJACENT], ids=["spread", "adjacent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{seqlen_q}x{seqlen_k}-{block_m}x{block_n}".format(**s))
def test_every_cta_count(shape, spacing):
    """Coverage, a permutation per dQ tile and no deadlock in either mode, CTA counts 1..256, split tail included."""
    errors = _sched.verify(SHIFT, _problem(shape, 1, spacing), 1, 256)
    assert not errors, "\n".join(errors)
    for ctas in (1, 5, 33, 132, 256):
        assert not _sched.simulate(SHIFT, _problem(shape, ctas, spacing), deterministic=False)["deadlock"]


@pytest.mark.parametrize("spacing", [SPREAD, ADJACENT], ids=["spread", "adjacent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "{seqlen_q}x{seqlen_k}-{block_m}x{block_n}".format(**s))
def test_q_tiles_and_arrival_spacing(shape, spacing):
    """Step t of KV tile j visits Q tile (j k + t // g) mod M; where a head's tiles share one wave (no split tail),
    a dQ tile's contributors in accumulation order arrive at least k steps apart (exactly k where M = k N)."""
    p = _problem(shape, 512, spacing, split=False)  # every head in one wave
    M, N, g = _sched.num_m_blocks(p), _sched.num_n_blocks(p), p.nheads // p.nheads_k
    k = _spacing(p)
    v = _sched.enumerate(SHIFT, p)["visits"]
    assert np.array_equal(v["m_block"], (v["n_block"].astype(np.int64) * k + v["step"] // g) % M)
    if k > 1 and N > 1:
        key = (v["batch"].astype(np.int64) * p.nheads + v["head"]) * M + v["m_block"]
        for tile in np.unique(key)[:50]:
            sel = np.flatnonzero(key == tile)
            steps = (v["step"][sel] // g)[np.argsort(v["wait_target"][sel])]
            gaps = np.diff(steps)
            assert np.all(gaps >= k) and (M != k * N or np.all(gaps == k)), (tile, steps)
    elif spacing == SPREAD:
        assert k == 1  # M < 2N or square tiles: the spread falls back to adjacent start tiles


def test_spread_is_the_default_and_validated():
    p = _sched.Problem(batch=1, nheads=1, nheads_k=1, seqlen_q=256, seqlen_k=256, block_m=64, block_n=128, mask=0)
    assert p.shift_spacing == SPREAD
    with pytest.raises(ValueError):
        _sched.Problem(batch=1, nheads=1, nheads_k=1, seqlen_q=256, seqlen_k=256, block_m=64, block_n=128, mask=0,
                       shift_spacing=2)
