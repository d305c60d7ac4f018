"""GPU backward: dQ/dK/dV of the sm90 kernels against the explicit float32 reference backward (marker `gpu`).

Same tolerance scheme as the forward tests: error <= max(2 x error of a plain PyTorch autograd backward in the input
dtype, a small floor). The floor of dq and dk adds twice the error that row statistics carried to 16 significant bits
can cause (reference.row_statistic_error_bound): the hdim 64 full/causal and hdim 128 full/causal/window kernels add
LSE and D to their accumulators as two bf16 parts each. It decides only where the baseline is exact, one key per
query (dS = 0). Gradients go through `flash_attn_func(...)` and autograd, so the registered autograd formula is what
is tested; the reference is `attention_bwd_ref` fed with the float32 reference forward's out and lse.
"""
import math
import os

import pytest
import torch

import dash_attn
from gpu_common import (exact_float32_matmul, supported_head_dims, main_head_dim,  # noqa: F401 (fixture)
                        assert_grads_within, assert_compiled_step_matches_eager, capture, poison_allocator,
                        DET_SCHEDULES)
from dash_attn.reference import attention_bwd_ref, attention_ref, row_statistic_error_bound
from dash_attn.schedules_table import NONDET_RUNS_BOUNDS
from dash_attn.validation import MIN_SOFTMAX_SCALE

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))


def make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=SEED):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim), (batch, seqlen_q, nheads, headdim)]
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes)
    return q, k, v, dout


