"""Learnable attention sinks (gpt-oss's `sinks`, transformers' `s_aux`): the public functions' `learnable_sink`.

A sink is one logit per query head, sink_h, that joins every row's softmax denominator with no value vector:
    out_i = sum_j exp(s_ij) v_j / (sum_j exp(s_ij) + exp(sink_h)),  lse_i = log(sum_j exp(s_ij) + exp(sink_h)).
CPU tensors run the reference math (dash_attn.reference) through the autograd.Functions below; the gradient of the
sink, d sink_h = -sum over rows of exp(sink_h - lse) * rowsum(dO * O), is summed by torch on the host, in a fixed
order, so the backward is deterministic by construction. The CUDA kernels take no sink yet: CUDA calls are refused
before any launch. These calls bypass the registered custom ops (dash_attn/_ops.py), whose schemas have no sink.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import validation
from ._args import _reference_dtype
from ._varlen import _checked_host_lists
from .reference import attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen


def _refuse_cuda(caller: str, q: torch.Tensor) -> None:
    """NotImplementedError (which validation.public_entry does not rename) naming the public function itself."""
    if q.device.type != "cpu":
        raise NotImplementedError(f"{caller}(): learnable_sink: the CUDA kernels do not take a sink yet; pass "
                                  "learnable_sink=None, or run the call on CPU tensors (the reference path)")


def _common(caller: str, q: torch.Tensor, learnable_sink: torch.Tensor, args: tuple, attention_chunk: int):
    """Checks the sink and the device; returns (softmax_scale, window, softcap) of api._common_args' tuple (the
    deterministic flag, schedule and sm_margin only steer the CUDA backward)."""
    validation.check_learnable_sink(learnable_sink, q, attention_chunk)
    _refuse_cuda(caller, q)
    softmax_scale, _, window_left, window_right, softcap = args[:5]
    return softmax_scale, (window_left, window_right), softcap


def attention(caller: str, q, k, v, learnable_sink, args: tuple,
              attention_chunk: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_func's body with a sink: (out, lse), lse float32 (batch, nheads, seqlen_q) including the sink."""
    softmax_scale, window, softcap = _common(caller, q, learnable_sink, args, attention_chunk)
    return _SinkAttention.apply(q, k, v, learnable_sink, softmax_scale, window, softcap)


def varlen_attention(caller: str, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q: int,
                     max_seqlen_k: int, learnable_sink, args: tuple,
                     attention_chunk: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func's body with a sink: (out, lse), lse float32 (nheads, total_q) including the sink (-inf
    on the rows past seqused, which take no part)."""
    softmax_scale, window, softcap = _common(caller, q, learnable_sink, args, attention_chunk)
    _checked_host_lists(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    return _SinkVarlenAttention.apply(q, k, v, learnable_sink, seqs, softmax_scale, window, softcap)


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
