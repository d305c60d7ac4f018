"""The torch.library custom ops behind the public entry points (dash_attn/api.py), their fake implementations and
autograd, and the autograd.Functions that plain eager CUDA calls run instead (see dash_attn/interface.py)."""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch.utils import _python_dispatch

from . import _kv_heads, validation
from ._args import OpArgs, _reference_dtype
from ._launch import _lse_shape, _out_like, bwd_cuda, fwd_cuda
from ._varlen import (_check_varlen, _runs_unplanned, _unplanned_bounds, _varlen_bwd_cuda, _varlen_bwd_unplanned,
                      _varlen_fwd_cuda, _varlen_fwd_unplanned)
from .reference import attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen


# ----------------------------------------------------------------------------------------------------------------------
# Dense custom ops
# ----------------------------------------------------------------------------------------------------------------------

def _op_args(op: str, seqlen_q: int, seqlen_k: int, *scalars) -> OpArgs:
    """The scalar arguments of a call of the custom op `op` for these lengths (OpArgs.for_lengths), checked on every
    device (validation.check_op_args), so that a direct call with values the public functions would have refused or
    rewritten (softmax_scale 0, which they run as zero queries at scale 1, api._scoreless_queries; a mask its window
    does not give) raises instead of returning NaN, wrong gradients or another mask's result."""
    validation.check_op_args(op, *scalars)
    return OpArgs(*scalars).for_lengths(seqlen_q, seqlen_k)


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, mask: int, window_left: int,
              window_right: int, softcap: float, deterministic: bool, schedule: str,
              sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    args = _op_args("dash_attn::fwd", q.shape[1], k.shape[1], softmax_scale, mask, window_left, window_right, softcap,
                    deterministic, schedule, sm_margin)
    if q.device.type != "cpu":
        return fwd_cuda(q, k, v, args)
    out = _out_like(q, v)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    ref_out, ref_lse = attention_ref(q, k, v, args.softmax_scale, False, args.window, args.softcap, return_lse=True,
                                     compute_dtype=_reference_dtype(q.dtype))
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


_fwd = torch.library.custom_op("dash_attn::fwd", mutates_args=())(_fwd_impl)


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    return _out_like(q, v), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float, mask: int, window_left: int, window_right: int, softcap: float,
              deterministic: bool, schedule: str,
              sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _op_args("dash_attn::bwd", q.shape[1], k.shape[1], softmax_scale, mask, window_left, window_right, softcap,
                    deterministic, schedule, sm_margin)
    if q.device.type != "cpu":
        return bwd_cuda(dout, q, k, v, out, lse, args)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # The reference backward recomputes out and lse in the compute dtype: the saved float32 lse would cap the
    # accuracy of float64 gradcheck.
    compute_dtype = _reference_dtype(q.dtype)
    ref_out, ref_lse = attention_ref(q, k, v, args.softmax_scale, False, args.window, args.softcap,
                                     return_lse=True, compute_dtype=compute_dtype)
    # The given out and lse rule, as in the kernels: a caller may pass those of a larger attention (the
    # context-parallel path does). Rows whose lse is the float32 rounding of this call's own take the
    # recomputed values, which keep the precision float32 storage dropped.
    own = ref_lse.to(lse.dtype) == lse
    ref_lse = torch.where(own, ref_lse, lse.to(compute_dtype))
    ref_out = torch.where(own.transpose(1, 2).unsqueeze(-1), ref_out, out.to(compute_dtype))
    grads = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, args.softmax_scale, False, args.window,
                              args.softcap, compute_dtype)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)
    return dq, dk, dv


_bwd = torch.library.custom_op("dash_attn::bwd", mutates_args=())(_bwd_impl)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap, deterministic,
              schedule, sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd_backward(ctx, dout, dlse, bwd=_bwd):
    # The gradient of the returned lse is not propagated (FlashAttention-3 does the same); lse is marked
    # non-differentiable so autograd never asks for it.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(_last_dim_contiguous(dout), q, k, v, out, lse, *ctx.params)
    return (dq, dk, dv) + (None,) * len(ctx.params)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ----------------------------------------------------------------------------------------------------------------------
# Eager CUDA calls
# ----------------------------------------------------------------------------------------------------------------------

# The registered ops are what torch.compile, FakeTensor, torch.func and the CPU path see. A plain eager call on CUDA
# tensors runs the same bodies through an autograd.Function instead: the op dispatcher's round trip (schema checks,
# output alias checks, the autograd wrapper) cost about as much host time as the rest of a step (H200 node, fwd+bwd
# at batch 4 x 512, 16 heads: 0.73 ms of host time a step through the ops), which small shapes cannot hide.
def _eager_function(name, forward_impl, setup_context, backward):
    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


def _eager_cuda(*tensors: torch.Tensor) -> bool:
    """Whether this call may skip the registered ops: eager mode, no dispatch mode, plain CUDA tensors."""
    if torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor and t.is_cuda and not torch._C._functorch.is_functorch_wrapped_tensor(t)
               for t in tensors)


_EagerAttention = _eager_function("_EagerAttention", _fwd_impl, _fwd_setup_context,
                                  functools.partial(_fwd_backward, bwd=_bwd_impl))


