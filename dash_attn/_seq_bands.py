"""The bounds the packed-sequence kernels' backward tiles a varlen call with, so that its schedule reaches every
sequence's causal or window band.

The packed kernels schedule a varlen call as a batch of sequences of the bounds' lengths (max_q, max_k): the KV tiles
of each sequence walk the Q tiles of one band, that of the diagonal max_k - max_q, while the element mask keeps each
sequence's own band around its own diagonal len_k - len_q (bottom-right aligned). Everything the schedule visits
outside a sequence's own band is masked (dQ, dK, dV += 0, in their places of the fixed orders, so that the
deterministic bits do not change); what it does not visit is lost. So every element a sequence's band holds must lie
in the schedule's band: a condition on the schedule's diagonal only, as the band's widths are the mask's. A right
bound needs the schedule's diagonal at or right of the sequence's, a left bound at or left of it, each relaxed where
the sequence's own edges end its band first (its last key before the right edge of its first row's band, its first
key after the left edge of its last row's). Bounds above the longest lengths move the diagonal: a larger max_k moves it
right, a larger max_q left; the tiles they add are masked for every sequence. Diagonals that no single band holds (a
two-sided window over sequences of different diagonals) need one launch per group of sequences that one band does
hold.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

from ._args import MaskKind


def _band(mask: int, window_left: int, window_right: int) -> Tuple[int, int]:
    """(left, right) of the mask's band, -1 unbounded; a full mask has none."""
    if mask == MaskKind.CAUSAL:
        return -1, 0
    if mask == MaskKind.WINDOW:
        return window_left, window_right
    return -1, -1


def diagonal_range(len_q: int, len_k: int, mask: int, window_left: int, window_right: int) -> Tuple[float, float]:
    """The schedule diagonals whose band holds every element of this sequence's band, as [lo, hi] (-inf, inf where a
    side is unbounded). Row i sees keys j with d - left <= j - i <= d + right, d = len_k - len_q; its elements reach
    j - i = min(d + right, len_k - 1) at most (row 0, the last key) and max(d - left, 1 - len_q) at least (the last
    row, key 0). A sequence without queries or keys has no elements: any diagonal will do."""
    left, right = _band(mask, window_left, window_right)
    if len_q <= 0 or len_k <= 0:
        return -math.inf, math.inf
    d = len_k - len_q
    lo = min(d, len_k - 1 - right) if right >= 0 else -math.inf
    hi = max(d, left + 1 - len_q) if left >= 0 else math.inf
    return lo, hi


def bands_inside(lens_q: Sequence[int], lens_k: Sequence[int], mask: int, window_left: int,
                 window_right: int) -> bool:
    """Whether the schedule of the longest lengths' bounds (max(lens_q), max(lens_k)) reaches every sequence's band."""
    if not lens_q:
        return True
    diagonal = max(lens_k) - max(lens_q)
    return all(lo <= diagonal <= hi for lo, hi in (diagonal_range(lq, lk, mask, window_left, window_right)
                                                   for lq, lk in zip(lens_q, lens_k)))


class BwdLaunch(NamedTuple):
    """One backward launch of the packed kernels: the sequences it runs (None: all of them; else the indices of
    those it runs, the others given no rows in use) and its bounds."""
    members: Optional[List[int]]
    max_q: int
    max_k: int


def _bounds_for(lens_q: Sequence[int], lens_k: Sequence[int], lo: float, hi: float) -> Tuple[int, int]:
    """The smallest bounds at least the longest lengths whose diagonal lies in [lo, hi] (not empty): the longest
    lengths' diagonal where it does, else that of the nearer end, reached by raising one bound."""
    max_q, max_k = max(lens_q, default=0), max(lens_k, default=0)
    natural = max_k - max_q
    diagonal = int(min(max(natural, lo), hi))
    if diagonal >= natural:
        return max_q, max_q + diagonal
    return max_k - diagonal, max_k


