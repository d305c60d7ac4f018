"""CUDA plumbing of the public API, exercised on the CPU: device and feature checks, and the launch helpers routed to
a recording stand-in extension (argument order, head dims between the kernels, the varlen paths and their choice,
the auto schedule, the host copies of cu_seqlens). Unplanned varlen calls: test_api_unplanned_varlen.py."""
import sys
import types

import pytest
import torch

from dash_attn import _varlen, interface, schedules_table, validation

from api_common import cu, op_args, qkv, varlen_inputs


def test_missing_extension_error_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "dash_attn._C", None)  # makes `from . import _C` raise ImportError
    with pytest.raises(RuntimeError, match="dash_attn._C is not built: reinstall on a machine with nvcc"):
        interface._extension()


def test_non_hopper_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match="need an sm90 \\(Hopper\\) GPU, found sm80"):
        validation.check_cuda_device(torch.device("cuda", 0))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(headdim=192), ValueError, "head dim 192"),
    (dict(softcap=1.0, softcap_built=False), RuntimeError, "DASH_ATTN_SOFTCAP=0"),
    (dict(softcap=1e31), ValueError, "softcap=1e\\+31 is above"),
])
def test_cuda_feature_gaps_are_refused(kwargs, error, message):
    args = dict(headdim=128, supported_head_dims=[64, 128], softcap=0.0)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        validation.check_cuda_features(**args)


def test_dtype_without_kernels_is_refused():
    with pytest.raises(RuntimeError, match="float16 inputs need kernels this build of dash_attn skipped \\(it has "
                                           "bfloat16\\): rebuild with DASH_ATTN_DTYPES"):
        validation.check_cuda_features(128, [64, 128], 0.0, True, torch.float16, (torch.bfloat16,))
    validation.check_cuda_features(128, [64, 128], 0.0, True, torch.bfloat16, (torch.bfloat16,))


def test_softcap_is_accepted_where_built():
    validation.check_cuda_features(128, [64, 128], 30.0, softcap_built=True)
    validation.check_cuda_features(128, [64, 128], 0.0, softcap_built=False)


def test_cuda_dtypes_exclude_full_precision():
    q, k, v = (t.to("meta") for t in qkv())
    # meta stands in for a non-CPU device: only fp16/bf16 are kernel dtypes.
    with pytest.raises(ValueError, match="float16"):
        validation.check_qkv(q, k, v, varlen=False)


def _bf16_inputs(headdim=64):
    q, k, v = qkv(seqlen_q=10, seqlen_k=12, headdim=headdim, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 10)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return q, k, v, out, lse, dq, dk, dv


def test_op_args_are_the_last_parameters_of_every_op():
    # The public functions splat OpArgs into the registered ops after their tensors (and context_parallel builds it by
    # field name): its fields must be those parameters, in the schemas' order.
    for op in (torch.ops.dash_attn.fwd, torch.ops.dash_attn.bwd, torch.ops.dash_attn.varlen_fwd,
               torch.ops.dash_attn.varlen_bwd):
        names = [argument.name for argument in op.default._schema.arguments]
        assert names[-len(interface.OpArgs._fields):] == list(interface.OpArgs._fields), op


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf"), validation.MIN_SOFTMAX_SCALE / 2])
def test_direct_op_calls_refuse_scales_the_kernels_cannot_take(scale):
    # The public functions run scale 0 as zero queries at scale 1; an op called directly gets a named error instead
    # of NaN or wrong gradients (the check runs on every device, so the CPU path shows it).
    q, k, v = qkv()
    out, lse = torch.ops.dash_attn.fwd(q, k, v, *op_args())
    lens = cu([9, 9])
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    vout, vlse = torch.ops.dash_attn.varlen_fwd(*flat, lens, lens, None, None, 9, 9, *op_args())
    calls = {"dash_attn::fwd": lambda: torch.ops.dash_attn.fwd(q, k, v, *op_args(softmax_scale=scale)),
             "dash_attn::bwd": lambda: torch.ops.dash_attn.bwd(out, q, k, v, out, lse, *op_args(softmax_scale=scale)),
             "dash_attn::varlen_fwd": lambda: torch.ops.dash_attn.varlen_fwd(*flat, lens, lens, None, None, 9, 9,
                                                                             *op_args(softmax_scale=scale)),
             "dash_attn::varlen_bwd": lambda: torch.ops.dash_attn.varlen_bwd(vout, *flat, vout, vlse, lens, lens, None,
                                                                             None, 9, 9, *op_args(softmax_scale=scale))}
    for name, call in calls.items():
        with pytest.raises(ValueError, match=f"{name}: softmax_scale must be a finite float >= 1e-30"):
            call()


