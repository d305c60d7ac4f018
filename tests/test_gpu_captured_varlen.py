"""GPU varlen calls captured in a CUDA graph (marker `gpu`).

Inside a capture flash_attn_varlen_func cannot read cu_seqlens on the host: it runs the packed-sequence kernels with
the caller's max_seqlen bounds and checks cu_seqlens on the GPU, turning every result into NaN when they are invalid
(dash_attn/device_seqlens.py). A captured forward + backward must then give, at every replay, the results of the
lengths cu_seqlens holds at that replay (other arrangements, a longest sequence below the bound), bitwise the eager
call's where the plan is the same, identical across replays (deterministic), NaN for invalid values without touching
memory outside its tensors (the kernels clamp every sequence to the packed rows), and finite again once the values
are valid. The check and the poisoning run in two kernels of the extension, held here to the torch-op rule of
dash_attn/device_seqlens.py.
"""
import random

import pytest
import torch

import dash_attn
from dash_attn import device_seqlens, interface
from dash_attn.reference import attention_bwd_ref_varlen, attention_ref_varlen
from api_common import patch_interface
from captured_varlen_cases import BOUND, INVALID, LENGTHS, NHEADS, NHEADS_K, TOTAL
from gpu_common import assert_grads_within, assert_out_lse_within, capture, main_head_dim, supported_head_dims

pytestmark = pytest.mark.gpu


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _inputs(seed, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((TOTAL, NHEADS, main_head_dim()), (TOTAL, NHEADS_K, main_head_dim()),
              (TOTAL, NHEADS_K, main_head_dim()), (TOTAL, NHEADS, main_head_dim()))
    return [torch.randn(s, generator=gen, device="cuda", dtype=dtype) for s in shapes]


class CapturedStep:
    """Forward + backward of one varlen call (q and k share cu_seqlens) captured on static tensors."""

    def __init__(self, causal, deterministic):
        q, k, v, dout = _inputs(0)
        self.leaves = [t.requires_grad_() for t in (q, k, v)]
        self.dout = dout
        self.cu = _cu(LENGTHS["captured"])
        self.causal, self.deterministic = causal, deterministic
        self.graph, self.results = capture(self._step, warmups=2)

    def _step(self):
        out, lse = dash_attn.flash_attn_varlen_func(*self.leaves, self.cu, self.cu, BOUND, BOUND, causal=self.causal,
                                                    deterministic=self.deterministic, return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, self.leaves, self.dout)

    def replay(self, cu, inputs):
        with torch.no_grad():
            self.cu.copy_(cu)
            for dst, src in zip(self.leaves + [self.dout], inputs):
                dst.copy_(src)
        self.graph.replay()
        torch.cuda.synchronize()
        return [t.clone() for t in self.results]


def _eager(cu, inputs, causal, deterministic):
    q, k, v, dout = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lens = (cu[1:] - cu[:-1]).tolist()
    out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu, cu, max(lens), max(lens), causal=causal,
                                                deterministic=deterministic, return_attn_probs=True)
    return [out, lse] + list(torch.autograd.grad(out, leaves, dout))


def _assert_matches_reference(results, cu, inputs, causal):
    q, k, v, dout = (t.float() for t in inputs)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu, cu, causal=causal, return_lse=True)
    ref_grads = attention_bwd_ref_varlen(dout, q, k, v, ref_out, ref_lse, cu, cu, causal=causal)
    leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    base_out = attention_ref_varlen(*leaves, cu, cu, causal=causal, upcast=False)
    base_grads = torch.autograd.grad(base_out, leaves, inputs[3])
    assert_out_lse_within(results[0], results[1], ref_out, ref_lse, base_out, inputs[0].dtype)
    assert_grads_within(results[2:], ref_grads, base_grads, inputs[0].dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "nondet"])
def test_replays_follow_the_lengths_cu_seqlens_holds(causal, deterministic):
    step = CapturedStep(causal, deterministic)
    for seed, name in enumerate(LENGTHS, start=1):
        cu, inputs = _cu(LENGTHS[name]), _inputs(seed)
        results = step.replay(cu, inputs)
        _assert_matches_reference(results, cu, inputs, causal)
        if name != "shorter":  # the eager call plans for the longest sequence, here the captured bound too
            eager = _eager(cu, inputs, causal, deterministic)
            for label, c, e in zip(("out", "lse", "dq", "dk", "dv"), results, eager):
                if deterministic or label in ("out", "lse"):
                    assert torch.equal(c, e), f"{name}: {label} of the replayed graph differs from eager"
        if deterministic:
            again = step.replay(cu, inputs)
            assert all(torch.equal(a, b) for a, b in zip(results, again)), f"{name}: replays differ"


