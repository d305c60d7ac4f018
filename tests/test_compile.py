"""torch.compile(fullgraph=True) traces the custom ops without graph breaks, and the ops pass torch.library.opcheck."""
import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.testing import CompileCounterWithBackend

import dash_attn
from dash_attn import interface


class _AttentionBlock(torch.nn.Module):
    """A minimal self-attention layer: projections around dash_attn.flash_attn_func."""

    def __init__(self, dim=64, nheads=4, nheads_k=2, causal=True):
        super().__init__()
        self.nheads, self.nheads_k, self.headdim, self.causal = nheads, nheads_k, dim // nheads, causal
        self.q_proj = torch.nn.Linear(dim, dim)
        self.kv_proj = torch.nn.Linear(dim, 2 * nheads_k * self.headdim)
        self.out_proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.nheads, self.headdim)
        k, v = self.kv_proj(x).view(batch, seqlen, 2, self.nheads_k, self.headdim).unbind(2)
        out = dash_attn.flash_attn_func(q, k, v, causal=self.causal)
        return self.out_proj(out.reshape(batch, seqlen, -1))


def _reset():
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_module_compiles_fullgraph_and_matches_eager(backend):
    _reset()
    torch.manual_seed(0)
    model = _AttentionBlock()
    x = torch.randn(2, 12, 64, requires_grad=True)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)

    out = compiled(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad for p in model.parameters()] + [x.grad]

    assert counter.frame_count == 1, "one frame means no graph break"
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_graph_contains_the_custom_ops_with_traced_arguments():
    _reset()
    captured = []

    def backend(gm, example_inputs):
        captured.extend(n for n in gm.graph.nodes if n.op == "call_function" and "dash_attn" in str(n.target))
        return gm.forward

    def fn(q, k, v):
        return dash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True, schedule="shift", sm_margin=4)

    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
    assert len(captured) == 1
    assert captured[0].args[3:] == (0.25, 1, -1, 0, 0.0, True, "shift", 4)


def test_deterministic_none_is_guarded_under_compile():
    _reset()
    flags = []

    def backend(gm, example_inputs):
        flags.extend(n.args[8] for n in gm.graph.nodes if "dash_attn" in str(n.target))
        return gm.forward

    fn = torch.compile(lambda q, k, v: dash_attn.flash_attn_func(q, k, v), backend=backend, fullgraph=True)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        fn(q, k, v)
        torch.use_deterministic_algorithms(True)
        fn(q, k, v)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert flags == [False, True], "toggling the global flag must recompile with the new value"


def test_dynamic_shapes_compile():
    _reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    fn = torch.compile(lambda q, k, v: dash_attn.flash_attn_func(q, k, v, causal=True), backend=backend,
                       fullgraph=True, dynamic=True)
    graphs_after_first_call = None
    for seqlen in (8, 13, 21):
        q, k, v = (torch.randn(2, seqlen, 2, 16, requires_grad=True) for _ in range(3))
        out = fn(q, k, v)
        out.sum().backward()
        torch.testing.assert_close(out, dash_attn.flash_attn_func(q, k, v, causal=True))
        graphs_after_first_call = graphs_after_first_call or len(graphs)
    # Dynamo may restart the first trace once to specialise a float argument; after that no length recompiles.
    assert len(graphs) == graphs_after_first_call


def test_varlen_compiles_fullgraph():
    _reset()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    q, k, v = (torch.randn(10, 2, 16, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return dash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True)

    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(fn, backend=counter, fullgraph=True)(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, fn(q, k, v))
    assert counter.frame_count == 1


def _dense_args(requires_grad=True):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 4, 8, generator=gen, requires_grad=requires_grad)
    k = torch.randn(1, 5, 2, 8, generator=gen, requires_grad=requires_grad)
    v = torch.randn(1, 5, 2, 8, generator=gen, requires_grad=requires_grad)
    return q, k, v


def test_opcheck_fwd():
    q, k, v = _dense_args()
    torch.library.opcheck(interface._fwd, (q, k, v, 0.3, 1, -1, 0, 0.0, True, "auto", 0))


def test_opcheck_bwd():
    q, k, v = _dense_args(requires_grad=False)
    out, lse = interface._fwd(q, k, v, 0.3, 0, -1, -1, 0.0, True, "auto", 0)
    torch.library.opcheck(interface._bwd, (torch.randn_like(out), q, k, v, out, lse, 0.3, 0, -1, -1, 0.0, True,
                                           "descending", 0))


def test_opcheck_varlen():
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    q, k, v = (torch.randn(6, 2, 8, requires_grad=True) for _ in range(3))
    used = torch.tensor([2, 3], dtype=torch.int32)
    for seqused in ((None, None), (used, None), (used, used)):
        args = (cu, cu) + seqused + (4, 4, 0.3, 1, -1, 0, 0.0, False, "auto", 0)
        torch.library.opcheck(interface._varlen_fwd, (q, k, v) + args)
        out, lse = interface._varlen_fwd(q.detach(), k.detach(), v.detach(), *args)
        torch.library.opcheck(interface._varlen_bwd, (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out,
                                                      lse) + args)