# ----------------------------------------------------------------------------------------------------------------------
# Varlen custom ops
# ----------------------------------------------------------------------------------------------------------------------

def _varlen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int,
                     window_right: int, softcap: float, deterministic: bool, schedule: str,
                     sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    args = _op_args("dash_attn::varlen_fwd", max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left,
                    window_right, softcap, deterministic, schedule, sm_margin)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ext, host = _check_varlen(q, k, v, *seqs, max_seqlen_q, max_seqlen_k, softcap)
    if ext is not None:
        return varlen_fwd_launch(ext, host, q, k, v, seqs, max_seqlen_q, max_seqlen_k, args)
    out = _out_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, args.softmax_scale, False,
                                            args.window, args.softcap, return_lse=True,
                                            compute_dtype=_reference_dtype(q.dtype), seqused_q=seqused_q,
                                            seqused_k=seqused_k)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def varlen_fwd_launch(ext, host, q, k, v, seqs, max_seqlen_q, max_seqlen_k, args: OpArgs, sink=None):
    """The CUDA varlen forward on checked arguments (ext, host: _check_varlen's; args: mask already effective): the
    packed kernels for unplanned calls, else the planned path. sink: None or (nheads,) float32 (dash_attn/_sinks.py)."""
    if _runs_unplanned(ext, host, seqs[2], seqs[3]):
        bounds = _unplanned_bounds(host, max_seqlen_q, max_seqlen_k)
        return _varlen_fwd_unplanned(ext, q, k, v, seqs, bounds, args, checked_on_host=host is not None, sink=sink)
    return _varlen_fwd_cuda(ext, q, k, v, seqs[0], seqs[1], host[0], host[1], args, sink)


def varlen_bwd_launch(ext, host, dout, q, k, v, out, lse, seqs, max_seqlen_q, max_seqlen_k, args: OpArgs, sink=None,
                      dsink=None):
    """The CUDA varlen backward on checked arguments, as varlen_fwd_launch; dsink: float32 (nheads,) with a sink. GQA
    with few KV heads, or causal with large groups, runs on KV-head copies (dash_attn/_kv_heads.py)."""
    expanded = _kv_heads.expand(q, k, v, args.mask)
    if expanded is not None:
        dq, dk_x, dv_x = varlen_bwd_launch(ext, host, dout, q, *expanded, out, lse, seqs, max_seqlen_q, max_seqlen_k,
                                           args, sink, dsink)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        _kv_heads.sum_kv(ext, dk_x, dv_x, dk, dv)
        return dq, dk, dv
    if _runs_unplanned(ext, host, seqs[2], seqs[3]):
        bounds = _unplanned_bounds(host, max_seqlen_q, max_seqlen_k)
        return _varlen_bwd_unplanned(ext, dout, q, k, v, out, lse, seqs, bounds, args,
                                     checked_on_host=host is not None, sink=sink, dsink=dsink)
    return _varlen_bwd_cuda(ext, dout, q, k, v, out, lse, seqs[0], seqs[1], host[0], host[1], args, sink, dsink)


_varlen_fwd = torch.library.custom_op("dash_attn::varlen_fwd", mutates_args=())(_varlen_fwd_impl)


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    return _out_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int, window_right: int,
                     softcap: float, deterministic: bool, schedule: str,
                     sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _op_args("dash_attn::varlen_bwd", max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left,
                    window_right, softcap, deterministic, schedule, sm_margin)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ext, host = _check_varlen(q, k, v, *seqs, max_seqlen_q, max_seqlen_k, softcap)
    if ext is not None:
        return varlen_bwd_launch(ext, host, dout, q, k, v, out, lse, seqs, max_seqlen_q, max_seqlen_k, args)
    compute_dtype = _reference_dtype(q.dtype)
    used = dict(seqused_q=seqused_q, seqused_k=seqused_k)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, args.softmax_scale, False,
                                            args.window, args.softcap, return_lse=True, compute_dtype=compute_dtype,
                                            **used)
    grads = attention_bwd_ref_varlen(dout, q, k, v, ref_out, ref_lse, cu_seqlens_q, cu_seqlens_k, args.softmax_scale,
                                     False, args.window, args.softcap, compute_dtype, **used)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)
    return dq, dk, dv


_varlen_bwd = torch.library.custom_op("dash_attn::varlen_bwd", mutates_args=())(_varlen_bwd_impl)


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule,
                     sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_VARLEN_SEQ_INPUTS = 4  # cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k: after q, k, v, before the scalars


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    seqs, params = inputs[3:3 + _VARLEN_SEQ_INPUTS], inputs[3 + _VARLEN_SEQ_INPUTS:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *seqs)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _varlen_fwd_backward(ctx, dout, dlse, bwd=_varlen_bwd):
    q, k, v, out, lse, *seqs = ctx.saved_tensors
    dq, dk, dv = bwd(_last_dim_contiguous(dout), q, k, v, out, lse, *seqs, *ctx.params)
    return (dq, dk, dv) + (None,) * (_VARLEN_SEQ_INPUTS + len(ctx.params))


_varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)
_EagerVarlenAttention = _eager_function("_EagerVarlenAttention", _varlen_fwd_impl, _varlen_fwd_setup_context,
                                        functools.partial(_varlen_fwd_backward, bwd=_varlen_bwd_impl))
