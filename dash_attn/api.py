"""The public entry points, FlashAttention-3's interface: argument checks and normalisation (metadata only, so that
they trace under torch.compile), then one call of a custom op or autograd function of dash_attn/interface.py."""
from __future__ import annotations

import functools

import torch

from . import _sinks, validation
from ._chunked import chunked_attention, chunked_varlen_attention
from .interface import EagerAttention, EagerVarlenAttention, OpArgs, eager_cuda, fwd_op, mask_args
from .interface import resolve_deterministic, varlen_fwd_op
from .schedules_table import AUTO, NONDETERMINISTIC_SCHEDULES, SCHEDULES

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "SCHEDULES",
           "NONDETERMINISTIC_SCHEDULES"]


def _common_args(q, softmax_scale, causal, window_size, softcap, deterministic, schedule, sm_margin):
    validation.check_softmax_scale(softmax_scale)
    window_left, window_right = validation.check_window(causal, window_size)
    softcap = validation.check_softcap(softcap)
    validation.check_deterministic(deterministic)
    validation.check_schedule(schedule)
    sm_margin = validation.check_sm_margin(sm_margin)
    if softmax_scale is None:
        softmax_scale = validation.default_softmax_scale(q.shape[-1])
    mask, window_left, window_right = mask_args(window_left, window_right)
    deterministic = resolve_deterministic(deterministic)
    validation.check_schedule_mode(schedule, deterministic)
    return OpArgs(float(softmax_scale), mask, window_left, window_right, softcap, deterministic, schedule, sm_margin)


# The bodies of the public functions. The public functions check their own extra arguments and call these, never each
# other: validation.public_entry names the function the user called in every error, once.
def _run_varlen(args, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """The varlen op on checked arguments; args: _common_args's."""
    op = EagerVarlenAttention.apply if eager_cuda(q, k, v) else varlen_fwd_op
    return op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, *args)


def _padded_head_dims(q, k, v):
    """q, k, v with their head dims zero-padded to validation.padded_head_dim's (copies only where a head dim is not a
    multiple of 8 already); autograd drops the padding columns from their gradients. Called after _common_args, whose
    default softmax_scale is that of the head dim given."""
    def pad(t, headdim):
        return t if t.shape[-1] == headdim else torch.nn.functional.pad(t, (0, headdim - t.shape[-1]))

    headdim, headdim_v = (validation.padded_head_dim(t.shape[-1]) for t in (q, v))
    return pad(q, headdim), pad(k, headdim), pad(v, headdim_v)


def _scoreless_queries(q, args):
    """softmax_scale 0 makes every score 0: zero queries at scale 1 give the same scores, so the same out, lse, dK
    and dV, and as q * 0 they give dQ = 0 through autograd. The kernels never take scale 0: a masked score's -inf
    times 0 is NaN in the forward, and the backward folds 1 / scale into its row statistics (RowStats::kGemmInit,
    csrc/bwd/bwd_config.h)."""
    if args.softmax_scale != 0.0:
        return q, args
    return q * 0, args._replace(softmax_scale=1.0)


def _results(out, lse, headdim_v, return_attn_probs):
    """What the public functions return: out without v's padding columns, contiguous like an unpadded call's (callers
    view it as (..., nheads * headdim_v)), and lse with return_attn_probs."""
    if out.shape[-1] != headdim_v:
        out = out[..., :headdim_v].contiguous()
    return (out, lse) if return_attn_probs else out


# attention_chunk = 0 takes none of the chunked paths' work; a chunk that masks nothing for these lengths (the
# chunked functions return None) runs the call as it is.
def _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, sm_margin, return_attn_probs,
               schedule, attention_chunk=0, learnable_sink=None):
    validation.check_qkv(q, k, v, varlen=False)
    args = _common_args(q, softmax_scale, causal, window_size, softcap, deterministic, schedule, sm_margin)
    headdim_v = v.shape[-1]
    q, k, v = _padded_head_dims(q, k, v)
    q, args = _scoreless_queries(q, args)
    if learnable_sink is not None:
        return _results(*_sinks.attention(q, k, v, learnable_sink, args, attention_chunk), headdim_v,
                        return_attn_probs)
    result = None
    if attention_chunk:
        result = chunked_attention(q, k, v, attention_chunk, functools.partial(_run_varlen, args))
    if result is None:
        result = (EagerAttention.apply if eager_cuda(q, k, v) else fwd_op)(q, k, v, *args)
    return _results(*result, headdim_v, return_attn_probs)


