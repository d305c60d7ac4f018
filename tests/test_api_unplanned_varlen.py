"""Unplanned varlen calls, exercised on the CPU with the recording stand-in extension: inside a CUDA graph capture
(no host copy of cu_seqlens, the packed kernels with the caller's bounds, a check on the device that turns every
result into NaN) and with FlashAttention-3's seqused_q/k (the rows of each sequence in use; the CPU reference path
too)."""
import pytest
import torch

import dash_attn
from dash_attn import interface, validation
from dash_attn.reference import attention_ref_varlen

from api_common import cu, op_args, patch_interface, varlen_inputs

@pytest.mark.parametrize("case, message", [("cu_on_cpu", "on q's device"), ("not_built", "DASH_ATTN_PACKED=0")])
def test_captured_varlen_refuses_what_the_packed_kernels_cannot_take(case, message):
    q, k, v, cu_q, cu_k, _, _ = (t.to("meta") if isinstance(t, torch.Tensor) else t
                                 for t in varlen_inputs(headdim=64))
    if case == "cu_on_cpu":
        cu_k = torch.zeros(cu_k.shape, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        validation.check_unplanned_varlen(q, cu_q, cu_k, None, None, case != "not_built", True)


def test_captured_varlen_reads_nothing_on_the_host(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    patch_interface(monkeypatch, "_host_lists", lambda *args: pytest.fail("host copy inside a capture"))
    q, k, v, cu_q, cu_k, max_q, max_k = (t.to("meta") if isinstance(t, torch.Tensor) else t
                                         for t in varlen_inputs(headdim=64, dtype=torch.bfloat16))
    assert interface._check_varlen(q, k, v, cu_q, cu_k, None, None, max_q, max_k, 0.0) == (fake_cuda, None)


def _writing_fake(fake_cuda):
    """The recording stand-in, plus plausible results (the GPU-side check must leave them alone)."""
    def fwd(*args):
        fake_cuda.calls.append(("varlen_fwd", args))
        args[3].fill_(1.0)
        args[4].fill_(0.5)

    def bwd(*args):
        fake_cuda.calls.append(("varlen_bwd", args))
        for grad in args[6:9]:
            grad.fill_(2.0)

    fake_cuda.varlen_fwd, fake_cuda.varlen_bwd = fwd, bwd
    return fake_cuda


def _captured_call(ext, lens_q, lens_k, bounds, mask=0, window=(-1, -1), cu_edit=None, used=(None, None)):
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs(lens_q, lens_k, headdim=64, dtype=torch.bfloat16)
    if cu_edit is not None:
        cu_edit(cu_q, cu_k)
    seqs = (cu_q, cu_k) + used
    out, lse = interface._varlen_fwd_unplanned(ext, q, k, v, seqs, bounds, op_args(mask, window))
    grads = interface._varlen_bwd_unplanned(ext, torch.randn_like(out), q, k, v, out, lse, seqs, bounds,
                                            op_args(mask, window))
    return (out, lse) + grads


def test_captured_varlen_runs_the_packed_kernels_with_capped_bounds(fake_cuda):
    # max_seqlen bounds above the packed lengths are capped at them; the batch is cu_seqlens' length - 1.
    results = _captured_call(_writing_fake(fake_cuda), (3, 0, 6), (4, 2, 5), (100, 7))
    (fwd_name, fwd_args), (bwd_name, bwd_args) = fake_cuda.calls
    assert fwd_name == "varlen_fwd" and fwd_args[7:11] == (None, None, 9, 7)
    assert bwd_name == "varlen_bwd" and bwd_args[11:15] == (None, None, 9, 7)
    assert bwd_args[-5:-3] == (interface.SCHEDULE_IDS["shift"], 0)  # the schedule, short_k; sm_margin, sink, dsink
    assert not any(r.isnan().any() for r in results)


def _set(index, value, which=0):
    def edit(cu_q, cu_k):
        (cu_q, cu_k)[which][index] = value
    return edit


_INVALID = {
    "first_not_zero": dict(cu_edit=_set(0, 1)),
    "last_not_total": dict(cu_edit=_set(-1, 7, which=1)),
    "decreasing": dict(cu_edit=_set(1, 5)),
    "longer_than_bound": dict(bounds=(5, 5)),
    # lens (3, 6) / (4, 6): the first sequence's causal diagonal (+1) lies right of the longest ones' (0)
    "diagonal_right_of_the_batch": dict(lens_q=(3, 6), lens_k=(4, 6), bounds=(6, 6), mask=1, window=(-1, 0)),
    # window (2, 0) on lens (4, 6) / (3, 6): diagonal -1, left of the longest ones' (0), against a left bound
    "window_band_left_of_the_batch": dict(lens_q=(4, 6), lens_k=(3, 6), bounds=(6, 6), mask=2, window=(2, 0)),
}


@pytest.mark.parametrize("case", list(_INVALID))
def test_captured_varlen_turns_every_result_to_nan_on_invalid_cu_seqlens(fake_cuda, case):
    args = dict(lens_q=(3, 0, 6), lens_k=(4, 2, 5), bounds=(6, 5))
    args.update(_INVALID[case])
    lens_q, lens_k, bounds = args.pop("lens_q"), args.pop("lens_k"), args.pop("bounds")
    results = _captured_call(_writing_fake(fake_cuda), lens_q, lens_k, bounds, **args)
    assert all(r.isnan().all() for r in results)


def test_captured_varlen_accepts_bands_inside_the_batch(fake_cuda):
    # Shared cu_seqlens put every diagonal on the batch's: causal and windows are valid.
    for mask, window in ((1, (-1, 0)), (2, (2, 1))):
        results = _captured_call(_writing_fake(fake_cuda), (3, 6, 1), (3, 6, 1), (6, 6), mask, window)
        assert not any(r.isnan().any() for r in results)


def test_captured_varlen_without_keys_launches_nothing(fake_cuda):
    out, lse, dq, dk, dv = _captured_call(_writing_fake(fake_cuda), (3, 2), (0, 0), (3, 0))
    assert fake_cuda.calls == []
    assert not out.any() and torch.isneginf(lse).all() and not dq.any()


# ----------------------------------------------------------------------------------------------------------------------
# seqused_q / seqused_k
# ----------------------------------------------------------------------------------------------------------------------

@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """CPU tensors take the CUDA branches of the varlen ops (with fake_cuda: the stand-in extension)."""
    patch_interface(monkeypatch, "_on_cuda", lambda t: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_seqused_on_the_cpu_matches_the_compacted_sequences():
    # Rows past seqused take no part: the call equals the one on the sequences cut to their rows in use, and those
    # rows get out 0, lse -inf and zero gradients.
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((5, 0, 7), (6, 3, 8), requires_grad=True)
    used_q, used_k = torch.tensor([3, 0, 7], dtype=torch.int32), torch.tensor([6, 1, 2], dtype=torch.int32)
    out, lse = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, used_q, used_k, causal=True,
                                                return_attn_probs=True)
    rows_q = torch.cat([torch.arange(a, a + u) for a, u in zip(cu_q[:-1].tolist(), used_q.tolist())])
    rows_k = torch.cat([torch.arange(a, a + u) for a, u in zip(cu_k[:-1].tolist(), used_k.tolist())])
    ref_out, ref_lse = attention_ref_varlen(q[rows_q], k[rows_k], v[rows_k], cu((3, 0, 7)), cu((6, 1, 2)),
                                            causal=True, return_lse=True)
    torch.testing.assert_close(out[rows_q], ref_out)
    torch.testing.assert_close(lse[:, rows_q], ref_lse.float())
    unused_q = torch.ones(q.shape[0], dtype=torch.bool)
    unused_q[rows_q] = False
    assert not out[unused_q].any() and torch.isneginf(lse[:, unused_q]).all()
    out.sum().backward()
    unused_k = torch.ones(k.shape[0], dtype=torch.bool)
    unused_k[rows_k] = False
    assert not q.grad[unused_q].any() and not k.grad[unused_k].any() and not v.grad[unused_k].any()


def test_seqused_gradients_pass_gradcheck():
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((3, 4), (4, 2), requires_grad=True)
    used_q, used_k = torch.tensor([2, 4], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 3, used_q, used_k), (q, k, v))


@pytest.mark.parametrize("used, error", [
    ((4, 0, 6), "seqused_q\\[0\\]=4 must lie in \\[0, 3\\]"),
    ((-1, 0, 6), "seqused_q\\[0\\]=-1"),
    ((3, 0, 6, 1), "length batch = 3"),
])
def test_seqused_values_are_checked_on_the_host(used, error):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    with pytest.raises(ValueError, match=error):
        dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, torch.tensor(used, dtype=torch.int32))


