"""The FA3 suite's wiring (tests/fa3_suite), on the CPU and without FA3's code: the feature table and what a scope
leaves out, the flash_attn_interface module FA3's file gets, the in-case dv filter, skip keys and failure classes,
and, on small stand-ins for FA3's test file, one run of the plugin as if on a GPU (the CPU path of dash_attn) and
one collection run of run.py."""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

SUITE = pathlib.Path(__file__).resolve().parent / "fa3_suite"
sys.path.insert(0, str(SUITE))

import fa3_features  # noqa: E402
import fa3_plugin  # noqa: E402
from fa3_features import Build, Scope, Shard  # noqa: E402
from fa3_summary import Summary, failure_class  # noqa: E402

from dash_attn import flash_attn_interface  # noqa: E402

BUILD = Build(head_dims=(64, 128, 256), dtypes=("fp16", "bf16"), softcap=True)


def _case(d=128, dtype=torch.bfloat16, **params):
    return dict(d=d, dtype=dtype, **params)


def test_the_suite_folder_holds_nothing_pytest_collects_on_its_own():
    # `pytest tests` must never load the plugin (it replaces flash_attn_interface in sys.modules).
    names = [p.name for p in SUITE.iterdir()]
    assert not [n for n in names if n == "conftest.py" or (n.startswith("test_") and n.endswith(".py"))]


def test_feature_table_is_consistent_with_the_interface():
    keys = [f.key for f in fa3_features.FEATURES]
    assert len(keys) == len(set(keys)) and all(f.reason for f in fa3_features.FEATURES)
    assert all(s.startswith("FLASH_ATTENTION_DISABLE_") for s in fa3_features.SWITCHES)
    # A stand-in must never hide a function dash_attn has.
    assert not set(fa3_features.STANDINS) & set(flash_attn_interface.__all__)


@pytest.mark.parametrize("test, params, key", [
    ("test_flash_attn_kvcache", _case(), "feature:kvcache"),
    ("test_flash_attn_combine", _case(dtype=torch.float32), "feature:split_kv"),
    ("test_flash3_bw_compatibility", {}, "feature:fa3_ops"),
    ("test_flash_attn_output", _case(dtype=torch.float8_e4m3fn), "feature:fp8"),
    ("test_flash_attn_output", _case(d=64, has_qv=True), "feature:qv"),
    ("test_flash_attn_race_condition", _case(d=512), "feature:head_dim"),
    ("test_flash_attn_output", _case(d=96, has_qv=False, softcap=15.0), None),
])
def test_case_left_out_by_feature(test, params, key):
    assert Scope(BUILD, BUILD.head_dims, BUILD.dtypes).case_left_out(test, params) == key


def test_case_left_out_by_build_and_selection():
    small = Build(head_dims=(64, 128), dtypes=("bf16",), softcap=False)
    scope = Scope(small, head_dims=(128,), dtypes=("bf16",))
    assert scope.case_left_out("t", _case(d=96)) is None  # runs in the 128 kernel
    assert scope.case_left_out("t", _case(d=40)) == "not selected: head dim 64 kernel"
    assert scope.case_left_out("t", _case(d=192)) == "not built: head dims above 128"
    assert scope.case_left_out("t", _case(dtype=torch.float16)) == "not built: fp16"
    assert scope.case_left_out("t", _case(softcap=15.0)) == "not built: softcap kernels"
    assert Scope(BUILD, BUILD.head_dims, ("bf16",)).case_left_out("t", _case(dtype=torch.float16)) \
        == "not selected: fp16"
    with pytest.raises(ValueError, match="not built"):
        Scope(small, head_dims=(256,), dtypes=("bf16",))


def test_subcase_left_out_holds_the_larger_head_dim():
    scope = Scope(BUILD, head_dims=(256,), dtypes=("bf16",))
    assert scope.subcase_left_out(192, 128) is None
    assert scope.subcase_left_out(64, 256) is None
    assert scope.subcase_left_out(64, 512) == "feature:head_dim"
    assert scope.subcase_left_out(64, 64) == "not selected: head dim 64 kernel"