def _invalid(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_invalid_cu_seqlens_turn_every_result_to_nan_and_the_graph_recovers(causal):
    step = CapturedStep(causal, True)
    inputs = _inputs(7)
    for name, values in INVALID.items():
        results = step.replay(_invalid(values), inputs)
        assert all(r.isnan().all() for r in results), f"{name}: a result is not NaN"
    cu = _cu(LENGTHS["reordered"])
    _assert_matches_reference(step.replay(cu, inputs), cu, inputs, causal)


@pytest.mark.parametrize("headdim", [96, 100])
def test_capture_runs_other_head_dims_on_padded_copies(headdim):
    # The packed kernels take a kernel's own head dim: 96 (and 100, padded to 104 by the public function) run on
    # copies zero-padded to the next kernel's inside the captured graph, which replays them with the inputs.
    if headdim > max(supported_head_dims()):
        pytest.skip(f"no kernel holds head dim {headdim}")
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, dout = (torch.randn(100, 4, headdim, generator=gen, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    cu = _cu((60, 40))

    def step():
        out, lse = dash_attn.flash_attn_varlen_func(*leaves, cu, cu, 60, 60, causal=True, deterministic=True,
                                                    return_attn_probs=True)
        return (out, lse) + torch.autograd.grad(out, leaves, dout)

    graph, results = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches_reference([t.clone() for t in results], cu, [q.detach(), k.detach(), v.detach(), dout], True)


def _random_case(rng):
    batch = rng.randint(0, 6)
    lens_q = [rng.randint(0, 40) for _ in range(batch)]
    lens_k = list(lens_q) if rng.random() < 0.5 else [rng.randint(0, 40) for _ in range(batch)]
    cus = [[0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist() for lens in (lens_q, lens_k)]
    totals = [cu[-1] for cu in cus]
    bounds = [max(lens, default=0) + rng.choice((0, 0, 0, 3, -1)) for lens in (lens_q, lens_k)]
    for cu in cus:  # corrupt an entry now and then: start, order, end, int32 extremes
        if rng.random() < 0.3:
            cu[rng.randrange(len(cu))] += rng.choice((-5, -1, 1, 7, 2 ** 31 - 1 - cu[-1], -2 ** 31 + 1))
    band = rng.choice((None, (-1, 0), (5, 0), (3, 2), (-1, 3)))
    return cus, totals, [max(b, 0) for b in bounds], band


def test_the_gpu_check_follows_the_reference_rule():
    ext, rng, verdicts = interface._extension(), random.Random(11), []
    for _ in range(400):
        (cu_q, cu_k), (total_q, total_k), (max_q, max_k), band = _random_case(rng)
        cpu = [torch.tensor(cu, dtype=torch.int32) for cu in (cu_q, cu_k)]
        expected = bool(device_seqlens.seqlens_ok(*cpu, None, None, total_q, total_k, max_q, max_k, band))
        left, right = band if band is not None else (-1, -1)
        ok = ext.packed_seqlens_ok(*(t.cuda() for t in cpu), None, None, total_q, total_k, max_q, max_k, left >= 0,
                                   right >= 0)
        assert bool(ok.item()) == expected, (cu_q, cu_k, total_q, total_k, max_q, max_k, band)
        verdicts.append(expected)
    assert 50 < sum(verdicts) < 350, "the random cases must mix valid and invalid cu_seqlens"


@pytest.mark.parametrize("flag", [0, 1], ids=["invalid", "valid"])
def test_poisoning_covers_every_element_of_every_dtype(flag):
    ext = interface._extension()
    results = [torch.randn(37, 3, 64, device="cuda", dtype=dtype) for dtype in (torch.bfloat16, torch.float16)]
    results += [torch.randn(5, 129, device="cuda"), torch.randn(8, 16, 33, device="cuda").permute(2, 0, 1)]
    before = [r.clone() for r in results]
    ext.poison_unless_ok(torch.tensor(flag, dtype=torch.int32, device="cuda"), results)
    for r, b in zip(results, before):
        assert r.isnan().all() if flag == 0 else torch.equal(r, b)


def test_torch_compile_with_cuda_graphs_runs_the_captured_path(monkeypatch):
    # mode="reduce-overhead" records the compiled step in a CUDA graph (cudagraph trees) and replays it with the
    # inputs of each call copied in: the varlen op must take the captured path there, and each call's lengths.
    captured = []
    for name in ("_varlen_fwd_unplanned", "_varlen_bwd_unplanned"):
        original = getattr(interface, name)
        patch_interface(monkeypatch, name,
                        lambda *a, _f=original, _n=name, **kw: captured.append(_n) or _f(*a, **kw))
    torch._dynamo.reset()

    def forward(q, k, v, cu):
        return dash_attn.flash_attn_varlen_func(q, k, v, cu, cu, BOUND, BOUND, causal=True, deterministic=True,
                                                return_attn_probs=True)

    compiled = torch.compile(forward, mode="reduce-overhead")
    for seed, name in enumerate(["captured", "captured", "reordered", "shorter", "captured"], start=20):
        cu, inputs = _cu(LENGTHS[name]), _inputs(seed)
        leaves = [t.detach().clone().requires_grad_() for t in inputs[:3]]
        out, lse = compiled(*leaves, cu)
        out.backward(inputs[3])
        torch.cuda.synchronize()
        _assert_matches_reference([out.detach().clone(), lse.clone()] + [t.grad for t in leaves], cu, inputs, True)
    assert "_varlen_fwd_unplanned" in captured and "_varlen_bwd_unplanned" in captured
    torch._dynamo.reset()
