"""attention_chunk (FlashAttention-3's chunked attention) on the CPU path, against a reference that builds the chunk
mask explicitly: query i at position p = i + seqlen_k - seqlen_q sees key j iff p // C == j // C and j lies in its
causal / window band, written out here independently of the implementation. Dense and varlen calls,
the packed forms, seqused, GQA, seqlen_q != seqlen_k both ways, C not dividing the lengths and C past them; outputs,
lse and dq/dk/dv; the argument's errors; attention_chunk=0 untouched."""
import itertools

import pytest
import torch

import dash_attn
from dash_attn import _chunked, api

DTYPE = torch.float64
HEADDIM = 16


def chunk_ref(q, k, v, chunk, causal=False, window=(-1, -1), softcap=0.0):
    """(out, lse) of (batch, seqlen, heads, d) inputs, float64 autograd-able math with an explicit mask."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / HEADDIM ** 0.5
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(seqlen_q).unsqueeze(1) + seqlen_k - seqlen_q
    key = torch.arange(seqlen_k).unsqueeze(0)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if chunk > 0:
        visible &= torch.div(pos, chunk, rounding_mode="floor") == torch.div(key, chunk, rounding_mode="floor")
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        visible &= key >= pos - left
    if right >= 0:
        visible &= key <= pos + right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.where(visible, torch.exp(scores.masked_fill(~visible, 0.0) - torch.where(seen, lse, 0.0)[..., None]),
                        0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def _inputs(batch, seqlen_q, seqlen_k, nheads=4, nheads_k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, HEADDIM), (batch, seqlen_k, nheads_k, HEADDIM),
              (batch, seqlen_k, nheads_k, HEADDIM), (batch, seqlen_q, nheads, HEADDIM)]
    return [torch.randn(s, generator=gen, dtype=DTYPE) for s in shapes]


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def _assert_close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)


def _assert_lse(actual, expected):
    # The op stores lse in float32.
    torch.testing.assert_close(actual, expected.to(torch.float32), rtol=1e-6, atol=1e-6)


LENGTHS = [(13, 13), (7, 19), (19, 7), (1, 10), (10, 1), (16, 16)]
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (False, (3, -1)), (False, (2, 1)), (True, (4, 7))]


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
@pytest.mark.parametrize("seqlen_q, seqlen_k", LENGTHS)
@pytest.mark.parametrize("causal, window", MASKS)
def test_dense_matches_chunk_mask(chunk, seqlen_q, seqlen_k, causal, window):
    q, k, v, dout = _inputs(2, seqlen_q, seqlen_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_func(*leaves, causal=causal, window_size=window, attention_chunk=chunk,
                                         return_attn_probs=True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = chunk_ref(*ref_leaves, chunk, causal, window)
    _assert_close(out, ref_out)
    _assert_lse(lse, ref_lse)
    assert lse.shape == (2, 4, seqlen_q) and lse.is_contiguous()
    for grad, ref_grad in zip(_grads(out, leaves, dout), _grads(ref_out, ref_leaves, dout)):
        _assert_close(grad, ref_grad)


def test_dense_softcap_and_scale_follow_the_call():
    q, k, v, _ = _inputs(1, 11, 11)
    out = dash_attn.flash_attn_func(q, k, v, causal=True, softcap=0.7, attention_chunk=3)
    _assert_close(out, chunk_ref(q, k, v, 3, causal=True, softcap=0.7)[0])
    scaled = dash_attn.flash_attn_func(q, k, v, softmax_scale=2.0 / HEADDIM ** 0.5, attention_chunk=3)
    _assert_close(scaled, chunk_ref(q * 2.0, k, v, 3)[0])


def test_queries_left_of_the_keys_see_nothing():
    # seqlen_q > seqlen_k: the first seqlen_q - seqlen_k queries sit at negative positions, in no key's chunk.
    q, k, v, _ = _inputs(1, 9, 4)
    out, lse = dash_attn.flash_attn_func(q, k, v, attention_chunk=2, return_attn_probs=True)
    assert torch.all(out[:, :5] == 0) and torch.all(lse[:, :, :5] == float("-inf"))
    assert torch.all(torch.isfinite(lse[:, :, 5:]))


def _cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)


def _varlen_ref(q, k, v, lens_q, lens_k, chunk, causal, window, used_q=None, used_k=None):
    """Per sequence chunk_ref over its rows in use; rows past them out 0, lse -inf."""
    outs, lses = [], []
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        start_q, start_k = sum(lens_q[:b]), sum(lens_k[:b])
        u_q = n_q if used_q is None else used_q[b]
        u_k = n_k if used_k is None else used_k[b]
        rows_q, rows_k = slice(start_q, start_q + u_q), slice(start_k, start_k + u_k)
        out, lse = chunk_ref(q[None, rows_q], k[None, rows_k], v[None, rows_k], chunk, causal, window)
        outs += [out[0], q.new_zeros(n_q - u_q, q.shape[1], v.shape[-1])]
        lses += [lse[0], lse.new_full((q.shape[1], n_q - u_q), float("-inf"))]
    return torch.cat(outs), torch.cat(lses, dim=1)


VARLEN_LENGTHS = [((5, 0, 13, 9, 3), (9, 4, 13, 2, 0)), ((8, 8, 3), (8, 8, 3)), ((1, 20, 6), (17, 20, 6))]


@pytest.mark.parametrize("chunk", [1, 3, 8, 100])
@pytest.mark.parametrize("lens_q, lens_k", VARLEN_LENGTHS)
@pytest.mark.parametrize("causal, window", MASKS)
def test_varlen_matches_chunk_mask(chunk, lens_q, lens_k, causal, window):
    gen = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(sum(lens_q), 4, HEADDIM, generator=gen, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 2, HEADDIM, generator=gen, dtype=DTYPE) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                                causal=causal, window_size=window, attention_chunk=chunk,
                                                return_attn_probs=True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _varlen_ref(*ref_leaves, lens_q, lens_k, chunk, causal, window)
    _assert_close(out, ref_out)
    _assert_lse(lse, ref_lse)
    for grad, ref_grad in zip(_grads(out, leaves, dout), _grads(ref_out, ref_leaves, dout)):
        _assert_close(grad, ref_grad)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_chunks_the_rows_in_use(causal):
    lens_q, lens_k, used_q, used_k = (7, 12, 5), (10, 12, 9), (6, 12, 0), (10, 5, 9)
    gen = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(sum(lens_q), 2, HEADDIM, generator=gen, dtype=DTYPE) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 2, HEADDIM, generator=gen, dtype=DTYPE) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k),
                                                seqused_q=torch.tensor(used_q, dtype=torch.int32),
                                                seqused_k=torch.tensor(used_k, dtype=torch.int32), causal=causal,
                                                attention_chunk=4, return_attn_probs=True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _varlen_ref(*ref_leaves, lens_q, lens_k, 4, causal, (-1, -1), used_q, used_k)
    _assert_close(out, ref_out)
    _assert_lse(lse, ref_lse)
    for grad, ref_grad in zip(_grads(out, leaves, dout), _grads(ref_out, ref_leaves, dout)):
        _assert_close(grad, ref_grad)


def test_packed_forms_forward_attention_chunk():
    q, k, v, _ = _inputs(2, 10, 10, nheads=2, nheads_k=2)
    expected = chunk_ref(q, k, v, 4, causal=True)[0]
    qkv = torch.stack([q, k, v], dim=2)
    _assert_close(dash_attn.flash_attn_qkvpacked_func(qkv, causal=True, attention_chunk=4), expected)
    _assert_close(dash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), causal=True, attention_chunk=4),
                  expected)
    cu = _cu([10, 10])
    flat = expected.flatten(0, 1)
    _assert_close(dash_attn.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 10, causal=True,
                                                             attention_chunk=4), flat)
    _assert_close(dash_attn.flash_attn_varlen_kvpacked_func(q.flatten(0, 1), torch.stack([k, v], 2).flatten(0, 1),
                                                            cu, cu, 10, 10, causal=True, attention_chunk=4), flat)


def test_compiles_in_one_graph():
    # The dense path plans its chunks from shapes only: torch.compile(fullgraph=True) traces it.
    q, k, v, _ = _inputs(1, 10, 10)
    call = lambda *t: dash_attn.flash_attn_func(*t, causal=True, attention_chunk=4)  # noqa: E731
    torch._dynamo.reset()
    _assert_close(torch.compile(call, fullgraph=True)(q, k, v), call(q, k, v))


def test_gradcheck_through_the_chunks():
    q, k, v, _ = _inputs(1, 6, 7, nheads=2, nheads_k=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *t: dash_attn.flash_attn_func(*t, causal=True, attention_chunk=3), leaves)
    cu_q, cu_k = _cu([2, 4]), _cu([4, 3])
    flat = [t.detach().flatten(0, 1)[:n].clone().requires_grad_() for t, n in zip(leaves, (6, 7, 7))]
    assert torch.autograd.gradcheck(
        lambda *t: dash_attn.flash_attn_varlen_func(*t, cu_q, cu_k, 4, 4, window_size=(1, 1), attention_chunk=2),
        flat)


@pytest.mark.parametrize("chunk", [0, None])
def test_off_runs_no_chunk_work(monkeypatch, chunk):
    def refuse(*args, **kwargs):
        raise AssertionError("chunked path taken")

    monkeypatch.setattr(api, "chunked_attention", refuse)
    monkeypatch.setattr(api, "chunked_varlen_attention", refuse)
    q, k, v, _ = _inputs(1, 8, 8)
    _assert_close(dash_attn.flash_attn_func(q, k, v, causal=True, attention_chunk=chunk),
                  dash_attn.flash_attn_func(q, k, v, causal=True))
    cu = _cu([8])
    dash_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, attention_chunk=chunk)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(8, 8), (3, 8), (0, 5), (4, 0)])
def test_a_chunk_holding_every_position_runs_the_plain_call(monkeypatch, seqlen_q, seqlen_k):
    # One chunk holds every position: the chunk masks nothing, the dense call runs unchanged.
    assert _chunked._sequence_segments(seqlen_q, seqlen_k, 8) in ([(seqlen_q, seqlen_k)], [])
    q, k, v, _ = _inputs(1, seqlen_q, seqlen_k)
    ran = []
    monkeypatch.setattr(api, "chunked_attention",
                        lambda *args: ran.append(_chunked.chunked_attention(*args)) or ran[-1])
    _assert_close(dash_attn.flash_attn_func(q, k, v, attention_chunk=8), dash_attn.flash_attn_func(q, k, v))
    assert ran == [None]


@pytest.mark.parametrize("seqlen_q, seqlen_k, chunk", [(13, 13, 4), (7, 19, 5), (19, 7, 3), (0, 9, 2), (6, 0, 4),
                                                         (1, 10, 1)])
def test_segments_tile_the_rows_and_keep_each_diagonal(seqlen_q, seqlen_k, chunk):
    segments = _chunked._sequence_segments(seqlen_q, seqlen_k, chunk)
    assert sum(s[0] for s in segments) == seqlen_q and sum(s[1] for s in segments) == seqlen_k
    assert all(0 < len_q + len_k and len_q <= chunk and len_k <= chunk for len_q, len_k in segments)
    # Each segment's own diagonal (len_k - len_q) is its first query's position minus its first key's.
    first_q, first_k, diagonal = 0, 0, seqlen_k - seqlen_q
    for len_q, len_k in segments:
        if len_q and len_k:
            assert len_k - len_q == (first_q + diagonal) - first_k
            assert (first_q + diagonal) // chunk == first_k // chunk == (first_k + len_k - 1) // chunk
        first_q, first_k = first_q + len_q, first_k + len_k


ERRORS = [(-1, "attention_chunk must be an int >= 0"), (2.5, "attention_chunk must be an int"),
          (True, "attention_chunk must be an int"), ("4", "attention_chunk must be an int")]


@pytest.mark.parametrize("value, message", ERRORS)
def test_bad_attention_chunk_names_argument_and_function(value, message):
    q, k, v, _ = _inputs(1, 4, 4)
    with pytest.raises(ValueError, match=rf"^flash_attn_func\(\): {message}"):
        dash_attn.flash_attn_func(q, k, v, attention_chunk=value)
    cu = _cu([4])
    with pytest.raises(ValueError, match=rf"^flash_attn_varlen_func\(\): {message}"):
        dash_attn.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, attention_chunk=value)
    with pytest.raises(ValueError, match=rf"^flash_attn_kvpacked_func\(\): {message}"):
        dash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), attention_chunk=value)


def test_integer_likes_are_accepted():
    q, k, v, _ = _inputs(1, 9, 9)
    expected = chunk_ref(q, k, v, 4, causal=True)[0]
    _assert_close(dash_attn.flash_attn_func(q, k, v, causal=True, attention_chunk=torch.tensor(4)), expected)


def test_bad_cu_seqlens_are_refused_before_planning():
    q, k, v, _ = _inputs(1, 6, 6)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func\(\): cu_seqlens_q\[-1\] must equal"):
        dash_attn.flash_attn_varlen_func(q[0], k[0], v[0], _cu([5]), _cu([6]), 6, 6, attention_chunk=2)
