"""learnable_sink (gpt-oss's attention sinks) on the CPU path: values and the gradients of q, k, v and the sink against
an explicit float64 formula differentiated by torch.autograd (the sink as one more column of logits, dropped after the
softmax, as transformers' gpt-oss eager attention writes it), the explicit reference backward, gradcheck, varlen with
empty sequences, bitwise repeatability, the argument checks and the refusal on CUDA."""
import pytest
import torch

import dash_attn
from dash_attn.reference import (attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen,
                                 visibility_mask)

from api_common import cu, qkv, varlen_inputs

F64 = torch.float64
TOL64 = dict(rtol=1e-10, atol=1e-10)


def _explicit(q, k, v, sink, scale, causal=False, window=(-1, -1), softcap=0.0):
    """out and lse of attention with a sink, written as gpt-oss's eager attention: softmax over [scores, sink]."""
    nheads, sq, sk = q.shape[2], q.shape[1], k.shape[1]
    group = nheads // k.shape[2]
    kx, vx = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window
    if causal:
        right = 0
    scores = scores.masked_fill(~visibility_mask(sq, sk, left, right), float("-inf"))
    sinks = sink.view(1, -1, 1, 1).expand(q.shape[0], -1, sq, 1)
    logits = torch.cat((scores, sinks), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, vx), torch.logsumexp(logits, dim=-1)


def _sink(nheads, value, dtype=torch.float32, requires_grad=True):
    gen = torch.Generator().manual_seed(7)
    return (value + torch.randn(nheads, generator=gen)).to(dtype).requires_grad_(requires_grad)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


# (seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap)
CASES = [
    pytest.param(6, 6, 2, 2, False, (-1, -1), 0.0, id="full"),
    pytest.param(5, 9, 4, 2, True, (-1, -1), 0.0, id="causal-sq<sk-gqa"),
    pytest.param(9, 5, 4, 1, True, (-1, -1), 0.0, id="causal-sq>sk-mqa"),
    pytest.param(8, 8, 4, 2, False, (2, 1), 0.0, id="window"),
    pytest.param(7, 10, 2, 2, True, (3, 0), 0.0, id="window-causal"),
    pytest.param(6, 7, 4, 2, True, (-1, -1), 1.5, id="causal-softcap"),
    pytest.param(4, 0, 2, 1, False, (-1, -1), 0.0, id="no-keys"),
]
SINK_VALUES = [-5.0, 0.0, 5.0, 30.0]  # +30: the sink takes nearly all the mass


@pytest.mark.parametrize("sink_value", SINK_VALUES)
@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", CASES)
def test_float64_matches_autograd_of_explicit_formula(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap,
                                                      sink_value):
    q, k, v = qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 16, dtype=F64, requires_grad=True)
    sink = _sink(nheads, sink_value, F64)
    out, lse = dash_attn.flash_attn_func(q, k, v, 0.3, causal, window_size=window, softcap=softcap,
                                         learnable_sink=sink, return_attn_probs=True)
    ref_out, ref_lse = _explicit(q, k, v, sink, 0.3, causal, window, softcap)
    torch.testing.assert_close(out, ref_out, **TOL64)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    grads = _grads(out, (q, k, v, sink), dout)
    expected = _grads(ref_out, (q, k, v, sink), dout)
    for g, e in zip(grads, expected):
        assert g.dtype == F64
        torch.testing.assert_close(g, e, **TOL64)


@pytest.mark.parametrize("sink_value", SINK_VALUES)
@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", CASES)
def test_reference_backward_matches_autograd(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap,
                                             sink_value):
    """attention_bwd_ref's explicit formulas (d_sink = -sum p_sink * D) against autograd of attention_ref."""
    q, k, v = qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 8, dtype=F64, requires_grad=True)
    sink = _sink(nheads, sink_value, F64)
    out, lse = attention_ref(q, k, v, 0.4, causal, window, softcap, return_lse=True, learnable_sink=sink)
    ref_out, ref_lse = _explicit(q, k, v, sink, 0.4, causal, window, softcap)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    grads = attention_bwd_ref(dout, q, k, v, out, lse, 0.4, causal, window, softcap, F64, learnable_sink=sink)
    assert len(grads) == 4 and grads[3].shape == (nheads,)
    for g, e in zip(grads, _grads(ref_out, (q, k, v, sink), dout)):
        torch.testing.assert_close(g, e, **TOL64)


