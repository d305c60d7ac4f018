"""Public API on the CPU path: argument checks, deterministic=None, results and gradients, varlen and packed layouts.
FA3's and FA2's signatures, keywords and input rules are in test_api_fa3.py; the CUDA plumbing, checked on the CPU with
a stand-in extension, in test_api_cuda_path.py."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dash_attn
from dash_attn import interface, validation
from dash_attn.reference import attention_ref, attention_ref_varlen

from api_common import cu, qkv, varlen_inputs


class _OpRecorder(TorchDispatchMode):
    """Records the arguments every dash_attn op receives."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dash_attn":
            self.calls.append((func._opname, args))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------------------------------
# Exports
# ----------------------------------------------------------------------------------------------------------------------

def test_exports():
    assert dash_attn.SCHEDULES == ("auto", "ascending", "descending", "spt", "shift", "shift_causal", "shift_runs",
                                   "shift_causal_runs", "descending_lanes", "dynamic")
    assert dash_attn.NONDETERMINISTIC_SCHEDULES == ("dynamic",)
    assert isinstance(dash_attn.__version__, str) and dash_attn.__version__
    assert callable(dash_attn.flash_attn_func) and callable(dash_attn.flash_attn_varlen_func)


def test_schedule_ids_mirror_params_h():
    assert interface.SCHEDULE_IDS == {"ascending": 0, "descending": 1, "spt": 2, "shift": 3, "shift_causal": 4,
                                      "dynamic": 5, "shift_runs": 6, "shift_causal_runs": 7,
                                      "descending_lanes": 8}
    assert set(interface.SCHEDULE_IDS) | {"auto"} == set(dash_attn.SCHEDULES)
    assert [int(m) for m in interface.MaskKind] == [0, 1, 2]


# ----------------------------------------------------------------------------------------------------------------------
# Validation errors
# ----------------------------------------------------------------------------------------------------------------------

def _call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = qkv()
    return dash_attn.flash_attn_func(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs)


BAD_ARGUMENTS = [
    (dict(q=torch.zeros(2, 9, 4, 16, dtype=torch.int32)), "dtype"),
    (dict(k=torch.zeros(2, 9, 2, 16, dtype=torch.float64)), "dtype"),
    (dict(q=torch.zeros(9, 4, 16)), "4 dimensions"),
    (dict(k=torch.zeros(3, 9, 2, 16), v=torch.zeros(3, 9, 2, 16)), "batch"),
    (dict(k=torch.zeros(2, 8, 2, 16)), "same shape but for the head dim"),
    (dict(q=torch.zeros(2, 9, 4, 24)), "head dim"),
    (dict(q=torch.zeros(2, 9, 3, 16)), "multiple of nheads"),
    (dict(q=torch.zeros(2, 9, 4, 0), k=torch.zeros(2, 9, 2, 0), v=torch.zeros(2, 9, 2, 0)), "head dim 0"),
    (dict(q=torch.zeros(2, 9, 4, 264), k=torch.zeros(2, 9, 2, 264), v=torch.zeros(2, 9, 2, 264)), "head dim 264"),
    (dict(q=torch.zeros(2, 9, 16, 4).transpose(2, 3)), "contiguous last dimension"),
    (dict(v=torch.zeros(2, 9, 16, 2).transpose(2, 3)), "v must have a contiguous"),
    (dict(window_size=(3,)), "window_size"),
    (dict(window_size=(1.5, 0)), "window_size left"),
    (dict(causal=1), "causal"),
    (dict(softcap=-1.0), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softmax_scale=float("inf")), "softmax_scale"),
    (dict(softmax_scale=-0.5), "softmax_scale"),
    (dict(softmax_scale=1e-31), "softmax_scale"),
    (dict(schedule="fastest"), "schedule"),
    (dict(sm_margin=-1), "sm_margin"),
    (dict(deterministic="yes"), "deterministic"),
]


