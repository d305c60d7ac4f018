"""GPU learnable sinks (gpt-oss): out, lse and the four gradients of the CUDA kernels against the float32 reference
(marker `gpu`).

Tolerances are calibrated as in test_gpu_backward.py: twice the error of a low-precision autograd baseline (the
reference run in the inputs' dtype), with the row-statistics floor of the kernels that carry LSE and D as bf16 parts.
The sink's gradient is checked the same way against the baseline's. Sinks of -5, 0, +5 and +30 (the sink takes
nearly all the mass, so out is tiny and d sink is a sum of nearly whole D's); GQA; full, causal (seqlen_q !=
seqlen_k both ways) and window masks; both modes; varlen packs with an empty sequence; bitwise-repeatable gradients,
the sink's included, under a competing stream.
"""
import pytest
import torch

import dash_attn
from dash_attn.reference import (attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen,
                                 row_statistic_error_bound)
from gpu_common import assert_grads_within, assert_within, main_head_dim, poison_allocator, requires_softcap, \
    supported_head_dims, tolerance

pytestmark = pytest.mark.gpu

SINKS = (-5.0, 0.0, 5.0, 30.0)
MASKS = {"full": dict(causal=False), "causal": dict(causal=True), "window": dict(window_size=(40, 7))}


def _inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim), (batch, seqlen_q, nheads, headdim)]
    return [torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes]


def _sink(nheads, center, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return center + torch.rand(nheads, generator=gen, device="cuda") - 0.5


def _window(mask_args):
    if mask_args.get("causal"):
        return True, (-1, -1)
    return False, mask_args.get("window_size", (-1, -1))


def _kernel(q, k, v, dout, sink, mask_args, deterministic, poison=True):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = dash_attn.flash_attn_func(*leaves[:3], deterministic=deterministic, return_attn_probs=True,
                                         learnable_sink=leaves[3], **mask_args)
    if poison:
        poison_allocator()
    out.backward(dout)
    torch.cuda.synchronize()
    return out, lse, [t.grad for t in leaves]


def _reference(q, k, v, dout, sink, mask_args):
    """(out, lse, grads) of the float32 reference, the low-precision baseline's (out, grads), and dq/dk floors."""
    causal, window = _window(mask_args)
    qf, kf, vf = q.float(), k.float(), v.float()
    out, lse = attention_ref(qf, kf, vf, causal=causal, window_size=window, return_lse=True, learnable_sink=sink)
    grads = attention_bwd_ref(dout.float(), qf, kf, vf, out, lse, causal=causal, window_size=window,
                              learnable_sink=sink)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sink.detach().clone().requires_grad_()]
    base_out = attention_ref(*leaves[:3], causal=causal, window_size=window, upcast=False, learnable_sink=leaves[3])
    base = torch.autograd.grad(base_out, leaves, dout)
    bounds = row_statistic_error_bound(dout.float(), qf, kf, vf, out, lse, causal=causal, window_size=window)
    floors = tuple(2 * b.max().item() if b.numel() else 0.0 for b in bounds) + (0.0,)
    return out, lse, grads, base_out, base, floors


def _check(q, k, v, dout, sink, mask_args, deterministic):
    out, lse, grads = _kernel(q, k, v, dout, sink, mask_args, deterministic)
    ref_out, ref_lse, ref_grads, base_out, base_grads, floors = _reference(q, k, v, dout, sink, mask_args)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_within("out", out, ref_out, tolerance(base_out, ref_out, q.dtype))
    assert_within("lse", lse, ref_lse, 1e-3 * max(1.0, ref_lse.abs().max().item()))
    assert_grads_within(grads[:3], ref_grads[:3], base_grads[:3], q.dtype, floors)
    dsink, ref_dsink = grads[3], ref_grads[3]
    assert dsink.dtype == torch.float32 and dsink.shape == sink.shape and torch.isfinite(dsink).all()
    assert_within("dsink", dsink, ref_dsink,
                  tolerance(base_grads[3], ref_dsink, torch.float32, abs_floor=1e-4 * ref_dsink.abs().max().item()))


@pytest.mark.parametrize("headdim", supported_head_dims())
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("center", SINKS)
@pytest.mark.parametrize("deterministic", [True, False])
def test_sink_against_reference(headdim, mask, center, deterministic):
    q, k, v, dout = _inputs(2, 300, 300, 4, 2, headdim)
    _check(q, k, v, dout, _sink(4, center), MASKS[mask], deterministic)


