"""Helpers shared by the GPU test modules (tolerances, poisoning, what the extension was built with).

The tolerance scheme is described in test_gpu_forward.py's docstring.
"""
import pytest
import torch

import dash_attn

# The schedules a deterministic backward can run (dash_attn.NONDETERMINISTIC_SCHEDULES have no accumulation order).
DET_SCHEDULES = [s for s in dash_attn.SCHEDULES if s not in dash_attn.NONDETERMINISTIC_SCHEDULES]


@pytest.fixture(autouse=True)
def exact_float32_matmul():
    """The float32 reference must not run its matmuls in TF32."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def supported_head_dims():
    try:
        from dash_attn import _C
    except ImportError:
        return [64, 128, 256]  # only names the tests; they are skipped without the extension
    return sorted(int(d) for d in _C.supported_head_dims())


def softcap_built():
    try:
        from dash_attn import _C
    except ImportError:
        return True  # only names the tests; they are skipped without the extension
    return bool(_C.softcap_built())


requires_softcap = pytest.mark.skipif(not softcap_built(), reason="extension built with DASH_ATTN_SOFTCAP=0")


def main_head_dim():
    dims = supported_head_dims()
    return 128 if 128 in dims else dims[-1]


def tolerance(baseline, ref, dtype, abs_floor=1e-5):
    base_err = (baseline.float() - ref).abs().max().item() if ref.numel() else 0.0
    rounding = (ref.to(dtype).float() - ref).abs().max().item() if ref.numel() else 0.0
    return max(2 * base_err, 2 * rounding + abs_floor)


def assert_within(name, got, ref, tol):
    err = (got.float() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol, f"{name}: max abs error {err:.3e} > tolerance {tol:.3e}"


def assert_out_lse_within(out, lse, ref_out, ref_lse, base_out, dtype, base_lse=None, lse_abs=1e-3):
    """out finite and within the baseline's tolerance; lse -inf exactly on the rows that see no key and, on the others,
    within the tolerance of base_lse (the low-precision baseline's) when given, else within lse_abs."""
    assert torch.isfinite(out).all(), "output has NaN/Inf (unwritten or overflowed elements)"
    assert_within("out", out, ref_out, tolerance(base_out, ref_out, dtype))
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), ~seen), "lse must be -inf exactly on the rows that see no key"
    lse_tol = lse_abs if base_lse is None else tolerance(base_lse.float()[seen], ref_lse[seen], torch.float32,
                                                          abs_floor=lse_abs)
    assert_within("lse", lse[seen], ref_lse[seen], lse_tol)


def assert_grads_within(grads, ref_grads, base_grads, dtype, floors=(0.0, 0.0, 0.0)):
    """dq, dk, dv: every element written and finite, and within the tolerance of the low-precision baseline. `floors`
    raise the absolute floor per gradient (the row statistics' bound, reference.row_statistic_error_bound)."""
    for name, g, r, b, floor in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, floors):
        assert torch.isfinite(g).all(), f"{name} has NaN/Inf (unwritten or overflowed elements)"
        assert_within(name, g, r, tolerance(b, r, dtype, abs_floor=1e-5 + floor))


def assert_compiled_step_matches_eager(q, k, v, dout):
    """A causal deterministic forward + backward under torch.compile(fullgraph=True): bitwise the eager results."""
    import dash_attn
    torch._dynamo.reset()

    def step(q, k, v):
        return dash_attn.flash_attn_func(q, k, v, causal=True, deterministic=True)

    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    step(*eager).backward(dout)
    compiled = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = torch.compile(step, fullgraph=True)(*compiled)
    out.backward(dout)
    assert torch.equal(out, step(q, k, v))
    for e, c in zip(eager, compiled):
        assert torch.equal(e.grad, c.grad)


# Scale of q and k in the soft-capping tests: scores (at softmax_scale = d^-1/2) of standard deviation ~3 against
# softcaps of 2-30, so that tanh bends and a kernel that left out 1 - t^2 in dS would fail.
SOFTCAP_SCORE_BOOST = 3.0 ** 0.5


def poison_allocator(nbytes=1 << 30, small_blocks=256):
    """Leaves NaN in freed blocks of the caching allocator (large and small pools), so torch.empty in the op returns
    memory full of NaN: any output element the kernel fails to write shows up."""
    big = torch.full((nbytes // 4,), float("nan"), device="cuda")
    small = [torch.full((1 << 17,), float("nan"), device="cuda") for _ in range(small_blocks)]  # 512 KiB each
    torch.cuda.synchronize()
    del big, small


def capture(step, warmups=1):
    """(graph, step's results) of `step` captured in a CUDA graph after `warmups` runs on a side stream: imports, the
    schedule choice and the allocator's pools happen outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        results = step()
    return graph, results


def train_steps(model, batches, device_type, lr):
    """Training steps of a transformers model under bfloat16 autocast, one per batch (a dict of model inputs with
    labels): the losses and the final weights by name. AdamW without weight decay, so that only a gradient moves a
    weight (a learnable sink whose gradient is lost keeps its value)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for inputs in batches:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.detach().clone() for name, p in model.named_parameters()}
