"""GPU: the split last wave of shift and shift_causal (csrc/schedule/tail_split.h) gives correct and
bitwise-reproducible dQ/dK/dV.

The shapes below leave the schedule a partial last wave that the schedule engine cuts into pieces on this GPU's grid
(checked through dash_attn._sched before the kernels run, so a shape that stopped splitting fails instead of passing
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
# Causal (shift_causal's pairs): less than a wave of pairs, GQA with ragged last tiles, seqlen_q > seqlen_k (leading
# query rows without keys) and several whole waves plus a tail.
CAUSAL_SHAPES = [(1, 4096, 4096, 8, 8), (2, 1500, 1500, 8, 2), (1, 4096, 2048, 8, 8), (1, 8192, 8192, 16, 16)]
CASES = [("shift", False, s) for s in SHAPES] + [("shift_causal", True, s) for s in CAUSAL_SHAPES]


def splits(schedule, causal, shape, headdim, sm_margin=0):
    """Whether the schedule splits this shape's last wave on this GPU (what the kernel's schedule will do)."""
    batch, sq, sk, h, hk = shape
    block_m, block_n = sched.tile_shape(headdim)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count - sm_margin
    p = sched.plan(schedule, "causal" if causal else "full", sq, sk, block_m, block_n, h, batch, ctas, nheads_k=hk)
    return bool(np.any(p.items["first_step"] > 0))


@pytest.mark.parametrize("headdim", supported_head_dims())
@pytest.mark.parametrize("schedule,causal,shape", CASES, ids=[f"{n}-{'x'.join(map(str, s))}" for n, _, s in CASES])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_split_tail_matches_reference(schedule, causal, shape, headdim, deterministic):
    assert splits(schedule, causal, shape, headdim), "the shape no longer splits the tail on this GPU"
    batch, sq, sk, h, hk = shape
    q, k, v, dout = make_inputs(batch, sq, sk, h, hk, headdim, torch.bfloat16)
    ref, base, floors = reference_grads(q, k, v, dout, causal=causal)
    grads = kernel_grads(q, k, v, dout, causal, schedule, deterministic, poison=True)
    assert_grads_within(grads, ref, base, torch.bfloat16, floors)


@pytest.mark.parametrize("sm_margin", [0, 18])
@pytest.mark.parametrize("schedule,causal,shape", [("shift", False, SHAPES[2]), ("shift_causal", True,
                                                                                CAUSAL_SHAPES[1])],
                         ids=["shift", "shift_causal"])
def test_split_tail_bitwise_repeatable(schedule, causal, shape, sm_margin):
    headdim = 128 if 128 in supported_head_dims() else supported_head_dims()[-1]
    assert splits(schedule, causal, shape, headdim, sm_margin)
    batch, sq, sk, h, hk = shape
    q, k, v, dout = make_inputs(batch, sq, sk, h, hk, headdim, torch.bfloat16)
    first = kernel_grads(q, k, v, dout, causal, schedule, True, sm_margin=sm_margin)
    mismatches = 0
    for _ in range(REPEATS):
        again = kernel_grads(q, k, v, dout, causal, schedule, True, sm_margin=sm_margin)
        mismatches += int(any(not torch.equal(a, b) for a, b in zip(first, again)))
    assert mismatches == 0, f"{mismatches} of {REPEATS} calls differed (sm_margin={sm_margin})"
