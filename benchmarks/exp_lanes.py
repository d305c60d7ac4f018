"""Experiment (branch exp/descending-lanes): backward TFLOPS of descending_lanes beside the deterministic auto pick,
descending and the non-deterministic auto, and whether descending_lanes' gradients equal descending's bit for bit."""
import os
import sys

import torch
import triton

import dash_attn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flops import bwd_flops, tflops  # noqa: E402

SHAPES = [(16, 1024, 16, 128, False), (16, 1024, 16, 128, True), (8, 2048, 16, 128, True), (16, 1024, 32, 64, True),
          (8, 2048, 32, 64, False), (4, 4096, 16, 128, False), (1, 16384, 16, 128, False)]
VARIANTS = [("descending_lanes", True), ("auto", True), ("descending", True), ("auto", False)]


def main():
    res = {}
    for rnd in range(2):
        for batch, seqlen, heads, hdim, causal in SHAPES:
            q, k, v = [torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3)]
            grads = {}
            for sched, det in VARIANTS:
                out = dash_attn.flash_attn_func(q, k, v, causal=causal, deterministic=det, schedule=sched)
                dout = torch.randn_like(out) if not grads else dout_ref
                dout_ref = dout
                fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                if rnd == 0 and det and sched != "auto":
                    grads[sched] = fn()
                ms = triton.testing.do_bench(fn, warmup=5, rep=20)
                res.setdefault((batch, seqlen, heads, hdim, causal, sched, det), []).append(
                    tflops(bwd_flops(batch, heads, seqlen, seqlen, hdim, causal), ms))
            if rnd == 0:
                same = all(torch.equal(a, b) for a, b in zip(grads["descending_lanes"], grads["descending"]))
                print(batch, seqlen, heads, hdim, causal, "lanes==descending bitwise:", same, flush=True)
    for key, vals in res.items():
        print(*key, " ".join(f"{x:.0f}" for x in vals), flush=True)


if __name__ == "__main__":
    main()