@pytest.mark.parametrize("fields, message", [
    (dict(mask=0, window=(-1, 0)), r"mask must be 1 \(causal\) for the window \(-1, 0\), got 0"),
    (dict(mask=5), r"mask must be 0 \(full\) for the window \(-1, -1\), got 5"),
    (dict(mask=2, window=(-3, 4)), r"window_left must be -1 \(unbounded\) or in \[0, "),
    (dict(softcap=-1.0), "softcap must be"),
    (dict(schedule="fastest"), "unknown schedule 'fastest'"),
    (dict(schedule="dynamic", deterministic=True), "schedule=.dynamic. claims work at run time"),
    (dict(sm_margin=-2), "sm_margin must be an int >= 0"),
], ids=["mask_not_the_windows", "no_such_mask", "window_below_minus_one", "softcap", "schedule", "dynamic_det",
        "sm_margin"])
def test_direct_op_calls_refuse_what_the_public_functions_would(fields, message):
    # A mask its window does not give would run another mask silently; the other values the public functions refuse.
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dash_attn::fwd: " + message):
        torch.ops.dash_attn.fwd(q, k, v, *op_args(**fields))


def test_launch_fwd_calls_the_binding_in_order(fake_cuda):
    q, k, v, out, lse, *_ = _bf16_inputs()
    interface._launch_fwd(q, k, v, out, lse, op_args(mask=1, window=(-1, 0), softmax_scale=0.25))
    name, args = fake_cuda.calls[0]
    assert name == "fwd" and args[:5] == (q, k, v, out, lse) and args[5:] == (0.25, 1, -1, 0, 0.0, None)


def test_launch_refuses_unsupported_head_dim_before_launch(fake_cuda):
    q, k, v, out, lse, *_ = _bf16_inputs(headdim=192)  # the fake build's largest head dim is 128
    with pytest.raises(ValueError, match="head dim 192"):
        interface._launch_fwd(q, k, v, out, lse, op_args())
    fake_cuda.softcap = False
    interface._softcap_built.cache_clear()
    with pytest.raises(RuntimeError, match="softcap"):
        interface._launch_fwd(*_bf16_inputs()[:5], op_args(softcap=5.0))
    assert fake_cuda.calls == []


def test_launch_passes_softcap(fake_cuda):
    interface._launch_fwd(*_bf16_inputs()[:5], op_args(mask=1, window=(-1, 0), softcap=30.0))
    name, args = fake_cuda.calls[0]
    assert name == "fwd" and args[5:] == (0.125, 1, -1, 0, 30.0, None)


def test_launch_passes_sliding_window_bounds(fake_cuda):
    interface._launch_fwd(*_bf16_inputs()[:5], op_args(mask=2, window=(3, 0)))
    name, args = fake_cuda.calls[0]
    assert name == "fwd" and args[5:] == (0.125, 2, 3, 0, 0.0, None)


@pytest.mark.parametrize("schedule, expected", [("ascending", 0), ("descending", 1), ("spt", 2), ("shift", 3),
                                                ("shift_causal", 4)])
def test_launch_bwd_passes_schedule_ids(fake_cuda, schedule, expected):
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs()
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv, op_args(schedule=schedule, sm_margin=4))
    name, args = fake_cuda.calls[0]
    assert name == "bwd" and args[9:] == (0.125, 0, -1, -1, 0.0, True, expected, 4, None, None)


