"""GPU soft-capping (softcap > 0, scores = softcap * tanh(scores / softcap)): forward O/LSE and backward dQ/dK/dV of
the soft-capped kernels against the float32 reference, with the tolerance scheme of test_gpu_forward.py (marker
`gpu`; skipped where the extension was built with DASH_ATTN_SOFTCAP=0).

The inputs are scaled so that a good share of the scores lands in tanh's curved part and some saturate: a softcap of
2-30 against scores of standard deviation ~3 (randn inputs times `SOFTCAP_SCORE_BOOST`). Without that, tanh(x) ~ x
and a kernel that ignored 1 - t^2 in dS would pass.
"""
import os

import pytest
import torch

import dash_attn
from gpu_common import (exact_float32_matmul, supported_head_dims, assert_out_lse_within,  # noqa: F401 (fixture)
                        assert_grads_within, poison_allocator, requires_softcap, softcap_built,
                        SOFTCAP_SCORE_BOOST)
from dash_attn.reference import attention_bwd_ref, attention_ref

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
DTYPES = [torch.float16, torch.bfloat16]
# (mask name, causal, window)
MASKS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (150, 37))}


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=SEED):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim), (batch, seqlen_q, nheads, headdim)]
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda", dtype=torch.float32) for s in shapes)
    return (q * SOFTCAP_SCORE_BOOST).to(dtype), (k * SOFTCAP_SCORE_BOOST).to(dtype), v.to(dtype), dout.to(dtype)


def check_softcap(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, mask, softcap, deterministic=True,
                  schedule="auto", poison=False):
    causal, window = MASKS[mask]
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if poison:
        poison_allocator()
    out, lse = dash_attn.flash_attn_func(*leaves, causal=causal, window_size=window, softcap=softcap,
                                         deterministic=deterministic, schedule=schedule, return_attn_probs=True)
    if poison:
        poison_allocator()
    out.backward(dout)
    torch.cuda.synchronize()

    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref(qf, kf, vf, causal=causal, window_size=window, softcap=softcap,
                                     return_lse=True)
    ref_grads = attention_bwd_ref(dout.float(), qf, kf, vf, ref_out, ref_lse, causal=causal, window_size=window,
                                  softcap=softcap)
    base_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out, base_lse = attention_ref(*base_leaves, causal=causal, window_size=window, softcap=softcap, upcast=False,
                                       return_lse=True)
    base_grads = torch.autograd.grad(base_out, base_leaves, dout)

    assert_out_lse_within(out, lse, ref_out, ref_lse, base_out, dtype, base_lse=base_lse)
    grads = [t.grad for t in leaves]
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
    assert_grads_within(grads, ref_grads, base_grads, dtype)


@requires_softcap
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 17), (113, 257), (257, 113), (1023, 1023)],
                         ids=["17", "113x257", "257x113", "1023"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_softcap_head_dims_dtypes_masks(seqlen_q, seqlen_k, mask, dtype, headdim):
    check_softcap(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype, mask, softcap=5.0)


@requires_softcap
@pytest.mark.parametrize("softcap", [2.0, 30.0])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_softcap_values_and_modes(softcap, deterministic, mask, headdim):
    check_softcap(1, 1023, 1023, 8, 8, headdim, torch.bfloat16, mask, softcap, deterministic=deterministic)


@requires_softcap
@pytest.mark.parametrize("schedule", [s for s in dash_attn.SCHEDULES if s != "auto"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_softcap_every_schedule_poisoned(schedule, mask):
    headdim = 128 if 128 in supported_head_dims() else supported_head_dims()[0]
    deterministic = schedule not in dash_attn.NONDETERMINISTIC_SCHEDULES
    check_softcap(2, 513, 513, 8, 2, headdim, torch.bfloat16, mask, softcap=5.0, deterministic=deterministic,
                  schedule=schedule, poison=True)


@requires_softcap
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_softcap_backward_bitwise_reproducible(mask, headdim):
    causal, window = MASKS[mask]
    q, k, v, dout = make_inputs(2, 1013, 1013, 8, 2, headdim, torch.bfloat16)
    mask_id = {"full": 0, "causal": 1, "window": 2}[mask]
    left, right = (-1, 0) if causal else window
    scale = headdim ** -0.5
    out, lse = torch.ops.dash_attn.fwd(q, k, v, scale, mask_id, left, right, 5.0, True, "auto", 0)
    first = torch.ops.dash_attn.bwd(dout, q, k, v, out, lse, scale, mask_id, left, right, 5.0, True, "auto", 0)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(100):
        grads = torch.ops.dash_attn.bwd(dout, q, k, v, out, lse, scale, mask_id, left, right, 5.0, True, "auto", 0)
        mismatches += torch.stack([(a != b).any() for a, b in zip(grads, first)]).any().to(torch.int64)
    assert int(mismatches.item()) == 0


def test_softcap_changes_the_result():
    """The soft-capped kernels really cap: at softcap 2 the output differs from the plain kernel's."""
    q, k, v, _ = make_inputs(1, 257, 257, 4, 4, supported_head_dims()[0], torch.bfloat16)
    if not softcap_built():
        with pytest.raises(RuntimeError, match="DASH_ATTN_SOFTCAP=0"):
            dash_attn.flash_attn_func(q, k, v, softcap=2.0)
        return
    capped = dash_attn.flash_attn_func(q, k, v, softcap=2.0)
    plain = dash_attn.flash_attn_func(q, k, v)
    assert (capped.float() - plain.float()).abs().max().item() > 0.05
