"""The reference implementation against torch's SDPA, a naive softmax, autograd and float64 gradcheck."""
import math

import pytest
import torch
import torch.nn.functional as F

from dash_attn.reference import (attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen,
                                 row_statistic_error_bound, visibility_mask)


def _qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads, headdim, generator=gen, dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, headdim, generator=gen, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """SDPA in the (batch, seqlen, heads, dim) layout, GQA through enable_gqa."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _naive(q, k, v, scale, visible, softcap=0.0):
    """Textbook attention with torch.softmax; rows without a visible key are zeroed afterwards."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


# (seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap): one case per feature and their combinations.
FEATURES = [
    pytest.param(7, 7, 2, 2, False, (-1, -1), 0.0, id="full"),
    pytest.param(7, 7, 2, 2, True, (-1, -1), 0.0, id="causal"),
    pytest.param(5, 9, 2, 2, True, (-1, -1), 0.0, id="causal-sq<sk"),
    pytest.param(9, 5, 2, 2, True, (-1, -1), 0.0, id="causal-sq>sk-masked-rows"),
    pytest.param(6, 10, 4, 2, False, (-1, -1), 0.0, id="gqa2-sq!=sk"),
    pytest.param(6, 6, 4, 1, True, (-1, -1), 0.0, id="mqa-causal"),
    pytest.param(9, 9, 2, 2, False, (2, 1), 0.0, id="window"),
    pytest.param(6, 11, 2, 2, False, (3, -1), 0.0, id="window-left-only"),
    pytest.param(11, 6, 2, 1, True, (2, -1), 0.0, id="window-causal-gqa"),
    pytest.param(7, 8, 2, 2, False, (-1, -1), 0.5, id="softcap"),
    pytest.param(8, 7, 4, 2, True, (3, 0), 1.5, id="everything"),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", FEATURES)
def test_forward_matches_naive_and_lse(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap):
    q, k, v = _qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 16)
    scale = 0.3
    out, lse = attention_ref(q, k, v, scale, causal, window, softcap, return_lse=True)
    visible = visibility_mask(seqlen_q, seqlen_k, window[0], 0 if causal else window[1])
    out_naive, lse_naive = _naive(q, k, v, scale, visible, softcap)
    torch.testing.assert_close(out, out_naive, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_naive, rtol=1e-10, atol=1e-10)
    assert out.dtype == torch.float64 and lse.shape == (2, nheads, seqlen_q)


def test_full_matches_sdpa():
    q, k, v = _qkv(2, 13, 21, 4, 4, 32)
    torch.testing.assert_close(attention_ref(q, k, v), _sdpa(q, k, v))


