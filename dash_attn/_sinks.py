"""Learnable attention sinks (gpt-oss's `sinks`, transformers' `s_aux`): the public functions' `learnable_sink`.

A sink is one logit per query head, sink_h, that joins every row's softmax denominator with no value vector:
    out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)),  lse_i = log(sum_j exp(s_ij) + exp(sink_h)).
CUDA tensors run the kernels: the forward adds the sink to each row's final sum (so lse includes it), the backward's
dQ/dK/dV need nothing more than that lse, and its preprocess computes d sink_h = -sum over rows of exp(sink_h - lse) *
rowsum(dO * O) from the D it computes anyway, summed in a fixed order (csrc/bwd/bwd_preprocess.h): deterministic in
both modes. CPU tensors run the reference math (dash_attn.reference), d sink summed by torch on the host. These calls
run through the autograd.Functions below, not the registered custom ops (dash_attn/_ops.py), whose schemas have no
sink (torch.compile with a sink is untested on CUDA).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import validation
from ._args import OpArgs, _reference_dtype
from ._launch import bwd_cuda, fwd_cuda
from ._ops import _last_dim_contiguous, varlen_bwd_launch, varlen_fwd_launch
from ._varlen import _check_varlen, _checked_host_lists
from .reference import attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen


def _reference_args(args: OpArgs):
    """(softmax_scale, window, softcap) for the CPU reference (whose window already encodes a causal mask; the
    deterministic flag, schedule and sm_margin only steer the CUDA backward)."""
    return args.softmax_scale, args.window, args.softcap


def attention(q, k, v, learnable_sink, args: OpArgs,
              attention_chunk: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_func's body with a sink: (out, lse), lse float32 (batch, nheads, seqlen_q) including the sink."""
    validation.check_learnable_sink(learnable_sink, q, attention_chunk)
    if q.device.type != "cpu":
        return _CudaSinkAttention.apply(q, k, v, learnable_sink.contiguous(), args)
    return _SinkAttention.apply(q, k, v, learnable_sink, *_reference_args(args))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q: int,
                     max_seqlen_k: int, learnable_sink, args: OpArgs,
                     attention_chunk: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's body with a sink: (out, lse), lse float32 (nheads, total_q) including the sink (-inf
    on the rows past seqused, which take no part)."""
    validation.check_learnable_sink(learnable_sink, q, attention_chunk)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    if q.device.type != "cpu":
        return _CudaSinkVarlenAttention.apply(q, k, v, learnable_sink.contiguous(), seqs, max_seqlen_q, max_seqlen_k,
                                              args)
    _checked_host_lists(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _SinkVarlenAttention.apply(q, k, v, learnable_sink, seqs, *_reference_args(args))


class _CudaSinkAttention(torch.autograd.Function):
    """Dense attention with a sink in the CUDA kernels."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, args: OpArgs):
        args = args.for_lengths(q.shape[1], k.shape[1])
        out, lse = fwd_cuda(q, k, v, args, learnable_sink)
        ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
        ctx.args = args
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, learnable_sink = ctx.saved_tensors
        dsink = torch.empty_like(learnable_sink)
        dq, dk, dv = bwd_cuda(_last_dim_contiguous(dout), q, k, v, out, lse, ctx.args, learnable_sink, dsink)
        return dq, dk, dv, dsink, None


class _CudaSinkVarlenAttention(torch.autograd.Function):
    """Varlen attention with a sink in the CUDA kernels; seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, seqs, max_seqlen_q: int, max_seqlen_k: int, args: OpArgs):
        args = args.for_lengths(max_seqlen_q, max_seqlen_k)
        ext, host = _check_varlen(q, k, v, *seqs, max_seqlen_q, max_seqlen_k, args.softcap)
        out, lse = varlen_fwd_launch(ext, host, q, k, v, seqs, max_seqlen_q, max_seqlen_k, args, learnable_sink)
        ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
        ctx.launch = (ext, host, seqs, max_seqlen_q, max_seqlen_k, args)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, learnable_sink = ctx.saved_tensors
        ext, host, seqs, max_q, max_k, args = ctx.launch
        dsink = torch.empty_like(learnable_sink)
        dq, dk, dv = varlen_bwd_launch(ext, host, _last_dim_contiguous(dout), q, k, v, out, lse, seqs, max_q, max_k,
                                       args, learnable_sink, dsink)
        return dq, dk, dv, dsink, None, None, None, None


def _cast_grads(grads, inputs):
    """The reference's gradients (compute dtype) in the dtypes of the inputs they belong to."""
    return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))


class _SinkAttention(torch.autograd.Function):
    """Dense attention with a sink on the CPU. Like the custom ops' CPU path, the backward recomputes out and lse in
    the compute dtype (float64 for float64 inputs): the float32 lse returned would cap gradcheck's accuracy."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, softmax_scale: float, window: Tuple[int, int], softcap: float):
        out, lse = attention_ref(q, k, v, softmax_scale, False, window, softcap, return_lse=True,
                                 compute_dtype=_reference_dtype(q.dtype), learnable_sink=learnable_sink)
        lse = lse.to(torch.float32)
        ctx.save_for_backward(q, k, v, learnable_sink)
        ctx.params = (softmax_scale, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        # The returned lse takes no gradient (as in the custom ops): it is marked non-differentiable.
        q, k, v, learnable_sink = ctx.saved_tensors
        softmax_scale, window, softcap = ctx.params
        compute_dtype = _reference_dtype(q.dtype)
        out, lse = attention_ref(q, k, v, softmax_scale, False, window, softcap, return_lse=True,
                                 compute_dtype=compute_dtype, learnable_sink=learnable_sink)
        grads = attention_bwd_ref(dout, q, k, v, out, lse, softmax_scale, False, window, softcap, compute_dtype,
                                  learnable_sink)
        return _cast_grads(grads, (q, k, v, learnable_sink)) + (None,) * 3


class _SinkVarlenAttention(torch.autograd.Function):
    """Varlen attention with a sink on the CPU; seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)."""

    @staticmethod
    def forward(ctx, q, k, v, learnable_sink, seqs: Tuple[Optional[torch.Tensor], ...], softmax_scale: float,
                window: Tuple[int, int], softcap: float):
        out, lse = _varlen_ref(q, k, v, learnable_sink, seqs, softmax_scale, window, softcap)
        lse = lse.to(torch.float32)
        ctx.save_for_backward(q, k, v, learnable_sink)
        ctx.params = (seqs, softmax_scale, window, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, learnable_sink = ctx.saved_tensors
        seqs, softmax_scale, window, softcap = ctx.params
        out, lse = _varlen_ref(q, k, v, learnable_sink, seqs, softmax_scale, window, softcap)
        cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = seqs
        grads = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         softmax_scale, False, window, softcap, _reference_dtype(q.dtype), seqused_q,
                                         seqused_k, learnable_sink)
        return _cast_grads(grads, (q, k, v, learnable_sink)) + (None,) * 4


def _varlen_ref(q, k, v, learnable_sink, seqs, softmax_scale, window, softcap):
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = seqs
    return attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, False, window, softcap,
                                return_lse=True, compute_dtype=_reference_dtype(q.dtype), seqused_q=seqused_q,
                                seqused_k=seqused_k, learnable_sink=learnable_sink)