def reference_grads(q, k, v, dout, causal, window=(-1, -1), softmax_scale=None):
    """(float32 reference grads, low-precision autograd baseline grads, absolute floors of dq/dk/dv)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    call_args = dict(softmax_scale=softmax_scale, causal=causal, window_size=window)
    out, lse = attention_ref(qf, kf, vf, return_lse=True, **call_args)
    ref = attention_bwd_ref(dout.float(), qf, kf, vf, out, lse, **call_args)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = attention_ref(*leaves, upcast=False, **call_args)
    base = torch.autograd.grad(base_out, leaves, dout)
    bounds = row_statistic_error_bound(dout.float(), qf, kf, vf, out, lse, **call_args)
    floors = tuple(2 * b.max().item() if b.numel() else 0.0 for b in bounds) + (0.0,)
    return ref, base, floors


def kernel_grads(q, k, v, dout, causal, schedule, deterministic, sm_margin=0, poison=False, window=(-1, -1),
                 softmax_scale=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = dash_attn.flash_attn_func(*leaves, softmax_scale=softmax_scale, causal=causal, window_size=window,
                                    deterministic=deterministic, schedule=schedule, sm_margin=sm_margin)
    if poison:
        poison_allocator()
    out.backward(dout)
    torch.cuda.synchronize()
    return tuple(t.grad for t in leaves)


def check_backward(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, schedule, deterministic,
                   poison=False, sm_margin=0, window=(-1, -1)):
    q, k, v, dout = make_inputs(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype)
    grads = kernel_grads(q, k, v, dout, causal, schedule, deterministic, sm_margin, poison, window)
    ref, base, floors = reference_grads(q, k, v, dout, causal, window)
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype, f"{name} has shape {g.shape} / dtype {g.dtype}"
    assert_grads_within(grads, ref, base, dtype, floors)


# Ragged last tiles, odd KV-tile counts, seqlen_q != seqlen_k both ways (bottom-right causal, masked rows).
# 400 x 900: a causal band whose first 3 KV tiles are fully live.
BWD_SEQLENS = [(1, 1), (17, 17), (113, 257), (257, 113), (400, 900), (1023, 1023)]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", BWD_SEQLENS, ids=[f"{a}x{b}" for a, b in BWD_SEQLENS])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", DET_SCHEDULES)
def test_backward_schedule_mask_gqa_shapes(seqlen_q, seqlen_k, group, causal, schedule):
    """Every schedule x mask x GQA ratio x odd shape, deterministic mode, bf16, the main head dim."""
    check_backward(2, seqlen_q, seqlen_k, 8, 8 // group, main_head_dim(), torch.bfloat16, causal, schedule, True)


# Sliding windows (left, right) around the bottom-right diagonal: both sides, one side each, a band narrower than a
# tile (rows whose band falls outside seqlen_k see no key), and (0, 0) (each row sees one key).
WINDOWS = [(64, 64), (100, 0), (-1, 40), (300, -1), (5, 3), (0, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 257), (257, 113), (1023, 1023)],
                         ids=["113x257", "257x113", "1023x1023"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}_{b}" for a, b in WINDOWS])
@pytest.mark.parametrize("schedule", DET_SCHEDULES)
def test_backward_sliding_window(seqlen_q, seqlen_k, window, schedule):
    """Every schedule x window x odd shape, deterministic mode, GQA 4:2, bf16, the main head dim."""
    check_backward(2, seqlen_q, seqlen_k, 4, 2, main_head_dim(), torch.bfloat16, False, schedule, True,
                   window=window)


# Units claimed at run time and each dQ tile's first add elected as its visit loads: every mask, GQA ratio and odd
# shape of the deterministic tests above, non-deterministic mode (the only one it runs in).
@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", BWD_SEQLENS, ids=[f"{a}x{b}" for a, b in BWD_SEQLENS])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("schedule", dash_attn.NONDETERMINISTIC_SCHEDULES)
def test_backward_nondeterministic_schedules(seqlen_q, seqlen_k, group, mask, schedule):
    window = (100, 7) if mask == "window" else (-1, -1)
    check_backward(2, seqlen_q, seqlen_k, 8, 8 // group, main_head_dim(), torch.bfloat16, mask == "causal", schedule,
                   False, window=window)


@pytest.mark.gpu
def test_backward_nondeterministic_auto_on_long_causal_bands():
    """From schedules_table.NONDET_RUNS_BOUNDS' key bound the non-deterministic `auto` runs shift_causal_runs on square
    causal bands at hdim 128, with poisoned outputs."""
    if 128 not in supported_head_dims():
        pytest.skip("this build has no hdim 128 kernels")
    bound = NONDET_RUNS_BOUNDS[("causal", 128)].min_seqlen_k
    check_backward(1, bound, bound, 2, 2, 128, torch.bfloat16, True, "auto", False, poison=True)


@pytest.mark.gpu
def test_backward_nondeterministic_auto_with_ordered_adds():
    """Where schedules_table.NONDET_RUNS_BOUNDS runs the non-deterministic `auto` with ordered dQ adds (hdim 256, causal,
    4 query heads per KV head): within the reference's bounds with poisoned outputs, and the deterministic call's
    bits."""
    if 256 not in supported_head_dims():
        pytest.skip("this build has no hdim 256 kernels")
    ratio = NONDET_RUNS_BOUNDS[("causal", 256)].min_gqa_ratio
    check_backward(2, 700, 700, 2 * ratio, 2, 256, torch.bfloat16, True, "auto", False, poison=True)
    q, k, v, dout = make_inputs(2, 700, 700, 2 * ratio, 2, 256, torch.bfloat16)
    nondet = kernel_grads(q, k, v, dout, True, "auto", False)
    det = kernel_grads(q, k, v, dout, True, "auto", True)
    for name, a, b in zip(("dq", "dk", "dv"), nondet, det):
        assert torch.equal(a, b), f"{name}: the ordered adds differ from the deterministic call's"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_dynamic_head_dims_long(causal, dtype, headdim):
    """Several units claimed per CTA (264 KV tiles at hdim 128 on a grid of 32), with poisoned outputs."""
    check_backward(2, 4097, 4097, 8, 4, headdim, dtype, causal, "dynamic", False, poison=True, sm_margin=100)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_sliding_window_head_dims(deterministic, dtype, headdim):
    check_backward(2, 1023, 1023, 4, 2, headdim, dtype, False, "auto", deterministic, window=(200, 57))


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 17), (113, 257), (1023, 1023)],
                         ids=["17x17", "113x257", "1023x1023"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_head_dims_dtypes_modes(seqlen_q, seqlen_k, deterministic, causal, dtype, headdim):
    check_backward(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype, causal, "auto", deterministic)


@pytest.mark.gpu
# 600 x 5000: a causal band with most KV tiles fully live, where deterministic `auto` runs descending_lanes unpaired.
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(4097, 4097), (4097, 1023), (1023, 4097), (600, 5000)],
                         ids=["4097x4097", "4097x1023", "1023x4097", "600x5000"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", ["auto", "descending", "shift", "shift_causal", "descending_lanes"])
def test_backward_long(seqlen_q, seqlen_k, causal, schedule):
    check_backward(1, seqlen_q, seqlen_k, 4, 2, main_head_dim(), torch.bfloat16, causal, schedule, True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_poisoned_outputs(causal, deterministic, headdim):
    """dq/dk/dv and the kernel workspace come from a cache full of NaN: every element must still be written."""
    check_backward(2, 1023, 1023, 4, 2, headdim, torch.bfloat16, causal, "auto", deterministic, poison=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_peaked_softmax(causal, dtype, headdim):
    """Logits 16x the usual spread (LSE_log2 up to ~100), rows with a single dominant key: a kernel that carried LSE
    in fewer bits than fp32 would err in the exponent of P by |LSE_log2| times its precision; the gradients must stay
    within the usual bound."""
    q, k, v, dout = make_inputs(2, 1023, 1023, 4, 2, headdim, dtype)
    q, k = q * 4, k * 4
    grads = kernel_grads(q, k, v, dout, causal, "auto", True)
    ref, base, floors = reference_grads(q, k, v, dout, causal)
    assert_grads_within(grads, ref, base, dtype, floors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_single_key(dtype, headdim):
    """One query, one key: P = 1, dP = D and dS = 0 exactly, so dQ and dK are 0 and the baseline is exact. What is
    left is the statistics' rounding: D carried to 16 bits (two bf16 parts) leaves dS at up to 2^-17 |D| (dQ 1.5-4.3e-5
    measured on the H200), within the floor of row_statistic_error_bound."""
    check_backward(2, 1, 1, 4, 2, headdim, dtype, False, "auto", True)


@pytest.mark.gpu
@pytest.mark.parametrize("log2_scale", [-40, -12, 20, 100])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_backward_gradient_scale(log2_scale, causal, headdim):
    """dO times a power of two: dQ, dK, dV times the same power, bitwise (every statistic keeps its relative
    precision at any scale: fp32, or bf16 parts), and within the reference's bound for the unscaled gradients."""
    q, k, v, dout = make_inputs(2, 1023, 1023, 4, 2, headdim, torch.bfloat16)
    grads = kernel_grads(q, k, v, dout * 2.0**log2_scale, causal, "auto", True)
    plain = kernel_grads(q, k, v, dout, causal, "auto", True)
    unscaled = tuple(g.float() * 2.0**-log2_scale for g in grads)
    for name, u, g in zip(("dq", "dk", "dv"), unscaled, plain):
        assert torch.equal(u, g.float()), f"{name} does not scale exactly with dO"
    ref, base, floors = reference_grads(q, k, v, dout, causal)
    assert_grads_within(unscaled, ref, base, torch.bfloat16, floors)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_softmax_scale_zero(causal, varlen):
    """Scale 0 (uniform attention over the visible keys): the kernels run on zero queries at scale 1
    (api._scoreless_queries), so dQ and dK are exactly 0 and dV is the reference's."""
    q, k, v, dout = make_inputs(2, 300, 300, 4, 2, main_head_dim(), torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if varlen:
        cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
        packed = [t.flatten(0, 1) for t in leaves]
        out = dash_attn.flash_attn_varlen_func(*packed, cu, cu, 300, 300, softmax_scale=0.0, causal=causal,
                                               deterministic=True).unflatten(0, (2, 300))
    else:
        out = dash_attn.flash_attn_func(*leaves, softmax_scale=0.0, causal=causal, deterministic=True)
    out.backward(dout)
    dq, dk, dv = (t.grad for t in leaves)
    assert not dq.any() and not dk.any()
    ref, base, _ = reference_grads(q, k, v, dout, causal, softmax_scale=0.0)
    assert_grads_within((dq, dk, dv), ref, base, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_smallest_softmax_scale(causal):
    """The smallest positive scale taken runs in the kernels as is: their row statistics in score units (lse / scale)
    stay finite there (validation.MIN_SOFTMAX_SCALE)."""
    q, k, v, dout = make_inputs(2, 300, 300, 4, 2, main_head_dim(), torch.bfloat16)
    grads = kernel_grads(q, k, v, dout, causal, "auto", True, softmax_scale=MIN_SOFTMAX_SCALE)
    ref, base, _ = reference_grads(q, k, v, dout, causal, softmax_scale=MIN_SOFTMAX_SCALE)
    # dQ and dK carry the factor `scale` (about 1e-30): compared without it, so that the absolute floor means nothing.
    factors = (MIN_SOFTMAX_SCALE, MIN_SOFTMAX_SCALE, 1.0)
    grads, ref, base = ([g.float() / f for g, f in zip(gs, factors)] for gs in (grads, ref, base))
    assert_grads_within(grads, ref, base, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("sm_margin", [0, 4, 18])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_sm_margin(sm_margin, causal):
    check_backward(2, 1023, 1023, 8, 2, main_head_dim(), torch.bfloat16, causal, "auto", True, sm_margin=sm_margin)


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["descending", "shift"])
def test_autograd_matches_direct_op_call(schedule):
    """The registered autograd formula calls the backward op with the forward's arguments: bitwise the same."""
    q, k, v, dout = make_inputs(2, 513, 513, 8, 2, main_head_dim(), torch.bfloat16)
    grads = kernel_grads(q, k, v, dout, True, schedule, True)
    scale = 1.0 / math.sqrt(q.shape[-1])  # the expression flash_attn_func uses, so the float is the same
    out, lse = torch.ops.dash_attn.fwd(q, k, v, scale, 1, -1, 0, 0.0, True, schedule, 0)
    direct = torch.ops.dash_attn.bwd(dout, q, k, v, out, lse, scale, 1, -1, 0, 0.0, True, schedule, 0)
    for g, d in zip(grads, direct):
        assert torch.equal(g, d)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads_q", [None, 8], ids=["mha", "gqa"])
def test_packed_qkv_matches_separate_tensors(num_heads_q):
    """The packed layouts reach the kernels as strided views: results bitwise equal to contiguous q, k, v."""
    d = main_head_dim()
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    shape = (2, 513, 3, 8, d) if num_heads_q is None else (2, 513, 8 + 2 * 2, d)
    qkv = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dout = torch.randn(2, 513, 8, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = dash_attn.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True, num_heads_q=num_heads_q)
    out.backward(dout)
    parts = qkv.detach().unbind(2) if num_heads_q is None else qkv.detach().split([8, 2, 2], 2)
    leaves = [t.contiguous().requires_grad_() for t in parts]
    ref = dash_attn.flash_attn_func(*leaves, causal=True, deterministic=True)
    ref.backward(dout)
    assert torch.equal(out, ref)
    grads = [t.grad for t in leaves]
    packed = torch.stack(grads, 2) if num_heads_q is None else torch.cat(grads, 2)
    assert torch.equal(qkv.grad, packed)


@pytest.mark.gpu
def test_torch_compile_fullgraph_matches_eager():
    assert_compiled_step_matches_eager(*make_inputs(2, 513, 513, 8, 2, main_head_dim(), torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_cuda_graph_capture_of_forward_backward(deterministic):
    headdim = main_head_dim()
    q, k, v, dout = make_inputs(2, 513, 513, 8, 2, headdim, torch.bfloat16)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    static_dout = dout.clone()

    def step():
        out = dash_attn.flash_attn_func(*static, causal=True, deterministic=deterministic)
        return (out,) + torch.autograd.grad(out, static, static_dout)

    graph, captured = capture(step, warmups=3)

    new_q, new_k, new_v, new_dout = make_inputs(2, 513, 513, 8, 2, headdim, torch.bfloat16, seed=SEED + 1)
    with torch.no_grad():
        for dst, src in zip(static + [static_dout], (new_q, new_k, new_v, new_dout)):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()

    leaves = [t.detach().clone().requires_grad_() for t in (new_q, new_k, new_v)]
    out = dash_attn.flash_attn_func(*leaves, causal=True, deterministic=deterministic)
    expected = (out,) + torch.autograd.grad(out, leaves, new_dout)
    for name, c, e in zip(("out", "dq", "dk", "dv"), captured, expected):
        if deterministic or name == "out":
            assert torch.equal(c, e), f"{name} from the replayed graph differs from eager"
        else:
            torch.testing.assert_close(c, e, rtol=2e-2, atol=2e-2)