def test_varlen_cuda_path_launches_per_run_and_assembles_rows(fake_cuda, monkeypatch):
    # The CUDA varlen path through the recording extension: one launch per run of equal lengths on views of the
    # packed tensors (none for a run without queries), the window re-normalised per run, and each run's
    # (count, heads, seqlen) lse placed in the packed (heads, total) layout and handed back to the backward.
    def fwd(q, k, v, out, lse, *params):
        fake_cuda.calls.append(("fwd", (tuple(q.shape), tuple(k.shape)) + params))
        out.copy_(q)
        lse.copy_(q[..., 0].transpose(1, 2))

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, *params):
        assert torch.equal(lse, q[..., 0].transpose(1, 2).float())
        fake_cuda.calls.append(("bwd", (tuple(q.shape), tuple(k.shape)) + params))
        dq.copy_(dout)
        dk.copy_(k)
        dv.copy_(v)

    monkeypatch.setattr(fake_cuda, "fwd", fwd)
    monkeypatch.setattr(fake_cuda, "bwd", bwd)
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((3, 3, 0, 0, 5), (2, 2, 4, 4, 6), dtype=torch.float32)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out, lse = interface._varlen_fwd_cuda(fake_cuda, q, k, v, cu_q, cu_k, cq, ck, op_args(mask=2, window=(4, 0)))
    assert fake_cuda.calls == [("fwd", ((2, 3, 4, 8), (2, 2, 2, 8), 0.125, 1, -1, 0, 0.0, None)),
                               ("fwd", ((1, 5, 4, 8), (1, 6, 2, 8), 0.125, 2, 4, 0, 0.0, None))]
    assert torch.equal(out, q) and torch.equal(lse, q[..., 0].t())
    fake_cuda.calls.clear()
    dout = torch.randn_like(q)
    dq, dk, dv = interface._varlen_bwd_cuda(fake_cuda, dout, q, k, v, out, lse, cu_q, cu_k, cq, ck,
                                            op_args(mask=2, window=(4, 0)))
    assert [c[1][:4] for c in fake_cuda.calls] == [((2, 3, 4, 8), (2, 2, 2, 8), 0.125, 1),
                                                   ((1, 5, 4, 8), (1, 6, 2, 8), 0.125, 2)]
    keys_without_queries = slice(4, 12)
    assert torch.equal(dq, dout)
    assert not dk[keys_without_queries].any() and not dv[keys_without_queries].any()
    assert torch.equal(dk[:4], k[:4]) and torch.equal(dv[12:], v[12:])


@pytest.mark.parametrize("lens", [(512,) * 32, (1000, 3000, 200)], ids=["one_short_run", "varied"])
def test_varlen_packed_kernels_take_host_bound_and_varied_calls(fake_cuda, lens):
    q, k, v, _, _, _, _ = varlen_inputs(lens, lens, headdim=64, dtype=torch.bfloat16)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    assert interface._packed_launch(fake_cuda, q, k, v, cu, cu, (lens, lens), 1, -1, 0) == (max(lens), max(lens))
    assert interface._packed_launch(fake_cuda, q, k, v, cu, cu, (lens, lens), 2, 100, 7) == (max(lens), max(lens))


def test_deterministic_backward_takes_the_per_run_path_as_the_forward_does(fake_cuda, monkeypatch):
    # The packed and batched kernels read the row statistics alike (csrc/bwd/bwd_config.h, reads_gemm_stats), so a
    # deterministic backward may take the per-run batched path where it wins, as the forward and the non-deterministic
    # backward do; and under a schedule whose batch of the longest sequences cannot reach every band (descending:
    # diagonals 100, 0 and 128), it runs per run rather than on the packed kernels.
    lens = [512] * 4
    q, k, v, _, _, _, _ = varlen_inputs(lens, lens, headdim=64, dtype=torch.bfloat16)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    det, nondet = op_args(mask=1, window=(-1, 0), schedule="shift_causal_runs"), op_args(mask=1, deterministic=False)
    monkeypatch.setattr(_varlen, "_runs_beat_packed", lambda *args: True)
    for bwd_args in (det, nondet, None):
        assert interface._packed_launch(fake_cuda, q, k, v, cu, cu, (lens, lens), 1, -1, 0, bwd_args=bwd_args) is None
    monkeypatch.setattr(_varlen, "_runs_beat_packed", lambda *args: False)
    lens_q, lens_k = [100, 700, 129], [200, 700, 257]
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs(lens_q, lens_k, headdim=64, dtype=torch.bfloat16)
    descending = op_args(mask=1, window=(-1, 0), schedule="descending")
    assert interface._packed_launch(fake_cuda, q, k, v, cu_q.tolist(), cu_k.tolist(), (lens_q, lens_k), 1, -1, 0,
                                    bwd_args=descending) is None