@pytest.mark.parametrize("kwargs, message", BAD_ARGUMENTS, ids=[m for _, m in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _call(**kwargs)


def test_unknown_schedule_names_the_argument_and_the_choices():
    with pytest.raises(ValueError) as info:
        _call(schedule="Descending")
    text = str(info.value)
    assert "schedule" in text and all(name in text for name in dash_attn.SCHEDULES)


@pytest.mark.parametrize("schedule", dash_attn.NONDETERMINISTIC_SCHEDULES)
def test_nondeterministic_schedule_refuses_a_deterministic_backward(schedule):
    with pytest.raises(ValueError, match="deterministic=False"):
        _call(schedule=schedule, deterministic=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match=f"schedule={schedule!r}"):
            _call(schedule=schedule)  # deterministic=None follows torch's flag
    finally:
        torch.use_deterministic_algorithms(previous)
    _call(schedule=schedule, deterministic=False)


def test_device_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        dash_attn.flash_attn_func(q, k.to("meta"), v)


def test_causal_with_compatible_window_is_accepted():
    q, k, v = qkv()
    out = dash_attn.flash_attn_func(q, k, v, causal=True, window_size=(3, 0))
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, window_size=(3, 0)))
    # (-1, -1) with causal is FlashAttention's default and means plain causal.
    torch.testing.assert_close(dash_attn.flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)),
                               attention_ref(q, k, v, causal=True))


VARLEN_BAD = [
    (dict(cu_seqlens_q=cu([3, 0, 6]).long()), "int32"),
    (dict(cu_seqlens_q=cu([3, 0, 6])[None]), "1-D"),
    (dict(cu_seqlens_k=cu([4, 7])), "batch \\+ 1"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(max_seqlen_k=2.0), "max_seqlen_k"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 3, 9], dtype=torch.int32)), "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 9], dtype=torch.int32)), "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 6, 10], dtype=torch.int32)), "packed length 11"),
    (dict(max_seqlen_q=5), "max_seqlen_q=5 is smaller than the longest sequence \\(6\\)"),
]


@pytest.mark.parametrize("overrides, message", VARLEN_BAD, ids=[m for _, m in VARLEN_BAD])
def test_bad_varlen_arguments(overrides, message):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    args.update(overrides)
    with pytest.raises(ValueError, match=message):
        dash_attn.flash_attn_varlen_func(q, k, v, **args)


