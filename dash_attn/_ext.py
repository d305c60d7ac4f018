"""The CUDA extension dash_attn._C, loaded lazily (the package imports and the CPU path works without it): its
queries about the build and the device (cached), and the checks every CUDA launch runs first."""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from . import validation

_NOT_BUILT = "dash_attn._C is not built: reinstall on a machine with nvcc and a CUDA build of torch"


# ----------------------------------------------------------------------------------------------------------------------
# CUDA extension access (lazy: the package imports and the CPU path works without it)
# ----------------------------------------------------------------------------------------------------------------------

def _extension():
    try:
        from . import _C
    except ImportError as exc:
        raise RuntimeError(f"{_NOT_BUILT} ({exc})") from exc
    return _C


@functools.lru_cache(maxsize=None)
def _supported_head_dims() -> Tuple[int, ...]:
    return tuple(int(d) for d in _extension().supported_head_dims())


@functools.lru_cache(maxsize=None)
def _softcap_built() -> bool:
    return bool(_extension().softcap_built())


@functools.lru_cache(maxsize=None)
def _supported_dtypes() -> Tuple[torch.dtype, ...]:
    return tuple(validation.KERNEL_DTYPE_NAMES[name] for name in _extension().supported_dtypes())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return int(_extension().num_sms(device_index))


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


@functools.lru_cache(maxsize=None)
def _bwd_tile_shape(headdim: int, mask: int) -> Tuple[int, int]:
    block_m, block_n = _extension().bwd_tile_shape(headdim, mask)
    return int(block_m), int(block_n)


def _held_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head dim a kernel must hold: q's and k's, or v's where larger."""
    return max(q.shape[-1], v.shape[-1])


def _check_cuda(q: torch.Tensor, v: torch.Tensor, softcap: float):
    validation.check_cuda_device(q.device)
    ext = _extension()
    validation.check_cuda_features(_held_head_dim(q, v), _supported_head_dims(), softcap, _softcap_built(), q.dtype,
                                   _supported_dtypes())
    return ext


def _device_guard(device: torch.device):
    return torch.cuda.device(device)


def _kernel_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    return validation.kernel_head_dim(_held_head_dim(q, v), _supported_head_dims())
