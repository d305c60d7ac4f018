"""Head dims that are not multiples of 8, on the CPU: the public functions zero-pad q, k and v to the next multiple
(validation.padded_head_dim), keep the softmax scale of the head dim given and drop the padding from out and the
gradients. The CPU path runs the same padded call, so the padding itself is checked here: against the reference at
the head dim given (every public function, masks, GQA, both modes), against explicitly padded calls (bitwise), on
the CUDA branch with the stand-in extension (what reaches the launches), under torch.compile, and the errors for what
stays unsupported. The GPU side: test_gpu_unaligned_head_dims.py.
"""
import math

import pytest
import torch

import dash_attn
from dash_attn import validation
from dash_attn.reference import attention_ref, attention_ref_varlen

from api_common import varlen_inputs

UNALIGNED = [1, 3, 33, 100, 127, 190, 255]


@pytest.mark.parametrize("headdim, padded", [(1, 8), (7, 8), (8, 8), (33, 40), (100, 104), (127, 128), (190, 192),
                                             (255, 256), (256, 256)])
def test_padded_head_dim_is_the_next_multiple_of_8(headdim, padded):
    assert validation.padded_head_dim(headdim) == padded


def _dense(headdim, headdim_v=None, seqlen_q=9, seqlen_k=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, seqlen_q, 4, headdim), (2, seqlen_k, 2, headdim), (2, seqlen_k, 2, headdim_v or headdim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes]


def _assert_call_matches_reference(call, reference, leaves):
    out = call(*leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref = reference(*ref_leaves)
    assert out.shape == ref.shape and out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, dout)
    for g, r, x in zip(grads, torch.autograd.grad(ref, ref_leaves, dout), leaves):
        assert g.shape == x.shape
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("band", [dict(causal=False), dict(causal=True), dict(window_size=(3, 2))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_dense_call_matches_the_reference_at_the_head_dim_given(headdim, band, deterministic):
    options = dict(band, softcap=0.0 if headdim % 2 else 3.0)
    _assert_call_matches_reference(
        lambda q, k, v: dash_attn.flash_attn_func(q, k, v, deterministic=deterministic, **options),
        lambda q, k, v: attention_ref(q, k, v, **options), _dense(headdim))


@pytest.mark.parametrize("headdim, headdim_v", [(33, 20), (100, 128), (64, 1), (190, 250)])
def test_value_head_dims_are_padded_on_their_own(headdim, headdim_v):
    _assert_call_matches_reference(lambda q, k, v: dash_attn.flash_attn_func(q, k, v, causal=True),
                                   lambda q, k, v: attention_ref(q, k, v, causal=True), _dense(headdim, headdim_v))


@pytest.mark.parametrize("headdim", [33, 100])
def test_softmax_scale_and_lse_are_those_of_the_head_dim_given(headdim):
    q, k, v = _dense(headdim)
    for scale in (None, 0.3):
        out, lse = dash_attn.flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
        ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=scale, return_lse=True)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(lse, ref_lse.to(lse.dtype), rtol=0, atol=1e-6)


@pytest.mark.parametrize("headdim", [33, 127])
def test_the_call_is_the_explicitly_padded_one(headdim):
    # Bitwise: padding inside is what a caller padding q, k, v with zeros and passing the scale of `headdim` gets.
    q, k, v = _dense(headdim)
    width = validation.padded_head_dim(headdim)
    padded = [torch.nn.functional.pad(t.detach(), (0, width - headdim)).requires_grad_() for t in (q, k, v)]
    out = dash_attn.flash_attn_func(q, k, v, causal=True)
    wide = dash_attn.flash_attn_func(*padded, softmax_scale=1 / math.sqrt(headdim), causal=True)
    assert torch.equal(out, wide[..., :headdim])
    dout = torch.randn(out.shape, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    wide_grads = torch.autograd.grad(wide, padded, torch.nn.functional.pad(dout, (0, width - headdim)))
    for g, w in zip(grads, wide_grads):
        assert torch.equal(g, w[..., :headdim])


@pytest.mark.parametrize("seqused", [False, True])
@pytest.mark.parametrize("headdim", [3, 100, 255])
def test_varlen_call_matches_the_reference(headdim, seqused):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs((5, 0, 7), (6, 3, 8), headdim=headdim, requires_grad=True)
    used = dict(seqused_q=torch.tensor([3, 0, 7], dtype=torch.int32),
                seqused_k=torch.tensor([6, 1, 2], dtype=torch.int32)) if seqused else {}
    _assert_call_matches_reference(
        lambda q, k, v: dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, **used),
        lambda q, k, v: attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, **used), [q, k, v])