def test_varlen_accepts_host_cu_seqlens_next_to_device_tensors():
    # cu_seqlens may stay on the CPU beside q on another device (the CUDA path reads it on the host anyway); any
    # other device is refused.
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    validation.check_cu_seqlens_meta(q.to("meta"), cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the device of q"):
        validation.check_cu_seqlens_meta(q, cu_q.to("meta"), cu_k, max_q, max_k)


def test_varlen_runs_group_consecutive_equal_lengths():
    # The CUDA varlen path runs one dense batch per run of consecutive sequences with equal (seqlen_q, seqlen_k).
    cq = [0, 3, 6, 9, 9, 9, 14]
    ck = [0, 2, 4, 6, 8, 10, 15]
    assert interface._runs(cq, ck) == [(slice(0, 9), slice(0, 6), 3, 3, 2), (slice(9, 9), slice(6, 10), 2, 0, 2),
                                       (slice(9, 14), slice(10, 15), 1, 5, 5)]
    assert interface._runs([0], [0]) == []
    x = torch.arange(14 * 3).reshape(14, 3)
    batch = interface._batched(x, slice(0, 9), 3, 3)
    assert batch.shape == (3, 3, 3) and batch.data_ptr() == x.data_ptr()  # a view: no copy
    assert torch.equal(batch[1], x[3:6])


def test_varlen_rank_is_checked():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    with pytest.raises(ValueError, match="3 dimensions"):
        dash_attn.flash_attn_varlen_func(q[None], k, v, cu_q, cu_k, max_q, max_k)


# ----------------------------------------------------------------------------------------------------------------------
# deterministic=None semantics and argument plumbing
# ----------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def deterministic_algorithms():
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(previous, warn_only=previous_warn)


def _recorded_fwd_args(**kwargs):
    q, k, v = qkv(requires_grad=True)
    with _OpRecorder() as rec:
        out = dash_attn.flash_attn_func(q, k, v, **kwargs)
        out.sum().backward()
    names = [name for name, _ in rec.calls]
    assert names == ["fwd", "bwd"]
    fwd_args = dict(zip(["softmax_scale", "mask", "window_left", "window_right", "softcap", "deterministic",
                         "schedule", "sm_margin"], rec.calls[0][1][3:]))
    assert rec.calls[1][1][6:] == rec.calls[0][1][3:], "backward must receive the forward's parameters"
    return fwd_args


@pytest.mark.parametrize("global_flag", [False, True])
def test_deterministic_none_follows_torch_flag(global_flag, deterministic_algorithms):
    torch.use_deterministic_algorithms(global_flag)
    assert _recorded_fwd_args()["deterministic"] is global_flag
    # An explicit value wins over the global flag.
    assert _recorded_fwd_args(deterministic=not global_flag)["deterministic"] is (not global_flag)


def test_arguments_reach_the_ops():
    args = _recorded_fwd_args(softmax_scale=0.5, causal=True, window_size=(4, -1), softcap=2.0, schedule="shift",
                              sm_margin=8, deterministic=True)
    assert args == dict(softmax_scale=0.5, mask=2, window_left=4, window_right=0, softcap=2.0, deterministic=True,
                        schedule="shift", sm_margin=8)
    assert _recorded_fwd_args()["softmax_scale"] == pytest.approx(16 ** -0.5)
    assert _recorded_fwd_args(causal=True)["mask"] == interface.MaskKind.CAUSAL


@pytest.mark.parametrize("window, expected", [((-1, -1), (0, -1, -1)), ((-1, 0), (1, -1, 0)), ((3, 0), (2, 3, 0)),
                                              ((-1, 5), (2, -1, 5))])
def test_mask_normalisation(window, expected):
    assert interface._mask_args(*window) == expected


@pytest.mark.parametrize("mask_args, seqlens, expected", [
    ((2, 100, 100), (10, 20), (0, -1, -1)),   # wider than the sequences: full
    ((2, 19, 0), (10, 20), (1, -1, 0)),       # left bound reaches key 0 for every row: causal
    ((2, 18, 0), (10, 20), (2, 18, 0)),       # one key short: still a window
    ((2, 3, 9), (10, 20), (2, 3, -1)),        # right bound past the last key for every row
    ((1, -1, 0), (10, 20), (1, -1, 0)),
])
def test_effective_mask_drops_void_window_sides(mask_args, seqlens, expected):
    assert interface._effective_mask(*mask_args, *seqlens) == expected


def test_void_window_gives_the_same_result():
    q, k, v = qkv(seqlen_q=7, seqlen_k=11)
    torch.testing.assert_close(dash_attn.flash_attn_func(q, k, v, window_size=(50, 50)),
                               dash_attn.flash_attn_func(q, k, v))


# ----------------------------------------------------------------------------------------------------------------------
# CPU results
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cpu_forward_matches_reference(dtype):
    q, k, v = qkv(seqlen_q=7, seqlen_k=12, dtype=dtype)
    out, lse = dash_attn.flash_attn_func(q, k, v, causal=True, softcap=3.0, return_attn_probs=True)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, softcap=3.0, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 7)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=0)


def test_return_attn_probs_false_returns_tensor_and_lse_is_not_differentiable():
    q, k, v = qkv(requires_grad=True)
    assert isinstance(dash_attn.flash_attn_func(q, k, v), torch.Tensor)
    out, lse = dash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.requires_grad and not lse.requires_grad


def test_strided_inputs_with_contiguous_last_dim():
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 9, 3, 4, 16, generator=gen)
    q, k, v = qkv.unbind(2)
    out = dash_attn.flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(out, attention_ref(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))


