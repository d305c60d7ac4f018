"""pytest plugin that runs FlashAttention-3's own hopper/test_flash_attn.py, unedited, against dash_attn.

Loaded with `-p fa3_plugin` (tests/fa3_suite on PYTHONPATH; run.py does both). It
- puts a `flash_attn_interface` module in sys.modules before FA3's file imports it: dash_attn's FA3-named functions
  (the very objects of dash_attn.flash_attn_interface) and, for FA3's names dash_attn lacks, stand-ins that skip;
- puts the FA3 file's folder on sys.path, for its sibling modules (padding, test_util);
- sets FA3's own FLASH_ATTENTION_DISABLE_* switches for the features dash_attn does not offer;
- leaves out, and counts by key, the cases fa3_features.Scope does not run (features, build, --fa3-hdims/dtypes);
- takes FA3's in-case loops over v head dims down to the dv values the scope runs (_DvFilter);
- with --fa3-out, writes summary.json and summary.md (fa3_summary.py).

It is not a conftest: the repo's own `pytest tests` never loads it. Under pytest-xdist the workers collect and send
their counts to the controller (workeroutput), which writes the summary; tests that fill most of the GPU's memory are
kept on one worker (--dist loadgroup).
"""
from __future__ import annotations

import hashlib
import importlib.util
import itertools
import os
import pathlib
import sys
import time
import types
from typing import Optional

import pytest
import torch

from fa3_features import (STANDINS, SWITCHES, Build, Scope, Shard, feature_skip_message, skip_message)
from fa3_summary import Summary, failure_class, function_of

REPO = pathlib.Path(__file__).resolve().parents[2]
# FA3's race test allocates 70 GiB before it starts: two at once do not fit on one GPU.
MEMORY_GROUPS = {"test_flash_attn_race_condition": "fa3_gpu_memory"}
_DROPPED = "fa3_dropped"  # the user property a case records a dropped sub-case under


def pytest_addoption(parser):
    group = parser.getgroup("fa3-suite", "FlashAttention-3's test_flash_attn.py against dash_attn")
    group.addoption("--fa3-hdims", default=os.environ.get("FA3_HDIMS") or None,
                    help="kernel head dims to cover, e.g. 64,128 (env FA3_HDIMS; default: every built one). A case "
                         "runs where the kernel dash_attn picks for it is one of these: 128 covers head dim 96")
    group.addoption("--fa3-dtypes", default=os.environ.get("FA3_DTYPES") or None,
                    help="dtypes to cover, bf16 and/or fp16 (env FA3_DTYPES; default: every built one)")
    group.addoption("--fa3-out", default=None, help="folder for summary.json and summary.md")
    group.addoption("--fa3-budget", type=float, default=None,
                    help="seconds after the start: later tests are skipped as 'time budget', so a run in a time "
                         "slot still ends with a summary")
    group.addoption("--fa3-shard", type=Shard.parse, default=None,
                    help="K/N: run shard K of N of the cases the scope keeps (dealt round robin in collection order)")
    group.addoption("--fa3-deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): dash_attn's deterministic backward throughout")


def pytest_configure(config):
    for switch in SWITCHES:
        os.environ[switch] = "TRUE"
    sys.modules["flash_attn_interface"] = _interface_module()
    if config.getoption("fa3_deterministic"):
        # warn_only: the reference code in FA3's tests has ops without a deterministic implementation.
        torch.use_deterministic_algorithms(True, warn_only=True)
    config.pluginmanager.register(_Suite(config), "fa3_suite")


# ----------------------------------------------------------------------------------------------------------------------
# The flash_attn_interface FA3's file imports
# ----------------------------------------------------------------------------------------------------------------------

def _standin(name: str, feature):
    def standin(*args, **kwargs):
        pytest.skip(feature_skip_message(feature))

    standin.__name__ = standin.__qualname__ = name
    return standin


def _interface_module() -> types.ModuleType:
    """In sys.modules, so it wins over a real FA3 build on sys.path and over FA3's flash_attn_interface.py beside
    the test file."""
    from dash_attn import flash_attn_interface as ours

    module = types.ModuleType("flash_attn_interface", "dash_attn.flash_attn_interface for FA3's test file "
                                                      "(tests/fa3_suite/fa3_plugin.py)")
    for name in ours.__all__:
        setattr(module, name, getattr(ours, name))
    for name, feature in STANDINS.items():
        setattr(module, name, _standin(name, feature))
    return module


