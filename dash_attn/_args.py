"""Argument normalisation shared by the public functions (dash_attn/api.py) and the custom ops: mask kinds and windows,
the deterministic flag, the reference math's compute dtype."""
from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch


class MaskKind(enum.IntEnum):
    """Mirrors dash::MaskKind in csrc/common/params.h."""
    FULL = 0
    CAUSAL = 1
    WINDOW = 2


def _mask_args(window_left: int, window_right: int) -> Tuple[int, int, int]:
    """(mask kind, left, right) from a window with causal already folded in; causal is the (-1, 0) window."""
    if window_left < 0 and window_right < 0:
        return int(MaskKind.FULL), -1, -1
    if window_left < 0 and window_right == 0:
        return int(MaskKind.CAUSAL), -1, 0
    return int(MaskKind.WINDOW), window_left, window_right


def _effective_mask(mask: int, window_left: int, window_right: int, seqlen_q: int, seqlen_k: int):
    """Drops window sides that cannot mask anything for these lengths (as FlashAttention-3 does), so a window wider
    than the sequences reaches the full/causal kernels. Left bound: row i needs j >= i + sk - sq - left, void for
    every row once left >= sk - 1; right bound: j <= i + sk - sq + right, void once right >= sq - 1."""
    if mask != MaskKind.WINDOW:
        return mask, window_left, window_right
    if window_left >= max(seqlen_k - 1, 0):
        window_left = -1
    if window_right >= max(seqlen_q - 1, 0):
        window_right = -1
    return _mask_args(window_left, window_right)


def _resolve_deterministic(deterministic: Optional[bool]) -> bool:
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    return deterministic


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