def test_skip_keys():
    feature = fa3_features.FEATURE_BY_KEY["kvcache"]
    assert fa3_features.skip_key("Skipped: " + fa3_features.feature_skip_message(feature)) == "feature:kvcache"
    assert fa3_features.skip_key("Skipped: needs hdim 64") == "FA3's own skip: needs hdim 64"
    assert fa3_features.skip_key("Skipped: ") == "FA3's own skip: (no reason given)"


def test_interface_module_reexports_dash_attn_and_skips_the_rest():
    module = fa3_plugin._interface_module()
    for name in flash_attn_interface.__all__:
        assert getattr(module, name) is getattr(flash_attn_interface, name)
    with pytest.raises(pytest.skip.Exception, match=r"\[feature:kvcache\]$"):
        module.flash_attn_with_kvcache(None, None, None)
    with pytest.raises(pytest.skip.Exception, match=r"\[feature:split_kv\]$"):
        module.flash_attn_combine(None, None)


class _Item:
    def __init__(self):
        self.user_properties = []


def _fa3_like_loop(itertools, d, dv_vals):
    """The shape of FA3's in-case loop: product over the local dv_vals first."""
    return [dv for dv, _ in itertools.product(dv_vals, [0, 7])][::2]


def test_dv_filter_drops_subcases_and_records_them():
    item = _Item()
    scope = Scope(Build((64, 128), ("bf16",), True), (64, 128), ("bf16",))
    ran = _fa3_like_loop(fa3_plugin._DvFilter(scope, item), 64, [256, 512, 64])
    assert ran == [64]
    assert item.user_properties == [("fa3_dropped", "not built: head dims above 128"),
                                    ("fa3_dropped", "feature:head_dim")]
    # Any other product is itertools' own.
    assert list(fa3_plugin._DvFilter(scope, item).product([1, 512], [0])) == [(1, 0), (512, 0)]
    with pytest.raises(pytest.skip.Exception, match=r"\[feature:head_dim\]$"):
        _fa3_like_loop(fa3_plugin._DvFilter(scope, _Item()), 64, [512])


def test_failure_classes(tmp_path):
    fa3_file = tmp_path / "test_flash_attn.py"
    fa3_file.write_text("def test_flash_attn_output():\n    assert (dq - dq_ref).abs().max() <= dq_atol\n")
    assert failure_class("test_flash_attn.py::test_flash_attn_output[1-1-64]", str(fa3_file), 2,
                         "assert 0.5 <= ((2 * 0.01) + 0.001)") == (
        "test_flash_attn_output: AssertionError at test_flash_attn.py:2: assert (dq - dq_ref).abs().max() <= dq_atol")
    assert failure_class("x.py::test_v[a]", "/x/validation.py", 9, "RuntimeError: head dims [64, 128] got 96") == \
        "test_v: RuntimeError: head dims [N, N] got N"


def test_ok_means_ran_nothing_failed_and_only_feature_skips():
    assert Summary(passed=1, skipped={"feature:qv": 3}).ok()
    assert not Summary(passed=0).ok()
    assert not Summary(passed=1, failed=1).ok()
    assert not Summary(passed=1, skipped={"time budget": 1}).ok()


def test_a_retry_replaces_the_out_of_memory_failures(tmp_path):
    oom = "test_flash_attn_output: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate N GiB"
    first = Summary(passed=5, failed=3, errors=1, selected=9, failures={
        oom: ["f.py::a[1]", "f.py::a[2]"], "error in setup: " + oom: ["f.py::b"],
        "test_x: AssertionError": ["f.py::x"]})
    first.write(tmp_path)
    loaded = Summary.load(tmp_path)
    assert loaded.as_dict() == first.as_dict() and loaded.failures == first.failures
    assert sorted(loaded.memory_failures()) == sorted([oom, "error in setup: " + oom])
    retry = Summary(passed=2, failed=1, failures={"test_flash_attn_output: AssertionError": ["f.py::b"]})
    loaded.fold_retry(retry, loaded.memory_failures())
    assert (loaded.passed, loaded.failed, loaded.errors, loaded.selected) == (7, 2, 0, 9)
    assert sorted(loaded.failures) == ["test_flash_attn_output: AssertionError", "test_x: AssertionError"]
    assert loaded.context["serial_retry"]["cases"] == 3 and loaded.context["serial_retry"]["passed"] == 2


