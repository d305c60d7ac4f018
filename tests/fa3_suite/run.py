"""Runs FlashAttention-3's own hopper/test_flash_attn.py, unedited, against dash_attn and records the result.

  python3 tests/fa3_suite/run.py --fa3 PATH/TO/flash-attention/hopper [--hdims 64,128] [--dtypes bf16,fp16]
      [--out build/fa3_suite] [--workers 8] [--budget SECONDS] [--shard K/N] [--deterministic] [--no-retry]
      [-- more pytest arguments]

FA3's checkout stays outside the repo (or in the git-ignored .peers/): nothing of it is copied, edited or committed.
Needs dash_attn importable (built in place or installed), pytest and einops; pytest-xdist for --workers. Writes
junit.xml, pytest.log, summary.json and summary.md under --out. Exit status 0 only when tests ran and none failed
(with --collect-only among the pytest arguments: pytest's own status). With workers, the cases that ran out of GPU
memory beside the others are run again one at a time (results under OUT/retry; with --budget, RETRY_SHARE of it is
kept for them) and the summary counts their second outcome. What is left out and why: tests/fa3_suite/fa3_features.py.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
# dash_attn from this checkout where it is built in place and not installed (fa3_features reads its rules).
sys.path.insert(1, str(REPO))

from fa3_features import Shard  # noqa: E402  (this folder, first on sys.path for a script)
from fa3_summary import Summary  # noqa: E402
TEST_FILE = "test_flash_attn.py"
# Share of --budget kept for the one-at-a-time retry of the cases that ran out of GPU memory beside other workers:
# spending it all in the parallel run left the 120 such cases of a 560 s run without their retry.
RETRY_SHARE = 0.15


def _parse(argv):
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fa3", default=os.environ.get("FA3_HOPPER"),
                        help=f"FA3's hopper/ folder, holding {TEST_FILE} (env FA3_HOPPER)")
    parser.add_argument("--hdims", help="kernel head dims to cover (default: the built ones)")
    parser.add_argument("--dtypes", help="bf16 and/or fp16 (default: the built ones)")
    parser.add_argument("--out", default=str(REPO / "build" / "fa3_suite"), help="folder for the results")
    parser.add_argument("--workers", type=int, default=0,
                        help="pytest-xdist workers, all on the one GPU (0: a single process)")
    parser.add_argument("--budget", type=float,
                        help="seconds; tests not started by then are skipped, so the run still ends with a summary")
    parser.add_argument("--shard", help="K/N: shard K of N of the cases (round robin), so that several budgeted runs "
                                         "cover the suite between them")
    parser.add_argument("--deterministic", action="store_true", help="dash_attn's deterministic backward throughout")
    parser.add_argument("--no-retry", dest="retry", action="store_false",
                        help="keep the cases that ran out of GPU memory beside other workers failed (default: run "
                             "them again one at a time)")
    args = parser.parse_args(ours)
    if args.shard is not None:
        try:
            Shard.parse(args.shard)
        except ValueError as error:
            parser.error(f"--shard: {error}")
    if not args.fa3 or not (pathlib.Path(args.fa3) / TEST_FILE).is_file():
        parser.error(f"--fa3 (or FA3_HOPPER) must name FA3's hopper/ folder holding {TEST_FILE}, got {args.fa3!r}")
    return args, extra


def _plugin_options(args, out: pathlib.Path):
    options = ["--fa3-out", str(out)]
    for flag, value in (("--fa3-hdims", args.hdims), ("--fa3-dtypes", args.dtypes), ("--fa3-budget", args.budget),
                        ("--fa3-shard", args.shard)):
        if value is not None:
            options += [flag, str(value)]
    return options + (["--fa3-deterministic"] if args.deterministic else [])


def pytest_command(args, extra, out: pathlib.Path, node_ids=None):
    """The pytest run of FA3's file, or of the given node ids of it."""
    hopper = pathlib.Path(args.fa3).resolve()
    targets = [str(hopper / TEST_FILE)] if node_ids is None else [str(hopper / i) for i in node_ids]
    command = [sys.executable, "-m", "pytest", *targets, "-p", "fa3_plugin",
               # Neither this repo's pytest settings (its own suite's) nor any in FA3's tree apply; no cache is
               # written into FA3's checkout; its folder is not made a package root on sys.path.
               "-c", os.devnull, "--rootdir", str(hopper), "-p", "no:cacheprovider", "--import-mode=importlib",
               # One line a failure (the log and junit.xml stay small however many fail); the summary classes
               # failures by where they were raised, which that line keeps.
               "-q", "-rfE", "--tb=line", "--junitxml", str(out / "junit.xml"),
               "-o", "junit_suite_name=fa3_test_flash_attn"] + _plugin_options(args, out)
    if args.workers:
        command += ["-n", str(args.workers), "--dist", "loadgroup"]
    return command + extra


def _environment():
    env = dict(os.environ)
    # The plugin by its module name (also in the xdist workers), and dash_attn from this checkout when built in place.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), str(REPO), env.get("PYTHONPATH")) if p)
    return env


def _run_logged(command, env, log: pathlib.Path) -> int:
    with open(log, "w") as sink, subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        # A `timeout` around this script signals it alone: pytest (and its xdist workers) must stop with it.
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
    return proc.returncode


def _retry_out_of_memory(args, extra, out: pathlib.Path, started: float) -> None:
    """Runs the cases that ran out of GPU memory beside other workers again, one at a time, and folds their
    outcomes into OUT's summary (the parallel run's own stays in OUT/parallel)."""
    summary = Summary.load(out)
    classes = summary.memory_failures()
    if not classes:
        return
    node_ids = [i for cls in classes for i in summary.failures[cls]]
    retry_out = out / "retry"
    retry_out.mkdir(exist_ok=True)
    retry_args = argparse.Namespace(**vars(args))
    retry_args.shard, retry_args.workers = None, 0  # exactly these cases, one at a time
    if args.budget is not None:
        retry_args.budget = max(args.budget - (time.time() - started), 1.0)
    command = pytest_command(retry_args, extra, retry_out, node_ids)
    print(f"fa3 suite: {len(node_ids)} cases out of GPU memory, run again one at a time", flush=True)
    _run_logged(command, _environment(), retry_out / "pytest.log")
    if not (retry_out / "summary.json").is_file():
        return
    summary.write(out / "parallel")
    summary.fold_retry(Summary.load(retry_out), classes)
    summary.write(out)


def parallel_args(args):
    """The arguments of the first run: with workers, a retry and a budget, the budget less RETRY_SHARE of it."""
    if not (args.workers and args.retry and args.budget is not None):
        return args
    return argparse.Namespace(**dict(vars(args), budget=args.budget * (1 - RETRY_SHARE)))


def main(argv=None) -> int:
    args, extra = _parse(sys.argv[1:] if argv is None else argv)
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = pytest_command(parallel_args(args), extra, out)
    print("fa3 suite:", " ".join(command), flush=True)
    started = time.time()
    status = _run_logged(command, _environment(), out / "pytest.log")
    summary = out / "summary.json"
    if "--collect-only" in extra or "--co" in extra or not summary.is_file():
        return status
    if args.workers and args.retry:
        _retry_out_of_memory(args, extra, out, started)
    print(f"fa3 suite: {out / 'summary.md'}")
    print((out / "summary.md").read_text().split("\n\n")[1])
    return 0 if json.loads(summary.read_text())["ok"] else (status or 1)


if __name__ == "__main__":
    sys.exit(main())