@pytest.mark.parametrize("mask, window", [(0, (-1, -1)), (1, (-1, 0)), (2, (3, 1))], ids=["full", "causal", "window"])
def test_varlen_cuda_path_runs_the_packed_kernels_once(fake_cuda, mask, window):
    # Calls at a kernel's own head dim whose sequences' bands lie inside the longest ones' go to the packed-sequence
    # kernels in one launch per direction, with the longest sequences' lengths (not the caller's max_seqlen bounds)
    # and int32 cu_seqlens.
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs((3, 0, 6), (5, 2, 8), headdim=64, dtype=torch.bfloat16)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    out, lse = interface._varlen_fwd_cuda(fake_cuda, q, k, v, cu_q.long(), cu_k, cq, ck, op_args(mask, window))
    assert out.shape == q.shape and lse.shape == (4, 9)
    ((name, args),) = fake_cuda.calls
    assert name == "varlen_fwd" and args[:5] == (q, k, v, out, lse)
    assert args[5].dtype == torch.int32 and torch.equal(args[5], cu_q) and torch.equal(args[6], cu_k)
    assert args[7:] == (None, None, 6, 8, 0.125, mask) + window + (0.0, None)
    fake_cuda.calls.clear()
    dout = torch.randn_like(q)
    dq, dk, dv = interface._varlen_bwd_cuda(fake_cuda, dout, q, k, v, out, lse, cu_q, cu_k, cq, ck,
                                            op_args(mask, window, sm_margin=3))
    ((name, args),) = fake_cuda.calls
    assert name == "varlen_bwd" and args[:9] == (dout, q, k, v, out, lse, dq, dk, dv)
    assert args[11:] == (None, None, 6, 8, 0.125, mask) + window + (0.0, True, interface.SCHEDULE_IDS["shift"], 0, 3,
                                                                  None, None)


# (lens_q, lens_k, q/k head dim, v head dim, mask, extension has the packed kernels)
_NOT_PACKED = {
    # window (2, 0): the first sequence's band (diagonal 4 - 3) lies right of the longest ones' (6 - 6)
    "window_band": ((3, 6), (4, 6), 64, 64, 2, True),
    "head_dim_between_kernels": ((3, 6), (4, 6), 32, 32, 0, True),
    "v_head_dim_of_its_own": ((3, 6), (4, 6), 64, 128, 0, True),
    # the first sequence's causal diagonal (4 - 3) lies right of the longest ones' (6 - 6)
    "diagonal": ((3, 6), (4, 6), 64, 64, 1, True),
    "no_keys": ((3, 6), (0, 0), 64, 64, 0, True),
    "not_built": ((3, 6), (4, 6), 64, 64, 0, False),
    # one run of 16 sequences x 2 KV heads x 32 KV tiles of 128 (four waves on the fake 132 SMs), ~2 ms of kernels
    "few_long_runs": ((4096,) * 16, (4096,) * 16, 64, 64, 0, True),
}


@pytest.mark.parametrize("case", list(_NOT_PACKED))
def test_varlen_cuda_path_keeps_the_batched_kernels_where_packed_ones_do_not_apply(fake_cuda, case):
    lens_q, lens_k, headdim, headdim_v, mask, built = _NOT_PACKED[case]
    fake_cuda.packed = built
    q, k, _, cu_q, cu_k, _, _ = varlen_inputs(lens_q, lens_k, headdim=headdim, dtype=torch.bfloat16)
    v = torch.randn(k.shape[0], k.shape[1], headdim_v, dtype=torch.bfloat16)
    window = (2, 0) if mask == 2 else (-1, -1)
    lens = (list(lens_q), list(lens_k))
    assert interface._packed_launch(fake_cuda, q, k, v, cu_q.tolist(), cu_k.tolist(), lens, mask, *window) is None


def test_auto_schedule_uses_the_cost_model(fake_cuda, monkeypatch):
    seen = []

    def choose(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window=None, nheads_k=None,
               deterministic=True, l2=None):
        seen.append((mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms, window, nheads_k,
                     deterministic, l2))
        return "shift"

    def l2_model(l2_bytes, block_m, block_n, headdim):
        return ("l2", l2_bytes, block_m, block_n, headdim)

    monkeypatch.setitem(sys.modules, "dash_attn.schedule", types.SimpleNamespace(choose=choose, l2_model=l2_model))
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs()
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv,
                          op_args(mask=1, window=(-1, 0), deterministic=False, schedule="auto", sm_margin=4))
    # The device's L2 size (the fixture reports 60 MiB) and the head dim reach the model's L2 term.
    assert seen == [("causal", 10, 12, 64, 128, 4, 2, 128, None, 2, False, ("l2", 60 * 2**20, 64, 128, 64))]
    assert fake_cuda.calls[0][1][15] == interface.SCHEDULE_IDS["shift"]