# A small stand-in for FA3's test file (its shape, none of its code): sibling imports, the interface names, a switch.
_FAKE_FA3 = '''
import itertools
import os

import pytest
import torch

from sibling_helper import SIBLING
from flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_combine
from flash_attn_interface import flash_attn_with_kvcache, get_scheduler_metadata

SPLITS = [1] if os.environ.get("FLASH_ATTENTION_DISABLE_SPLIT") == "TRUE" else [1, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("has_qv", [False, True])
@pytest.mark.parametrize("d", [300, 64, 96, 192, 512])
def test_flash_attn_output(d, has_qv, dtype):
    assert SIBLING


@pytest.mark.parametrize("num_splits", SPLITS)
def test_splits(num_splits):
    pass


def test_flash_attn_kvcache():
    flash_attn_with_kvcache()
'''


def test_run_collects_a_fake_fa3_file_on_the_cpu(tmp_path):
    hopper = tmp_path / "hopper"
    hopper.mkdir()
    (hopper / "test_flash_attn.py").write_text(_FAKE_FA3)
    (hopper / "sibling_helper.py").write_text("SIBLING = True\n")
    # FA3's real interface module sits beside its test file: the suite's must win.
    (hopper / "flash_attn_interface.py").write_text("raise ImportError('FA3 itself imported')\n")
    out = tmp_path / "out"
    # No GPU in the child, whatever this machine has: the collection path with the assumed default build.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SUITE / "run.py"), "--fa3", str(hopper), "--out", str(out),
                           "--hdims", "128", "--dtypes", "bf16"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0, "nothing can pass without a GPU"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["left_out"] == {"feature:fp8": 10, "feature:qv": 10, "feature:head_dim": 4,
                                   "not selected: head dim 64 kernel": 2, "not selected: fp16": 1,
                                   "not selected: head dim 256 kernel": 2, "feature:kvcache": 1}, proc.stdout
    assert summary["selected"] == 2 and summary["skipped"] == {"environment": 2}
    assert summary["passed"] == summary["failed"] == summary["errors"] == 0
    assert (out / "junit.xml").is_file() and (out / "summary.md").is_file()


def test_shards_deal_the_cases_round_robin():
    shard = Shard.parse("1/3")
    assert (shard.index, shard.count) == (1, 3) and shard.key == "not selected: shard 1/3"
    assert [p for p in range(7) if shard.keeps(p)] == [1, 4]
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0", "1/2/3"):
        with pytest.raises(ValueError, match="K/N"):
            Shard.parse(bad)