@pytest.mark.parametrize("seqlens", [(113, 257), (257, 113), (1, 65)])
@pytest.mark.parametrize("nheads_k", [1, 4])
def test_sink_causal_uneven_and_gqa(seqlens, nheads_k):
    q, k, v, dout = _inputs(2, *seqlens, 4, nheads_k, main_head_dim())
    _check(q, k, v, dout, _sink(4, 1.0), MASKS["causal"], True)


@requires_softcap
def test_sink_with_softcap():
    q, k, v, dout = _inputs(1, 200, 200, 4, 4, main_head_dim())
    sink = _sink(4, 2.0)
    out, lse, grads = _kernel(q, k, v, dout, sink, dict(causal=True, softcap=5.0), True)
    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref(qf, kf, vf, causal=True, softcap=5.0, return_lse=True, learnable_sink=sink)
    ref = attention_bwd_ref(dout.float(), qf, kf, vf, ref_out, ref_lse, causal=True, softcap=5.0, learnable_sink=sink)
    base_out = attention_ref(q, k, v, causal=True, softcap=5.0, upcast=False, learnable_sink=sink)
    assert_within("out", out, ref_out, tolerance(base_out, ref_out, q.dtype))
    assert_within("lse", lse, ref_lse, 1e-3 * max(1.0, ref_lse.abs().max().item()))
    assert_within("dsink", grads[3], ref[3], 2e-2 * ref[3].abs().max().item() + 1e-3)


def test_no_sink_equals_minus_infinity_sink():
    """A sink of -inf is no sink: the same bits as the call without one (the kernels' finalize branch)."""
    q, k, v, dout = _inputs(1, 256, 256, 4, 4, main_head_dim())
    plain = dash_attn.flash_attn_func(q, k, v, causal=True)
    with_sink = dash_attn.flash_attn_func(q, k, v, causal=True, learnable_sink=torch.full((4,), float("-inf"),
                                                                                          device="cuda"))
    assert torch.equal(plain, with_sink)


def _varlen_case(headdim, lens_q, lens_k, seed=3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    q, dout = (torch.randn(tq, 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(tk, 2, headdim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = [torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
          for x in (lens_q, lens_k)]
    return q, k, v, dout, cu


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [((130, 0, 257, 64), (200, 9, 257, 64)), ((64, 64, 64), (64, 64, 64)),
                                  ((5, 300), (0, 300))])
def test_varlen_sink_against_reference(causal, lens):
    q, k, v, dout, (cu_q, cu_k) = _varlen_case(main_head_dim(), *lens)
    sink = _sink(4, 0.5)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves[:3], cu_q, cu_k, max(lens[0]), max(lens[1]), causal=causal,
                                                deterministic=True, return_attn_probs=True,
                                                learnable_sink=leaves[3])
    out.backward(dout)
    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref_varlen(qf, kf, vf, cu_q, cu_k, causal=causal, return_lse=True,
                                            learnable_sink=sink)
    ref = attention_bwd_ref_varlen(dout.float(), qf, kf, vf, ref_out, ref_lse, cu_q, cu_k, causal=causal,
                                   learnable_sink=sink)
    base_out = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal, upcast=False, learnable_sink=sink)
    assert_within("out", out, ref_out, tolerance(base_out, ref_out, q.dtype))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_within("lse", lse[finite], ref_lse[finite], 1e-2)
    for name, g, r in zip(("dq", "dk", "dv", "dsink"), [t.grad for t in leaves], ref):
        assert torch.isfinite(g).all(), name
        assert_within(name, g, r, 3e-2 * max(1.0, r.abs().max().item()))


def test_sink_gradients_bitwise_repeatable_under_load():
    """1000 deterministic backward calls, a competing matmul stream running: dq, dk, dv and dsink identical."""
    q, k, v, dout = _inputs(2, 512, 512, 8, 2, main_head_dim())
    sink = _sink(8, 0.0)
    first = _kernel(q, k, v, dout, sink, MASKS["causal"], True, poison=False)[2]
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for i in range(1000):
        if i % 50 == 0:
            with torch.cuda.stream(side):
                for _ in range(4):
                    a = (a @ a).clamp_(-1, 1)
        grads = _kernel(q, k, v, dout, sink, MASKS["causal"], True, poison=False)[2]
        for name, g, f in zip(("dq", "dk", "dv", "dsink"), grads, first):
            assert torch.equal(g, f), f"{name} differs at call {i}"
    torch.cuda.synchronize()
