"""GPU varlen: flash_attn_varlen_func against the float32 varlen reference (marker `gpu`).

The CUDA varlen path runs the packed-sequence kernels at a kernel's own head dim where each sequence's causal or
window band lies inside the longest sequences' (test_gpu_packed.py checks that path on its own), and elsewhere the
dense kernels once per run of consecutive sequences with equal lengths (the causal "unequal" and "empty" packings,
whose diagonals lie right of the longest sequences', and the windows of "unequal"). These tests cover what the
packing adds on top of the dense tests: sequence boundaries (each sequence masked on its own, causal aligned per
sequence), empty sequences on either side, runs batched together, GQA, windows re-normalised per run,
bitwise-identical deterministic gradients. Calls inside a CUDA graph capture: test_gpu_captured_varlen.py.
Tolerances as in test_gpu_forward.py.
"""
import os

import pytest
import torch

import dash_attn
from gpu_common import (exact_float32_matmul, main_head_dim, supported_head_dims,  # noqa: F401 (fixture)
                        assert_out_lse_within, assert_grads_within, poison_allocator, requires_softcap,
                        SOFTCAP_SCORE_BOOST)
from dash_attn.reference import attention_bwd_ref_varlen, attention_ref_varlen

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
REPEATS = int(os.environ.get("DASH_VARLEN_DET_REPEATS", "50"))

# (query lengths, key lengths) per sequence: odd sizes around the tiles, empty sequences on either side, and
# seqlen_q != seqlen_k within a sequence (bottom-right causal per sequence).
PACKINGS = {
    "odd": ((113, 1, 257, 64), (113, 1, 257, 64)),
    "empty": ((0, 17, 300, 5), (9, 0, 300, 5)),
    "unequal": ((200, 31, 1023), (77, 400, 1023)),
    # Runs of equal lengths go to the kernels as one batch each (the last run has seqlen_q != seqlen_k).
    "runs": ((100, 100, 100, 7, 7, 0, 0, 300, 300), (100, 100, 100, 7, 7, 5, 5, 257, 257)),
}


def _cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def make_varlen(packing, nheads, nheads_k, headdim, dtype, seed=SEED, cu_device="cuda"):
    lens_q, lens_k = PACKINGS[packing]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(sum(lens_q), nheads, headdim), (sum(lens_k), nheads_k, headdim), (sum(lens_k), nheads_k, headdim),
              (sum(lens_q), nheads, headdim)]
    q, k, v, dout = (torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes)
    return q, k, v, dout, _cu(lens_q, cu_device), _cu(lens_k, cu_device), max(lens_q), max(lens_k)


def run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, window, deterministic, schedule="auto",
               softcap=0.0):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                                softcap=softcap, deterministic=deterministic, schedule=schedule,
                                                return_attn_probs=True)
    out.backward(dout)
    torch.cuda.synchronize()
    return out, lse, tuple(t.grad for t in leaves)