def test_seqused_max_seqlen_bounds_the_rows_in_use():
    # A sequence longer than max_seqlen_k is fine when its rows in use are not.
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((3, 6), (9, 2))
    used_k = torch.tensor([4, 2], dtype=torch.int32)
    dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 4, seqused_k=used_k)
    with pytest.raises(ValueError, match="max_seqlen_k=3 is smaller"):
        dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 3, seqused_k=used_k)


def test_seqused_on_cuda_runs_unplanned_with_the_rows_in_use(fake_cuda, cpu_as_cuda):
    # Not inside a capture: host checks first, then the packed kernels with the longest rows in use as bounds, the
    # outputs zeroed first (the kernels leave the rows past seqused alone).
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((5, 0, 7), (6, 3, 8), headdim=64, dtype=torch.bfloat16)
    used_q, used_k = torch.tensor([3, 0, 7], dtype=torch.int32), torch.tensor([6, 1, 2], dtype=torch.int32)
    out, lse = interface._varlen_fwd_impl(q, k, v, cu_q, cu_k, used_q, used_k, 7, 8, 0.125, 0, -1, -1, 0.0, True,
                                          "auto", 0)
    ((name, args),) = fake_cuda.calls
    assert name == "varlen_fwd" and torch.equal(args[7], used_q) and torch.equal(args[8], used_k)
    assert args[9:11] == (7, 6)
    assert not out.any() and torch.isneginf(lse).all()


