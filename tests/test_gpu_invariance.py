"""Invariant determinism on the GPU (marker `gpu`): with deterministic=True and schedule="auto", a sequence's dQ, dK
and dV are bitwise the same whatever the SM count left by sm_margin, the batch around it, its position in the batch,
or (varlen) the sequences packed with it and their order. The CPU side proves the orders (test_schedule_invariance.py);
this checks the bits, with random other content so that nothing but the sequence itself is shared.
"""
import itertools
import os

import pytest
import torch

import dash_attn
from dash_attn import _sched
from dash_attn.schedule import tile_shape
from dash_attn.schedules_table import short_keys
from gpu_common import assert_grads_within, requires_softcap, supported_head_dims, tolerance  # noqa: F401

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("DASH_TEST_SEED", "0"))
SM_MARGINS = (0, 4, 18, 54, 100)
CASES = [  # (causal, window, softcap, nheads, nheads_k, seqlen)
    (False, (-1, -1), 0.0, 8, 8, 1013),
    (True, (-1, -1), 0.0, 8, 2, 1013),
    (False, (200, 0), 0.0, 4, 4, 777),
    (True, (-1, -1), 30.0, 4, 2, 640),
    # Past schedules_table.SHORT_SEQLEN_K: the other invariant pick; with GQA 4 at hdim 128 descending_lanes
    # (LANES_GQA_RATIO), here with an odd number of KV tiles (35 of 128 keys) at causal.
    (False, (-1, -1), 0.0, 4, 2, 4500),
    (True, (-1, -1), 0.0, 4, 4, 4500),
    (True, (-1, -1), 0.0, 8, 2, 4400),
    # 47 KV tiles at hdim 128: descending_lanes (GQA 4) with several tiles per lane, their count set by the grid.
    (False, (-1, -1), 0.0, 8, 2, 6000),
    # One KV head: the backward runs on copies of 2 query heads (groups of 8) or as MHA (groups of 4), dK and dV
    # summed over the copies (dash_attn/_kv_heads.py).
    (True, (-1, -1), 0.0, 8, 1, 1013),
    (False, (-1, -1), 0.0, 8, 1, 2100),
    (False, (-1, -1), 0.0, 4, 1, 1013),
]


def _ids(c):
    return f"{'causal' if c[0] else 'full'}-w{c[1][0]}_{c[1][1]}-cap{c[2]:g}-h{c[3]}:{c[4]}-s{c[5]}"


def _rand(gen, shape, dtype):
    return torch.randn(shape, generator=gen, device="cuda", dtype=dtype)


def _grads(q, k, v, dout, causal, window, softcap, sm_margin=0, schedule="auto"):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = dash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                    deterministic=True, sm_margin=sm_margin, schedule=schedule)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, (q, k, v), dout)


def _seq(gen, seqlen, nheads, nheads_k, hdim, dtype):
    return (_rand(gen, (1, seqlen, nheads, hdim), dtype), _rand(gen, (1, seqlen, nheads_k, hdim), dtype),
            _rand(gen, (1, seqlen, nheads_k, hdim), dtype), _rand(gen, (1, seqlen, nheads, hdim), dtype))


def _skip_if_unbuilt(hdim, softcap):
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    if softcap and not dash_attn._C.softcap_built():
        pytest.skip("soft-capped kernels not built")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_invariant_across_sm_margin_and_batch(case, hdim, dtype):
    causal, window, softcap, nheads, nheads_k, seqlen = case
    _skip_if_unbuilt(hdim, softcap)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    mine = _seq(gen, seqlen, nheads, nheads_k, hdim, dtype)
    ref = _grads(*mine, causal, window, softcap)
    for margin in SM_MARGINS[1:]:
        got = _grads(*mine, causal, window, softcap, sm_margin=margin)
        for name, a, b in zip("qkv", got, ref):
            assert torch.equal(a, b), f"d{name} changed with sm_margin={margin}"
    for batch in (2, 5):
        for pos in (0, batch - 1):
            others = [_seq(gen, seqlen, nheads, nheads_k, hdim, dtype) for _ in range(batch - 1)]
            parts = others[:pos] + [mine] + others[pos:]
            full = [torch.cat([p[i] for p in parts]) for i in range(4)]
            got = _grads(*full, causal, window, softcap)
            for name, a, b in zip("qkv", got, ref):
                assert torch.equal(a[pos:pos + 1], b), f"d{name} of the sequence at {pos} of {batch} differs from alone"