# (seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap)
GRAD_CASES = [
    pytest.param(5, 5, 2, 2, False, (-1, -1), 0.0, id="full"),
    pytest.param(7, 4, 2, 1, True, (-1, -1), 0.0, id="causal-sq>sk-gqa"),
    pytest.param(4, 7, 4, 2, True, (-1, -1), 0.0, id="causal-sq<sk-gqa"),
    pytest.param(6, 6, 2, 2, False, (1, 2), 0.0, id="window"),
    pytest.param(5, 6, 2, 2, True, (2, 0), 0.8, id="window-causal-softcap"),
]


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap", GRAD_CASES)
def test_gradcheck_through_the_op(seqlen_q, seqlen_k, nheads, nheads_k, causal, window, softcap):
    q, k, v = qkv(1, seqlen_q, seqlen_k, nheads, nheads_k, 8, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v):
        return dash_attn.flash_attn_func(q, k, v, 0.4, causal, window_size=window, softcap=softcap)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("causal, softcap", [(False, 0.0), (True, 0.0), (True, 5.0)])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_softmax_scale_zero_runs_as_zero_queries(causal, softcap, varlen):
    """Scale 0 reaches the ops as zero queries at scale 1 (api._scoreless_queries): out, lse and every gradient are
    the reference's at scale 0, dQ and dK exactly 0."""
    q, k, v = qkv(2, 7, 12, 4, 2, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if varlen:
        cu_q, cu_k = cu([7, 7]), cu([12, 12])
        out, lse = dash_attn.flash_attn_varlen_func(*(t.flatten(0, 1) for t in (q, k, v)), cu_q, cu_k, 7, 12,
                                                    softmax_scale=0, causal=causal, softcap=softcap,
                                                    return_attn_probs=True)
        out, lse = out.unflatten(0, (2, 7)), lse.unflatten(1, (2, 7)).transpose(0, 1)
    else:
        out, lse = dash_attn.flash_attn_func(q, k, v, softmax_scale=0, causal=causal, softcap=softcap,
                                             return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref_out, ref_lse = attention_ref(q, k, v, 0.0, causal, softcap=softcap, return_lse=True)
    ref = torch.autograd.grad(ref_out, (q, k, v), dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.float())
    assert not dq.any() and not dk.any()
    torch.testing.assert_close(dv, ref[2], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_backward_matches_reference_autograd(dtype):
    q, k, v = qkv(seqlen_q=8, seqlen_k=6, dtype=dtype, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(dash_attn.flash_attn_func(q, k, v, causal=True), (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(attention_ref(q64, k64, v64, causal=True), (q64, k64, v64), dout.double())
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for g, e in zip(grads, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), e, **tol)


def test_non_contiguous_grad_output():
    q, k, v = qkv(requires_grad=True)
    out = dash_attn.flash_attn_func(q, k, v)
    dout = torch.randn(q.shape[:-1] + (32,))[..., ::2]
    assert dout.stride(-1) != 1
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = torch.autograd.grad(dash_attn.flash_attn_func(q, k, v), (q, k, v), dout.contiguous())
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)


def test_zero_length_sequences():
    q, k, v = qkv(seqlen_q=0)
    out, lse = dash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 0)
    q, k, v = qkv(seqlen_k=0)
    out, lse = dash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.all(out == 0) and torch.isneginf(lse).all()


# ----------------------------------------------------------------------------------------------------------------------
# Varlen
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (2, 1), 0.5)])
def test_varlen_forward_and_backward_match_dense_per_sequence(causal, window, softcap):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(requires_grad=True)
    out, lse = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                                softcap=softcap, return_attn_probs=True)
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    ref = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap)
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(cu_q) - 1):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense = dash_attn.flash_attn_func(q[sq][None], k[sk][None], v[sk][None], causal=causal, window_size=window,
                                          softcap=softcap)
        torch.testing.assert_close(out[sq], dense[0])
        if dense.numel() == 0:
            continue
        expected = torch.autograd.grad(dense, (q, k, v), dout[sq][None])
        for g, e, s in zip(grads, expected, (sq, sk, sk)):
            torch.testing.assert_close(g[s], e[s])


def test_varlen_gradcheck():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(2, 4), lens_k=(3, 2), requires_grad=True)

    def fn(q, k, v):
        return dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, softcap=1.0)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-7, fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_separate_tensors(causal):
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 9, 3, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 9, 4, 16, generator=gen, dtype=torch.float64)
    out, lse = dash_attn.flash_attn_qkvpacked_func(qkv, causal=causal, return_attn_probs=True)
    out.backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in qkv.unbind(2)]
    ref, ref_lse = dash_attn.flash_attn_func(*leaves, causal=causal, return_attn_probs=True)
    ref.backward(dout)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(qkv.grad, torch.stack([t.grad for t in leaves], 2))


