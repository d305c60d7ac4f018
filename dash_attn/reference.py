"""Pure-PyTorch attention with every feature of the public API, in float32 or float64 math.

Two roles: the CPU implementation behind `flash_attn_func` (so the API works without a GPU) and the oracle that the GPU
tests compare the kernels against. Layout follows FlashAttention: q (batch, seqlen_q, nheads, headdim), k/v
(batch, seqlen_k, nheads_k, headdim); varlen packs sequences along dim 0 and delimits them with cu_seqlens.

Mask convention (shared with the kernels): the diagonal is bottom-right aligned, so query row i sees key j iff
    i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
where a window bound of -1 drops that side of the condition and causal is window_right = 0. A row that sees no key
gets output 0 and log-sum-exp -inf.

Learnable sinks (gpt-oss): learnable_sink (nheads,) adds exp(sink_h) to every row's softmax denominator of head h, a
logit with no value vector (neither scaled nor soft-capped). The output shrinks by the mass the sink takes, lse
becomes log(sum_j exp(s_ij) + exp(sink_h)) (sink_h on a row that sees no key, whose output stays 0), and the sink's
gradient is d sink_h = -sum over rows of exp(sink_h - lse) * D, D = rowsum(dO * O).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "visibility_mask",
    "attention_ref",
    "attention_ref_varlen",
    "attention_bwd_ref",
    "attention_bwd_ref_varlen",
    "row_statistic_error_bound",
]


def _default_scale(headdim: int) -> float:
    return 1.0 / math.sqrt(headdim)


def _window_bounds(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def visibility_mask(seqlen_q: int, seqlen_k: int, window_left: int = -1, window_right: int = -1,
                    device=None) -> torch.Tensor:
    """Boolean (seqlen_q, seqlen_k) tensor, True where query i may attend to key j (bottom-right aligned)."""
    row = torch.arange(seqlen_q, device=device).unsqueeze(1)
    col = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = row + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        visible &= col >= diag - window_left
    if window_right >= 0:
        visible &= col <= diag + window_right
    return visible


def _compute_dtype(dtype: torch.dtype, upcast: bool, compute_dtype: Optional[torch.dtype]) -> torch.dtype:
    if not upcast:
        return dtype
    if compute_dtype is not None:
        return compute_dtype
    # float64 inputs (gradcheck) keep float64 math; everything else is upcast to float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv_heads(x: torch.Tensor, nheads: int) -> torch.Tensor:
    """(b, s, hk, d) -> (b, s, nheads, d): query head h reads key/value head h // (nheads // hk)."""
    group = nheads // x.shape[2]
    if group == 1:
        return x
    b, s, hk, d = x.shape
    return x.unsqueeze(3).expand(b, s, hk, group, d).reshape(b, s, nheads, d)


