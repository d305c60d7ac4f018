"""Inputs and the recording stand-in extension shared by the CPU-side API tests (test_api.py,
test_api_cuda_path.py, test_api_unplanned_varlen.py) and their launch arguments (op_args); patch_interface, which
the GPU tests use too."""
import sys
import types

import torch


def qkv(batch=2, seqlen_q=9, seqlen_k=9, nheads=4, nheads_k=2, headdim=16, dtype=torch.float32, seed=0,
         requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen_q, nheads, headdim), (batch, seqlen_k, nheads_k, headdim),
              (batch, seqlen_k, nheads_k, headdim)]
    return tuple(torch.randn(s, generator=gen).to(dtype).requires_grad_(requires_grad) for s in shapes)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def varlen_inputs(lens_q=(3, 0, 6), lens_k=(4, 2, 5), nheads=4, nheads_k=2, headdim=8, dtype=torch.float64,
                   requires_grad=False):
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), nheads, headdim, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    k = torch.randn(sum(lens_k), nheads_k, headdim, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    v = torch.randn(sum(lens_k), nheads_k, headdim, generator=gen, dtype=dtype).requires_grad_(requires_grad)
    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k)


def op_args(mask=0, window=(-1, -1), softcap=0.0, deterministic=True, schedule="shift", sm_margin=0,
            softmax_scale=0.125):
    """The launch helpers' scalar arguments (interface.OpArgs), each field by name."""
    from dash_attn import interface

    return interface.OpArgs(softmax_scale=softmax_scale, mask=mask, window_left=window[0], window_right=window[1],
                            softcap=softcap, deterministic=deterministic, schedule=schedule, sm_margin=sm_margin)


def patch_interface(monkeypatch, name, replacement):
    """Replaces dash_attn.interface's `name` (re-exported from the module that holds it: _ext, _launch, _varlen, _ops)
    in every dash_attn module that binds the same object, under any name, so that every caller sees `replacement`."""
    from dash_attn import interface

    original = getattr(interface, name)
    patched = 0
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "dash_attn" or module_name.startswith("dash_attn.")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                monkeypatch.setattr(module, attr, replacement)
                patched += 1
    assert patched > 1, f"interface.{name} is bound nowhere else"


class FakeExtension(types.SimpleNamespace):
    def __init__(self, softcap=True, packed=True):
        super().__init__(calls=[], softcap=softcap, packed=packed)

    def packed_built(self):
        return self.packed

    def varlen_fwd(self, *args):
        self.calls.append(("varlen_fwd", args))

    def varlen_bwd(self, *args):
        self.calls.append(("varlen_bwd", args))

    def supported_head_dims(self):
        return [64, 128]

    def softcap_built(self):
        return self.softcap

    def supported_dtypes(self):
        return ["fp16", "bf16"]

    def bwd_tile_shape(self, headdim, mask):
        return (64, 128)

    def num_sms(self, index):
        return 132

    def fwd(self, *args):
        self.calls.append(("fwd", args))

    def bwd(self, *args):
        self.calls.append(("bwd", args))

    def sum_kv_heads(self, ins, outs, copies):
        """The GPU's one-pass KV-head sum: declined here, so the torch ops (the same bits) run."""
        self.calls.append(("sum_kv_heads", (ins, outs, copies)))
        return False
