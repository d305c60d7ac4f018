"""Context-parallel attention (dash_attn.context_parallel) on CPU: gloo process groups of 2 and 4 ranks on the
reference path, against the same algorithm run in one process (bitwise: every sum has the same order) and against
single-process attention (tolerance), bitwise reproducible run to run."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dash_attn
from dash_attn import context_parallel as cp

CASES = [  # (world, causal, nheads, nheads_k, dtype)
    (2, False, 4, 4, torch.float64),
    (2, True, 4, 2, torch.float32),
    (4, True, 4, 1, torch.float64),
    (4, False, 2, 2, torch.float32),
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(nheads, nheads_k, dtype, seqlen=64, batch=2, d=16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, seqlen, nheads, d, generator=g, dtype=dtype)
    k = torch.randn(batch, seqlen, nheads_k, d, generator=g, dtype=dtype)
    v = torch.randn(batch, seqlen, nheads_k, d, generator=g, dtype=dtype)
    dout = torch.randn(batch, seqlen, nheads, d, generator=g, dtype=dtype)
    return q, k, v, dout


def _worker(rank, world, port, causal, nheads, nheads_k, dtype, path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q, k, v, dout = _inputs(nheads, nheads_k, dtype)
        results = []
        for _ in range(2):  # twice: run-to-run identity
            qs, ks, vs = (cp.shard_sequence(t, rank, world).requires_grad_() for t in (q, k, v))
            out = cp.ring_attn_func(qs, ks, vs, causal=causal, deterministic=True)
            grads = torch.autograd.grad(out, (qs, ks, vs), cp.shard_sequence(dout, rank, world))
            results.append((out.detach(),) + tuple(grads))
        torch.save(results, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, causal, nheads, nheads_k, dtype", CASES)
def test_ring_matches_simulation_and_attention(tmp_path, world, causal, nheads, nheads_k, dtype):
    path = str(tmp_path / "res")
    mp.spawn(_worker, args=(world, _free_port(), causal, nheads, nheads_k, dtype, path), nprocs=world, join=True)
    per_rank = [torch.load(f"{path}.{r}") for r in range(world)]
    runs = [[cp.unshard_sequence([per_rank[r][i][j] for r in range(world)]) for j in range(4)] for i in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "not bitwise reproducible run to run"
    q, k, v, dout = _inputs(nheads, nheads_k, dtype)
    sim = cp.simulate(q, k, v, dout, world, causal=causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], sim):
        assert torch.equal(a, b), f"{name}: the distributed run differs from the same algorithm in one process"
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = dash_attn.flash_attn_func(qr, kr, vr, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    ref = (out,) + torch.autograd.grad(out, (qr, kr, vr), dout)
    # The per-step log-sum-exp the kernels return is float32, which bounds the merge's precision in float64 too.
    tol = 1e-6 if dtype == torch.float64 else 2e-5
    for name, a, b in zip(("out", "dq", "dk", "dv"), runs[0], ref):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item()), name


def test_shard_round_trip_and_errors():
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    assert torch.equal(cp.unshard_sequence([cp.shard_sequence(x, r, 4) for r in range(4)]), x)
    with pytest.raises(ValueError, match="shard_sequence"):
        cp.shard_sequence(x, 0, 3)
    with pytest.raises(ValueError, match="ring_attn_func"):
        cp.ring_attn_func(x, x, x)
    q = torch.randn(1, 8, 2, 16)
    for scale in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"simulate\(\): softmax_scale must be a finite float"):
            cp.simulate(q, q, q, q, 2, softmax_scale=scale)