def _reduce_kv_heads(x: torch.Tensor, nheads_k: int) -> torch.Tensor:
    """Inverse of _expand_kv_heads for gradients: sum over the query heads of each group."""
    b, s, h, d = x.shape
    if h == nheads_k:
        return x
    return x.reshape(b, s, nheads_k, h // nheads_k, d).sum(dim=3)


def _scores(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, softcap: float) -> torch.Tensor:
    """Scaled (and optionally soft-capped) scores, (b, h, sq, sk); q and k already in the compute dtype."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    return scores


def _sink_logits(learnable_sink, dtype, like: torch.Tensor) -> torch.Tensor:
    """(nheads,) sink logits as (1, nheads, 1, 1) in `dtype`, broadcasting against scores (b, h, sq, sk)."""
    return learnable_sink.to(dtype).view(1, -1, 1, 1).expand(like.shape[0], -1, like.shape[2], 1)


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, upcast=True,
                  return_lse=False, compute_dtype=None, learnable_sink=None):
    """Attention forward, differentiable by autograd (the reference backward).

    upcast=True runs the math in `compute_dtype` (default float32, float64 for float64 inputs) and returns the output
    in q's dtype; upcast=False runs it in q's dtype, which is the "plain low-precision implementation" the GPU tests
    use to calibrate tolerances. With return_lse the log-sum-exp (natural log, (batch, nheads, seqlen_q), in the
    compute dtype, -inf for rows that see no key) is returned too. learnable_sink: None or (nheads,) sink logits
    (see the module docstring), differentiable too.
    """
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = _default_scale(headdim)
    dtype = _compute_dtype(q.dtype, upcast, compute_dtype)
    left, right = _window_bounds(causal, window_size)

    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    kc = _expand_kv_heads(kc, nheads)
    vc = _expand_kv_heads(vc, nheads)

    scores = _scores(qc, kc, softmax_scale, softcap)
    visible = visibility_mask(seqlen_q, seqlen_k, left, right, device=q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    # A sink is one more column of logits that takes part in the row max and the row sum but has no value vector.
    sink = None if learnable_sink is None else _sink_logits(learnable_sink, dtype, scores)
    logits = scores if sink is None else torch.cat((scores, sink), dim=-1)

    # Softmax written out so fully masked rows give P = 0 (not NaN) in both the value and the autograd backward.
    if logits.shape[-1] > 0:
        row_max = logits.amax(dim=-1, keepdim=True).detach()
    else:  # amax over an empty dim fails; with no key every row is fully masked anyway
        row_max = scores.new_zeros(batch, nheads, seqlen_q, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    unnormalised = torch.exp(scores - row_max)
    row_sum = unnormalised.sum(dim=-1, keepdim=True)
    if sink is not None:
        row_sum = row_sum + torch.exp(sink - row_max)
    probs = unnormalised / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc).to(q.dtype)
    if not return_lse:
        return out
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    return out, lse


def _sequence_slices(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q=None, seqused_k=None):
    """Each sequence's rows: [cu_seqlens[b], cu_seqlens[b + 1]), or its first seqused[b] of them."""
    starts_q = cu_seqlens_q.tolist()
    starts_k = cu_seqlens_k.tolist()
    used_q = seqused_q.tolist() if seqused_q is not None else None
    used_k = seqused_k.tolist() if seqused_k is not None else None
    for b in range(len(starts_q) - 1):
        end_q = starts_q[b + 1] if used_q is None else starts_q[b] + used_q[b]
        end_k = starts_k[b + 1] if used_k is None else starts_k[b] + used_k[b]
        yield slice(starts_q[b], end_q), slice(starts_k[b], end_k)


def attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False, window_size=(-1, -1),
                         softcap=0.0, upcast=True, return_lse=False, compute_dtype=None, seqused_q=None,
                         seqused_k=None, learnable_sink=None):
    """Varlen forward: q (total_q, nheads, d), k/v (total_k, nheads_k, d); each sequence masked on its own.
    seqused_q/k (batch,): the rows of each sequence in use (from its first); the others see nothing and are seen by
    nothing (out 0, lse -inf, with a sink too: they take no part). learnable_sink as in attention_ref.

    Returns out (total_q, nheads, d) and, with return_lse, lse (nheads, total_q).
    """
    if softmax_scale is None:
        softmax_scale = _default_scale(q.shape[-1])
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=_compute_dtype(q.dtype, upcast, compute_dtype),
                     device=q.device)
    for sq, sk in _sequence_slices(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        out_b, lse_b = attention_ref(q[sq].unsqueeze(0), k[sk].unsqueeze(0), v[sk].unsqueeze(0), softmax_scale,
                                     causal, window_size, softcap, upcast, True, compute_dtype, learnable_sink)
        out[sq] = out_b.squeeze(0)
        lse[:, sq] = lse_b.squeeze(0)
    return (out, lse) if return_lse else out


def _bwd_terms(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, dtype):
    """The operands of the backward formulas in `dtype`: scores, P, D (b, h, sq), dO, Q and K/V expanded to every
    query head."""
    nheads = q.shape[2]
    left, right = _window_bounds(causal, window_size)
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    doc, oc, lsec = dout.to(dtype), out.to(dtype), lse.to(dtype)
    kx, vx = _expand_kv_heads(kc, nheads), _expand_kv_heads(vc, nheads)
    scores = _scores(qc, kx, softmax_scale, softcap)
    visible = visibility_mask(q.shape[1], k.shape[1], left, right, device=q.device)
    # Rows with lse = -inf saw no key: P must be 0 there, not exp(-inf + inf).
    lse_safe = torch.where(torch.isneginf(lsec), torch.full_like(lsec, float("inf")), lsec)
    probs = torch.exp(scores - lse_safe.unsqueeze(-1)).masked_fill(~visible, 0.0)
    delta = (doc * oc).sum(dim=-1).transpose(1, 2)  # (b, h, sq)
    return scores, probs, delta, doc, qc, kx, vx


def attention_bwd_ref(dout, q, k, v, out, lse, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      compute_dtype=torch.float32, learnable_sink=None):
    """Explicit backward with the FlashAttention formulas, given the forward's out and lse.

        D = rowsum(dO * O),  P = exp(S - lse),  dP = dO V^T,  dS = P * (dP - D),
        dV = P^T dO,  dQ = scale * dS' K,  dK = scale * dS'^T Q,
    where dS' = dS * (1 - tanh^2) when softcap is on (the derivative of softcap * tanh(x / softcap)).
    GQA: dK/dV are summed over the query heads that share a key/value head. Returns dq, dk, dv in compute_dtype.
    With learnable_sink (its lse includes the sink) the formulas stay as they are, P just no longer sums to 1 over the
    keys, and d_sink (nheads,) in compute_dtype is returned fourth (_sink_grad).
    """
    nheads_k = k.shape[2]
    if softmax_scale is None:
        softmax_scale = _default_scale(q.shape[-1])
    scores, probs, delta, doc, qc, kx, vx = _bwd_terms(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                                                       softcap, compute_dtype)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", doc, vx)
    dscores = probs * (dprobs - delta.unsqueeze(-1))
    if softcap > 0.0:
        dscores = dscores * (1.0 - (scores / softcap) ** 2)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, doc)
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, kx) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, qc) * softmax_scale
    grads = (dq, _reduce_kv_heads(dk, nheads_k), _reduce_kv_heads(dv, nheads_k))
    if learnable_sink is None:
        return grads
    return grads + (_sink_grad(learnable_sink, lse, delta, compute_dtype),)


