"""The forward kernel's persistent tile order (csrc/fwd/fwd_tile_scheduler.h, through dash_attn._sched) and a model of
the K/V traffic it causes.

The forward has no accumulation order to prove; what its order decides is balance (causal tiles differ in length) and
L2 reuse: the CTAs running at one time should read the K/V of few heads. `kv_traffic` replays the order in time
(every CTA streams its tiles' key tiles one per step) through an LRU of K/V tiles the size of the L2 and counts the
bytes that miss it.
"""
import heapq
import math
from collections import OrderedDict
from typing import Dict, List, Tuple

from . import _sched
from .schedules_table import MASK_IDS, problem


def tiles(mask: str, seqlen_q: int, block_m: int, nheads: int, batch: int, num_sms: int) -> Dict:
    """Per CTA of the grid, the (batch, head, m_block) tiles the kernel runs, in order (`_sched.fwd_tiles`)."""
    return _sched.fwd_tiles(MASK_IDS[mask], seqlen_q, block_m, nheads, batch, num_sms)


def _key_tiles(mask: str, seqlen: int, block_m: int, block_n: int) -> List[int]:
    """Key tiles each query tile of a seqlen x seqlen band reads (all from the first: full or causal), by m_block: the
    band arithmetic of csrc/schedule/problem.h (n_block_range), which the forward's key_tiles follows too."""
    p = problem(mask, seqlen, seqlen, block_m, block_n, 1, 1, 1, None, 1)
    return [_sched.n_block_range(p, m)[1] for m in range(_sched.num_m_blocks(p))]


def kv_traffic(mask: str, seqlen: int, block_m: int, block_n: int, headdim: int, nheads: int, batch: int,
               num_sms: int, l2_bytes: int, elem_bytes: int = 2) -> Tuple[float, float, float]:
    """(K/V bytes read from DRAM, the compulsory ones, makespan / mean CTA time) for seqlen_q = seqlen_k, full or
    causal. A step streams one key tile (K and V); a query tile costs its steps plus one step for its Q load and
    epilogue."""
    d = tiles(mask, seqlen, block_m, nheads, batch, num_sms)
    ctas: List[List[Tuple[int, int, int]]] = d["ctas"]
    key_tiles = _key_tiles(mask, seqlen, block_m, block_n)
    tile_bytes = 2 * block_n * headdim * elem_bytes
    capacity = max(1, l2_bytes // tile_bytes)
    lru: "OrderedDict[Tuple[int, int, int], None]" = OrderedDict()
    misses = 0
    step = block_m / 128.0
    events = [(0.0, c, 0, 0) for c in range(len(ctas))]
    heapq.heapify(events)
    makespan = 0.0
    while events:
        t, c, i, k = heapq.heappop(events)
        if i == len(ctas[c]):
            makespan = max(makespan, t)
            continue
        b, h, m = ctas[c][i]
        key = (b, h, k)
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
        if k + 1 < key_tiles[m]:
            heapq.heappush(events, (t + step, c, i, k + 1))
        else:
            heapq.heappush(events, (t + step + 1.0, c, i + 1, 0))
    work = sum(key_tiles[m] * step + 1.0 for cta in ctas for _, _, m in cta)
    compulsory = batch * nheads * math.ceil(seqlen / block_n) * tile_bytes
    return misses * tile_bytes, compulsory, makespan / (work / len(ctas))
