"""Deterministic backward: bitwise-identical dQ/dK/dV over many repeated calls (marker `gpu`).

DASH_DET_REPEATS (default 1000) sets the repeat count per schedule. The backward op is called directly with a fixed
forward's out/lse so the loop measures only the backward; comparisons stay on the GPU and sync once per check.
"""
import os

import pytest
import torch

import dash_attn
from gpu_common import DET_SCHEDULES, main_head_dim, supported_head_dims

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
REPEATS = int(os.environ.get("DASH_DET_REPEATS", "1000"))
# The schedules of a deterministic backward ("dynamic" runs only non-deterministically).
EXPLICIT_SCHEDULES = [s for s in DET_SCHEDULES if s != "auto"]
# Only these orders are a function of the sequence's geometry alone (tests/test_schedule_invariance.py proves it on the
# CPU; deterministic `auto` picks among them); spt/shift/shift_causal order by wave, which depends on the grid size.
SM_INDEPENDENT_SCHEDULES = ["ascending", "descending", "shift_runs", "shift_causal_runs", "descending_lanes", "auto"]
# (mask id, window_left, window_right): the window cuts both sides of every row's band.
MASKS = {"full": (0, -1, -1), "causal": (1, -1, 0), "window": (2, 150, 37)}
# Modest but tile-rich: several Q and KV tiles per head, ragged last tiles, GQA (dK/dV reduced across 4 heads).
SHAPE = dict(batch=2, seqlen=1013, nheads=8, nheads_k=2)


class Problem:
    """Fixed inputs plus the forward's out/lse; `grads` runs one backward op call."""

    def __init__(self, mask, headdim=None, dtype=torch.bfloat16, batch=SHAPE["batch"], seqlen=SHAPE["seqlen"],
                 nheads=SHAPE["nheads"], nheads_k=SHAPE["nheads_k"]):
        headdim = headdim or main_head_dim()
        gen = torch.Generator(device="cuda").manual_seed(SEED)

        def randn(*shape):
            return torch.randn(shape, generator=gen, device="cuda", dtype=dtype)

        self.q = randn(batch, seqlen, nheads, headdim)
        self.k = randn(batch, seqlen, nheads_k, headdim)
        self.v = randn(batch, seqlen, nheads_k, headdim)
        self.dout = randn(batch, seqlen, nheads, headdim)
        self.mask, self.window_left, self.window_right = MASKS[mask]
        self.scale = headdim ** -0.5
        self.out, self.lse = torch.ops.dash_attn.fwd(self.q, self.k, self.v, self.scale, self.mask,
                                                     self.window_left, self.window_right, 0.0, True, "auto", 0)

    def grads(self, schedule, deterministic=True, sm_margin=0):
        return torch.ops.dash_attn.bwd(self.dout, self.q, self.k, self.v, self.out, self.lse, self.scale, self.mask,
                                       self.window_left, self.window_right, 0.0, deterministic, schedule, sm_margin)


def count_mismatches(problem, schedule, repeats, reference=None, sm_margin=0, before_each=None):
    """Runs `repeats` backward calls; returns (first result, number of calls not bitwise equal to `reference`)."""
    first = problem.grads(schedule, sm_margin=sm_margin)
    reference = first if reference is None else reference
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    mismatches += int(any(not torch.equal(a, b) for a, b in zip(first, reference)))
    for _ in range(repeats - 1):
        if before_each is not None:
            before_each()
        grads = problem.grads(schedule, sm_margin=sm_margin)
        differs = torch.stack([(a != b).any() for a, b in zip(grads, reference)]).any()
        mismatches += differs.to(torch.int64)
    return first, int(mismatches.item())


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("schedule", DET_SCHEDULES)
def test_repeated_backward_is_bitwise_identical(schedule, mask):
    problem = Problem(mask)
    _, mismatches = count_mismatches(problem, schedule, REPEATS)
    assert mismatches == 0, f"{mismatches} of {REPEATS} deterministic backward calls differed ({schedule}, {mask})"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("schedule", EXPLICIT_SCHEDULES)
def test_bitwise_identical_under_competing_stream_load(schedule, mask):
    """A matmul stream steals SMs at random moments, which reorders tile arrivals; results must not change."""
    problem = Problem(mask)
    reference = problem.grads(schedule)
    torch.cuda.synchronize()
    load_stream = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(SEED + 7)
    a = torch.randn(4096, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    load_stream.wait_stream(torch.cuda.current_stream())

    def launch_load():
        with torch.cuda.stream(load_stream):
            torch.matmul(a, b)

    repeats = max(50, REPEATS // 10)
    _, mismatches = count_mismatches(problem, schedule, repeats, reference=reference, before_each=launch_load)
    torch.cuda.synchronize()
    assert mismatches == 0, f"{mismatches} of {repeats} calls under load differed ({schedule}, {mask})"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("schedule", SM_INDEPENDENT_SCHEDULES)
def test_identical_across_sm_margins(schedule, mask):
    """Fixed-order schedules promise the same bits whatever the grid size.

    32 query / 16 KV heads give 256 KV-tile work items, more than one wave on any grid, so the margins really change
    which CTA runs what and when.
    """
    problem = Problem(mask, nheads=32, nheads_k=16)
    reference = problem.grads(schedule, sm_margin=0)
    for sm_margin in (4, 18):
        _, mismatches = count_mismatches(problem, schedule, 20, reference=reference, sm_margin=sm_margin)
        assert mismatches == 0, f"sm_margin={sm_margin} changed the result of {schedule} ({mask})"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("schedule", ["spt", "shift", "shift_causal"])
def test_run_to_run_per_sm_margin(schedule, mask):
    """Arrival-order schedules only promise run-to-run identity for a given grid size, so that is all we check."""
    problem = Problem(mask)
    for sm_margin in (0, 4, 18):
        _, mismatches = count_mismatches(problem, schedule, 50, sm_margin=sm_margin)
        assert mismatches == 0, f"{schedule} ({mask}) not run-to-run identical with sm_margin={sm_margin}"


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", supported_head_dims())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_head_dim_and_dtype_is_deterministic(headdim, dtype):
    for mask in MASKS:
        problem = Problem(mask, headdim=headdim, dtype=dtype)
        _, mismatches = count_mismatches(problem, "auto", 50)
        assert mismatches == 0, f"hdim {headdim} {dtype} {mask}: {mismatches} of 50 calls differed"


@pytest.mark.gpu
def test_deterministic_none_follows_global_flag_on_gpu():
    """With torch.use_deterministic_algorithms(True), the default call is the deterministic kernel."""
    problem = Problem("causal")
    leaves = [t.detach().clone().requires_grad_() for t in (problem.q, problem.k, problem.v)]
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = []
        for _ in range(20):
            out = dash_attn.flash_attn_func(*leaves, causal=True)
            results.append(torch.autograd.grad(out, leaves, problem.dout))
    finally:
        torch.use_deterministic_algorithms(previous)
    for grads in results[1:]:
        for a, b in zip(grads, results[0]):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", list(MASKS))
def test_deterministic_and_nondeterministic_agree_closely(mask):
    """Both modes compute the same sums in different orders: close, not necessarily equal."""
    problem = Problem(mask)
    det = problem.grads("auto", deterministic=True)
    nondet = problem.grads("auto", deterministic=False)
    for name, a, b in zip(("dq", "dk", "dv"), det, nondet):
        scale = a.float().abs().max().item()
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 2e-2 * scale + 1e-3, f"{name}: det vs non-det differ by {err:.3e} (max |grad| {scale:.3e})"