def check_varlen(packing, nheads, nheads_k, headdim, dtype, causal, window=(-1, -1), deterministic=True,
                 schedule="auto", poison=False, cu_device="cuda", softcap=0.0):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_varlen(packing, nheads, nheads_k, headdim, dtype,
                                                          cu_device=cu_device)
    if softcap > 0:
        q, k = (t.float().mul(SOFTCAP_SCORE_BOOST).to(dtype) for t in (q, k))
    if poison:
        poison_allocator()
    out, lse, grads = run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, window, deterministic, schedule,
                                 softcap)
    assert out.shape == q.shape and lse.shape == (nheads, q.shape[0]) and lse.dtype == torch.float32

    qf, kf, vf = q.float(), k.float(), v.float()
    ref_out, ref_lse = attention_ref_varlen(qf, kf, vf, cu_q, cu_k, causal=causal, window_size=window,
                                            softcap=softcap, return_lse=True)
    ref_grads = attention_bwd_ref_varlen(dout.float(), qf, kf, vf, ref_out, ref_lse, cu_q, cu_k, causal=causal,
                                         window_size=window, softcap=softcap)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    base_out = attention_ref_varlen(*leaves, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap,
                                    upcast=False)
    base_grads = torch.autograd.grad(base_out, leaves, dout)

    assert_out_lse_within(out, lse, ref_out, ref_lse, base_out, dtype)
    assert_grads_within(grads, ref_grads, base_grads, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_varlen_matches_reference(packing, causal, deterministic, headdim):
    check_varlen(packing, 4, 2, headdim, torch.bfloat16, causal, deterministic=deterministic)


@pytest.mark.gpu
@requires_softcap
@pytest.mark.parametrize("packing", ["odd", "empty", "runs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_varlen_softcap(packing, causal, headdim):
    check_varlen(packing, 4, 2, headdim, torch.bfloat16, causal, softcap=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(64, 0), (100, 30), (1000, 1000)], ids=["w64_0", "w100_30", "w1000_1000"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_windows_and_dtypes(window, dtype):
    check_varlen("unequal", 8, 2, main_head_dim(), dtype, False, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("packing", ["odd", "empty", "runs"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_varlen_one_kv_head(packing, causal, deterministic):
    """GQA 8:1, which runs on copies of 2 query heads with dK and dV summed over the copies (dash_attn/_kv_heads.py)."""
    check_varlen(packing, 8, 1, main_head_dim(), torch.bfloat16, causal, deterministic=deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_with_cu_seqlens_on_the_host(causal):
    check_varlen("runs", 4, 2, main_head_dim(), torch.bfloat16, causal, cu_device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", list(dash_attn.SCHEDULES))
def test_varlen_every_schedule_with_poisoned_outputs(schedule):
    deterministic = schedule not in dash_attn.NONDETERMINISTIC_SCHEDULES
    check_varlen("odd", 4, 4, main_head_dim(), torch.bfloat16, True, deterministic=deterministic, schedule=schedule,
                 poison=True)


@pytest.mark.gpu
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_varlen_causal_runs_per_sequence(packing, dtype, headdim):
    """shift_causal_runs on causal packs schedules every sequence on its own geometry (csrc/schedule/seq_runs.h):
    empty sequences, single tiles and seqlen_q != seqlen_k included, into poisoned outputs."""
    check_varlen(packing, 4, 2, headdim, dtype, True, schedule="shift_causal_runs", poison=True)


@pytest.mark.gpu
@requires_softcap
def test_varlen_causal_runs_per_sequence_softcap():
    check_varlen("unequal", 4, 2, main_head_dim(), torch.bfloat16, True, schedule="shift_causal_runs", softcap=5.0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_deterministic_gradients_are_bitwise_identical(causal):
    q, k, v, dout, cu_q, cu_k, max_q, max_k = make_varlen("unequal", 8, 2, main_head_dim(), torch.bfloat16)
    _, _, first = run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, (-1, -1), True)
    for _ in range(REPEATS):
        _, _, grads = run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, (-1, -1), True)
        for name, a, b in zip(("dq", "dk", "dv"), first, grads):
            assert torch.equal(a, b), f"{name} differs between repeated deterministic varlen backward calls"


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads_q", [None, 4], ids=["mha", "gqa"])
def test_varlen_packed_qkv_matches_separate_tensors(num_heads_q):
    """The packed layouts reach the kernels as strided views: bitwise the results of contiguous q, k, v."""
    nheads_k = 4 if num_heads_q is None else 2
    q, k, v, dout, cu, _, max_len, _ = make_varlen("odd", 4, nheads_k, main_head_dim(), torch.bfloat16)
    qkv = (torch.stack([q, k, v], 1) if num_heads_q is None else torch.cat([q, k, v], 1)).requires_grad_()
    out = dash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, max_len, causal=True, deterministic=True,
                                                     num_heads_q=num_heads_q)
    out.backward(dout)
    ref, _, grads = run_varlen(q, k, v, dout, cu, cu, max_len, max_len, True, (-1, -1), True)
    assert torch.equal(out, ref)
    assert torch.equal(qkv.grad, torch.stack(grads, 1) if num_heads_q is None else torch.cat(grads, 1))
