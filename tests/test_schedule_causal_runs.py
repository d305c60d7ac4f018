"""shift_causal_runs' rotated walk (csrc/schedule/runs.h): on causal bands where every long tile sees every Q tile,
the units of a head that start together reach each dQ chain one after another, in the chain's order, so no add waits
for one that arrives at the same step or later. The stepped walk there brings every long tile, and then every short
tile, to a Q tile at the same step."""
import collections

import numpy as np
import pytest

from dash_attn import _sched
from dash_attn import schedule as S

# (block_m, block_n, seqlen_q, seqlen_k, strict): hdim 128 and 64 tiles, half-full bands. Not strict: 4000 x 8192, where
# the short tiles of two units see every Q tile too (r_u = 0), so those two arrive together.
SHAPES = [(64, 128, 4096, 8192, True), (128, 128, 4096, 8192, True), (128, 128, 2100, 4096, True),
          (64, 128, 4000, 8192, False)]


def _chains(block_m, block_n, seqlen_q, seqlen_k, nheads=2, nheads_k=2):
    """Per dQ chain (batch, head, m_block, run): the arrival steps of its adds in accumulation order, counted from the
    start of each unit (one unit per CTA: a grid as large as the units)."""
    tiles = _sched.num_n_blocks(_sched.Problem(1, nheads, nheads_k, seqlen_q, seqlen_k, block_m, block_n,
                                               _sched.MASK_CAUSAL))
    plan = S.plan("shift_causal_runs", "causal", seqlen_q, seqlen_k, block_m, block_n, nheads, 1,
                  nheads_k * (tiles + tiles % 2), nheads_k=nheads_k)
    v = plan.visits
    first_len = collections.Counter((int(c), int(i)) for c, i in zip(v["cta"], v["item"]))
    chains = collections.defaultdict(list)
    for k in range(v["cta"].size):
        c, i = int(v["cta"][k]), int(v["item"][k])
        arrival = int(v["step"][k]) + (first_len[(c, 0)] if i == 1 else 0)
        key = (int(v["batch"][k]), int(v["head"][k]), int(v["m_block"][k]), int(v["run"][k]))
        chains[key].append((int(v["wait_target"][k]), arrival))
    return {key: [a for _, a in sorted(adds)] for key, adds in chains.items()}


@pytest.mark.parametrize("block_m, block_n, seqlen_q, seqlen_k, strict", SHAPES)
def test_rotated_walk_arrives_in_chain_order(block_m, block_n, seqlen_q, seqlen_k, strict):
    for key, arrivals in _chains(block_m, block_n, seqlen_q, seqlen_k).items():
        gaps = np.diff(arrivals)
        assert np.all(gaps > 0 if strict else gaps >= 0), f"chain {key}: arrival steps {arrivals}"


def test_stepped_walk_arrives_in_chain_order_on_square_bands():
    """Square bands keep the stepped walk, whose long tiles start at distinct Q tiles: in chain order there too."""
    for key, arrivals in _chains(64, 128, 4096, 4096).items():
        assert np.all(np.diff(arrivals) > 0), f"chain {key}: arrival steps {arrivals}"


# (block_m, block_n, GQA group, outermost): groups that walk their query heads outermost (4 and 8 on 64-row Q tiles,
# 8 on 128-row ones: ShiftCausalRuns::heads_outer) and groups that walk every query head at each Q tile.
GROUPS = [(64, 128, 4, True), (64, 128, 8, True), (64, 64, 4, True), (64, 128, 2, False), (128, 128, 4, False),
          (128, 128, 8, True)]


@pytest.mark.parametrize("block_m, block_n, group, outer", GROUPS)
def test_gqa_walk_order_and_chain_order(block_m, block_n, group, outer):
    """A KV tile walks its group's query heads outermost where heads_outer says so (the whole walk for one query head,
    then the next), else every query head at each Q tile; either way every dQ chain receives its adds in its order."""
    plan = S.plan("shift_causal_runs", "causal", 4096, 4096, block_m, block_n, group, 1, 132, nheads_k=1)
    v = plan.visits
    first = (v["cta"] == 0) & (v["item"] == 0)
    heads, m_blocks = v["head"][first], v["m_block"][first]
    walk = np.unique(m_blocks).size
    if outer:
        assert np.array_equal(heads, np.repeat(np.arange(group), walk)), heads
    else:
        assert np.array_equal(heads, np.tile(np.arange(group), walk)), heads
    for key, arrivals in _chains(block_m, block_n, 4096, 4096, group, 1).items():
        assert np.all(np.diff(arrivals) > 0), f"chain {key}: arrival steps {arrivals}"
