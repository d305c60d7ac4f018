"""GQA with few KV heads in the backward: K and V repeated per query head, the backward run as MHA, each KV head's dK
and dV summed over its query heads in a fixed order.

Why: the backward's units are (batch, KV head, KV tile), each walking all of its KV head's query heads. With one KV
head (a tensor-parallel shard of a GQA model: 8 query heads and 1 KV head per GPU) there are fewer units than CTAs and
each is several query heads long: from 4k keys both modes ran 1.3-2.7x slower than run as MHA, whose units are
(batch, query head, KV tile) (docs/tuning.md has the figures; two KV heads were not measured that way, so they keep
the GQA kernels).

Bits: the rule reads the head counts alone (kv_heads_expanded), never the batch, the lengths or the SM count, so a
sequence's gradients keep the invariance of the MHA kernels (dense or packed, any neighbours). Each query head's dK
and dV are rounded to the input dtype once, then summed in float32 in query-head order and rounded again.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# KV head counts up to which a GQA backward runs as MHA (kv_heads_expanded).
EXPANDED_KV_HEADS = 1


def kv_heads_expanded(nheads: int, nheads_k: int) -> bool:
    """Whether a backward of nheads query heads on nheads_k KV heads runs as MHA (expand, sum_groups)."""
    return nheads_k <= EXPANDED_KV_HEADS and nheads > nheads_k


def expand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """K and V with each KV head repeated for its query heads (heads on dim -2, query head h reads KV head h // g),
    or None where kv_heads_expanded says no."""
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if not kv_heads_expanded(nheads, nheads_k):
        return None
    group = nheads // nheads_k
    return k.repeat_interleave(group, dim=-2), v.repeat_interleave(group, dim=-2)


def sum_groups(grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (KV heads on dim -2) = the sum of grad's query heads of each KV head, in float32 (or grad's dtype where
    wider), query head 0 first."""
    group = grad.shape[-2] // out.shape[-2]
    grouped = grad.unflatten(-2, (out.shape[-2], group))
    total = grouped[..., 0, :].to(torch.promote_types(grad.dtype, torch.float32), copy=True)
    for member in range(1, group):
        total.add_(grouped[..., member, :])
    return out.copy_(total)
