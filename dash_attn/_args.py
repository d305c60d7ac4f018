"""Argument normalisation shared by the public functions (dash_attn/api.py) and the custom ops: mask kinds and windows,
the scalar arguments of a call (OpArgs), the deterministic flag, the reference math's compute dtype."""
from __future__ import annotations

import enum
from typing import NamedTuple, Optional, Tuple

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


class OpArgs(NamedTuple):
    """The scalar arguments of an attention call, checked and normalised (api._common_args builds them), in the order
    the registered custom ops take them after their tensors and sequence arguments. A tuple, so that `op(q, k, v,
    *args)` passes them to the ops, whose schemas stay positional (torch.compile and the tests call them by position);
    the helpers below the ops take one OpArgs and read its fields by name, so that no value binds to a neighbour's
    parameter."""
    softmax_scale: float
    mask: int  # MaskKind, with causal folded into a (-1, 0) window by _mask_args
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool
    schedule: str  # a name of schedules_table.SCHEDULES; the launches turn it into an id
    sm_margin: int

    @property
    def window(self) -> Tuple[int, int]:
        return self.window_left, self.window_right

    @property
    def mask_args(self) -> Tuple[int, int, int]:
        """(mask, window_left, window_right), as _mask_args returns them."""
        return self.mask, self.window_left, self.window_right

    @property
    def kernel_args(self) -> Tuple[float, int, int, int, float]:
        """What every binding function takes after its tensors and sequence arguments: softmax_scale, mask,
        window_left, window_right, softcap (the backward's then take deterministic, the schedule id and sm_margin)."""
        return self.softmax_scale, self.mask, self.window_left, self.window_right, self.softcap

    def for_lengths(self, seqlen_q: int, seqlen_k: int) -> "OpArgs":
        """These arguments with the mask _effective_mask gives for these lengths."""
        mask, window_left, window_right = _effective_mask(*self.mask_args, seqlen_q, seqlen_k)
        return self._replace(mask=mask, window_left=window_left, window_right=window_right)


def _resolve_deterministic(deterministic: Optional[bool]) -> bool:
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    return deterministic


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