@pytest.mark.parametrize("schedule, bounds", [("descending", (6, 8)), ("auto", (6, 6))])
def test_seqused_backward_bounds_reach_every_band(fake_cuda, cpu_as_cuda, schedule, bounds):
    # Rows in use (3, 6) / (5, 6): the first sequence's causal diagonal (+2) lies right of the longest ones' (0). The
    # forward tiles the longest rows in use. A backward scheduled as a batch of the longest (descending) moves the
    # schedule's diagonal to +2 (max_k 8), so that it reaches every band (dash_attn/_seq_bands.py;
    # tests/test_packed_bands.py checks the results); deterministic `auto` schedules each sequence on its own
    # geometry (csrc/schedule/seq_runs.h) and keeps the longest rows in use.
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((5, 6), (5, 6), headdim=64, dtype=torch.bfloat16)
    used_q, used_k = torch.tensor([3, 6], dtype=torch.int32), torch.tensor([5, 6], dtype=torch.int32)
    args = (cu_q, cu_k, used_q, used_k, 6, 6, 0.125, 1, -1, 0, 0.0, True, schedule, 0)
    out, lse = interface._varlen_fwd_impl(q, k, v, *args)
    interface._varlen_bwd_impl(torch.ones_like(out), q, k, v, out, lse, *args)
    (fwd_name, fwd_args), (bwd_name, bwd_args) = fake_cuda.calls
    assert fwd_name == "varlen_fwd" and fwd_args[9:11] == (6, 6)
    assert bwd_name == "varlen_bwd" and bwd_args[11:15] == (used_q, used_k) + bounds


@pytest.mark.parametrize("headdim, headdim_v", [(32, 32), (96, 96), (64, 128), (104, 40)])
def test_seqused_runs_other_head_dims_padded_to_a_kernels(fake_cuda, cpu_as_cuda, headdim, headdim_v):
    # The packed kernels take one kernel head dim for q, k and v (the fake build has 64 and 128): the launches get
    # copies zero-padded to it, the results come back cut to the call's head dims.
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(headdim=headdim, dtype=torch.bfloat16)
    v = torch.randn(*v.shape[:-1], headdim_v).to(torch.bfloat16)
    width = 64 if max(headdim, headdim_v) <= 64 else 128
    args = (cu_q, cu_k, torch.tensor([1, 0, 2], dtype=torch.int32), None, max_q, max_k, 0.125, 0, -1, -1, 0.0, True,
            "auto", 0)
    out, lse = interface._varlen_fwd_impl(q, k, v, *args)
    grads = interface._varlen_bwd_impl(torch.ones_like(out), q, k, v, out, lse, *args)
    assert out.shape[-1] == headdim_v and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    (_, fwd_args), (_, bwd_args) = fake_cuda.calls
    for launched, given in zip(fwd_args[:3] + bwd_args[1:5], (q, k, v, q, k, v, out)):
        assert launched.shape[-1] == width and torch.equal(launched[..., :given.shape[-1]], given)
        assert not launched[..., given.shape[-1]:].any()


@pytest.mark.parametrize("used, valid", [((3, 0, 6), True), ((2, 0, 6), True), ((4, 0, 6), False),
                                         ((-1, 0, 6), False)])
def test_captured_seqused_is_checked_on_the_device(fake_cuda, used, valid):
    results = _captured_call(_writing_fake(fake_cuda), (3, 0, 6), (4, 2, 5), (6, 5),
                             used=(torch.tensor(used, dtype=torch.int32), None))
    assert all((not r.isnan().any()) if valid else r.isnan().all() for r in results)
