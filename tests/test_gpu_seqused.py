"""GPU varlen calls with FlashAttention-3's seqused_q/seqused_k (marker `gpu`).

seqused gives the rows of each sequence in use, from its first; the rows past it take no part, and each sequence's
causal or window band lies around its own diagonal seqused_k - seqused_q (bottom-right aligned). Such calls run in the
packed-sequence kernels, which shorten each sequence to its rows in use (csrc/common/packed_seqs.h), on outputs that
start as zeros (lse -inf); the backward's bounds move the schedule's band over every sequence's, or the backward runs
one launch per group of sequences that one band holds (dash_attn/_seq_bands.py). Checked against the float32
reference with the same seqused (dash_attn/reference.py) on poisoned memory, for full, causal and window masks (one-
and two-sided, over sequences of different diagonals) and both modes, GQA, every built head dim, seqused on either
side or both; bitwise-identical deterministic gradients, which are those of each sequence alone; a captured graph
replayed with other seqused values.
"""
import pytest
import torch

import dash_attn
from dash_attn import _seq_bands, interface
from dash_attn.reference import attention_bwd_ref_varlen, attention_ref_varlen
from gpu_common import (assert_grads_within, assert_out_lse_within, capture, main_head_dim, poison_allocator,
                        supported_head_dims)

pytestmark = pytest.mark.gpu

LENS_Q = (130, 1, 0, 700, 64, 257)
LENS_K = (200, 64, 9, 700, 65, 257)
USED = {  # (seqused_q, seqused_k); None: every row in use
    # Diagonals 100, 63, 9, 0, 65, 128: causal runs with bounds (700, 828), two-sided windows in groups.
    "q": ((100, 1, 0, 700, 0, 129), None),
    # Diagonals 70, 16, 0, 0, 1, -129.
    "k": (None, (200, 17, 0, 700, 65, 128)),
    # Equal on both sides: every sequence's diagonal on the longest ones'.
    "both": ((129, 1, 0, 450, 64, 1), (129, 1, 0, 450, 64, 1)),
}
MASKS = {  # (causal, window_size)
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "right": (False, (-1, 33)),  # one-sided: one launch, the bounds moved
    "left_causal": (True, (96, -1)),  # (96, 0), two-sided: groups
    "window": (False, (40, 17)),  # two-sided: groups
}


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _used(values):
    return None if values is None else torch.tensor(values, dtype=torch.int32, device="cuda")


def _inputs(nheads, nheads_k, headdim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((sum(LENS_Q), nheads, headdim), (sum(LENS_K), nheads_k, headdim), (sum(LENS_K), nheads_k, headdim),
              (sum(LENS_Q), nheads, headdim))
    return [torch.randn(s, generator=gen, device="cuda", dtype=torch.bfloat16) for s in shapes]


def _run(inputs, used_q, used_k, mask, deterministic, seqs=None):
    """Results of the call; seqs: (lens_q, lens_k) of the packed inputs, LENS_Q / LENS_K by default. max_seqlen is
    LENS_Q's and LENS_K's longest in every call, so that every call drops the same window sides (the same kernel)."""
    lens_q, lens_k = seqs or (LENS_Q, LENS_K)
    causal, window = MASKS[mask]
    q, k, v, dout = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, _cu(lens_q), _cu(lens_k), max(LENS_Q), max(LENS_K), used_q,
                                                used_k, causal=causal, window_size=window,
                                                deterministic=deterministic, return_attn_probs=True)
    out.backward(dout)
    torch.cuda.synchronize()
    return [out, lse] + [t.grad for t in leaves]


def _assert_matches_reference(results, inputs, used_q, used_k, mask):
    causal, window = MASKS[mask]
    q, k, v, dout = (t.float() for t in inputs)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    band = dict(causal=causal, window_size=window, seqused_q=used_q, seqused_k=used_k)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, return_lse=True, **band)
    ref_grads = attention_bwd_ref_varlen(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, **band)
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    base_out = attention_ref_varlen(*leaves, cu_q, cu_k, upcast=False, **band)
    base_grads = torch.autograd.grad(base_out, leaves, inputs[3])
    assert_out_lse_within(results[0], results[1], ref_out, ref_lse, base_out, inputs[0].dtype)
    assert_grads_within(results[2:], ref_grads, base_grads, inputs[0].dtype)