@pytest.mark.parametrize("mask, expected", [(0, "descending_lanes"), (1, "shift_causal_runs"), (2, "descending")])
def test_deterministic_auto_picks_by_shape_alone(fake_cuda, monkeypatch, mask, expected):
    """Deterministic `auto` never asks the model (whose pick depends on the SM count): the invariant pick for the
    mask, head dim and lengths (10 queries, 12 keys at hdim 64 here: a causal band with fewer queries than keys
    and not mostly full keeps the runs schedule)."""
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs()
    for margin in (0, 18):
        window = (5 if mask == 2 else -1, 0 if mask else -1)
        interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv,
                              op_args(mask, window, schedule="auto", sm_margin=margin))
    assert [c[1][15] for c in fake_cuda.calls] == [interface.SCHEDULE_IDS[expected]] * 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_auto_runs_lanes_with_gqa_4_at_hdim_128(fake_cuda, monkeypatch, deterministic):
    """Past the short-key bound, both modes of `auto` run descending_lanes on a square causal band with 4 query heads
    per KV head at hdim 128 (schedules_table.gqa_takes_invariant_pick), and shift_causal_runs on a band with half as
    many queries as keys, without asking the model."""
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    for seqlen_q, expected in ((5000, "descending_lanes"), (2500, "shift_causal_runs")):
        q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=5000, nheads=8, nheads_k=2, headdim=128, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(2, 8, seqlen_q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv,
                              op_args(mask=1, window=(-1, 0), deterministic=deterministic, schedule="auto"))
        assert fake_cuda.calls[-1][1][15] == interface.SCHEDULE_IDS[expected], seqlen_q