@pytest.mark.parametrize("headdim", [33, 190])
def test_packed_forms_match_the_separate_tensors(headdim):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 9, 3, 4, headdim, generator=gen, dtype=torch.float64, requires_grad=True)
    q, k, v = qkv.unbind(2)
    checks = [
        (lambda t: dash_attn.flash_attn_qkvpacked_func(t, causal=True), qkv),
        (lambda t: dash_attn.flash_attn_kvpacked_func(q, t, causal=True), qkv[:, :, 1:]),
    ]
    for call, packed in checks:
        out = call(packed)
        ref = attention_ref(q, k, v, causal=True)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        (grad,) = torch.autograd.grad(out.sum(), (packed,))
        assert grad.shape == packed.shape
    flat = torch.randn(18, 3, 4, headdim, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    out = dash_attn.flash_attn_varlen_qkvpacked_func(flat, cu, 9, causal=True)
    ref = attention_ref_varlen(*flat.unbind(1), cu, cu, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    out = dash_attn.flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], cu, cu, 9, 9, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_gradcheck_through_the_padding():
    q, k, v = (t.detach()[:1, :5, :, :].clone().requires_grad_() for t in _dense(5))
    assert torch.autograd.gradcheck(lambda q, k, v: dash_attn.flash_attn_func(q, k, v, causal=True), (q, k, v))


@pytest.mark.parametrize("headdim, message", [(0, "head dim 0 is not supported"),
                                              (257, "head dim 257 is not supported")])
def test_head_dims_outside_1_to_256_are_refused(headdim, message):
    q, k, v = (torch.zeros(2, 9, h, headdim) for h in (4, 2, 2))
    with pytest.raises(ValueError, match=f"^flash_attn_func\\(\\): {message}"):
        dash_attn.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=f"^flash_attn_varlen_func\\(\\): {message}"):
        dash_attn.flash_attn_varlen_func(q[0], k[0], v[0], torch.tensor([0, 9], dtype=torch.int32),
                                         torch.tensor([0, 9], dtype=torch.int32), 9, 9)
    with pytest.raises(ValueError, match="head dim of v 257 is not supported"):
        dash_attn.flash_attn_func(*(torch.zeros(2, 9, h, 8) for h in (4, 2)), torch.zeros(2, 9, 2, 257))


@pytest.mark.parametrize("varlen", [False, True])
def test_the_ops_get_zero_padded_tensors_and_the_scale_of_the_head_dim_given(monkeypatch, varlen):
    # What every path below the public functions (CPU reference, CUDA kernels, packed or dense) receives.
    from dash_attn import api
    seen = []

    def op(q, k, v, *args):
        seen.append((q, k, v, args))
        return q.new_ones(*q.shape[:-1], v.shape[-1]), q.new_zeros(1)

    monkeypatch.setattr(api, "varlen_fwd_op" if varlen else "fwd_op", op)
    q, k, v = (torch.randn(1, 8, h, 100) for h in (2, 1, 1))
    if varlen:
        cu = torch.tensor([0, 8], dtype=torch.int32)
        q, k, v = (t[0] for t in (q, k, v))
        out = dash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 8, 8, causal=True)
    else:
        out = dash_attn.flash_attn_func(q, k, v, causal=True)
    ((pq, pk, pv, args),) = seen
    for padded, given in zip((pq, pk, pv), (q, k, v)):
        assert padded.shape[-1] == 104 and torch.equal(padded[..., :100], given) and not padded[..., 100:].any()
    assert args[6 if varlen else 0] == pytest.approx(1 / math.sqrt(100))
    assert out.shape == (*q.shape[:-1], 100) and out.is_contiguous()


def test_compiles_fullgraph_with_an_unaligned_head_dim():
    torch._dynamo.reset()
    q, k, v = (t.detach().requires_grad_() for t in _dense(33))
    step = lambda q, k, v: dash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True)  # noqa: E731
    out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    ref = step(*(t.detach().clone() for t in (q, k, v)))
    assert torch.equal(out, ref)
    out.sum().backward()
    assert q.grad.shape == q.shape
