"""GPU: shift's split last wave (csrc/schedule/tail_split.h) gives correct and bitwise-reproducible dQ/dK/dV.

The shapes below leave shift a partial last wave that the schedule engine cuts into pieces on this GPU's grid (checked
through dash_attn._sched before the kernels run, so a shape that stopped splitting fails instead of passing
vacuously). A piece's dK/dV are partial sums that the last piece to finish adds in piece order (bwd_epilogue.h).
"""
import os

import numpy as np
import pytest
import torch

from dash_attn import schedule as sched
from gpu_common import exact_float32_matmul, supported_head_dims, assert_grads_within  # noqa: F401 (fixture)
from test_gpu_backward import kernel_grads, make_inputs, reference_grads

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
REPEATS = max(100, int(os.environ.get("DASH_DET_REPEATS", "1000")) // 5)
# (batch, seqlen_q, seqlen_k, nheads, nheads_k): one wave's worth or less (everything is tail), several whole waves
# plus a tail, GQA with ragged last tiles and seqlen_q != seqlen_k.
SHAPES = [(1, 3072, 3072, 5, 5), (1, 4096, 4096, 8, 8), (2, 1500, 1133, 8, 2)]


def splits(shape, headdim, sm_margin=0):
    """Whether shift splits this shape's last wave on this GPU (what the kernel's schedule will do)."""
    batch, sq, sk, h, hk = shape
    block_m, block_n = sched.tile_shape(headdim)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count - sm_margin
    p = sched.plan("shift", "full", sq, sk, block_m, block_n, h, batch, ctas, nheads_k=hk)
    return bool(np.any(p.items["first_step"] > 0))


@pytest.mark.parametrize("headdim", supported_head_dims())
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_split_tail_matches_reference(shape, headdim, deterministic):
    assert splits(shape, headdim), "the shape no longer splits shift's tail on this GPU"
    batch, sq, sk, h, hk = shape
    q, k, v, dout = make_inputs(batch, sq, sk, h, hk, headdim, torch.bfloat16)
    ref, base, floors = reference_grads(q, k, v, dout, causal=False)
    grads = kernel_grads(q, k, v, dout, False, "shift", deterministic, poison=True)
    assert_grads_within(grads, ref, base, torch.bfloat16, floors)


@pytest.mark.parametrize("sm_margin", [0, 18])
def test_split_tail_bitwise_repeatable(sm_margin):
    headdim = 128 if 128 in supported_head_dims() else supported_head_dims()[-1]
    shape = SHAPES[2]
    assert splits(shape, headdim, sm_margin)
    batch, sq, sk, h, hk = shape
    q, k, v, dout = make_inputs(batch, sq, sk, h, hk, headdim, torch.bfloat16)
    first = kernel_grads(q, k, v, dout, False, "shift", True, sm_margin=sm_margin)
    mismatches = 0
    for _ in range(REPEATS):
        again = kernel_grads(q, k, v, dout, False, "shift", True, sm_margin=sm_margin)
        mismatches += int(any(not torch.equal(a, b) for a, b in zip(first, again)))
    assert mismatches == 0, f"{mismatches} of {REPEATS} calls differed (sm_margin={sm_margin})"
