"""GQA backward on copies of each KV head: K and V repeated (per query head, or per pair of query heads in large
groups), the backward run on the copies, each KV head's dK and dV summed over its copies in a fixed order.

Why: the backward's units are (batch, KV head, KV tile), each walking all of its KV head's query heads. With one KV
head (a tensor-parallel shard of a GQA model: 8 query heads and 1 KV head per GPU) there are fewer units than CTAs and
each is several query heads long: from 4k keys both modes ran 1.3-2.7x slower than run as MHA, whose units are
(batch, query head, KV tile), and copies of 2 query heads ran the deterministic backward 2-4% faster than MHA again
(8 query heads, 2k-8k keys; the non-deterministic one within 2%). On causal masks the same imbalance holds for
groups of 6 or more at any batch measured, and copies of 2 query heads ran fastest at groups of 8 (at groups of 6,
1.3x the GQA kernels, MHA 1.5x, on the one shape measured); full masks with several KV heads keep the GQA kernels
(docs/tuning.md has the figures).

Bits: the rule reads the head counts and the mask alone (kv_copies), never the batch, the lengths or the SM count, so a
sequence's gradients keep the invariance of the schedules the copies run (dense or packed, any neighbours). Each
copy's dK and dV are rounded to the input dtype once, then summed in float32 in a fixed order (sum_groups) and rounded
again: FA3 adds the query heads' float32 partials and rounds once, so these sums carry up to one more rounding per
copy. On the GPU one kernel does the sum in that order in one pass (csrc/common/kv_head_sum.h): the torch ops read and
write the shares several times over, which cost several percent of the backward.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._args import MaskKind

# KV head counts up to which a GQA backward runs on copies of its KV heads whatever the mask (kv_copies).
EXPANDED_KV_HEADS = 1
# Groups of at least SPLIT_GROUP query heads run on copies of HEADS_PER_COPY query heads each (kv_copies): on causal
# masks at any KV head count, since there the GQA kernels' units, a KV tile of every query head of its group, differ in
# length by up to the group's whole walk and balance badly on the grid; with one KV head (EXPANDED_KV_HEADS) on either
# mask from SPLIT_GROUP_ONE_KV on, MHA below it. Measured at groups of 6 and 8 (docs/tuning.md); causal groups of 4
# keep descending_lanes' GQA kernels (schedules_table.LANES_GQA_RATIO): ahead at 2k keys, 3-10% behind from 8k.
# One KV head keeps MHA at groups of 6: MHA ran ahead of copies of 2 there at 8k keys (causal; behind at 2k, even on
# full masks), and a copy's dK and dV are rounded once more than a query head's alone, which FA3's MQA cases (6 query
# heads, 1-3 keys, where PyTorch's error is 0) see: with copies of 2, dV off by up to 0.0625 against their bound of
# 0.0316 (50 of 1,536 cases); as MHA none.
SPLIT_GROUP = 6
SPLIT_GROUP_ONE_KV = 8
HEADS_PER_COPY = 2


def kv_copies(nheads: int, nheads_k: int, causal: bool) -> int:
    """Copies of each KV head that the backward of nheads query heads on nheads_k KV heads runs on, each serving
    nheads // nheads_k // copies consecutive query heads: with a group of SPLIT_GROUP or more that HEADS_PER_COPY
    divides, copies of that many query heads on causal masks (from SPLIT_GROUP_ONE_KV with up to EXPANDED_KV_HEADS KV
    heads, on full masks too); else the group (MHA) up to EXPANDED_KV_HEADS KV heads, else 1 (the GQA kernels as they
    are). A function of the head counts and the mask alone (the module's docstring says why)."""
    group = nheads // nheads_k
    few_kv_heads = nheads_k <= EXPANDED_KV_HEADS
    split_from = SPLIT_GROUP_ONE_KV if few_kv_heads else SPLIT_GROUP
    if group >= split_from and group % HEADS_PER_COPY == 0 and (causal or few_kv_heads):
        return group // HEADS_PER_COPY
    return group if few_kv_heads and group > 1 else 1


def expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: MaskKind) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """K and V with each KV head repeated kv_copies times (heads on dim -2; copy c of KV head j is head j * copies + c
    and serves query heads (j * copies + c) * g / copies onwards, g the group), or None where kv_copies is 1. mask:
    the call's (OpArgs.mask)."""
    copies = kv_copies(q.shape[-2], k.shape[-2], mask == MaskKind.CAUSAL)
    if copies == 1:
        return None
    return tuple(x.unsqueeze(-2).expand(*x.shape[:-1], copies, x.shape[-1]).flatten(-3, -2) for x in (k, v))


def sum_kv(ext, dk_x: torch.Tensor, dv_x: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """dk, dv = sum_groups of dk_x, dv_x. ext: the CUDA extension, whose kernel (csrc/common/kv_head_sum.h) sums both
    in one pass over the shares, with sum_groups' bits, wherever it takes the call. Elsewhere, in torch ops: where the
    two have one shape they are widened into one float32 buffer (read once each) and reduced by elementwise adds."""
    if ext.sum_kv_heads([dk_x, dv_x], [dk, dv], dk_x.shape[-2] // dk.shape[-2]):
        return
    if dk_x.shape == dv_x.shape:
        acc = dk_x.new_empty((2,) + tuple(dk_x.shape), dtype=_sum_dtype(dk_x))
        acc[0].copy_(dk_x)
        acc[1].copy_(dv_x)
        sum_groups(acc, dk, dv)
    else:
        sum_groups(_in_sum_dtype(dk_x.unsqueeze(0)), dk)
        sum_groups(_in_sum_dtype(dv_x.unsqueeze(0)), dv)


def _sum_dtype(grads: torch.Tensor) -> torch.dtype:
    return torch.promote_types(grads.dtype, torch.float32)


def _in_sum_dtype(grads: torch.Tensor) -> torch.Tensor:
    """Scratch gradients in the sum's dtype (float32, or theirs where wider); sum_groups overwrites the result, which
    is grads itself where the dtype already matches."""
    return grads.to(_sum_dtype(grads))


def sum_groups(acc: torch.Tensor, *outs: torch.Tensor) -> None:
    """outs[i] (KV heads on dim -2) = the sum of acc[i]'s copies of each KV head, in a fixed pairwise order (the
    heads of the second half added to those of the first, elementwise, until one is left), so that the bits depend on
    the values alone. acc: the expanded heads' gradients in the sum's dtype (_in_sum_dtype), overwritten."""
    group = acc.shape[-2] // outs[0].shape[-2]
    acc = acc.unflatten(-2, (outs[0].shape[-2], group))
    count = group
    while count > 1:
        half = count // 2
        acc[..., :half, :].add_(acc[..., count - half:count, :])
        count -= half
    for index, out in enumerate(outs):
        out.copy_(acc[index, ..., 0, :])