def _sink_grad(learnable_sink, lse, delta, dtype) -> torch.Tensor:
    """d sink_h = -sum over (batch, row) of p_sink * D, p_sink = exp(sink_h - lse): the sink's logit enters every
    row's softmax like a key's, with dP = 0 (no value), so its dS is p_sink * (0 - D). Rows with lse = -inf (none see
    the sink: the rows past seqused) add 0. lse, delta (b, h, sq); summed by torch on the host in a fixed order."""
    lsec = lse.to(dtype)
    lse_safe = torch.where(torch.isneginf(lsec), torch.full_like(lsec, float("inf")), lsec)
    p_sink = torch.exp(learnable_sink.to(dtype).view(1, -1, 1) - lse_safe)
    return -(p_sink * delta).sum(dim=(0, 2))


def row_statistic_error_bound(dout, q, k, v, out, lse, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, rel=2.0**-16, compute_dtype=torch.float32):
    """Largest error of dq and dk (elementwise bounds, in compute_dtype) when D = rowsum(dO * O) is carried to relative
    precision `rel`: dS = P * (dP - D) then errs by at most P * |D| * rel, so dQ by scale * (P |D| rel) |K| and dK by
    scale * (P |D| rel)^T |Q| (soft-capping's factor 1 - tanh^2 only shrinks them). Where one key cancels exactly
    (dS = 0) this is the whole error of such a kernel, and a PyTorch baseline that forms D as sum(P * dP) has none, so
    the bound is the floor such cases are checked against."""
    nheads_k = k.shape[2]
    if softmax_scale is None:
        softmax_scale = _default_scale(q.shape[-1])
    _, probs, delta, _, qc, kx, _ = _bwd_terms(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                                               compute_dtype)
    err_ds = probs * delta.abs().unsqueeze(-1) * rel
    dq = torch.einsum("bhqk,bkhd->bqhd", err_ds, kx.abs()) * softmax_scale
    dk = torch.einsum("bhqk,bqhd->bkhd", err_ds, qc.abs()) * softmax_scale
    return dq, _reduce_kv_heads(dk, nheads_k)


def attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, compute_dtype=torch.float32, seqused_q=None,
                             seqused_k=None, learnable_sink=None):
    """Varlen form of attention_bwd_ref; lse is (nheads, total_q). Returns dq, dk, dv in compute_dtype (0 on the rows
    past seqused), and with learnable_sink d_sink too, summed over the sequences in order."""
    if softmax_scale is None:
        softmax_scale = _default_scale(q.shape[-1])
    dq = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=compute_dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=compute_dtype, device=v.device)
    dsink = None if learnable_sink is None else torch.zeros(q.shape[1], dtype=compute_dtype, device=q.device)
    for sq, sk in _sequence_slices(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        grads = attention_bwd_ref(dout[sq].unsqueeze(0), q[sq].unsqueeze(0), k[sk].unsqueeze(0), v[sk].unsqueeze(0),
                                  out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0), softmax_scale, causal, window_size,
                                  softcap, compute_dtype, learnable_sink)
        dq[sq], dk[sk], dv[sk] = (g.squeeze(0) for g in grads[:3])
        if dsink is not None:
            dsink += grads[3]
    return (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink)
