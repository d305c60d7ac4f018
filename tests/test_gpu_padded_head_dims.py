"""GPU head dims without a kernel of their own (marker `gpu`): they run in the next larger head dim's kernel, whose
loads fill the missing columns with zeros (csrc/common/head_dims.h); its outputs go through rows of its width.

Forward O/LSE and backward dQ/dK/dV against the float32 reference at the caller's head dim (tolerance scheme of
test_gpu_forward.py; full, causal, windows and soft-capping) with outputs from a NaN-poisoned allocator, inputs whose
rows continue in memory past the head dim with NaN (nothing past it may be read), bitwise-identical repeated
deterministic backward calls, the varlen path, torch.compile(fullgraph=True), and v with a head dim of its own.
"""
import os

import pytest
import torch

import dash_attn
from gpu_common import (exact_float32_matmul, supported_head_dims, assert_out_lse_within,  # noqa: F401 (fixture)
                        assert_compiled_step_matches_eager, assert_grads_within, poison_allocator,
                        softcap_built, SOFTCAP_SCORE_BOOST)
from dash_attn.reference import attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen
from test_gpu_varlen import check_varlen

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
# Multiples of 8 below the largest compiled head dim that have no kernel of their own.
PADDED = [d for d in (8, 32, 80, 96, 160, 192, 248)
          if d not in supported_head_dims() and d < max(supported_head_dims())]


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=SEED, headdim_v=None):
    """q, k, v, dout; v and dout with headdim_v columns where given."""
    dv = headdim if headdim_v is None else headdim_v
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, dv), (batch, seqlen_q, nheads, dv)]
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes)


