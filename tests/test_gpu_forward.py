"""GPU forward: O and LSE of the sm90 kernels against the float32 reference (marker `gpu`, H200 only).

Tolerance scheme (shared by the backward tests): a quantity passes when its max abs error against the float32
reference is at most max(2 x the error of a plain PyTorch implementation in the input dtype, a small floor). The
floor is twice the rounding error of the reference into the output dtype plus a tiny absolute term, so a kernel is
never asked to be more exact than storing the exact answer in fp16/bf16.
"""
import os

import pytest
import torch

import dash_attn
from gpu_common import exact_float32_matmul, supported_head_dims, tolerance, assert_within, poison_allocator  # noqa: F401 (fixture imported by name)
from dash_attn.reference import attention_ref
from dash_attn.validation import MIN_SOFTMAX_SCALE

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
SEED = int(os.environ.get("DASH_TEST_SEED", "0"))


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed=SEED, requires_grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim)]
    return tuple(torch.randn(s, generator=gen, device="cuda", dtype=dtype).requires_grad_(requires_grad)
                 for s in shapes)


def finite_lse_rows_match(lse, ref_lse):
    """Rows that see no key must give lse = -inf exactly (the API's documented value); the others must be finite."""
    masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), masked), "lse must be -inf exactly on the rows that see no key"
    assert torch.isfinite(lse[~masked]).all(), "lse must be finite on every row that sees a key"


def check_forward(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, causal, poison=False, seed=SEED,
                  window=(-1, -1), qkv=None):
    q, k, v = qkv if qkv is not None else make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, headdim, dtype, seed)
    if poison:
        poison_allocator()
    out, lse = dash_attn.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32

    ref_out, ref_lse = attention_ref(q.float(), k.float(), v.float(), causal=causal, window_size=window,
                                     return_lse=True)
    base_out, base_lse = attention_ref(q, k, v, causal=causal, window_size=window, upcast=False, return_lse=True)
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten or overflowed elements)"
    assert_within("out", out, ref_out, tolerance(base_out, ref_out, dtype))

    finite_lse_rows_match(lse, ref_lse)
    seen = torch.isfinite(ref_lse)
    base_lse = torch.where(seen, base_lse.float(), ref_lse)
    lse_tol = tolerance(base_lse[seen], ref_lse[seen], torch.float32, abs_floor=1e-3)
    assert_within("lse", lse[seen], ref_lse[seen], lse_tol)
    if not seen.all():
        rows = ~seen.transpose(1, 2)  # (batch, seqlen_q, nheads)
        assert torch.all(out[rows] == 0), "rows that see no key must output 0"


# Odd lengths around the tile sizes, seqlen_q == seqlen_k and both ways unequal (bottom-right causal).
SEQLENS = [(1, 1), (17, 17), (113, 113), (1023, 1023), (4097, 4097), (113, 1023), (1023, 113), (1, 4097),
           (4097, 17)]