# ----------------------------------------------------------------------------------------------------------------------
# What this machine and build run
# ----------------------------------------------------------------------------------------------------------------------

def _environment_problem() -> Optional[str]:
    """Why no test can run here (collection still can), in dash_attn's own words; None on an sm90 GPU with
    dash_attn._C built."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    from dash_attn import _ext, validation
    try:
        validation.check_cuda_device(torch.device("cuda"))
        _ext._extension()
    except RuntimeError as exc:
        return str(exc)
    return None


def _built() -> Build:
    from dash_attn import _ext, validation
    head_dims = tuple(_ext._supported_head_dims())
    dtypes = tuple(validation.DTYPE_KERNEL_NAMES[dtype] for dtype in _ext._supported_dtypes())
    return Build(head_dims, dtypes, _ext._softcap_built())


def _assumed_build() -> Build:
    """Without a GPU (collection only): setup.py's default build, from the instantiation axis table."""
    spec = importlib.util.spec_from_file_location("dash_attn_instantiation_axes",
                                                  REPO / "csrc" / "instantiations" / "generate.py")
    axes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(axes)
    return Build(tuple(axes.HDIMS), tuple(axes.DTYPES), True)


def _listed(text: Optional[str], kind=str):
    return tuple(kind(x) for x in text.replace(",", " ").split()) if text else None


def _scope(config, build: Build) -> Scope:
    try:
        return Scope(build, _listed(config.getoption("fa3_hdims"), int) or build.head_dims,
                     _listed(config.getoption("fa3_dtypes")) or build.dtypes)
    except ValueError as exc:
        raise pytest.UsageError(f"fa3 suite: {exc}") from None


def _params(item) -> dict:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec else {}


def _file_digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------------
# The in-case loop over v head dims
# ----------------------------------------------------------------------------------------------------------------------

class _DvFilter:
    """Stands in for `itertools` in FA3's module during one test call. FA3's output tests loop over several v head
    dims inside one case (`for dv, ... in itertools.product(dv_vals, ...)`, e.g. 256 and 512 beside d=64): the dv
    values the scope does not run are taken out of that loop and recorded as dropped sub-cases, so the case still
    runs the others. Only a product whose first argument is the calling frame's own `dv_vals` is touched: were FA3
    to rename it, nothing would be filtered and those sub-cases would fail, not pass unseen."""

    def __init__(self, scope: Scope, item):
        self._scope, self._item = scope, item

    def __getattr__(self, name):
        return getattr(itertools, name)

    def product(self, *iterables, repeat=1):
        caller = sys._getframe(1).f_locals
        if iterables and "d" in caller and iterables[0] is caller.get("dv_vals"):
            iterables = (self._kept(caller["d"], iterables[0]),) + iterables[1:]
        return itertools.product(*iterables, repeat=repeat)

    def _kept(self, d: int, dvs):
        kept, reasons = [], []
        for dv in dvs:
            why = self._scope.subcase_left_out(d, dv)
            if why is None:
                kept.append(dv)
            else:
                reasons.append(why)
                self._item.user_properties.append((_DROPPED, why))
        if not kept:  # an empty loop would pass having tested nothing
            pytest.skip(skip_message(reasons[0], f"every v head dim of this case is left out: {list(dvs)}"))
        return kept


# ----------------------------------------------------------------------------------------------------------------------
# The session's hooks
# ----------------------------------------------------------------------------------------------------------------------