@pytest.mark.parametrize("shard", ["0/2", "1/2"])
def test_run_keeps_its_shard_of_the_cases(tmp_path, shard):
    hopper = tmp_path / "hopper"
    hopper.mkdir()
    (hopper / "test_flash_attn.py").write_text(_FAKE_FA3)
    (hopper / "sibling_helper.py").write_text("SIBLING = True\n")
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, str(SUITE / "run.py"), "--fa3", str(hopper), "--out", str(out), "--hdims", "128",
                    "--dtypes", "bf16", "--shard", shard], env=env, capture_output=True, text=True, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    # The two cases the scope keeps (test_run_collects_a_fake_fa3_file_on_the_cpu), one in each shard.
    assert summary["selected"] == 1 and summary["left_out"][f"not selected: shard {shard}"] == 1
    bad = subprocess.run([sys.executable, str(SUITE / "run.py"), "--fa3", str(hopper), "--shard", "2/2"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--shard" in bad.stderr


_FAKE_FA3_RUN = '''
import itertools

import pytest
import torch

from flash_attn_interface import flash_attn_func, flash_attn_combine


@pytest.mark.parametrize("d", [64, 128])
def test_flash_attn_output(d):
    dv_vals = [256, 512, d]
    ran = [dv for dv, _ in itertools.product(dv_vals, [0])]
    q = torch.randn(1, 4, 2, d)
    assert ran == [d] and flash_attn_func(q, q, q).shape == q.shape


def test_combine_caller():
    flash_attn_combine(None, None)


def test_wrong():
    assert 1 == 2
'''


# Loaded after fa3_plugin in the child pytest: as on an sm90 GPU with a (64, 128) bf16 build, while the tests
# themselves run dash_attn's CPU path.
_FAKE_GPU_PLUGIN = '''
import fa3_plugin
from fa3_features import Build

fa3_plugin._environment_problem = lambda: None
fa3_plugin._built = lambda: Build((64, 128), ("bf16",), True)
'''


def test_plugin_run_counts_outcomes_skips_and_dropped_subcases(tmp_path):
    # A child process: the plugin replaces sys.modules entries and os.environ switches for its whole session.
    (tmp_path / "test_flash_attn.py").write_text(_FAKE_FA3_RUN)
    (tmp_path / "fake_gpu.py").write_text(_FAKE_GPU_PLUGIN)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUITE), str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_flash_attn.py"), "-c", os.devnull,
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-p", "fa3_plugin", "-p", "fake_gpu",
                           "--fa3-out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert "2 passed" in proc.stdout and "1 failed" in proc.stdout and "1 skipped" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["passed"], summary["failed"], summary["skipped"]) == (2, 1, {"feature:split_kv": 1})
    assert summary["dropped_subcases"] == {"not built: head dims above 128": 2, "feature:head_dim": 2}
    [failure] = summary["failure_classes"]
    assert re.fullmatch(r"test_wrong: AssertionError at test_flash_attn.py:\d+: assert 1 == 2", failure["class"])
    assert not summary["ok"] and summary["context"]["build"]["head_dims"] == [64, 128]


_FAKE_FA3_OOM = '''
import os

import pytest
import torch

from flash_attn_interface import flash_attn_func


@pytest.mark.parametrize("d", [64, 128])
def test_flash_attn_output(d):
    if d == 128 and os.environ.get("PYTEST_XDIST_WORKER"):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    q = torch.randn(1, 4, 2, d)
    assert flash_attn_func(q, q, q).shape == q.shape


def test_wrong():
    assert 1 == 2
'''


def test_run_retries_the_out_of_memory_cases_one_at_a_time(tmp_path):
    pytest.importorskip("xdist")
    hopper = tmp_path / "hopper"
    hopper.mkdir()
    (hopper / "test_flash_attn.py").write_text(_FAKE_FA3_OOM)
    (tmp_path / "fake_gpu.py").write_text(_FAKE_GPU_PLUGIN)
    out = tmp_path / "out"
    # Not this suite's own xdist variables: the fake case reads PYTEST_XDIST_WORKER to know it runs beside others.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(SUITE / "run.py"), "--fa3", str(hopper), "--out", str(out),
                           "--workers", "2", "--", "-p", "fake_gpu"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert "1 cases out of GPU memory, run again one at a time" in proc.stdout, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["passed"], summary["failed"], summary["errors"]) == (2, 1, 0), summary
    assert summary["context"]["serial_retry"] == {"cases": 1, "passed": 1, "failed": 0,
                                                  "why": "out of GPU memory beside the other workers"}
    assert json.loads((out / "parallel" / "summary.json").read_text())["failed"] == 2
    assert proc.returncode != 0  # test_wrong still fails


def test_a_budgeted_run_with_workers_keeps_time_for_the_retry(tmp_path):
    """With workers, retries and --budget, the parallel run gets the budget less run.RETRY_SHARE of it, so that the
    cases that ran out of GPU memory beside the others still get their one-at-a-time run."""
    import run
    hopper = tmp_path / "hopper"
    hopper.mkdir()
    (hopper / "test_flash_attn.py").write_text("")

    def budget_of(*flags):
        args, extra = run._parse(["--fa3", str(hopper), "--budget", "100", *flags])
        command = run.pytest_command(run.parallel_args(args), extra, tmp_path)
        return float(command[command.index("--fa3-budget") + 1])

    assert budget_of("--workers", "4") == pytest.approx(100 * (1 - run.RETRY_SHARE))
    assert budget_of("--workers", "4", "--no-retry") == budget_of() == 100
