"""The reproducible-training demo (examples/demo.py, `make demo`) on the CPU reference path, at a few steps."""
import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dash_attn import __main__ as cli

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_PATH = REPO_ROOT / "examples" / "demo.py"


def _load_demo():
    """examples/demo.py as a module (examples/ is not a package; dataclasses need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location("dash_attn_examples_demo", DEMO_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()
# Small enough that both runs take well under a second, large enough that the attention sees several key blocks.
TINY = ["--device", "cpu", "--steps", "4", "--batch", "2", "--seqlen", "32"]


def _run_demo(args):
    out = io.StringIO()
    code = demo.main(args, stream=out)
    return code, out.getvalue()


def test_deterministic_runs_are_bitwise_identical():
    code, text = _run_demo(TINY)
    assert code == 0, text
    assert "Losses:  all 4 steps bitwise identical" in text
    assert "VERDICT: IDENTICAL" in text
    weights = next(line for line in text.splitlines() if line.startswith("Weights:"))
    done, total = weights.split()[1].split("/")
    assert done == total and int(total) > 0, weights


def test_demo_restores_global_torch_state():
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    _run_demo(TINY)
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_attention_goes_through_flash_attn_func(monkeypatch):
    calls = []
    real = demo.flash_attn_func

    def recording(q, k, v, **kwargs):
        calls.append((tuple(q.shape), kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(demo, "flash_attn_func", recording)
    code, text = _run_demo(TINY + ["--nondeterministic", "--schedule", "descending"])
    assert code == 0, text
    assert calls, "the model never called flash_attn_func"
    preset = demo.CPU_PRESET.model
    assert calls[0][0] == (2, 32, preset.n_heads, preset.head_dim)  # (batch, seqlen, heads, headdim)
    assert all(kw == {"causal": True, "deterministic": False, "schedule": "descending"} for _, kw in calls)


def _nudged(result, name):
    """A copy of a run whose parameter `name` differs from the original by one ulp in one element."""
    params = {k: v.clone() for k, v in result.params.items()}
    flat = params[name].view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    return demo.RunResult(result.losses.clone(), params, result.seconds, result.tokens_per_s)


def _fake_run():
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    return demo.RunResult(torch.rand(5, generator=gen), params, 1.0, 100.0)


def test_one_ulp_difference_fails_the_deterministic_verdict():
    a = _fake_run()
    b = _nudged(a, "w")
    cmp = demo.compare_runs(a, b)
    assert cmp.losses_identical and not cmp.identical
    assert cmp.params_identical == 1 and cmp.params_total == 2
    out = io.StringIO()
    assert demo.report(cmp, a, b, deterministic=True, on_cpu=True, stream=out) == 1
    assert "VERDICT: FAIL" in out.getvalue()
    # With --nondeterministic a difference is the expected demonstration, not a failure.
    assert demo.report(cmp, a, b, deterministic=False, on_cpu=False, stream=io.StringIO()) == 0


def test_loss_difference_is_located():
    a = _fake_run()
    b = demo.RunResult(a.losses.clone(), a.params, a.seconds, a.tokens_per_s)
    b.losses[3] += 1e-3
    cmp = demo.compare_runs(a, b)
    assert not cmp.losses_identical and cmp.first_loss_diff_step == 3


@pytest.mark.parametrize("args", [["--steps", "0"], ["--seqlen", "100000000"], ["--threads", "0"],
                                  ["--schedule", "no-such-schedule"], ["--schedule", "dynamic"]])
def test_bad_arguments_exit_with_usage_error(args):
    # Status 2, as argparse uses, so a usage error is never read as 1 (the deterministic runs differ).
    with pytest.raises(SystemExit) as exc:
        demo.main(TINY + args, stream=io.StringIO())
    assert exc.value.code == 2


def test_script_entry_point():
    # One real launch of the script, as `make demo` runs it (interpreter start-up and torch import dominate its time),
    # from another directory: the script finds the checkout's dash_attn and its corpus by its own path.
    run = subprocess.run([sys.executable, str(DEMO_PATH)] + TINY, cwd=REPO_ROOT / "tests", capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "VERDICT: IDENTICAL" in run.stdout


def test_demo_is_not_in_the_library_package():
    assert not (REPO_ROOT / "dash_attn" / "demo.py").exists()
    assert not (REPO_ROOT / "dash_attn" / "data").exists()


def test_dispatcher_usage_and_unknown_command(capsys):
    assert cli.main([]) == 0
    assert "schedule" in capsys.readouterr().out
    assert cli.main(["no-such-command"]) == 2
    assert "unknown command" in capsys.readouterr().err
