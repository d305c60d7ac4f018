"""The GPU tests' time limit (gpu_watchdog.py), checked on the CPU: a body past the limit ends its process with the
label and the stacks, one within it returns normally, and the limit's environment variable is read strictly."""
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_watchdog

TESTS = Path(__file__).resolve().parent


def _run(body):
    code = f"import sys, time; sys.path.insert(0, {str(TESTS)!r}); import gpu_watchdog\n{body}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_body_past_the_limit_ends_the_process_with_its_label_and_stacks():
    result = _run("with gpu_watchdog.watchdog('tests/x.py::stuck', 0.5):\n    time.sleep(30)\nprint('returned')")
    assert result.returncode == gpu_watchdog.EXIT_CODE
    assert "tests/x.py::stuck still running after 0.5 s" in result.stderr
    assert "returned" not in result.stdout and "most recent call first" in result.stderr


def test_a_body_within_the_limit_returns_and_leaves_no_timer():
    result = _run("with gpu_watchdog.watchdog('t', 5):\n    pass\ntime.sleep(0.2)\nprint('returned')")
    assert result.returncode == 0 and result.stdout.strip() == "returned"


def test_a_zero_limit_turns_the_watchdog_off():
    result = _run("with gpu_watchdog.watchdog('t', 0):\n    time.sleep(0.3)\nprint('returned')")
    assert result.returncode == 0 and result.stdout.strip() == "returned"


def test_the_limit_comes_from_the_environment():
    assert gpu_watchdog.limit_seconds({}) == gpu_watchdog.DEFAULT_SECONDS
    assert gpu_watchdog.limit_seconds({gpu_watchdog.ENV: "0"}) == 0
    assert gpu_watchdog.limit_seconds({gpu_watchdog.ENV: "12.5"}) == 12.5
    with pytest.raises(ValueError, match=gpu_watchdog.ENV):
        gpu_watchdog.limit_seconds({gpu_watchdog.ENV: "five minutes"})