def _varlen_grads(seqs, order, causal, sm_margin=0, schedule="auto", window=(-1, -1)):
    lens_q, lens_k = ([seqs[i][j].shape[1] for i in order] for j in (0, 1))
    cu_q, cu_k = (torch.tensor([0] + list(torch.tensor(n).cumsum(0)), device="cuda", dtype=torch.int32)
                  for n in (lens_q, lens_k))
    q, k, v, dout = (torch.cat([seqs[i][j][0] for i in order]).detach() for j in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           window_size=window, deterministic=True, sm_margin=sm_margin,
                                           schedule=schedule)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, (q, k, v), dout)
    bounds = (cu_q, cu_k, cu_k)
    return {i: tuple(g[int(c[n]):int(c[n + 1])] for g, c in zip(grads, bounds)) for n, i in enumerate(order)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_varlen_invariant_to_packing(hdim, mask, dtype):
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    causal, window = mask == "causal", ((200, 0) if mask == "window" else (-1, -1))
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    lens = [333, 1500, 64, 777, 333]
    seqs = [_seq(gen, n, 4, 2, hdim, dtype) for n in lens]
    ref = _varlen_grads(seqs, [0], causal, window=window)[0]
    for order, margin in (([0, 1, 2, 3, 4], 0), ([4, 3, 1, 0, 2], 18), ([2, 0], 100)):
        got = _varlen_grads(seqs, order, causal, margin, window=window)[0]
        for name, a, b in zip("qkv", got, ref):
            assert torch.equal(a, b), f"d{name} of sequence 0 changed when packed as {order} (sm_margin {margin})"
    # The dense call under `auto` (test_varlen_auto_gives_sequences_their_dense_bits; windows run descending either way).
    dense = _grads(*seqs[0], causal, window, 0.0)
    for name, a, b in zip("qkv", ref, (g[0] for g in dense)):
        assert torch.equal(a, b), f"d{name} of the varlen call differs from the dense call"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hdim", [64, 128, 256])
@pytest.mark.parametrize("path", ["packed", "runs"])
@pytest.mark.parametrize("mask", ["causal", "full"])
def test_varlen_auto_gives_sequences_their_dense_bits(mask, hdim, dtype, path, monkeypatch):
    """Deterministic `auto` on causal and full packs: each sequence gets the orders of its dense call under `auto`
    (descending_lanes' up to schedules_table.short_keys keys, the runs schedule's above), on the packed kernels and on
    runs of equal lengths launched as batches alike, so its bits follow neither its neighbours nor the path; and
    equal the dense call's."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    from dash_attn import _varlen
    monkeypatch.setattr(_varlen, "_runs_beat_packed", lambda *args: path == "runs")
    causal, short = mask == "causal", short_keys(mask, hdim)
    gen = torch.Generator(device="cuda").manual_seed(SEED + 3)
    lens = sorted({max(short, 64), short + 1, 200, 1100})
    seqs = [_seq(gen, n, 4, 2, hdim, dtype) for n in lens]
    orders = [list(range(len(lens))), list(reversed(range(len(lens)))), [len(lens) - 1]]
    ref = _varlen_grads(seqs, orders[0], causal)
    for order in orders[1:]:
        got = _varlen_grads(seqs, order, causal, 18)
        for i in order:
            for name, a, b in zip("qkv", got[i], ref[i]):
                assert torch.equal(a, b), f"d{name} of sequence {i} changed when packed as {order} ({path})"
    for i in range(len(lens)):
        dense = _grads(*seqs[i], causal, (-1, -1), 0.0)
        for name, a, b in zip("qkv", ref[i], (g[0] for g in dense)):
            assert torch.equal(a, b), f"d{name} of sequence {i} ({lens[i]} keys): varlen differs from dense"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_varlen_causal_runs_are_per_sequence(hdim, dtype):
    """schedule="shift_causal_runs" on causal packs: every sequence on its own geometry (csrc/schedule/seq_runs.h),
    so its bits do not depend on its neighbours, their order or sm_margin, and equal a dense call's of the sequence
    under the same schedule."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 2)
    shapes = [(333, 333), (1500, 1500), (64, 64), (777, 900), (1, 1), (400, 250)]
    seqs = [(_rand(gen, (1, sq, 4, hdim), dtype), _rand(gen, (1, sk, 2, hdim), dtype),
             _rand(gen, (1, sk, 2, hdim), dtype), _rand(gen, (1, sq, 4, hdim), dtype)) for sq, sk in shapes]
    ref = _varlen_grads(seqs, list(range(len(seqs))), True, schedule="shift_causal_runs")
    for order, margin in (([5, 4, 3, 2, 1, 0], 18), ([3, 0], 100), ([0, 3, 1], 54)):
        got = _varlen_grads(seqs, order, True, margin, schedule="shift_causal_runs")
        for i in order:
            for name, a, b in zip("qkv", got[i], ref[i]):
                assert torch.equal(a, b), f"d{name} of sequence {i} changed when packed as {order} (sm_margin {margin})"
    for i in (0, 3, 5):
        dense = _grads(*seqs[i], True, (-1, -1), 0.0, schedule="shift_causal_runs")
        for name, a, b in zip("qkv", ref[i], (g[0] for g in dense)):
            assert torch.equal(a, b), f"d{name} of sequence {i}: the varlen call differs from the dense call"


@pytest.mark.parametrize("schedule", ["descending", "ascending"])
@pytest.mark.parametrize("hdim", [64, 128])
def test_varlen_named_invariant_schedules_whatever_the_bands(hdim, schedule):
    """A named invariant schedule on a causal pack whose bands the longest sequences' batch cannot reach (diagonals 100,
    0 and 128): each sequence's bits equal its own call's, in any order (the per-run batched path runs it)."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 4)
    shapes = [(100, 200), (700, 700), (129, 257)]
    seqs = [(_rand(gen, (1, sq, 4, hdim), torch.bfloat16), _rand(gen, (1, sk, 2, hdim), torch.bfloat16),
             _rand(gen, (1, sk, 2, hdim), torch.bfloat16), _rand(gen, (1, sq, 4, hdim), torch.bfloat16))
            for sq, sk in shapes]
    alone = {i: _varlen_grads(seqs, [i], True, schedule=schedule)[i] for i in range(len(shapes))}
    for order in ([0, 1, 2], [2, 0, 1]):
        got = _varlen_grads(seqs, order, True, 18, schedule=schedule)
        for i in order:
            for name, a, b in zip("qkv", got[i], alone[i]):
                assert torch.equal(a, b), f"d{name} of sequence {i} packed as {order} differs from alone ({schedule})"


@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_full_mask_sequences_where_shift_runs_would_wait(hdim):
    """Full masks, seqlen_q well below seqlen_k: shift_runs runs descending there (ShiftRuns::waits_free), per sequence
    of a pack as in a dense call, so each sequence's bits equal its dense call's under shift_runs, named in both, and
    under `auto` in both, whatever the pack's order."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 5)
    # The first and third wrap (the last too at hdim 128 and 256); 4,500 keys are past
    # short_keys, where `auto` takes descending_lanes for the third.
    shapes = [(300, 2000), (1000, 1000), (600, 4500), (129, 257)]
    seqs = [(_rand(gen, (1, sq, 4, hdim), torch.bfloat16), _rand(gen, (1, sk, 2, hdim), torch.bfloat16),
             _rand(gen, (1, sk, 2, hdim), torch.bfloat16), _rand(gen, (1, sq, 4, hdim), torch.bfloat16))
            for sq, sk in shapes]
    for order, schedule in itertools.product(([0, 1, 2, 3], [3, 2, 1, 0]), ("shift_runs", "auto")):
        got = _varlen_grads(seqs, order, False, 18, schedule=schedule)
        for i in order:
            q, k, v, dout = seqs[i]
            dense = _grads(q, k, v, dout, False, (-1, -1), 0.0, schedule=schedule)
            for name, a, b in zip("qkv", got[i], dense):
                assert torch.equal(a, b[0]), \
                    f"d{name} of sequence {i} packed as {order} differs from its dense call ({schedule})"
    block_m, block_n = tile_shape(hdim)
    wraps = [_sched.resolve(_sched.SHIFT_RUNS, _sched.Problem(1, 4, 2, sq, sk, block_m, block_n, _sched.MASK_FULL))
             == _sched.DESCENDING for sq, sk in shapes]
    assert wraps[0] and not wraps[1] and wraps[2]
    for i in (i for i, w in enumerate(wraps) if w):
        q, k, v, dout = seqs[i]
        named, auto = (_grads(q, k, v, dout, False, (-1, -1), 0.0, schedule=s) for s in ("shift_runs", "auto"))
        assert all(torch.equal(a, b) for a, b in zip(named, auto)), f"sequence {i}: auto's bits differ"


@pytest.mark.parametrize("hdim", [64, 128])
def test_mostly_full_causal_sequences_dense_and_packed(hdim):
    """Mostly full causal bands (mostly_full_band, seqlen_q well below seqlen_k): deterministic `auto` runs descending's
    orders there, dense (descending_lanes, unpaired) and per sequence of a pack alike, so a sequence's bits equal its
    dense call's whatever the pack's order and sm_margin. Beside them bands under the key bound (short_keys) that are
    taller than wide (descending's orders) or wider but not mostly full (the runs'; 1024 x 4096 has exactly 3/4 of its
    KV tiles fully live, 384 x 2048 13/16: mostly full at hdim 64, not at hdim 128)."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 6)
    shapes = [(150, 1500), (700, 700), (600, 5000), (64, 4500), (500, 1000), (900, 700), (1024, 4096), (384, 2048)]
    block_m, block_n = tile_shape(hdim, "causal")
    assert [_sched.mostly_full_band(_sched.Problem(1, 4, 2, sq, sk, block_m, block_n, _sched.MASK_CAUSAL))
            for sq, sk in shapes] == [True, False, True, True, False, False, False, hdim == 64]
    seqs = [(_rand(gen, (1, sq, 4, hdim), torch.bfloat16), _rand(gen, (1, sk, 2, hdim), torch.bfloat16),
             _rand(gen, (1, sk, 2, hdim), torch.bfloat16), _rand(gen, (1, sq, 4, hdim), torch.bfloat16))
            for sq, sk in shapes]
    dense = [_grads(q, k, v, dout, True, (-1, -1), 0.0) for q, k, v, dout in seqs]
    for order, margin in (([0, 1, 2, 3, 4, 5, 6, 7], 0), ([5, 3, 7, 6, 2, 4, 1, 0], 18)):
        got = _varlen_grads(seqs, order, True, margin)
        for i in order:
            for name, a, b in zip("qkv", got[i], dense[i]):
                assert torch.equal(a, b[0]), f"d{name} of sequence {i} packed as {order} differs from its dense call"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_causal_bands_with_fully_live_tiles(hdim, dtype):
    """Causal bands with fewer queries than keys whose first KV tiles are fully live (their pairs are unequal, so a
    head's units do not stay in step): the same bits across sm_margin, batch position and packing, dense and varlen
    alike, for `auto` and the named shift_causal_runs."""
    if hdim not in supported_head_dims():
        pytest.skip(f"hdim {hdim} not built")
    gen = torch.Generator(device="cuda").manual_seed(SEED + 7)
    shapes = [(700, 1300), (1024, 3000), (333, 333)]
    seqs = [(_rand(gen, (1, sq, 4, hdim), dtype), _rand(gen, (1, sk, 2, hdim), dtype),
             _rand(gen, (1, sk, 2, hdim), dtype), _rand(gen, (1, sq, 4, hdim), dtype)) for sq, sk in shapes]
    for schedule in ("auto", "shift_causal_runs"):
        dense = [_grads(*s, True, (-1, -1), 0.0, schedule=schedule) for s in seqs]
        for i, s in enumerate(seqs[:2]):
            for margin in (18, 100):
                got = _grads(*s, True, (-1, -1), 0.0, sm_margin=margin, schedule=schedule)
                assert all(torch.equal(a, b) for a, b in zip(got, dense[i])), \
                    f"{schedule} {shapes[i]} sm_margin {margin}"
            other = [_rand(gen, t.shape, dtype) for t in s]
            for pos in (0, 2):
                parts = [other, other]
                parts.insert(pos, s)
                got = _grads(*(torch.cat([p[j] for p in parts]) for j in range(4)), True, (-1, -1), 0.0,
                             schedule=schedule)
                assert all(torch.equal(a[pos:pos + 1], b) for a, b in zip(got, dense[i])), \
                    f"{schedule} {shapes[i]} at {pos} of 3"
        for order in ([0, 1, 2], [2, 1, 0]):
            got = _varlen_grads(seqs, order, True, 54, schedule=schedule)
            for i in order:
                assert all(torch.equal(a, b[0]) for a, b in zip(got[i], dense[i])), \
                    f"{schedule} {shapes[i]} packed as {order} differs from its dense call"
