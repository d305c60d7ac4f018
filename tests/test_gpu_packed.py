"""GPU packed-sequence kernels: flash_attn_varlen_func calls that run in one launch per direction (marker `gpu`).

dash_attn/interface.py sends varlen calls at a built kernel's own head dim whose sequences' causal or window bands
lie inside the longest sequences' band to the packed-sequence kernels (csrc/common/params.h: PackedSeqs), which tile
and schedule the call as a batch of the longest sequence and skip what lies past each sequence's end. These tests
check that those calls take that path and what it must get right on its own: sequences far shorter than the longest
(many skipped tiles, KV tiles past a sequence's end that still hold turns in dQ chains), empty sequences, lengths
around the tiles, per-sequence causal diagonals left of the longest ones', sliding windows, softcap, GQA, fp16, every
schedule with poisoned outputs, and bitwise-identical deterministic gradients. test_gpu_varlen.py covers the varlen
API as a whole (its "unequal" and "empty" causal packings fall back to the batched kernels: a sequence's diagonal
lies right of the longest ones').
"""
import pytest
import torch

import dash_attn
import dash_attn.interface as interface
import test_gpu_varlen as varlen
from api_common import patch_interface
from gpu_common import DET_SCHEDULES, main_head_dim, requires_softcap, supported_head_dims

pytestmark = pytest.mark.gpu

# (query lengths, key lengths) per sequence.
PACKED = {
    # One long sequence among short ones, empty ones, and lengths at and around the tile sizes (64, 128).
    "docs": ((1, 64, 65, 0, 1023, 128, 129, 200, 17), (1, 64, 65, 0, 1023, 128, 129, 200, 17)),
    # Per-sequence diagonals (seqlen_k - seqlen_q: 30, 20, 0, 200) at or left of the longest ones' (700 - 500).
    "diagonals": ((100, 300, 3, 500), (130, 320, 3, 700)),
    # Keys longer than queries and the other way round, with a full mask only (see _packed_path below).
    "ragged": ((300, 31, 1023, 0), (77, 400, 1023, 9)),
}


@pytest.fixture(autouse=True)
def _packings(monkeypatch):
    for name, lengths in PACKED.items():
        monkeypatch.setitem(varlen.PACKINGS, name, lengths)


@pytest.fixture
def packed_calls(monkeypatch):
    """Records, for every varlen call, whether the packed kernels ran it."""
    calls = []
    original = interface._packed_launch

    def recording(*args, **kwargs):
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    patch_interface(monkeypatch, "_packed_launch", recording)
    return calls


def _extension_has_packed_kernels():
    return interface._extension().packed_built()


def _check(packed_calls, packing, *args, **kwargs):
    if not _extension_has_packed_kernels():
        pytest.skip("extension built without the packed-sequence kernels (DASH_ATTN_PACKED=0)")
    varlen.check_varlen(packing, *args, **kwargs)
    assert packed_calls and all(packed_calls), "the call did not run in the packed-sequence kernels"


@pytest.mark.parametrize("packing", ["docs", "diagonals"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_packed_matches_reference(packed_calls, packing, causal, deterministic, heads, headdim):
    _check(packed_calls, packing, heads[0], heads[1], headdim, torch.bfloat16, causal, deterministic=deterministic,
           poison=True)


@pytest.mark.parametrize("window", [(64, 0), (100, 30), (300, 300), (-1, 50)], ids=["w64_0", "w100_30", "w300_300",
                                                                              "wnone_50"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_packed_sliding_windows(packed_calls, window, deterministic, heads, headdim):
    _check(packed_calls, "docs", heads[0], heads[1], headdim, torch.bfloat16, False, window=window,
           deterministic=deterministic, poison=True)


@requires_softcap
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_packed_softcap(packed_calls, mask, deterministic, headdim):
    window = (100, 30) if mask == "window" else (-1, -1)
    _check(packed_calls, "docs", 4, 2, headdim, torch.bfloat16, mask == "causal", window=window,
           deterministic=deterministic, softcap=5.0, poison=True)


def test_window_band_outside_the_longest_falls_back(packed_calls):
    """A window whose left bound would need KV tiles left of the longest sequences' band runs in the batched kernels."""
    varlen.check_varlen("diagonals", 4, 2, main_head_dim(), torch.bfloat16, False, window=(50, 0))
    assert packed_calls and not any(packed_calls)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_packed_full_mask_ragged_lengths(packed_calls, deterministic, headdim):
    _check(packed_calls, "ragged", 4, 2, headdim, torch.bfloat16, False, deterministic=deterministic)


# The dtype as a parameter, so that a build without fp16 kernels skips it (conftest.py).
@pytest.mark.parametrize("dtype", [torch.float16], ids=["fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_packed_fp16(packed_calls, causal, headdim, dtype):
    _check(packed_calls, "docs", 4, 2, headdim, dtype, causal)


@pytest.mark.parametrize("schedule", DET_SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_every_schedule_with_poisoned_outputs(packed_calls, schedule, causal):
    _check(packed_calls, "docs", 4, 4, main_head_dim(), torch.bfloat16, causal, schedule=schedule, poison=True)


# The packed kernels claim no units: they run shift_causal's order for "dynamic".
@pytest.mark.parametrize("schedule", dash_attn.NONDETERMINISTIC_SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_nondeterministic_schedules(packed_calls, schedule, causal):
    _check(packed_calls, "docs", 4, 2, main_head_dim(), torch.bfloat16, causal, deterministic=False, schedule=schedule,
           poison=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_with_cu_seqlens_on_the_host(packed_calls, causal):
    _check(packed_calls, "diagonals", 4, 2, main_head_dim(), torch.bfloat16, causal, cu_device="cpu")


@pytest.mark.parametrize("schedule", DET_SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_deterministic_gradients_are_bitwise_identical(packed_calls, schedule, causal):
    if not _extension_has_packed_kernels():
        pytest.skip("extension built without the packed-sequence kernels (DASH_ATTN_PACKED=0)")
    q, k, v, dout, cu_q, cu_k, max_q, max_k = varlen.make_varlen("docs", 8, 2, main_head_dim(), torch.bfloat16)
    _, _, first = varlen.run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, (-1, -1), True, schedule)
    for _ in range(varlen.REPEATS):
        _, _, grads = varlen.run_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, (-1, -1), True, schedule)
        for name, a, b in zip(("dq", "dk", "dv"), first, grads):
            assert torch.equal(a, b), f"{name} differs between repeated deterministic packed backward calls"
    assert all(packed_calls)


def test_causal_diagonal_right_of_the_longest(packed_calls):
    """A sequence whose causal diagonal lies right of the longest ones': the forward, and a backward scheduled as a
    batch of the longest sequence (descending), run in the batched kernels; deterministic `auto` schedules every
    sequence on its own geometry (shift_causal_runs) and runs its backward in the packed kernels. Correct each time."""
    varlen.check_varlen("unequal", 4, 2, main_head_dim(), torch.bfloat16, True, schedule="descending")
    assert packed_calls and not any(packed_calls)
    packed_calls.clear()
    varlen.check_varlen("unequal", 4, 2, main_head_dim(), torch.bfloat16, True)
    assert packed_calls == [False, True]
