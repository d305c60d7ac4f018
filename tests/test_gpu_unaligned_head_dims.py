"""GPU head dims that are not multiples of 8 (marker `gpu`): the public functions zero-pad q, k and v to the next
multiple of 8 (validation.padded_head_dim), which then runs like any head dim (its own kernel, or the next larger
one: test_gpu_padded_head_dims.py), with the softmax scale of the head dim given; out and the gradients come back
without the padding. Varlen calls with seqused (the packed kernels) run on copies padded to the kernel's head dim.

Against the float32 reference at the head dim given (tolerance scheme of test_gpu_forward.py) with outputs from a
NaN-poisoned allocator: dense (full, causal, windows, soft-capping, GQA, both modes), v with another head dim,
varlen (planned and with seqused), the packed forms; bitwise-identical repeated deterministic backward calls;
bitwise the explicitly padded call; torch.compile(fullgraph=True).
"""
import math

import pytest
import torch

import dash_attn
from dash_attn import validation
from gpu_common import exact_float32_matmul, supported_head_dims, assert_compiled_step_matches_eager  # noqa: F401
from test_gpu_padded_head_dims import (BAND_OPTIONS, check_against_reference, check_reproducible,
                                       check_windows_and_softcap, make_inputs, run)
from test_gpu_varlen import check_varlen

pytestmark = pytest.mark.gpu

UNALIGNED = [d for d in (1, 33, 100, 127, 190, 255) if validation.padded_head_dim(d) <= max(supported_head_dims())]


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 257), (1023, 1023)], ids=["113x257", "1023"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_matches_reference(seqlen_q, seqlen_k, deterministic, causal, dtype, headdim):
    check_against_reference(*make_inputs(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype), causal, deterministic)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@BAND_OPTIONS
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_windows_and_softcap(deterministic, options, headdim):
    check_windows_and_softcap(headdim, deterministic, options)


VALUE_HEAD_DIMS = [(d, dv) for d, dv in ((100, 36), (33, 64), (190, 127), (72, 5))
                   if validation.padded_head_dim(max(d, dv)) <= max(supported_head_dims())]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim, headdim_v", VALUE_HEAD_DIMS, ids=[f"{d}v{dv}" for d, dv in VALUE_HEAD_DIMS])
def test_unaligned_value_head_dim_matches_reference(deterministic, headdim, headdim_v):
    inputs = make_inputs(2, 257, 257, 4, 2, headdim, torch.bfloat16, headdim_v=headdim_v)
    check_against_reference(*inputs, True, deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_backward_is_bitwise_reproducible(causal, headdim):
    check_reproducible(*make_inputs(2, 1023, 1023, 8, 2, headdim, torch.bfloat16), causal)


@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_is_the_explicitly_padded_call(headdim):
    # Bitwise: padding inside is the call on zero-padded tensors with the scale of the head dim given.
    q, k, v, dout = make_inputs(2, 257, 257, 4, 2, headdim, torch.bfloat16)
    width = validation.padded_head_dim(headdim)
    out, lse, grads = run(q, k, v, dout, True, True)
    wide = [torch.nn.functional.pad(t, (0, width - headdim)) for t in (q, k, v, dout)]
    wide_out, wide_lse, wide_grads = run(*wide, True, True, softmax_scale=1 / math.sqrt(headdim))
    assert torch.equal(out, wide_out[..., :headdim]) and torch.equal(lse, wide_lse)
    for g, w in zip(grads, wide_grads):
        assert torch.equal(g, w[..., :headdim])


@pytest.mark.parametrize("packing", ["odd", "runs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_varlen(packing, causal, deterministic, headdim):
    check_varlen(packing, 4, 2, headdim, torch.bfloat16, causal, deterministic=deterministic, poison=True)


@pytest.mark.parametrize("mask", ["causal", "window"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", UNALIGNED)
def test_unaligned_head_dim_with_seqused(mask, deterministic, headdim):
    # The packed kernels, on copies padded to the kernel's head dim, sequences of different diagonals.
    from test_gpu_seqused import USED, _assert_matches_reference, _inputs, _run, _used
    inputs = _inputs(8, 2, headdim)
    used_q, used_k = (_used(u) for u in USED["q"])
    _assert_matches_reference(_run(inputs, used_q, used_k, mask, deterministic), inputs, used_q, used_k, mask)


@pytest.mark.parametrize("headdim", [33, 100])
def test_unaligned_head_dim_packed_forms(headdim):
    if validation.padded_head_dim(headdim) > max(supported_head_dims()):
        pytest.skip(f"no kernel holds head dim {headdim}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 257, 3, 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(2, 257, 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
    packed = qkv.clone().requires_grad_()
    out = dash_attn.flash_attn_qkvpacked_func(packed, causal=True, deterministic=True)
    out.backward(dout)
    ref_out, _, ref_grads = run(*qkv.unbind(2), dout, True, True)
    assert torch.equal(out, ref_out) and torch.equal(packed.grad, torch.stack(ref_grads, 2))
    cu = torch.tensor([0, 257, 514], dtype=torch.int32, device="cuda")
    flat = qkv.flatten(0, 1).clone().requires_grad_()
    out = dash_attn.flash_attn_varlen_qkvpacked_func(flat, cu, 257, causal=True, deterministic=True)
    out.backward(dout.flatten(0, 1))
    assert out.shape == (514, 4, headdim) and flat.grad.shape == flat.shape


def test_unaligned_head_dim_compiles_fullgraph():
    assert_compiled_step_matches_eager(*make_inputs(2, 257, 257, 4, 2, UNALIGNED[1], torch.bfloat16))