def test_sink_free_signatures_are_unchanged():
    q, k, v = qkv(dtype=F64)
    dout = torch.ones_like(q)
    out, lse = attention_ref(q, k, v, return_lse=True)
    assert len(attention_bwd_ref(dout, q, k, v, out, lse, compute_dtype=F64)) == 3


def test_large_sink_takes_the_mass():
    q, k, v = qkv(dtype=F64)
    sink = torch.full((4,), 1e3, dtype=F64)
    out, lse = dash_attn.flash_attn_func(q, k, v, learnable_sink=sink, return_attn_probs=True)
    assert out.abs().max() < 1e-300 and torch.equal(lse, torch.full_like(lse, 1e3))


def test_rows_without_keys_get_the_sink_lse():
    """A row that sees no key: out 0, lse = the sink (the only term of its denominator), no NaN in any gradient."""
    q, k, v = qkv(1, 6, 3, 2, 2, 8, dtype=F64, requires_grad=True)  # causal, sq > sk: the first 3 rows see nothing
    sink = _sink(2, 0.0, F64)
    out, lse = dash_attn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    assert torch.all(out[:, :3] == 0)
    torch.testing.assert_close(lse[0, :, :3], sink.detach().float().view(2, 1).expand(2, 3))
    grads = torch.autograd.grad(out.sum(), (q, k, v, sink))
    assert all(torch.isfinite(g).all() for g in grads) and torch.all(grads[0][:, :3] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_follows_the_reference(dtype):
    """Inputs in the kernels' dtypes run the reference in float32 and come back in their dtype; the sink's gradient
    is float32."""
    q, k, v = qkv(seqlen_q=7, seqlen_k=9, dtype=dtype, requires_grad=True)
    sink = _sink(4, 1.0)
    out, lse = dash_attn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    grads = _grads(out, (q, k, v, sink), dout)
    q64, k64, v64, s64 = (t.detach().double().requires_grad_() for t in (q, k, v, sink))
    expected = _grads(_explicit(q64, k64, v64, s64, q.shape[-1] ** -0.5, True)[0], (q64, k64, v64, s64),
                      dout.double())
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    for g, e, t in zip(grads, expected, (q, k, v, sink)):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g.double(), e, **tol)


def test_gradcheck_with_sink():
    q, k, v = qkv(1, 4, 5, 2, 1, 8, dtype=F64, requires_grad=True)
    sink = _sink(2, 0.5, F64)

    def fn(q, k, v, sink):
        return dash_attn.flash_attn_func(q, k, v, 0.5, True, softcap=1.2, learnable_sink=sink)

    assert torch.autograd.gradcheck(fn, (q, k, v, sink), eps=1e-6, atol=1e-7)


def test_gradcheck_varlen_with_sink():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(2, 0, 3), lens_k=(3, 2, 2), nheads=2, nheads_k=1,
                                                      requires_grad=True)
    sink = _sink(2, 0.5, F64)

    def fn(q, k, v, sink):
        return dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, learnable_sink=sink)

    assert torch.autograd.gradcheck(fn, (q, k, v, sink), eps=1e-6, atol=1e-7)


def test_fixed_sink_needs_no_gradient():
    q, k, v = qkv(dtype=F64, requires_grad=True)
    sink = _sink(4, 0.0, F64, requires_grad=False)
    out = dash_attn.flash_attn_func(q, k, v, learnable_sink=sink)
    dq, = torch.autograd.grad(out.sum(), (q,))
    expected, = torch.autograd.grad(_explicit(q, k, v, sink, q.shape[-1] ** -0.5)[0].sum(), (q,))
    torch.testing.assert_close(dq, expected, **TOL64)


