"""The extension's own argument checks (dash_attn._C), reached directly rather than through the Python API, which
validates first: each must raise ValueError naming the problem, never crash the process.

Each call runs in a subprocess, so that a crash fails its test instead of taking the test run down with it: with
torch 2.11.0+cu130 a message that streams an integer through c10::str crashes with SIGSEGV (csrc/api/binding.cpp: num).
"""
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SETUP = textwrap.dedent("""
    import torch
    from dash_attn import interface
    ext = interface._extension()
    q = torch.randn(1, 300, 2, 128, device="cuda", dtype=torch.bfloat16)
    o, lse = torch.ops.dash_attn.fwd(q, q, q, 0.1, 1, -1, 0, 0.0, False, "auto", 0)
    grads = [torch.empty_like(q) for _ in range(3)]
    args = dict(q=q, mask=1, deterministic=False, schedule=1, sm_margin=0)
""")
CALL = textwrap.dedent("""
    try:
        ext.bwd(o, args["q"], q, q, o, lse, *grads, 0.1, args["mask"], -1, 0, 0.0, args["deterministic"],
                args["schedule"], args["sm_margin"], None, None)
        print("accepted")
    except ValueError as e:
        print("ValueError:", e)
""")

BAD = [
    ("schedule", 99, "schedule id 99"),  # auto: resolved in Python, never a launch id
    ("mask", 5, "unknown mask id 5"),
    ("sm_margin", -1, "sm_margin"),
    ("q", "q.cpu()", "must be a CUDA tensor"),
]


@pytest.mark.parametrize("field, value, message", BAD, ids=[b[0] for b in BAD])
def test_binding_checks_raise(field, value, message):
    code = SETUP + f"args[{field!r}] = {value}\n" + CALL
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-400:]}"
    assert "ValueError:" in r.stdout and message in r.stdout, r.stdout + r.stderr[-400:]


def test_binding_refuses_a_deterministic_dynamic_backward():
    code = SETUP + "args.update(deterministic=True, schedule=5)\n" + CALL
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"crashed (rc {r.returncode}): {r.stderr[-400:]}"
    assert "ValueError:" in r.stdout and "deterministic=False" in r.stdout, r.stdout + r.stderr[-400:]