def _lengths_in_use(used):
    return [list(u) if u is not None else list(lens) for u, lens in zip(USED[used], (LENS_Q, LENS_K))]


def test_the_cases_cover_moved_bounds_and_groups():
    lens_q, lens_k = _lengths_in_use("q")
    moved = _seq_bands.bwd_launches(lens_q, lens_k, 1, -1, 0)
    assert len(moved) == 1 and moved[0][1:] != (max(lens_q), max(lens_k))
    assert len(_seq_bands.bwd_launches(lens_q, lens_k, 2, 40, 17)) > 1


@pytest.mark.parametrize("used", list(USED))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_seqused_matches_reference(used, mask, deterministic, headdim):
    inputs = _inputs(8, 2, headdim)
    used_q, used_k = (_used(u) for u in USED[used])
    poison_allocator()
    _assert_matches_reference(_run(inputs, used_q, used_k, mask, deterministic), inputs, used_q, used_k, mask)


@pytest.mark.parametrize("used", list(USED))
@pytest.mark.parametrize("mask", ["full", "causal", "left_causal", "window"])
def test_seqused_deterministic_gradients_are_bitwise_identical(used, mask):
    inputs = _inputs(8, 2, main_head_dim())
    used_q, used_k = (_used(u) for u in USED[used])
    first = _run(inputs, used_q, used_k, mask, True)
    for _ in range(20):
        again = _run(inputs, used_q, used_k, mask, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("used", ["q", "k"])
@pytest.mark.parametrize("mask", ["causal", "right", "left_causal", "window"])
def test_seqused_deterministic_gradients_are_those_of_each_sequence_alone(used, mask):
    """Moved bounds and groups only add masked visits around a sequence's own (dQ, dK, dV += 0 in their places of the
    descending orders): each sequence's bits are those of a call of it alone."""
    inputs = _inputs(8, 2, main_head_dim())
    used_q, used_k = (_used(u) for u in USED[used])
    packed = _run(inputs, used_q, used_k, mask, True)
    cu_q, cu_k = _cu(LENS_Q).tolist(), _cu(LENS_K).tolist()
    q, k, v, dout = inputs
    for b in range(len(LENS_Q)):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        one = [q[rows_q], k[rows_k], v[rows_k], dout[rows_q]]
        alone = _run(one, None if used_q is None else used_q[b:b + 1], None if used_k is None else used_k[b:b + 1],
                     mask, True, seqs=((LENS_Q[b],), (LENS_K[b],)))
        for name, got, want, rows in zip(("dq", "dk", "dv"), packed[2:], alone[2:], (rows_q, rows_k, rows_k)):
            assert torch.equal(got[rows], want), f"{name} of sequence {b} differs from it alone ({used}, {mask})"


def test_captured_graph_follows_the_seqused_values_of_each_replay():
    q, k, v, dout = _inputs(8, 2, main_head_dim())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    used_q, used_k = (_used(u) for u in USED["both"])

    def step():
        out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(LENS_Q), max(LENS_K), used_q, used_k,
                                                    deterministic=True, return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, leaves, dout)

    graph, results = capture(step)
    # The capture plans for max_seqlen (700), not for the rows in use when it ran (450).
    for values in (USED["both"], (LENS_Q, LENS_K), ((0,) * 6, (5,) * 6)):
        with torch.no_grad():
            used_q.copy_(_used(values[0]))
            used_k.copy_(_used(values[1]))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_reference([t.clone() for t in results], [q.detach(), k.detach(), v.detach(), dout],
                                  _used(values[0]), _used(values[1]), "full")
    assert interface._extension().packed_built()