def _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                      softmax_scale, causal, window_size, softcap, deterministic, sm_margin, return_attn_probs,
                      schedule, attention_chunk=0, learnable_sink=None):
    validation.check_qkv(q, k, v, varlen=True)
    max_seqlen_q, max_seqlen_k = validation.check_cu_seqlens_meta(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                                  max_seqlen_k)
    validation.check_seqused_meta(q, cu_seqlens_q, seqused_q, seqused_k)
    args = _common_args(q, softmax_scale, causal, window_size, softcap, deterministic, schedule, sm_margin)
    headdim_v = v.shape[-1]
    q, k, v = _padded_head_dims(q, k, v)
    q, args = _scoreless_queries(q, args)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    if learnable_sink is not None:
        return _results(*_sinks.varlen_attention(q, k, v, *seqs, learnable_sink, args, attention_chunk), headdim_v,
                        return_attn_probs)
    result = None
    if attention_chunk:
        result = chunked_varlen_attention(q, k, v, *seqs, attention_chunk, functools.partial(_run_varlen, args))
    if result is None:
        result = _run_varlen(args, q, k, v, *seqs)
    return _results(*result, headdim_v, return_attn_probs)


# ----------------------------------------------------------------------------------------------------------------------
# FlashAttention-3's functions: its parameters in its order, dash_attn's own after
# them, keyword-only. deterministic defaults to None (FA3: False): follow torch.are_deterministic_algorithms_enabled().
# ----------------------------------------------------------------------------------------------------------------------

@validation.public_entry
def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=None, sm_margin=0, return_attn_probs=False, *, schedule=AUTO,
                    learnable_sink=None):
    """Scaled dot-product attention with FlashAttention-3's interface.

    q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim), nheads % nheads_k == 0; v:
    (batch, seqlen_k, nheads_k, headdim_v), headdim_v = headdim or another (e.g. 192 / 128); out takes headdim_v.
    Head dims: 1 to 256; on CUDA the kernel is the smallest built one (64, 128, 256) that holds both, the missing
    columns read as zeros, at its cost. A head dim that is not a multiple of 8 is zero-padded to the next one first
    (copies of q, k, v; out and the gradients come back without the padding). softmax_scale: >= 0, default
    1/sqrt(headdim) of the head dim given.
    causal: bottom-right aligned (query i sees key j <= i + seqlen_k - seqlen_q). window_size: (left, right) around
    the same diagonal, integers (ints, numpy integers, 0-d integer tensors); a negative side is unbounded, as is a
    side wider than the sequences; causal=True sets the right side to 0 (FlashAttention-3's rules).
    softcap > 0: scores = softcap * tanh(scores / softcap).
    deterministic: bitwise-reproducible backward; None follows torch.are_deterministic_algorithms_enabled().
    sm_margin: SMs the backward leaves free. schedule (keyword-only): backward schedule name from SCHEDULES ("auto":
    with deterministic=True the invariant pick by mask, else the cost model's; NONDETERMINISTIC_SCHEDULES claim their
    units at run time and run only with deterministic=False).
    learnable_sink (keyword-only; gpt-oss's attention sinks): None or a float32 (nheads,) tensor, one logit per query
    head that joins every row's softmax denominator with no value vector (out shrinks by the mass it takes, lse
    includes it) and takes a gradient (deterministic in both modes; dash_attn/_sinks.py).
    Returns out (batch, seqlen_q, nheads, headdim_v), or (out, lse) with return_attn_probs, lse float32 (batch,
    nheads, seqlen_q), natural log.
    attention_chunk: 0 (off), or C > 0 (FlashAttention-3's, Llama 4's chunked attention): a query at position
    p = i + seqlen_k - seqlen_q sees only keys j with j // C == p // C, within its causal / window band (a query
    at p < 0 sees none: out 0, lse -inf). It runs as a varlen call over the chunks (dash_attn/_chunked.py), with
    gradients (FA3's backward has none); not inside a CUDA graph capture.
    FlashAttention-3's other parameters run unchanged at their defaults: qv and q/k/v_descale (None) are features
    dash_attn lacks, refused otherwise; num_splits takes 1 or 0 (FA3's split-KV forward is not built); pack_gqa is
    accepted and ignored (it changes FA3's tiling, not the result).
    """
    attention_chunk = validation.check_fa3_options(dict(
        qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
        num_splits=num_splits, pack_gqa=pack_gqa))
    return _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, sm_margin,
                      return_attn_probs, schedule, attention_chunk, learnable_sink)