def test_causal_square_matches_sdpa_is_causal():
    q, k, v = _qkv(2, 17, 17, 3, 3, 16)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True), _sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("nheads, nheads_k", [(4, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_matches_sdpa_enable_gqa(nheads, nheads_k, causal):
    q, k, v = _qkv(2, 11, 11, nheads, nheads_k, 16)
    torch.testing.assert_close(attention_ref(q, k, v, causal=causal, softmax_scale=0.2),
                               _sdpa(q, k, v, is_causal=causal, scale=0.2))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(5, 12), (12, 12), (3, 4)])
def test_bottom_right_causal_matches_sdpa_with_explicit_mask(seqlen_q, seqlen_k):
    q, k, v = _qkv(1, seqlen_q, seqlen_k, 2, 2, 16)
    offset = seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool).tril(diagonal=offset)
    torch.testing.assert_close(attention_ref(q, k, v, causal=True), _sdpa(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("window", [(0, 0), (2, 3), (4, -1), (-1, 2)])
def test_window_matches_sdpa_with_explicit_mask(window):
    seqlen_q, seqlen_k = 9, 13
    q, k, v = _qkv(1, seqlen_q, seqlen_k, 2, 1, 16)
    offset = seqlen_k - seqlen_q
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if window[0] >= 0:
        mask &= j >= i + offset - window[0]
    if window[1] >= 0:
        mask &= j <= i + offset + window[1]
    torch.testing.assert_close(attention_ref(q, k, v, window_size=window), _sdpa(q, k, v, attn_mask=mask))


def test_bottom_right_alignment_rows():
    # seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing, the last row sees every key.
    visible = visibility_mask(6, 4, -1, 0)
    assert not visible[:2].any()
    assert visible[-1].all()
    assert visible[2].tolist() == [True, False, False, False]


def test_fully_masked_rows_give_zero_output_and_neg_inf_lse():
    q, k, v = _qkv(1, 6, 3, 2, 2, 8, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True, return_lse=True)
    assert torch.all(out[:, :3] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :3]))
    assert torch.isfinite(lse[:, :, 3:]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.all(q.grad[:, :3] == 0)


def test_no_keys_at_all():
    q, k, v = _qkv(1, 4, 0, 2, 2, 8)
    out, lse = attention_ref(q, k, v, return_lse=True)
    assert out.shape == q.shape and torch.all(out == 0) and torch.isneginf(lse).all()


def test_upcast_and_compute_dtype():
    q, k, v = _qkv(1, 9, 9, 2, 2, 16, dtype=torch.bfloat16)
    out, lse = attention_ref(q, k, v, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out64, lse64 = attention_ref(q, k, v, return_lse=True, compute_dtype=torch.float64)
    assert lse64.dtype == torch.float64
    low, low_lse = attention_ref(q, k, v, upcast=False, return_lse=True)
    assert low_lse.dtype == torch.bfloat16
    exact = attention_ref(q.double(), k.double(), v.double())
    # The float32 path is at most bf16 output rounding away from exact; the bf16 path is visibly worse.
    err32 = (out.double() - exact).abs().max().item()
    err16 = (low.double() - exact).abs().max().item()
    assert err32 <= 2 ** -8 and err32 <= err16


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = _qkv(1, 5, 5, 1, 1, 64)
    torch.testing.assert_close(attention_ref(q, k, v), attention_ref(q, k, v, softmax_scale=1 / math.sqrt(64)))


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", FEATURES)
def test_gradcheck_float64(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap):
    q, k, v = _qkv(1, seqlen_q, seqlen_k, nheads, nheads_k, 8, requires_grad=True)

    def fn(q, k, v):
        out, lse = attention_ref(q, k, v, 0.4, causal, window, softcap, return_lse=True)
        return out, lse.nan_to_num(neginf=0.0)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", FEATURES)
def test_explicit_backward_matches_autograd(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap):
    q, k, v = _qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 16, requires_grad=True)
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, lse = attention_ref(q, k, v, 0.3, causal, window, softcap, return_lse=True)
    expected = torch.autograd.grad(out, (q, k, v), dout)
    got = attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), 0.3, causal, window,
                            softcap, compute_dtype=torch.float64)
    for g, e in zip(got, expected):
        assert g.dtype == torch.float64 and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [(1, 1, False), (7, 1, False), (9, 13, True), (13, 9, False)])
def test_row_statistic_bound_covers_a_rounded_d(seqlen_q, seqlen_k, causal):
    """out only enters the backward through D = rowsum(dO * O): scaling it by 1 + rel is D off by rel |D|, and the
    gradients must move by no more than the bound, which is reached exactly where each query sees one key."""
    q, k, v = _qkv(2, seqlen_q, seqlen_k, 4, 2, 16)
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    out, lse = attention_ref(q, k, v, 0.3, causal, return_lse=True)
    rel = 2.0**-10
    exact = attention_bwd_ref(dout, q, k, v, out, lse, 0.3, causal, compute_dtype=torch.float64)
    off = attention_bwd_ref(dout, q, k, v, out * (1 + rel), lse, 0.3, causal, compute_dtype=torch.float64)
    bounds = row_statistic_error_bound(dout, q, k, v, out, lse, 0.3, causal, rel=rel, compute_dtype=torch.float64)
    for e, o, b in zip(exact, off, bounds):
        assert b.dtype == torch.float64 and b.shape == e.shape
        assert ((o - e).abs() <= b * (1 + 1e-9) + 1e-15).all()
    if seqlen_k == 1:
        torch.testing.assert_close((off[0] - exact[0]).abs(), bounds[0], rtol=1e-9, atol=1e-15)


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (2, 1), 0.7)])
def test_varlen_matches_per_sequence(causal, window, softcap):
    lens_q, lens_k = [3, 0, 7, 5], [4, 2, 7, 3]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lens_q), 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 16, generator=gen, dtype=torch.float64)
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, 0.3, causal, window, softcap, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    dq, dk, dv = attention_bwd_ref_varlen(dout, q, k, v, out, lse, cu_q, cu_k, 0.3, causal, window, softcap,
                                          compute_dtype=torch.float64)
    for b in range(len(lens_q)):
        sq = slice(cu_q[b].item(), cu_q[b + 1].item())
        sk = slice(cu_k[b].item(), cu_k[b + 1].item())
        args = (q[sq][None], k[sk][None], v[sk][None])
        out_b, lse_b = attention_ref(*args, 0.3, causal, window, softcap, return_lse=True)
        torch.testing.assert_close(out[sq], out_b[0])
        torch.testing.assert_close(lse[:, sq], lse_b[0])
        grads_b = attention_bwd_ref(dout[sq][None], *args, out_b, lse_b, 0.3, causal, window, softcap,
                                    compute_dtype=torch.float64)
        for g, g_b, s in zip((dq, dk, dv), grads_b, (sq, sk, sk)):
            torch.testing.assert_close(g[s], g_b[0])