def run(q, k, v, dout, causal, deterministic, poison=False, **options):
    """options: window_size, softcap."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if poison:
        poison_allocator()
    out, lse = dash_attn.flash_attn_func(*leaves, causal=causal, deterministic=deterministic, return_attn_probs=True,
                                         **options)
    out.backward(dout)
    torch.cuda.synchronize()
    return out, lse, tuple(t.grad for t in leaves)


def check_against_reference(q, k, v, dout, causal, deterministic, **options):
    """Outputs from a NaN-poisoned allocator, shapes (out takes v's head dim) and values against the reference.
    options: window_size, softcap, for the kernel and the reference alike."""
    dtype = q.dtype
    out, lse, grads = run(q, k, v, dout, causal, deterministic, poison=True, **options)
    assert out.shape == (*q.shape[:-1], v.shape[-1]) and out.is_contiguous() and out.dtype == dtype
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype
    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref(qf, kf, vf, causal=causal, return_lse=True, **options)
    ref_grads = attention_bwd_ref(dout.float(), qf, kf, vf, ref_out, ref_lse, causal=causal, **options)
    base_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out, base_lse = attention_ref(*base_leaves, causal=causal, upcast=False, return_lse=True, **options)
    base_grads = torch.autograd.grad(base_out, base_leaves, dout)
    assert_out_lse_within(out, lse, ref_out, ref_lse, base_out, dtype, base_lse=base_lse)
    assert_grads_within(grads, ref_grads, base_grads, dtype)


def check_reproducible(q, k, v, dout, causal, calls=20):
    _, _, first = run(q, k, v, dout, causal, True)
    for _ in range(calls):
        _, _, again = run(q, k, v, dout, causal, True)
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between deterministic calls"


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 17), (113, 257), (1023, 1023)], ids=["17", "113x257", "1023"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", PADDED)
def test_padded_head_dim_matches_reference(seqlen_q, seqlen_k, deterministic, causal, dtype, headdim):
    check_against_reference(*make_inputs(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype), causal, deterministic)


# Windows and soft-capping, each and together (check_windows_and_softcap).
BAND_OPTIONS = pytest.mark.parametrize(
    "options", [dict(window_size=(100, 20)), dict(softcap=5.0), dict(window_size=(64, 0), softcap=2.0)],
    ids=["window", "softcap", "both"])


def check_windows_and_softcap(headdim, deterministic, options):
    """check_against_reference of a 513 x 513 bf16 call with `options`; soft-capped calls get boosted scores."""
    if options.get("softcap") and not softcap_built():
        pytest.skip("extension built with DASH_ATTN_SOFTCAP=0")
    q, k, v, dout = make_inputs(2, 513, 513, 4, 2, headdim, torch.bfloat16)
    if options.get("softcap"):
        q, k = (t.float().mul(SOFTCAP_SCORE_BOOST).to(t.dtype) for t in (q, k))
    check_against_reference(q, k, v, dout, False, deterministic, **options)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@BAND_OPTIONS
@pytest.mark.parametrize("headdim", PADDED)
def test_padded_head_dim_windows_and_softcap(deterministic, options, headdim):
    check_windows_and_softcap(headdim, deterministic, options)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", PADDED)
def test_padded_head_dim_reads_nothing_past_the_head_dim(causal, headdim):
    # q, k, v, dout as views of rows 8 elements wider whose extra columns hold NaN: a kernel that read a column past
    # the head dim (instead of taking zeros) would spread NaN into every result.
    q, k, v, dout = make_inputs(2, 257, 257, 4, 2, headdim, torch.bfloat16)

    def wide(t):
        w = torch.full((*t.shape[:-1], headdim + 8), float("nan"), device="cuda", dtype=t.dtype)
        w[..., :headdim] = t
        return w

    leaves = [wide(t).requires_grad_() for t in (q, k, v)]
    views = [w[..., :headdim] for w in leaves]
    assert not views[0].is_contiguous()
    out, lse = dash_attn.flash_attn_func(*views, causal=causal, deterministic=True, return_attn_probs=True)
    out.backward(wide(dout)[..., :headdim])
    ref_out, ref_lse, ref_grads = run(q, k, v, dout, causal, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    for name, w, r in zip(("dq", "dk", "dv"), leaves, ref_grads):
        assert torch.equal(w.grad[..., :headdim], r), f"{name} differs when the rows continue past the head dim"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", PADDED)
def test_padded_head_dim_backward_is_bitwise_reproducible(causal, headdim):
    check_reproducible(*make_inputs(2, 1023, 1023, 8, 2, headdim, torch.bfloat16), causal)


@pytest.mark.parametrize("packing", ["odd", "runs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", PADDED)
def test_padded_head_dim_varlen(packing, causal, headdim):
    check_varlen(packing, 4, 2, headdim, torch.bfloat16, causal, deterministic=True, poison=True)


@pytest.mark.skipif(not PADDED, reason="every head dim up to the largest compiled one has a kernel")
def test_padded_head_dim_compiles_fullgraph():
    assert_compiled_step_matches_eager(*make_inputs(2, 257, 257, 4, 2, PADDED[0], torch.bfloat16))


# (q/k head dim, v head dim): DeepSeek's 192/128 and others; the kernel is the one that holds both.
VALUE_HEAD_DIMS = [(d, dv) for d, dv in ((192, 128), (128, 64), (64, 128), (96, 64), (64, 256))
                   if max(d, dv) <= max(supported_head_dims())]


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 257), (1023, 1023)], ids=["113x257", "1023"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim, headdim_v", VALUE_HEAD_DIMS, ids=[f"{d}v{dv}" for d, dv in VALUE_HEAD_DIMS])
def test_value_head_dim_matches_reference(seqlen_q, seqlen_k, deterministic, causal, headdim, headdim_v):
    inputs = make_inputs(2, seqlen_q, seqlen_k, 4, 2, headdim, torch.bfloat16, headdim_v=headdim_v)
    check_against_reference(*inputs, causal, deterministic)


@pytest.mark.parametrize("headdim, headdim_v", VALUE_HEAD_DIMS, ids=[f"{d}v{dv}" for d, dv in VALUE_HEAD_DIMS])
def test_value_head_dim_backward_is_bitwise_reproducible(headdim, headdim_v):
    check_reproducible(*make_inputs(2, 1023, 1023, 8, 2, headdim, torch.bfloat16, headdim_v=headdim_v), True)


@pytest.mark.parametrize("headdim, headdim_v", VALUE_HEAD_DIMS[:2], ids=[f"{d}v{dv}" for d, dv in VALUE_HEAD_DIMS[:2]])
def test_value_head_dim_varlen(headdim, headdim_v):
    lens = [113, 1, 257, 64, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    q, k = (torch.randn(sum(lens), 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v, dout = (torch.randn(sum(lens), 4, headdim_v, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), causal=True,
                                                deterministic=True, return_attn_probs=True)
    out.backward(dout)
    assert out.shape == (sum(lens), 4, headdim_v)
    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref_varlen(qf, kf, vf, cu, cu, causal=True, return_lse=True)
    ref_grads = attention_bwd_ref_varlen(dout.float(), qf, kf, vf, ref_out, ref_lse, cu, cu, causal=True)
    base_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = attention_ref_varlen(*base_leaves, cu, cu, causal=True, upcast=False)
    base_grads = torch.autograd.grad(base_out, base_leaves, dout)
    assert_out_lse_within(out, lse, ref_out, ref_lse, base_out, torch.bfloat16)
    assert_grads_within([t.grad for t in leaves], ref_grads, base_grads, torch.bfloat16)


@pytest.mark.parametrize("headdim, headdim_v", VALUE_HEAD_DIMS[:2], ids=[f"{d}v{dv}" for d, dv in VALUE_HEAD_DIMS[:2]])
def test_value_head_dim_window_and_softcap(headdim, headdim_v):
    if not softcap_built():
        pytest.skip("extension built with DASH_ATTN_SOFTCAP=0")
    q, k, v, dout = make_inputs(2, 513, 513, 4, 2, headdim, torch.bfloat16, headdim_v=headdim_v)
    q, k = (t.float().mul(SOFTCAP_SCORE_BOOST).to(t.dtype) for t in (q, k))
    check_against_reference(q, k, v, dout, False, True, window_size=(64, 0), softcap=2.0)
