"""Varlen calls planned without reading cu_seqlens on the host (inside a CUDA graph capture, or given seqused).

A captured graph replays its kernels with whatever cu_seqlens holds at replay time, and a copy to the host cannot be
captured at all, so such a call cannot check the prefix sums before its launch or pick a plan from them. It runs the
packed-sequence kernels with the caller's max_seqlen bounds (the kernels clamp every sequence's rows to the packed
tensors, so no value makes them read or write outside them: csrc/common/packed_seqs.h) and then checks cu_seqlens on
the GPU: when the check fails, every result of the call becomes NaN, so that invalid lengths surface in the loss
instead of as plausible numbers. Everything here is asynchronous: no result is read back. On CUDA tensors two small
kernels of the extension do it (csrc/common/seqlens_check.h; torch's masked_fill_ with a 0-dim mask took 0.35 ms per
backward at 16k tokens); `seqlens_ok` and `poison_unless` are the same rule in torch ops, for other devices and as
the reference the GPU tests hold the kernels to.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def capped_bounds(total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int) -> Tuple[int, int]:
    """The longest sequence lengths the kernels tile for: the caller's bounds, capped at the packed lengths (no
    sequence can be longer, and a larger bound would only size the grid and workspace for nothing)."""
    return min(max_seqlen_q, total_q), min(max_seqlen_k, total_k)


def seqlens_ok(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],
               seqused_k: Optional[torch.Tensor], total_q: int, total_k: int, max_q: int, max_k: int,
               band: Optional[Tuple[int, int]]) -> torch.Tensor:
    """A 0-dim bool tensor on cu_seqlens' device: both start at 0, never decrease, end at the packed lengths, seqused
    (where given) lies within each sequence's length, no sequence's rows in use exceed (max_q, max_k), and, for a
    causal or window mask (band = (left, right), -1 unbounded), each sequence's diagonal lies where the packed
    kernels' schedule can reach it: the schedule is that of a batch of the longest sequences, whose band lies around
    the diagonal max_k - max_q; a right bound needs no sequence diagonal right of it, a left bound none left of it
    (a coarse form of dash_attn/_seq_bands.py's rule: inside a capture no bounds can be planned around the
    diagonals)."""
    lens_q = cu_seqlens_q.long().diff()  # int64: differences of arbitrary int32 values cannot wrap around
    lens_k = cu_seqlens_k.long().diff()
    ok = (cu_seqlens_q[0] == 0) & (cu_seqlens_k[0] == 0)
    ok &= (cu_seqlens_q[-1] == total_q) & (cu_seqlens_k[-1] == total_k)
    ok &= ((lens_q >= 0) & (lens_k >= 0)).all()
    if seqused_q is not None:
        ok &= ((seqused_q >= 0) & (seqused_q <= lens_q)).all()
        lens_q = seqused_q.long()
    if seqused_k is not None:
        ok &= ((seqused_k >= 0) & (seqused_k <= lens_k)).all()
        lens_k = seqused_k.long()
    ok &= ((lens_q <= max_q) & (lens_k <= max_k)).all()
    if band is not None:
        left, right = band
        diagonal = (lens_k - lens_q) - (max_k - max_q)
        if right >= 0:
            ok &= (diagonal <= 0).all()
        if left >= 0:
            ok &= (diagonal >= 0).all()
    return ok


def poison_unless(ok: torch.Tensor, *results: torch.Tensor) -> None:
    """Fills every result with NaN where `ok` is False, on the device (a tensor mask: nothing waits for its value)."""
    bad = ok.logical_not()
    for result in results:
        result.masked_fill_(bad, float("nan"))


def flag_invalid(ext, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],
                 seqused_k: Optional[torch.Tensor], total_q: int, total_k: int, max_q: int, max_k: int,
                 band: Optional[Tuple[int, int]], *results: torch.Tensor) -> None:
    """Checks cu_seqlens and seqused (contiguous int32 on the results' device) and turns every result into NaN if they
    are invalid, all on the GPU."""
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if results[0].is_cuda:
        left, right = band if band is not None else (-1, -1)
        ok = ext.packed_seqlens_ok(*seqs, total_q, total_k, max_q, max_k, left >= 0, right >= 0)
        ext.poison_unless_ok(ok, list(results))
    else:
        poison_unless(seqlens_ok(*seqs, total_q, total_k, max_q, max_k, band), *results)
