"""GPU: eager calls skip the registered ops' dispatch but run the same bodies (marker `gpu`).

dash_attn/interface.py sends plain eager calls on CUDA tensors through an autograd.Function and everything else
(torch.compile, dispatch modes, torch.func, CPU tensors) through the registered custom ops. Both must give bitwise the
same outputs and gradients, and the ops must still be what a dispatch mode sees.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dash_attn
import dash_attn.interface as interface
from api_common import patch_interface
from gpu_common import main_head_dim

pytestmark = pytest.mark.gpu


def _inputs(varlen):
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (300, 4, main_head_dim()) if varlen else (2, 150, 4, main_head_dim())
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]


def _step(varlen, eager, q, k, v, dout, causal):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    cu = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not eager:
            patch_interface(monkeypatch, "_eager_cuda", lambda *tensors: False)
        if varlen:
            out = dash_attn.flash_attn_varlen_func(*leaves, cu, cu, 199, 199, causal=causal, deterministic=True)
        else:
            out = dash_attn.flash_attn_func(*leaves, causal=causal, deterministic=True)
        out.backward(dout)
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_eager_path_matches_the_registered_ops_bitwise(varlen, causal):
    q, k, v, dout = _inputs(varlen)
    assert interface._eager_cuda(q, k, v)
    for a, b in zip(_step(varlen, True, q, k, v, dout, causal), _step(varlen, False, q, k, v, dout, causal)):
        assert torch.equal(a, b)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_still_see_the_registered_op():
    q, k, v, _ = _inputs(False)
    with _Recorder() as recorder:
        assert not interface._eager_cuda(q, k, v)
        dash_attn.flash_attn_func(q, k, v)
    assert any("dash_attn.fwd" in name for name in recorder.names)