# ----------------------------------------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (2, 1), 0.7)])
def test_varlen_matches_dense_per_sequence(causal, window, softcap):
    """Sequences of lengths (3, 0, 6) / (4, 2, 5): an empty query sequence, seqlen_q != seqlen_k both ways; each
    sequence against its own dense call, the sink's gradient the sum of theirs."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(3, 0, 6, 2), lens_k=(4, 2, 5, 0), requires_grad=True)
    sink = _sink(4, 0.5, F64)
    out, lse = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                                softcap=softcap, learnable_sink=sink, return_attn_probs=True)
    assert lse.shape == (4, q.shape[0])
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=F64)
    grads = _grads(out, (q, k, v, sink), dout)
    dsink = torch.zeros_like(sink)
    for b in range(len(cu_q) - 1):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense, dense_lse = _explicit(q[sq][None], k[sk][None], v[sk][None], sink, q.shape[-1] ** -0.5, causal, window,
                                     softcap)
        torch.testing.assert_close(out[sq], dense[0], **TOL64)
        torch.testing.assert_close(lse[:, sq], dense_lse[0].float())
        if dense.numel() == 0:
            continue
        expected = _grads(dense, (q, k, v, sink), dout[sq][None])
        for g, e, s in zip(grads, expected, (sq, sk, sk)):
            torch.testing.assert_close(g[s], e[s], **TOL64)
        dsink += expected[3]
    torch.testing.assert_close(grads[3], dsink, **TOL64)


def test_varlen_reference_backward_matches_autograd():
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs(requires_grad=True)
    sink = _sink(4, 2.0, F64)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, learnable_sink=sink)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    grads = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, compute_dtype=F64,
                                     learnable_sink=sink)
    for g, e in zip(grads, _grads(out, (q, k, v, sink), dout)):
        torch.testing.assert_close(g, e, **TOL64)


def test_varlen_seqused_rows_take_no_part():
    """Rows past seqused_q: out 0, lse -inf (not the sink), gradients 0."""
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(4, 5), lens_k=(3, 6), requires_grad=True)
    used_q, used_k = torch.tensor([2, 5], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    sink = _sink(4, 0.0, F64)
    out, lse = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_q=used_q,
                                                seqused_k=used_k, learnable_sink=sink, return_attn_probs=True)
    assert torch.all(out[2:4] == 0) and torch.isneginf(lse[:, 2:4]).all()
    grads = _grads(out.sum(), (q, k, v, sink), None)
    assert torch.all(grads[0][2:4] == 0) and torch.all(grads[1][7:9] == 0) and torch.isfinite(grads[3]).all()
    first, _ = _explicit(q[:2][None], k[:3][None], v[:3][None], sink, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out[:2], first[0], **TOL64)


def test_packed_functions_take_the_sink():
    gen = torch.Generator().manual_seed(9)
    qkv_packed = torch.randn(2, 7, 3, 4, 16, generator=gen, dtype=F64)
    sink = _sink(4, 1.0, F64, requires_grad=False)
    q, k, v = qkv_packed.unbind(2)
    expected = dash_attn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    torch.testing.assert_close(dash_attn.flash_attn_qkvpacked_func(qkv_packed, causal=True, learnable_sink=sink),
                               expected, rtol=0, atol=0)
    torch.testing.assert_close(dash_attn.flash_attn_kvpacked_func(q, qkv_packed[:, :, 1:], causal=True,
                                                                  learnable_sink=sink), expected, rtol=0, atol=0)
    flat, cu_seqlens = qkv_packed.flatten(0, 1), cu([7, 7])
    expected_varlen = expected.flatten(0, 1)
    got = dash_attn.flash_attn_varlen_qkvpacked_func(flat, cu_seqlens, 7, causal=True, learnable_sink=sink)
    torch.testing.assert_close(got, expected_varlen, **TOL64)
    got = dash_attn.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu_seqlens, cu_seqlens, 7, 7,
                                                    causal=True, learnable_sink=sink)
    torch.testing.assert_close(got, expected_varlen, **TOL64)


def test_bitwise_repeatable():
    q, k, v = qkv(seqlen_q=11, seqlen_k=13, requires_grad=True)
    sink = _sink(4, 0.5)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10))
    runs = []
    for _ in range(2):
        out, lse = dash_attn.flash_attn_func(q, k, v, causal=True, learnable_sink=sink, return_attn_probs=True)
        runs.append((out, lse) + _grads(out, (q, k, v, sink), dout))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sink, error, message", [
    ([0.0] * 4, TypeError, "learnable_sink must be None or a float32 torch.Tensor of shape \\(nheads,\\), got list"),
    (torch.zeros(4, dtype=torch.bfloat16), TypeError, "learnable_sink must have dtype torch.float32"),
    (torch.zeros(4, dtype=F64), TypeError, "learnable_sink must have dtype torch.float32"),
    (torch.zeros(2), ValueError, "learnable_sink must have shape \\(nheads,\\) = \\(4,\\)"),
    (torch.zeros(1, 4), ValueError, "learnable_sink must have shape"),
    (torch.zeros(4, device="meta"), ValueError, "learnable_sink must be on the device of q"),
])
def test_bad_sinks_are_refused_naming_the_function(sink, error, message):
    q, k, v = qkv()
    with pytest.raises(error, match="^flash_attn_func\\(\\): " + message):
        dash_attn.flash_attn_func(q, k, v, learnable_sink=sink)
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(dtype=torch.float32)
    with pytest.raises(error, match="^flash_attn_varlen_func\\(\\): " + message):
        dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, learnable_sink=sink)


def test_varlen_contents_are_checked_with_a_sink():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match="^flash_attn_varlen_func\\(\\): max_seqlen_q=1 is smaller"):
        dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 1, max_k, learnable_sink=torch.zeros(4))


@pytest.mark.parametrize("call", [
    lambda q, k, v, s: dash_attn.flash_attn_func(q, k, v, attention_chunk=4, learnable_sink=s),
    lambda q, k, v, s: dash_attn.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), attention_chunk=4,
                                                          learnable_sink=s),
])
def test_sink_with_attention_chunk_is_refused(call):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="learnable_sink with attention_chunk=4 is not supported"):
        call(q, k, v, torch.zeros(4))


@pytest.mark.parametrize("used", [None, (2, 0, 1)])
def test_rows_without_keys_take_the_sink_as_lse(used):
    """A varlen call whose sequences have no keys launches no kernel: the rows in use get lse = sink (the reference's
    value), the rows past seqused keep -inf."""
    from dash_attn import _varlen
    cu_q = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    sink = torch.tensor([0.5, -2.0])
    lse = torch.full((2, 6), float("-inf"))
    _varlen._fill_sink_lse(lse, sink, cu_q, None if used is None else torch.tensor(used, dtype=torch.int32))
    in_use = torch.tensor([True] * 6) if used is None else torch.tensor([True, True, False, False, True, False])
    expected = torch.where(in_use, sink.view(-1, 1), torch.tensor(float("-inf")))
    assert torch.equal(lse, expected)


def test_sink_gradient_of_several_launches_is_their_sum_in_order():
    from dash_attn import _varlen
    dsink = torch.full((2,), float("nan"))
    total = _varlen._SinkGradSum(dsink, 2)
    for share in ([1.0, 2.0], [0.5, -4.0]):
        total.part.copy_(torch.tensor(share))
        total.add()
    assert torch.equal(dsink, torch.tensor([1.5, -2.0]))
    one = _varlen._SinkGradSum(dsink, 1)
    assert one.part is dsink
    none = _varlen._SinkGradSum(None, 3)
    assert none.part is None
    none.add()