class _Suite:
    """One per pytest process. Under xdist the controller only gathers (reports, worker counts) and writes the
    summary; the workers collect and run. Without xdist one process does both."""

    def __init__(self, config):
        self.config = config
        self.is_worker = hasattr(config, "workerinput")
        self.summary = Summary()
        self._here = None  # (why nothing can run here or None, Scope): measured on first use
        budget = config.getoption("fa3_budget")
        self.deadline = (config.workerinput.get("fa3_deadline") if self.is_worker
                         else (time.time() + budget if budget else None))

    # What runs here, measured once and only in a collecting process (the controller never touches the GPU).
    def _measure(self):
        if self._here is None:
            environment = _environment_problem()
            self._here = (environment, _scope(self.config, _assumed_build() if environment else _built()))
        return self._here

    def _context(self, items) -> dict:
        environment, scope = self._measure()
        from dash_attn import __file__ as dash_file, __version__
        files = sorted({pathlib.Path(item.path) for item in items})
        return {
            "fa3_test_files": {str(path): _file_digest(path) for path in files},
            "flash_attn_interface": "dash_attn.flash_attn_interface (+ stand-ins: " + ", ".join(STANDINS) + ")",
            "dash_attn": f"{__version__} at {pathlib.Path(dash_file).parent}",
            "torch": str(torch.__version__),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "environment_problem": environment,
            "build": {"head_dims": list(scope.build.head_dims), "dtypes": list(scope.build.dtypes),
                      "softcap": scope.build.softcap, "assumed_without_gpu": environment is not None},
            "covered": {"kernel_head_dims": list(scope.head_dims), "dtypes": list(scope.dtypes)},
            "fa3_switches_set": list(SWITCHES),
            "deterministic": bool(self.config.getoption("fa3_deterministic")),
            "budget_s": self.config.getoption("fa3_budget"),
        }

    @pytest.hookimpl(tryfirst=True)
    def pytest_pycollect_makemodule(self, module_path, parent):
        """FA3's file imports its sibling modules by plain name, as when run from its own folder."""
        folder = str(module_path.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)

    def pytest_itemcollected(self, item):
        # Before xdist's own modifyitems reads the marks (--dist loadgroup).
        group = MEMORY_GROUPS.get(function_of(item.nodeid))
        if group:
            item.add_marker(pytest.mark.xdist_group(group))

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        """After -k/-m have chosen: the cases the scope does not run are deselected and counted by key."""
        _, scope = self._measure()
        kept, left_out = [], []
        shard, in_scope = config.getoption("fa3_shard"), 0
        for item in items:
            why = scope.case_left_out(function_of(item.nodeid), _params(item))
            if why is None and shard is not None:
                why = None if shard.keeps(in_scope) else shard.key
                in_scope += 1
            (kept if why is None else left_out).append(item)
            if why:
                self.summary.left_out[why] += 1
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = kept
        self.summary.selected = len(kept)
        self.summary.context = self._context(kept + left_out)
        if self.is_worker:
            config.workeroutput["fa3"] = {"left_out": dict(self.summary.left_out), "selected": len(kept),
                                          "context": self.summary.context}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        environment, _ = self._measure()
        if environment:
            pytest.skip(skip_message("environment", f"cannot run here: {environment}"))
        if self.deadline is not None and time.time() > self.deadline:
            pytest.skip(skip_message("time budget", "not run: the run's time budget was spent"))

    @pytest.hookimpl(wrapper=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        module = pyfuncitem.module
        if getattr(module, "itertools", None) is not itertools:
            return (yield)
        module.itertools = _DvFilter(self._measure()[1], pyfuncitem)
        try:
            return (yield)
        finally:
            module.itertools = itertools

    def pytest_runtest_logreport(self, report):
        if self.is_worker:
            return
        if report.when == "call" and report.passed:
            self.summary.passed += 1
        elif report.skipped:
            self.summary.add_skip(report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr))
        elif report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            cls = (failure_class(report.nodeid, crash.path, crash.lineno, crash.message) if crash
                   else failure_class(report.nodeid, "", 0, report.longreprtext))
            self.summary.add_failure(cls, report.nodeid, report.when)
        if report.when == "call":
            for name, value in report.user_properties:
                if name == _DROPPED:
                    self.summary.dropped[value] += 1

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        node.workerinput["fa3_deadline"] = self.deadline

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        # Every worker collects the same cases: the first one's counts stand for all.
        sent = getattr(node, "workeroutput", {}).get("fa3")
        if sent and not self.summary.context:
            self.summary.left_out.update(sent["left_out"])
            self.summary.selected = sent["selected"]
            self.summary.context = sent["context"]

    def pytest_sessionfinish(self, session):
        out = self.config.getoption("fa3_out")
        if out and not self.is_worker:
            self.summary.write(pathlib.Path(out))
