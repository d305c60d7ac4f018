"""The torch.library custom ops behind the public entry points (dash_attn/api.py), their autograd and CUDA launches.

Layering: `flash_attn_func` / `flash_attn_varlen_func` check and normalise the arguments (metadata only, so they trace
under torch.compile) and call one custom op; the op allocates its outputs and dispatches on the device: CPU tensors run
the reference math (dash_attn.reference), CUDA tensors the compiled extension dash_attn._C. Fake implementations only
describe output shapes, and the backward is registered on the forward op, so torch.compile(fullgraph=True) sees two
opaque ops per attention call. deterministic, schedule and sm_margin travel as op arguments so traced graphs keep them.

This module is the facade of that layer: the public names api.py calls, and the pieces the tests reach, re-exported
from the modules that hold them by role:
    _args.py      argument normalisation (mask kinds, windows, the deterministic flag) and OpArgs, the scalar
                  arguments the ops take after their tensors, which the helpers below them pass as one
    _ext.py       the CUDA extension: lazy loading, cached queries, the checks before a launch
    _launch.py    the backward schedule of a launch (`auto` resolved) and the dense CUDA launches
    _varlen.py    the varlen CUDA paths: host copies of cu_seqlens, packed or per-run launches, unplanned calls
    _ops.py       the custom ops, their fake implementations and autograd, the eager autograd.Functions
and the schedule names and ids of dash_attn/schedules_table.py. A test that replaces one of these functions replaces
it where its callers look it up: in the module that holds it and in those that import it.
"""
from __future__ import annotations

from ._args import MaskKind, OpArgs, _effective_mask, _mask_args, _reference_dtype, _resolve_deterministic
from ._ext import (_NOT_BUILT, _bwd_tile_shape, _check_cuda, _device_guard, _extension, _held_head_dim,
                   _kernel_head_dim, _l2_bytes, _num_sms, _softcap_built, _supported_dtypes, _supported_head_dims)
from ._launch import (_choose_schedule, _full_width, _launch_bwd, _launch_fwd, _lse_shape, _out_like,
                      _resolve_schedule, _resolve_schedule_for, _run_bwd, _run_fwd, _with_varlen_schedule)
from ._ops import (_EagerAttention, _EagerVarlenAttention, _bwd, _bwd_impl, _eager_cuda, _fwd, _fwd_impl,
                   _varlen_bwd, _varlen_bwd_impl, _varlen_fwd, _varlen_fwd_impl)
from ._varlen import (_batched, _bands_inside, _check_varlen, _host_lists, _on_cuda, _packed_launch, _runs,
                      _runs_unplanned, _used_lengths, _varlen_bwd_cuda, _varlen_bwd_unplanned, _varlen_fwd_cuda,
                      _varlen_fwd_unplanned)
from .schedules_table import FALLBACK_SCHEDULE, SCHEDULE_IDS

# What dash_attn/api.py calls, under public names.
fwd_op = _fwd  # dash_attn::fwd
varlen_fwd_op = _varlen_fwd  # dash_attn::varlen_fwd
EagerAttention = _EagerAttention  # the same bodies for plain eager CUDA calls (see _ops.py)
EagerVarlenAttention = _EagerVarlenAttention
eager_cuda = _eager_cuda  # whether a call may take EagerAttention / EagerVarlenAttention
mask_args = _mask_args
resolve_deterministic = _resolve_deterministic

__all__ = [
    # public
    "MaskKind", "OpArgs", "SCHEDULE_IDS", "FALLBACK_SCHEDULE", "fwd_op", "varlen_fwd_op", "EagerAttention",
    "EagerVarlenAttention", "eager_cuda", "mask_args", "resolve_deterministic",
    # re-exported internals (tests, tools)
    "_effective_mask", "_mask_args", "_reference_dtype", "_resolve_deterministic",
    "_NOT_BUILT", "_bwd_tile_shape", "_check_cuda", "_device_guard", "_extension", "_held_head_dim",
    "_kernel_head_dim", "_l2_bytes", "_num_sms", "_softcap_built", "_supported_dtypes", "_supported_head_dims",
    "_choose_schedule", "_full_width", "_launch_bwd", "_launch_fwd", "_lse_shape", "_out_like", "_resolve_schedule",
    "_resolve_schedule_for", "_run_bwd", "_run_fwd", "_with_varlen_schedule",
    "_EagerAttention", "_EagerVarlenAttention", "_bwd", "_bwd_impl", "_eager_cuda", "_fwd", "_fwd_impl",
    "_varlen_bwd", "_varlen_bwd_impl", "_varlen_fwd", "_varlen_fwd_impl",
    "_batched", "_bands_inside", "_check_varlen", "_host_lists", "_on_cuda", "_packed_launch", "_runs",
    "_runs_unplanned", "_used_lengths", "_varlen_bwd_cuda", "_varlen_bwd_unplanned", "_varlen_fwd_cuda",
    "_varlen_fwd_unplanned",
]