# The masks whose packs split by length class. A full-mask pack tiled on its longest sequence leaves a short sequence's
# lanes or tiles mostly empty, and split it ran 9-11% faster in both modes; causal packs ran slower split, each
# launch paying its own unequal last wave (docs/tuning.md).
LENGTH_CLASS_MASKS = (MaskKind.FULL,)


def length_classes(members: Sequence[int], lens_q: Sequence[int], lens_k: Sequence[int]) -> List[List[int]]:
    """`members` by length class, longest class first: a sequence of length n = max(len_q, len_k) joins class c where
    L / 2^(c+1) < n <= L / 2^c, L the longest length among them. The packed kernels tile a launch on its longest
    sequence, so a short sequence packed with long ones leaves most of its CTAs' tiles empty (docs/schedules.md,
    "Limits"); within a class the lengths differ by less than 2x. Sequences without rows join no class."""
    length = {b: max(lens_q[b], lens_k[b]) for b in members if lens_q[b] > 0 and lens_k[b] > 0}
    if not length:
        return []
    longest = max(length.values())
    classes = {}
    for b, n in length.items():
        classes.setdefault((longest // n).bit_length() - 1, []).append(b)
    return [sorted(classes[c]) for c in sorted(classes)]


def bwd_launches(lens_q: Sequence[int], lens_k: Sequence[int], mask: int, window_left: int,
                 window_right: int, by_length: bool = False) -> List[BwdLaunch]:
    """The backward launches of a packed call whose sequences have these rows in use: one for all sequences when
    one band holds every sequence's band, else one per group, the fewest (each sequence's diagonals are an interval,
    and intervals sharing a point are a group: the greedy choice by upper end is optimal). Sequences without
    elements join no group (their gradients are zeros, which the caller's outputs start as). by_length: on the
    masks of LENGTH_CLASS_MASKS each launch further split by length_classes. Every split keeps each sequence's bits:
    the schedules the varlen calls run give a sequence its own orders whatever the launch's bounds
    (tests/test_packed_bands.py)."""
    ranges = [diagonal_range(lq, lk, mask, window_left, window_right) for lq, lk in zip(lens_q, lens_k)]
    launches = _band_launches(lens_q, lens_k, ranges)
    if not by_length or mask not in LENGTH_CLASS_MASKS:
        return launches
    split = []
    for launch in launches:
        members = range(len(lens_q)) if launch.members is None else launch.members
        classes = length_classes(members, lens_q, lens_k)
        if len(classes) <= 1:
            split.append(launch)
            continue
        for cls in classes:
            lo, hi = max(ranges[b][0] for b in cls), min(ranges[b][1] for b in cls)
            split.append(BwdLaunch(cls, *_bounds_for([lens_q[b] for b in cls], [lens_k[b] for b in cls], lo, hi)))
    return split


def _band_launches(lens_q: Sequence[int], lens_k: Sequence[int], ranges) -> List[BwdLaunch]:
    """bwd_launches by band alone; ranges: each sequence's diagonal_range."""
    lo, hi = max((r[0] for r in ranges), default=-math.inf), min((r[1] for r in ranges), default=math.inf)
    if lo <= hi:
        return [BwdLaunch(None, *_bounds_for(lens_q, lens_k, lo, hi))]
    groups: List[List[int]] = []
    point = -math.inf
    for b in sorted((b for b, r in enumerate(ranges) if r != (-math.inf, math.inf)), key=lambda b: ranges[b][1]):
        if not groups or ranges[b][0] > point:
            groups.append([])
            point = ranges[b][1]
        groups[-1].append(b)
    launches = []
    for members in groups:
        g_lo, g_hi = max(ranges[b][0] for b in members), min(ranges[b][1] for b in members)
        bounds = _bounds_for([lens_q[b] for b in members], [lens_k[b] for b in members], g_lo, g_hi)
        launches.append(BwdLaunch(sorted(members), *bounds))
    return launches