def test_nondet_auto_runs_the_invariant_pick_on_long_causal_bands(fake_cuda, monkeypatch):
    """From schedules_table.NONDET_RUNS_BOUNDS' key bound on square causal MHA bands the non-deterministic `auto` runs
    shift_causal_runs without asking the model; below the bound and on wider bands it asks the model (here absent, so
    the fallback schedule runs)."""
    from dash_attn.schedules_table import NONDET_RUNS_BOUNDS
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    bound = NONDET_RUNS_BOUNDS[("causal", 128)].min_seqlen_k
    fallback = interface.FALLBACK_SCHEDULE
    for seqlen_q, seqlen_k, expected in ((bound, bound, "shift_causal_runs"), (bound // 2 + 64, bound, fallback),
                                         (bound // 2, bound // 2, fallback)):
        q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=2, nheads_k=2, headdim=128, dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(2, 2, seqlen_q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv,
                              op_args(mask=1, window=(-1, 0), deterministic=False, schedule="auto"))
        assert fake_cuda.calls[-1][1][15] == interface.SCHEDULE_IDS[expected], (seqlen_q, seqlen_k)
        assert fake_cuda.calls[-1][1][14] is False, (seqlen_q, seqlen_k)  # arrival-order adds at hdim 128


def test_auto_schedule_falls_back_without_the_simulator(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs()
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv, op_args(deterministic=False, schedule="auto"))
    assert fake_cuda.calls[0][1][15] == interface.SCHEDULE_IDS[interface.FALLBACK_SCHEDULE]


@pytest.mark.parametrize("headdim, supported, expected", [
    (64, [64, 128, 256], 64), (96, [64, 128, 256], 128), (8, [64, 128], 64), (192, [64, 128, 256], 256),
    (128, [128], 128),
])
def test_kernel_head_dim_is_the_smallest_compiled_one_that_fits(headdim, supported, expected):
    assert validation.kernel_head_dim(headdim, supported) == expected


def test_head_dim_above_every_kernel_is_refused():
    with pytest.raises(ValueError, match="head dim 192 is above every compiled"):
        validation.kernel_head_dim(192, [64, 128])


def test_head_dim_rule_holds_on_every_device():
    q, k, v = (t.to("meta") for t in qkv(headdim=16, dtype=torch.bfloat16))
    validation.check_qkv(q, k, v, varlen=False)
    q, k, v = (torch.zeros(2, 9, n, 12, dtype=torch.bfloat16, device="meta") for n in (4, 2, 2))
    validation.check_qkv(q, k, v, varlen=False)  # padded to 16 by the public functions
    q, k, v = (torch.zeros(2, 9, n, 264, dtype=torch.bfloat16, device="meta") for n in (4, 2, 2))
    with pytest.raises(ValueError, match="head dim 264 is not supported"):
        validation.check_qkv(q, k, v, varlen=False)


def test_launch_takes_head_dims_between_kernels(fake_cuda):
    # The fake build has 64 and 128: 96 runs in the 128 kernel, whose outputs go through rows 128 wide (their first
    # 96 columns, copied into the results after the launch); 192 has no kernel and is refused before any launch.
    def write_rows(*args):
        fake_cuda.calls.append(("fwd", args))
        rows = args[3]
        assert rows.shape == out.shape and rows.stride(-2) == 128 and rows.stride(-1) == 1
        rows.fill_(7.0)

    fake_cuda.fwd = write_rows
    q, k, v, out, lse, *_ = _bf16_inputs(headdim=96)
    interface._launch_fwd(q, k, v, out, lse, op_args())
    assert len(fake_cuda.calls) == 1 and bool((out == 7.0).all())
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs(headdim=96)
    interface._launch_bwd(q, q, k, v, out, lse, dq, dk, dv, op_args())
    name, args = fake_cuda.calls[-1]
    assert name == "bwd" and args[6] is dq and args[7].stride(-2) == 128 and args[8].stride(-2) == 128
    q, k, v, out, lse, *_ = _bf16_inputs(headdim=192)
    with pytest.raises(ValueError, match="head dim 192 is above every compiled"):
        interface._launch_fwd(q, k, v, out, lse, op_args())
    assert len(fake_cuda.calls) == 2




def test_launch_value_head_dim_below_the_kernel_goes_through_full_rows(fake_cuda):
    q, k, v, out, lse, dq, dk, dv = _bf16_inputs(headdim=128)
    v, out, dv = v[..., :64].contiguous(), out[..., :64].contiguous(), dv[..., :64].contiguous()
    interface._launch_fwd(q, k, v, out, lse, op_args())
    assert fake_cuda.calls[-1][1][3].stride(-2) == 128  # out rows as wide as the 128 kernel
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv, op_args())
    args = fake_cuda.calls[-1][1]
    assert args[6] is dq and args[7] is dk and args[8].stride(-2) == 128


def test_host_copies_of_cu_seqlens_are_reused_until_the_tensors_change():
    cu_q, cu_k = cu((3, 0, 6)), cu((4, 2, 5))
    first = interface._host_lists(cu_q, cu_k, None, None)
    assert first == [[0, 3, 3, 9], [0, 4, 6, 11], None, None]
    assert interface._host_lists(cu_q, cu_k, None, None)[0] is first[0]  # the same copies, no new read
    cu_k[1:] += 1  # an in-place change bumps the version counter
    assert interface._host_lists(cu_q, cu_k, None, None) == [[0, 3, 3, 9], [0, 5, 7, 12], None, None]
    other = cu_q.clone()
    assert interface._host_lists(other, cu_k, None, None)[0] is not first[0]
    used = torch.tensor([2, 0, 6], dtype=torch.int32)
    assert interface._host_lists(other, cu_k, used, None) == [[0, 3, 3, 9], [0, 5, 7, 12], [2, 0, 6], None]


@pytest.mark.parametrize("mask, lens, headdim, expected", [
    ("causal", (300, 900, 300), 64, "shift_causal_runs"), ("causal", (600, 600, 600), 64, "auto"),
    ("full", (300, 900, 300), 64, "shift_runs"), ("full", (600, 600, 600), 64, "auto"),
    ("window", (300, 900, 300), 64, "auto"), ("full", (300, 900, 300), 128, "shift_runs")],
    ids=["causal-unequal", "causal-equal", "full-unequal", "full-equal", "window-unequal", "full-unequal-gqa4"])
def test_nondeterministic_auto_runs_unequal_packs_per_sequence(fake_cuda, monkeypatch, mask, lens, headdim, expected):
    """Non-deterministic `auto` on a full or causal pack of unequal lengths takes the deterministic pick (every sequence
    on its own geometry, short_k included), also where dense `auto` runs descending_lanes for the GQA
    ratio (GQA 4 at hdim 128); a pack of equal lengths or a window keeps `auto`, which the model resolves."""
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    monkeypatch.setattr(_varlen, "_runs_beat_packed", lambda *args: False)
    nheads = 8 if headdim == 128 else 4
    q, k, v, cu_q, cu_k, _, _ = varlen_inputs(lens, lens, nheads=nheads, headdim=headdim, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
    mask_id, window = {"full": (0, (-1, -1)), "causal": (1, (-1, 0)), "window": (2, (64, 0))}[mask]
    args = op_args(mask=mask_id, window=window, deterministic=False, schedule="auto")
    interface._varlen_bwd_cuda(fake_cuda, torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, cu_q.tolist(),
                               cu_k.tolist(), args)
    schedule = expected if expected != "auto" else interface.FALLBACK_SCHEDULE
    gqa_ratio = nheads // k.shape[-2]
    runs_schedule = expected in ("shift_causal_runs", "shift_runs")
    short_k = schedules_table.short_keys(mask, headdim, gqa_ratio) if runs_schedule else 0
    assert fake_cuda.calls  # full masks launch once per length class (dash_attn/_seq_bands.py)
    for name, launch in fake_cuda.calls:
        assert name == "varlen_bwd" and launch[-6:-3] == (False, interface.SCHEDULE_IDS[schedule], short_k)


@pytest.mark.parametrize("v_dim", [64, 32], ids=["dv=d", "dv<d"])
@pytest.mark.parametrize("nheads, nheads_k, launched_kv_heads", [(4, 1, 4), (8, 1, 4), (8, 2, 2)])
def test_one_kv_head_runs_the_backward_on_copies(fake_cuda, monkeypatch, nheads, nheads_k, launched_kv_heads, v_dim):
    """GQA with one KV head (dash_attn/_kv_heads.py): the kernel gets K and V repeated, per query head (4 query heads)
    or per pair of them (8), and the deterministic `auto` pick of that GQA ratio; dK and dV are the sums of the
    copies in float32, in sum_groups' fixed order. Two KV heads keep the GQA kernels."""
    q, k, v = qkv(seqlen_q=10, seqlen_k=12, nheads=nheads, nheads_k=nheads_k, headdim=64, dtype=torch.bfloat16)
    v = v[..., :v_dim].contiguous()
    out, lse = torch.empty_like(q), torch.empty(2, nheads, 10)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bwd(dout, q, k_in, v_in, out, lse, dq, dk_in, dv_in, *rest):
        fake_cuda.calls.append(("bwd", (k_in, v_in, rest)))
        heads = torch.arange(k_in.shape[2], dtype=torch.float32).view(1, 1, -1, 1)
        dk_in.copy_(k_in + heads / 64)
        dv_in.copy_(v_in - heads / 32)

    monkeypatch.setattr(fake_cuda, "bwd", bwd)
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv, op_args(schedule="auto"))
    ((_, (k_in, v_in, rest)), *sums) = fake_cuda.calls
    assert k_in.shape[2] == v_in.shape[2] == launched_kv_heads
    if launched_kv_heads > nheads_k:  # offered to the GPU's one-pass sum first (declined by the stand-in)
        ((name, (ins, outs, copies)),) = sums
        assert name == "sum_kv_heads" and copies == 4 and outs[0] is dk and outs[1] is dv
        assert [x.shape[2] for x in ins] == [4, 4]
    else:
        assert not sums
    heads = torch.arange(launched_kv_heads, dtype=torch.float32).view(1, 1, -1, 1)
    for got, x, step in ((dk, k, 1 / 64), (dv, v, -1 / 32)):
        h = (x.float().repeat_interleave(launched_kv_heads // nheads_k, 2) + heads * step).to(x.dtype).float()
        if launched_kv_heads > nheads_k:  # (h0 + h2) + (h1 + h3)
            h = (h[:, :, 0:1] + h[:, :, 2:3]) + (h[:, :, 1:2] + h[:, :, 3:4])
        assert torch.equal(got, h.to(got.dtype))
    ratio = nheads // launched_kv_heads
    assert rest[6] == interface.SCHEDULE_IDS[schedules_table.invariant_schedule("full", 64, 12, ratio)]


def test_kv_heads_run_on_partial_copies(fake_cuda, monkeypatch):
    """A copy count below the group (dash_attn._kv_heads.kv_copies): copy c of KV head j is launched head
    j * copies + c, serving query heads (j * copies + c) * g / copies onwards; its dK share is summed into KV head j."""
    from dash_attn import _kv_heads
    monkeypatch.setattr(_kv_heads, "kv_copies", lambda nheads, nheads_k, causal: 2)
    q, k, v = qkv(seqlen_q=10, seqlen_k=12, nheads=8, nheads_k=2, headdim=64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 10)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bwd(dout, q, k_in, v_in, out, lse, dq, dk_in, dv_in, *rest):
        fake_cuda.calls.append(("bwd", (k_in, v_in)))
        dk_in.copy_(k_in * torch.tensor([1, 2, 4, 8], dtype=k_in.dtype).view(1, 1, -1, 1))  # exact
        dv_in.copy_(v_in)

    monkeypatch.setattr(fake_cuda, "bwd", bwd)
    interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv, op_args(schedule="auto"))
    (_, (k_in, v_in)), (name, (_, _, copies)) = fake_cuda.calls
    assert name == "sum_kv_heads" and copies == 2
    assert torch.equal(k_in, k.repeat_interleave(2, 2)) and torch.equal(v_in, v.repeat_interleave(2, 2))
    weights = torch.tensor([1 + 2, 4 + 8], dtype=torch.float32).view(1, 1, -1, 1)  # copies (1, 2) and (4, 8)
    assert torch.equal(dk, (k.float() * weights).to(dk.dtype)) and torch.equal(dv, (v.float() * 2).to(dv.dtype))


def test_kv_copies_rule_reads_head_counts_and_mask():
    """Even groups of SPLIT_GROUP (6) or more: copies of 2 query heads on causal masks; with one KV head
    (EXPANDED_KV_HEADS) from SPLIT_GROUP_ONE_KV (8) on, on either mask; otherwise MHA up to EXPANDED_KV_HEADS KV
    heads, else the GQA kernels."""
    from dash_attn._kv_heads import kv_copies
    assert [kv_copies(16, 2, True), kv_copies(32, 4, True), kv_copies(8, 1, True), kv_copies(64, 4, True)] == [4, 4, 4, 8]
    assert [kv_copies(16, 4, True), kv_copies(4, 1, True), kv_copies(8, 1, False), kv_copies(16, 2, False)] == \
        [1, 4, 4, 1]
    assert [kv_copies(4, 1, False), kv_copies(6, 1, False), kv_copies(5, 1, False), kv_copies(2, 1, False)] == \
        [4, 6, 5, 2]
    assert [kv_copies(6, 1, True), kv_copies(10, 1, False), kv_copies(10, 1, True)] == [6, 5, 5]
    assert [kv_copies(12, 2, True), kv_copies(12, 2, False), kv_copies(12, 4, True)] == [3, 1, 1]
    assert kv_copies(8, 8, True) == kv_copies(8, 8, False) == 1


def test_nondet_auto_runs_the_invariant_pick_with_gqa_4_at_hdim_256(fake_cuda, monkeypatch):
    """On square causal bands with 4 query heads per KV head at hdim 256 (schedules_table.NONDET_RUNS_BOUNDS)
    the non-deterministic `auto` runs shift_causal_runs at any length without asking the model, with the kernel's
    ordered dQ adds (its deterministic flag); with 2 query heads per KV head, and on bands with fewer queries than keys,
    it asks the model (here absent, so the fallback runs) and keeps the arrival-order adds."""
    monkeypatch.setitem(sys.modules, "dash_attn.schedule", None)
    fake_cuda.supported_head_dims = lambda: [64, 128, 256]
    fake_cuda.bwd_tile_shape = lambda headdim, mask: (64, 64) if headdim > 128 else (64, 128)
    interface._supported_head_dims.cache_clear()
    interface._bwd_tile_shape.cache_clear()
    fallback = interface.FALLBACK_SCHEDULE
    for seqlen_q, seqlen_k, nheads_k, expected in ((1024, 1024, 2, "shift_causal_runs"), (1024, 1024, 4, fallback),
                                                   (512, 1024, 2, fallback)):
        q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=8, nheads_k=nheads_k, headdim=256,
                      dtype=torch.bfloat16)
        out, lse = torch.empty_like(q), torch.empty(2, 8, seqlen_q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        interface._launch_bwd(out, q, k, v, out, lse, dq, dk, dv,
                              op_args(mask=1, window=(-1, 0), deterministic=False, schedule="auto"))
        assert fake_cuda.calls[-1][1][15] == interface.SCHEDULE_IDS[expected], (seqlen_q, seqlen_k, nheads_k)
        assert fake_cuda.calls[-1][1][14] is (expected == "shift_causal_runs"), (seqlen_q, seqlen_k, nheads_k)
