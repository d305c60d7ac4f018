"""The one-pass KV-head sum of a backward run on KV-head copies (csrc/common/kv_head_sum.h, marker `gpu`): bitwise
equal to dash_attn._kv_heads.sum_groups in torch ops, for every copy count it takes, both dtypes, dense and strided
outputs, dK and dV of different head dims in one launch; calls it does not take are declined without a launch."""
import pytest
import torch

from dash_attn import _kv_heads, interface
from gpu_common import main_head_dim

pytestmark = pytest.mark.gpu


def shares(shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # Shares of mixed magnitude, so that the order of the adds shows in the bits.
    x = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32)
    return (x * torch.exp2(torch.randint(-8, 9, shape, generator=gen, device="cuda").float())).to(dtype)


def torch_sum(x, heads_k):
    out = x.new_empty(*x.shape[:-2], heads_k, x.shape[-1])
    _kv_heads.sum_groups(_kv_heads._in_sum_dtype(x.unsqueeze(0)), out)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copies", [2, 3, 7, 8, 16, 24, 64])
def test_kernel_sum_equals_sum_groups(dtype, copies):
    ext = interface._extension()
    heads_k = 2
    dk_x = shares((3, 37, heads_k * copies, 128), dtype, copies)
    dv_x = shares((3, 37, heads_k * copies, 64), dtype, copies + 1)
    dk = torch.full((3, 37, heads_k, 128), float("nan"), device="cuda", dtype=dtype)
    dv = torch.full((3, 37, heads_k, 64), float("nan"), device="cuda", dtype=dtype)
    assert ext.sum_kv_heads([dk_x, dv_x], [dk, dv], copies)
    assert torch.equal(dk, torch_sum(dk_x, heads_k)) and torch.equal(dv, torch_sum(dv_x, heads_k))


def test_kernel_sum_keeps_subnormals():
    """bfloat16 shares in float32's subnormal range: added as torch adds them (the package's fast-math flush would
    zero them)."""
    ext = interface._extension()
    dk_x = (shares((64, 8, 128), torch.float32, 4) * 2.0 ** -132).to(torch.bfloat16)
    assert (dk_x != 0).float().mean() > 0.3 and ((dk_x != 0) & (dk_x.abs() < 2.0 ** -126)).any()
    dk = torch.full((64, 1, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert ext.sum_kv_heads([dk_x], [dk], 8)
    assert torch.equal(dk, torch_sum(dk_x, 1)) and (dk != 0).any()


def test_kernel_sum_into_strided_outputs():
    """Outputs that are views of wider tensors (a packed KV layout, varlen rows): written in place, nothing else."""
    ext = interface._extension()
    copies = 8
    dk_x = shares((50, copies, 64), torch.bfloat16, 1)
    packed = torch.full((50, 2, 1, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    dk = packed[:, 0]
    assert ext.sum_kv_heads([dk_x], [dk], copies)
    assert torch.equal(dk, torch_sum(dk_x, 1)) and packed[:, 1].isnan().all()


def test_kernel_declines_what_it_does_not_take():
    ext = interface._extension()
    odd_dim = shares((4, 8, 7), torch.bfloat16, 2)
    assert not ext.sum_kv_heads([odd_dim], [odd_dim.new_empty(4, 1, 7)], 8)
    group_without_kernel = shares((4, 17, 64), torch.bfloat16, 3)
    assert not ext.sum_kv_heads([group_without_kernel], [group_without_kernel.new_empty(4, 1, 64)], 17)
    with pytest.raises(ValueError, match="sum_kv_heads"):
        ext.sum_kv_heads([odd_dim], [odd_dim.new_empty(4, 2, 7)], 8)


def test_sum_kv_falls_back_with_the_same_bits():
    """A copy count without a kernel takes the torch ops: the same function of the shares."""
    ext = interface._extension()
    for copies in (8, 17):
        dk_x, dv_x = shares((5, 3 * copies, 64), torch.float16, copies), shares((5, 3 * copies, 64), torch.float16, 9)
        dk, dv = dk_x.new_empty(5, 3, 64), dv_x.new_empty(5, 3, 64)
        _kv_heads.sum_kv(ext, dk_x, dv_x, dk, dv)
        assert torch.equal(dk, torch_sum(dk_x, 3)) and torch.equal(dv, torch_sum(dv_x, 3))


@pytest.mark.parametrize("copies", [2, 4])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_on_partial_copies(monkeypatch, copies, causal):
    """GQA 8:2 run on `copies` copies of each KV head (kv_copies patched): dQ, dK, dV within the reference's
    tolerance, and the same bits twice."""
    monkeypatch.setattr(_kv_heads, "kv_copies", lambda nheads, nheads_k, causal: copies)
    check_copies_backward(8, causal)


@pytest.mark.parametrize("nheads", [12, 16], ids=["group6", "group8"])
def test_backward_on_causal_copies_by_rule(nheads):
    """Causal GQA whose group kv_copies splits (3 and 4 copies of 2 query heads; the rule as shipped, not patched):
    dQ, dK, dV within the reference's tolerance, and the same bits twice."""
    assert _kv_heads.kv_copies(nheads, 2, True) == nheads // 4
    check_copies_backward(nheads, True)


def check_copies_backward(nheads, causal):
    """nheads query heads on 2 KV heads, deterministic `auto`: dQ, dK, dV within the reference's tolerance, and the
    same bits twice."""
    from test_gpu_backward import check_backward, kernel_grads, make_inputs
    check_backward(2, 257, 513, nheads, 2, main_head_dim(), torch.bfloat16, causal, "auto", True)
    q, k, v, dout = make_inputs(2, 257, 513, nheads, 2, main_head_dim(), torch.bfloat16)
    first, second = (kernel_grads(q, k, v, dout, causal, "auto", True) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