@validation.public_entry
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=None, sm_margin=0, return_attn_probs=False, *,
                           schedule=AUTO, learnable_sink=None):
    """Attention over sequences packed along dim 0 (FlashAttention-3's varlen interface).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim); cu_seqlens_q/k: int32 (batch + 1,) prefix sums
    of the sequence lengths; max_seqlen_q/k: the longest sequence (integers). Other arguments as in flash_attn_func;
    each sequence is masked on its own, and a window side wider than max_seqlen is unbounded. Returns out, or (out,
    lse) with lse float32 (nheads, total_q).
    On CUDA one launch per direction runs all sequences (the packed-sequence kernels) where each sequence's causal
    or window band lies inside the longest sequences' and the head dim is a kernel's own, else the dense kernels run
    once per run of consecutive sequences with equal lengths. cu_seqlens is read on the host (checks, planning); from
    the GPU that copy waits for it once per pair of tensors (the backward and other calls given the same tensors
    reuse it), CPU tensors need none. Inside a CUDA graph capture (cu_seqlens on q's device) nothing is read: the
    packed kernels run with max_seqlen_q/k as bounds and cu_seqlens is checked on the GPU, invalid values (including
    a sequence longer than its bound, or a causal or window band the bounds' schedule cannot reach) turning every
    result into NaN.
    seqused_q/k (FlashAttention-3's): None or int32 (batch,) tensors, the rows of each sequence in use (from its
    first); the rows past them take no part (out and their gradients 0, lse -inf), and a causal mask or window lies
    around each sequence's own diagonal seqused_k - seqused_q. Such calls run in the packed kernels; where those
    diagonals differ, with bounds (or, for two-sided windows, launches) that reach every sequence's band
    (dash_attn/_seq_bands.py). The packed kernels take q, k and v of one kernel's head dim: calls inside a capture
    or with seqused run on copies padded to it where theirs differ.
    attention_chunk as in flash_attn_func, per sequence (over its rows in use); cu_seqlens is then read on the host
    to plan the chunks, and the call runs as one varlen call over them without seqused.
    """
    attention_chunk = validation.check_fa3_options(dict(
        qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk,
        num_splits=num_splits, pack_gqa=pack_gqa))
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                             softmax_scale, causal, window_size, softcap, deterministic, sm_margin, return_attn_probs,
                             schedule, attention_chunk, learnable_sink)


@validation.public_entry
def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=None,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False, *, schedule=AUTO,
                              learnable_sink=None):
    """flash_attn_func on q, k, v packed in one tensor (FlashAttention-3's qkvpacked interface).

    qkv: (batch, seqlen, 3, nheads, headdim), or with num_heads_q given (batch, seqlen, num_heads_q + 2 * nheads_k,
    headdim): the query heads, then the key heads, then the value heads (MQA/GQA). The kernels read the three slices
    in place; their gradients come back packed like qkv. Other arguments and the result as in flash_attn_func.
    """
    attention_chunk = validation.check_fa3_options(dict(q_descale=q_descale, k_descale=k_descale,
                                                        v_descale=v_descale, attention_chunk=attention_chunk))
    q, k, v = validation.unpack_qkv(qkv, num_heads_q)
    return _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, sm_margin,
                      return_attn_probs, schedule, attention_chunk, learnable_sink)


# ----------------------------------------------------------------------------------------------------------------------
# FlashAttention-2's packed functions (FA3 has no such names): FA2's parameters in its order, dropout_p and
# alibi_slopes only at their 'off' values; then keyword-only dash_attn's own and FlashAttention-3's options
# (validation.FA3_OPTIONS), so that a call ported from FA3's keywords runs too.
# ----------------------------------------------------------------------------------------------------------------------

@validation.public_entry
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=None, return_attn_probs=False, *,
                             sm_margin=0, schedule=AUTO, learnable_sink=None, **fa3_options):
    """flash_attn_func with k and v packed in one tensor (FlashAttention-2's kvpacked interface).

    q: (batch, seqlen_q, nheads, headdim); kv: (batch, seqlen_k, 2, nheads_k, headdim). Other arguments and the
    result as in flash_attn_func.
    """
    validation.check_fa2_options(dropout_p, alibi_slopes)
    attention_chunk = validation.check_fa3_options(fa3_options)
    k, v = validation.unpack_kv(kv)
    return _attention(q, k, v, softmax_scale, causal, window_size, softcap, deterministic, sm_margin,
                      return_attn_probs, schedule, attention_chunk, learnable_sink)


@validation.public_entry
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=None,
                                     return_attn_probs=False, *, num_heads_q=None, sm_margin=0, schedule=AUTO,
                                     learnable_sink=None, **fa3_options):
    """flash_attn_varlen_func on packed sequences whose q, k, v share one tensor (FlashAttention-2's interface).

    qkv: (total, 3, nheads, headdim), or with num_heads_q (total, num_heads_q + 2 * nheads_k, headdim); cu_seqlens and
    max_seqlen serve both queries and keys. Other arguments and the result as in flash_attn_varlen_func.
    """
    validation.check_fa2_options(dropout_p, alibi_slopes)
    attention_chunk = validation.check_fa3_options(fa3_options)
    q, k, v = validation.unpack_qkv(qkv, num_heads_q, varlen=True)
    return _varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, None, None, softmax_scale,
                             causal, window_size, softcap, deterministic, sm_margin, return_attn_probs, schedule,
                             attention_chunk, learnable_sink)


@validation.public_entry
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=None, return_attn_probs=False, *, sm_margin=0,
                                    schedule=AUTO, learnable_sink=None, **fa3_options):
    """flash_attn_varlen_func with k and v packed in one tensor (FlashAttention-2's interface).

    q: (total_q, nheads, headdim); kv: (total_k, 2, nheads_k, headdim). Other arguments and the result as in
    flash_attn_varlen_func.
    """
    validation.check_fa2_options(dropout_p, alibi_slopes)
    attention_chunk = validation.check_fa3_options(fa3_options)
    k, v = validation.unpack_kv(kv, varlen=True)
    return _varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, None, None,
                             softmax_scale, causal, window_size, softcap, deterministic, sm_margin, return_attn_probs,
                             schedule, attention_chunk, learnable_sink)