def _batch_heads(seqlen_q, seqlen_k):
    # Keep the float32 reference (batch x heads x seqlen_q x seqlen_k scores) small for the long cases.
    return (1, 2) if max(seqlen_q, seqlen_k) > 2048 else (2, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_odd_shapes(seqlen_q, seqlen_k, causal, dtype, headdim):
    batch, nheads = _batch_heads(seqlen_q, seqlen_k)
    check_forward(batch, seqlen_q, seqlen_k, nheads, nheads, headdim, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 113), (257, 1023), (1023, 257)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_gqa(group, seqlen_q, seqlen_k, causal, dtype, headdim):
    check_forward(2, seqlen_q, seqlen_k, 8, 8 // group, headdim, dtype, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 17), (1023, 113), (113, 1023), (4097, 4097)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_poisoned_outputs(seqlen_q, seqlen_k, causal, headdim):
    batch, nheads = _batch_heads(seqlen_q, seqlen_k)
    check_forward(batch, seqlen_q, seqlen_k, nheads, nheads // 2, headdim, torch.bfloat16, causal, poison=True)


# A CTA runs several query tiles in turn, and on a causal band with more queries than keys the first tiles of each head
# see no key: the producer loads nothing for them and the consumers write their zeros from registers, between tiles
# whose K/V were loaded (and, at hdim 256, whose O is staged in the V ring: fwd_epilogue.h). 2300 queries against 700
# keys leave 12 of a head's 18 tiles of 128 rows (8 of 12 of 192 rows) without keys; 2 x 24 heads deal 4-7 tiles to
# each of 132 CTAs.
@pytest.mark.gpu
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_tiles_without_keys_among_loaded_ones(headdim):
    check_forward(2, 2300, 700, 24, 24, headdim, torch.bfloat16, True, poison=True)


# The causal tile order's phases (csrc/fwd/fwd_tile_scheduler.h) appear with two or more waves of tile pairs: pairs,
# the middle tiles of an odd tile count run in the tail, and the tail heads. (seqlen, batch, heads) per kernel head
# dim, 132 SMs: hdim 64 (192-row tiles) 2048 keys = 11 tiles and 4096 = 22; hdim 128 and 256 (128-row tiles)
# 1100 = 9 tiles. tests/test_fwd_tile_order.py proves the order itself on the CPU.
TILE_ORDER_SHAPES = {64: [(2048, 2, 32), (4096, 1, 32)], 128: [(1100, 3, 24)], 256: [(1100, 3, 24)]}


@pytest.mark.gpu
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_causal_tile_order_phases(headdim):
    for seqlen, batch, nheads in TILE_ORDER_SHAPES[headdim]:
        check_forward(batch, seqlen, seqlen, nheads, nheads, headdim, torch.bfloat16, True, poison=True)


# Each query row gets one key aligned with it (a score between 2 and 14 against a typical row max of 3) at a random
# position it may see, so rows raise their running max in different key tiles, late ones included, by less and by
# more than the softmax lets a max go stale: the forward skips the O rescale only in steps where no row of a warp
# moved its max (csrc/fwd/fwd_mainloop.h, OnlineSoftmax::max_moved), and a skip that should not happen shows as an O
# scaled by the wrong factor.
@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1023, 1023), (300, 2500)], ids=["1023x1023", "300x2500"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_row_max_in_any_key_tile(seqlen_q, seqlen_k, causal, dtype, headdim):
    batch, nheads = 1, 2
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads, headdim, dtype)
    gen = torch.Generator(device="cuda").manual_seed(SEED + 1)
    rows = torch.arange(seqlen_q, device="cuda")
    last_key = rows + (seqlen_k - seqlen_q) if causal else torch.full_like(rows, seqlen_k - 1)
    keep = last_key >= 0
    rows, last_key = rows[keep], last_key[keep]
    pos = (torch.rand(rows.numel(), generator=gen, device="cuda") * (last_key + 1)).long()
    for h in range(nheads):
        direction = q[0, rows, h].float()
        score = 2.0 + 12.0 * torch.rand(rows.numel(), 1, generator=gen, device="cuda")
        k[0, pos, h] = (score * direction / direction.norm(dim=-1, keepdim=True)).to(dtype)
    check_forward(batch, seqlen_q, seqlen_k, nheads, nheads, headdim, dtype, causal, poison=True, qkv=(q, k, v))


# (left, right) around the bottom-right diagonal; (5, 3) is narrower than a tile, (0, 0) shows one key per row.
WINDOWS = [(64, 64), (100, 0), (-1, 40), (300, -1), (5, 3), (0, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(113, 257), (257, 113), (1023, 1023)],
                         ids=["113x257", "257x113", "1023x1023"])
@pytest.mark.parametrize("window", WINDOWS, ids=[f"w{a}_{b}" for a, b in WINDOWS])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("headdim", supported_head_dims())
def test_forward_sliding_window(seqlen_q, seqlen_k, window, dtype, headdim):
    check_forward(2, seqlen_q, seqlen_k, 4, 2, headdim, dtype, False, window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_bitwise_reproducible(causal):
    headdim = supported_head_dims()[-1]
    q, k, v = make_qkv(2, 1023, 1023, 8, 2, headdim, torch.bfloat16)
    out0, lse0 = dash_attn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    for _ in range(20):
        out, lse = dash_attn.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)


@pytest.mark.gpu
def test_forward_strided_inputs():
    """q/k/v as views of one packed qkv tensor (row stride != nheads * headdim) must work like contiguous ones."""
    headdim = supported_head_dims()[0]
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    qkv = torch.randn(2, 113, 3, 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    out = dash_attn.flash_attn_func(q, k, v, causal=True)
    expected = dash_attn.flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, expected)


# Causal head dim 64 calls of up to 1024 query rows run 128-row tiles (FwdTileConfig<64, kShort>), longer ones 192-row
# tiles. A row's out and lse must not depend on the tile it is in, so that calls whose bounds pick different tiles (a
# sequence alone and packed beside a longer one) agree bitwise: the first 1024 rows of a causal 1100 x 1100 call see
# the keys of the 1024 x 1024 call of those rows.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_rows_do_not_depend_on_the_query_tile(dtype):
    if 64 not in supported_head_dims():
        pytest.skip("head dim 64 not built")
    q, k, v = make_qkv(2, 1100, 1100, 4, 2, 64, dtype)
    out, lse = dash_attn.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    short_out, short_lse = dash_attn.flash_attn_func(q[:, :1024], k[:, :1024], v[:, :1024], causal=True,
                                                     return_attn_probs=True)
    assert torch.equal(out[:, :1024], short_out)
    assert torch.equal(lse[..., :1024], short_lse)


# Scale 0 (uniform attention over the visible keys) at several key tiles, the last one ragged: it runs as zero queries
# at scale 1 (api._scoreless_queries). The smallest positive scale taken (validation.MIN_SOFTMAX_SCALE) runs as is.
@pytest.mark.gpu
@pytest.mark.parametrize("seqlen, scale", [(113, 0.05), (300, 0.05), (300, 0.0), (300, MIN_SOFTMAX_SCALE)])
def test_forward_softmax_scale(seqlen, scale):
    headdim = supported_head_dims()[0]
    q, k, v = make_qkv(2, seqlen, seqlen, 4, 4, headdim, torch.bfloat16)
    out = dash_attn.flash_attn_func(q, k, v, softmax_scale=scale)
    ref = attention_ref(q.float(), k.float(), v.float(), softmax_scale=scale)
    base = attention_ref(q, k, v, softmax_scale=scale, upcast=False)
    assert_within("out", out, ref, tolerance(base, ref, torch.bfloat16))


@pytest.mark.gpu
def test_unsupported_features_are_refused_on_cuda():
    headdim = supported_head_dims()[0]
    q, k, v = make_qkv(1, 64, 64, 2, 2, headdim, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        dash_attn.flash_attn_func(q.float(), k.float(), v.float())
    # Head dims between compiled ones run padded (test_gpu_padded_head_dims.py), as do those that are not multiples of
    # 8 (test_gpu_unaligned_head_dims.py); these are outside 1..256.
    for unsupported in (0, 264):
        q, k, v = make_qkv(1, 64, 64, 2, 2, unsupported, torch.bfloat16)
        with pytest.raises(ValueError, match=f"head dim {unsupported}"):
            dash_attn.flash_attn_func(q, k, v)