def test_qkvpacked_with_num_heads_q_is_gqa():
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 9, 4 + 2 * 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    out = dash_attn.flash_attn_qkvpacked_func(qkv, num_heads_q=4, causal=True)
    q, k, v = qkv.detach()[:, :, :4], qkv.detach()[:, :, 4:6], qkv.detach()[:, :, 6:]
    assert torch.equal(out, dash_attn.flash_attn_func(q, k, v, causal=True))
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape


def test_kvpacked_matches_separate_tensors():
    q, k, v = qkv(dtype=torch.float64)
    kv = torch.stack([k, v], 2)
    assert torch.equal(dash_attn.flash_attn_kvpacked_func(q, kv, causal=True),
                       dash_attn.flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("call, message", [
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 4, 16)), "pass num_heads_q"),
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 2, 4, 16)), "qkv must be"),
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 7, 16), num_heads_q=4), "num_heads_q=4"),
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 8, 16), num_heads_q=8), "num_heads_q=8"),
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 8, 16), num_heads_q=2.0), "num_heads_q"),
    (lambda: dash_attn.flash_attn_qkvpacked_func(torch.zeros(2, 9, 3, 4, 16), num_heads_q=4), "num_heads_q must"),
    (lambda: dash_attn.flash_attn_qkvpacked_func([1, 2]), "qkv must be a torch.Tensor"),
    (lambda: dash_attn.flash_attn_kvpacked_func(torch.zeros(2, 9, 4, 16), torch.zeros(2, 9, 3, 2, 16)), "kv must"),
])
def test_packed_layouts_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("causal", [False, True])
def test_value_head_dim_may_differ(causal):
    # DeepSeek-style attention: q/k head dim 24, v head dim 8; out takes v's head dim, the scale q's.
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 9, 4, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 11, 2, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    out = dash_attn.flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, 9, 4, 8)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*leaves, causal=causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(dout)
    for g, r in zip((q.grad, k.grad, v.grad), torch.autograd.grad(ref, leaves, dout)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


def test_value_head_dim_varlen_and_checks():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(headdim=16)
    out = dash_attn.flash_attn_varlen_func(q, k, v[..., :8].contiguous(), cu_q, cu_k, max_q, max_k)
    assert out.shape == (q.shape[0], q.shape[1], 8)
    with pytest.raises(ValueError, match="head dim of v 264 is not supported"):
        dash_attn.flash_attn_func(*qkv()[:2], torch.zeros(2, 9, 2, 264))


def test_varlen_packed_layouts_match_separate_tensors():
    q, k, v, cu, _, max_len, _ = varlen_inputs(lens_q=(3, 0, 6), lens_k=(3, 0, 6), nheads=4, nheads_k=4,
                                                requires_grad=False)
    qkv = torch.stack([q, k, v], 1).requires_grad_()
    out = dash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, causal=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = dash_attn.flash_attn_varlen_func(*leaves, cu, cu, max_len, max_len, causal=True)
    assert torch.equal(out, ref)
    dout = torch.randn(out.shape, dtype=out.dtype)
    out.backward(dout)
    ref.backward(dout)
    assert torch.equal(qkv.grad, torch.stack([t.grad for t in leaves], 1))
    kv = torch.stack([k, v], 1)
    assert torch.equal(dash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, max_len, max_len, causal=True),
                       ref.detach())
    gqa = torch.cat([q, k[:, :2], v[:, :2]], 1)
    assert torch.equal(dash_attn.flash_attn_varlen_qkvpacked_func(gqa, cu, max_len, num_heads_q=4),
                       dash_attn.flash_attn_varlen_func(q, k[:, :2], v[:, :2], cu, cu, max_len, max_len))


@pytest.mark.parametrize("call, message", [
    (lambda: dash_attn.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 4, 16), cu((9,)), 9), "pass num_heads_q"),
    (lambda: dash_attn.flash_attn_varlen_qkvpacked_func(torch.zeros(9, 3, 4, 16), cu((9,)), 9, num_heads_q=2),
     "num_heads_q must"),
    (lambda: dash_attn.flash_attn_varlen_kvpacked_func(torch.zeros(9, 4, 16), torch.zeros(9, 2, 2, 2, 16),
                                                       cu((9,)), cu((9,)), 9, 9), "kv must be \\(total_k"),
])
def test_varlen_packed_layouts_are_checked(call, message):
    with pytest.raises(ValueError, match=message):
        call()
