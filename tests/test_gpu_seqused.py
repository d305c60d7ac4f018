"""GPU varlen calls with FlashAttention-3's seqused_q/seqused_k (marker `gpu`).

seqused gives the rows of each sequence in use, from its first; the rows past it take no part. Such calls run in the
packed-sequence kernels, which shorten each sequence to its rows in use (csrc/common/packed_seqs.h), on outputs that
start as zeros (lse -inf). Checked against the float32 reference with the same seqused (dash_attn/reference.py) on
poisoned memory, for both masks and modes, GQA, every built head dim, seqused on either side or both; bitwise-identical
deterministic gradients; a captured graph replayed with other seqused values.
"""
import pytest
import torch

import dash_attn
from dash_attn import interface
from dash_attn.reference import attention_bwd_ref_varlen, attention_ref_varlen
from gpu_common import assert_grads_within, assert_out_lse_within, main_head_dim, poison_allocator, supported_head_dims

pytestmark = pytest.mark.gpu

LENS_Q = (130, 1, 0, 700, 64, 257)
LENS_K = (200, 64, 9, 700, 65, 257)
USED = {  # (seqused_q, seqused_k); None: every row in use
    "q": ((100, 1, 0, 700, 0, 129), None),
    "k": (None, (200, 17, 0, 700, 65, 128)),
    # Equal on both sides: every sequence's causal diagonal on the longest ones' (causal runs in the packed kernels).
    "both": ((129, 1, 0, 450, 64, 1), (129, 1, 0, 450, 64, 1)),
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


def _run(inputs, used_q, used_k, causal, deterministic):
    q, k, v, dout = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, _cu(LENS_Q), _cu(LENS_K), max(LENS_Q), max(LENS_K), used_q,
                                                used_k, causal=causal, deterministic=deterministic,
                                                return_attn_probs=True)
    out.backward(dout)
    torch.cuda.synchronize()
    return [out, lse] + [t.grad for t in leaves]


def _assert_matches_reference(results, inputs, used_q, used_k, causal):
    q, k, v, dout = (t.float() for t in inputs)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    used = dict(seqused_q=used_q, seqused_k=used_k)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, **used)
    ref_grads = attention_bwd_ref_varlen(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, causal=causal, **used)
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    base_out = attention_ref_varlen(*leaves, cu_q, cu_k, causal=causal, upcast=False, **used)
    base_grads = torch.autograd.grad(base_out, leaves, inputs[3])
    assert_out_lse_within(results[0], results[1], ref_out, ref_lse, base_out, inputs[0].dtype)
    assert_grads_within(results[2:], ref_grads, base_grads, inputs[0].dtype)


@pytest.mark.parametrize("used", list(USED))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_seqused_matches_reference(used, causal, deterministic, headdim):
    if causal and used != "both":
        pytest.skip("per-sequence causal diagonals right of the longest ones': refused (test below)")
    inputs = _inputs(8, 2, headdim)
    used_q, used_k = (_used(u) for u in USED[used])
    poison_allocator()
    _assert_matches_reference(_run(inputs, used_q, used_k, causal, deterministic), inputs, used_q, used_k, causal)


def test_seqused_band_outside_the_longest_ones_is_refused():
    inputs = _inputs(4, 4, main_head_dim())
    with pytest.raises(ValueError, match="band"):
        _run(inputs, _used(USED["q"][0]), None, True, True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused_deterministic_gradients_are_bitwise_identical(causal):
    inputs = _inputs(8, 2, main_head_dim())
    used_q, used_k = (_used(u) for u in USED["both"])
    first = _run(inputs, used_q, used_k, causal, True)
    for _ in range(20):
        again = _run(inputs, used_q, used_k, causal, True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_captured_graph_follows_the_seqused_values_of_each_replay():
    q, k, v, dout = _inputs(8, 2, main_head_dim())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    used_q, used_k = (_used(u) for u in USED["both"])

    def step():
        out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu_q, cu_k, max(LENS_Q), max(LENS_K), used_q, used_k,
                                                    deterministic=True, return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, leaves, dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    # The capture plans for max_seqlen (700), not for the rows in use when it ran (450).
    for values in (USED["both"], (LENS_Q, LENS_K), ((0,) * 6, (5,) * 6)):
        with torch.no_grad():
            used_q.copy_(_used(values[0]))
            used_k.copy_(_used(values[1]))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_reference([t.clone() for t in results], [q.detach(), k.detach(), v.detach(), dout],
                                  _used(values[0]), _used(values[1]), False)
    assert interface._extension().packed_built()
