"""The generated kernel translation units (csrc/instantiations) are exactly what generate.py writes, and its axis table
is what the builds select from.

setup.py (through csrc/build_config.py), `make check-kernels`, `make prebuild` and csrc/bench/bench.mk name these
files with generate.py's `--list`; a file that is missing or stale would fail a GPU build (an unresolved launch
template) or link a kernel the dispatcher does not expect, so this CPU test catches it first.
"""
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTANTIATIONS = ROOT / "csrc" / "instantiations"
GENERATE = INSTANTIATIONS / "generate.py"
BUILD_CONFIG = ROOT / "csrc" / "build_config.py"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generator():
    return _load("generate_instantiations", GENERATE)


def test_every_instantiation_file_is_generated_and_current():
    gen = _generator()
    expected = {gen.file_name(direction, hdim, dtype, mask, mod, layout): gen.source(direction, hdim, dtype, mask, mod,
                                                                                     layout)
                for layout, direction, hdim, dtype, mask, mod in gen.select()}
    assert len(expected) == len(gen.LAYOUTS) * len(gen.DIRECTIONS) * len(gen.HDIMS) * len(gen.DTYPES) * len(
        gen.MASKS) * len(gen.SCORE_MODS)
    actual = {path.name: path.read_text() for path in INSTANTIATIONS.glob("*.cu")}
    assert sorted(actual) == sorted(expected)
    stale = [name for name in expected if actual[name] != expected[name]]
    assert not stale, f"run csrc/instantiations/generate.py: stale {stale}"


def test_file_names_and_launch_templates():
    gen = _generator()
    assert gen.file_name("bwd", 128, "bf16", "full") == "bwd_hdim128_bf16_full.cu"
    assert gen.file_name("fwd", 64, "fp16", "window", "softcap", "packed") == "fwd_hdim64_fp16_window_softcap_packed.cu"
    text = gen.source("bwd", 128, "bf16", "causal", "softcap", "packed")
    assert ("template void dash::bwd::run_bwd_packed_<128, cutlass::bfloat16_t, dash::MaskKind::kCausal, "
            "dash::ScoreMod::kSoftcap>(const dash::BwdParams&, cudaStream_t, int32_t);") in text


def _list(*args):
    result = subprocess.run([sys.executable, str(GENERATE), "--list", *args], capture_output=True, text=True)
    return result.returncode, result.stdout.split(), result.stderr


def test_list_selects_in_the_given_order():
    # The selection CI's `make check-kernels CHECK_DIRECTIONS="fwd bwd" CHECK_MASKS=full` compiles.
    rc, names, _ = _list("--prefix", "csrc/instantiations/", "--layouts", "batched", "--directions", "fwd", "bwd",
                         "--hdims", "128", "--dtypes", "bf16", "--masks", "full", "--score-mods", "none", "softcap")
    assert rc == 0
    assert names == ["csrc/instantiations/fwd_hdim128_bf16_full.cu", "csrc/instantiations/fwd_hdim128_bf16_full_softcap.cu",
                     "csrc/instantiations/bwd_hdim128_bf16_full.cu", "csrc/instantiations/bwd_hdim128_bf16_full_softcap.cu"]
    rc, names, _ = _list("--hdims", "128", "--dtypes", "bf16", "--masks", "window", "full", "--directions", "bwd",
                         "--score-mods", "none", "--layouts", "packed", "batched")
    assert names == ["bwd_hdim128_bf16_window_packed.cu", "bwd_hdim128_bf16_full_packed.cu",
                     "bwd_hdim128_bf16_window.cu", "bwd_hdim128_bf16_full.cu"]
    rc, names, _ = _list()
    assert rc == 0 and sorted(names) == sorted(p.name for p in INSTANTIATIONS.glob("*.cu"))


@pytest.mark.parametrize("args", [["--hdims", "96"], ["--dtypes", "fp32"], ["--masks", "sliding"],
                                  ["--score-mods", "_softcap"], ["--layouts", "varlen"]])
def test_list_rejects_values_outside_the_table(args):
    rc, names, err = _list(*args)
    assert rc == 2 and not names and "unsupported" in err


def test_build_config_defines_and_flags():
    cfg = _load("build_config", BUILD_CONFIG)
    assert cfg.enable_defines([64, 128], ["bf16"], softcap=True) == [
        "-DDASH_ENABLE_HDIM_64", "-DDASH_ENABLE_HDIM_128", "-DDASH_ENABLE_BF16", "-DDASH_ENABLE_SOFTCAP"]
    assert "arch=compute_90a,code=sm_90a" in cfg.NVCC_FLAGS
    out = subprocess.run([sys.executable, str(BUILD_CONFIG), "--defines", "--hdims", "128", "--dtypes", "bf16"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["-DDASH_ENABLE_HDIM_128", "-DDASH_ENABLE_BF16",
                   f"-DDASH_SCHEDULE_FINGERPRINT_SYMBOL={cfg.FINGERPRINT_SYMBOL}{cfg.schedule_fingerprint()}"]
    assert cfg.axes.HDIMS == _generator().HDIMS


def test_build_config_cutlass_dir(tmp_path, monkeypatch):
    cfg = _load("build_config", BUILD_CONFIG)
    (tmp_path / "include" / "cute").mkdir(parents=True)
    assert cfg.cutlass_include_dir(str(tmp_path)) == str(tmp_path / "include")  # a checkout
    assert cfg.cutlass_include_dir(str(tmp_path / "include")) == str(tmp_path / "include")  # its include/ folder
    with pytest.raises(cfg.CutlassNotFound):
        cfg.cutlass_include_dir(str(tmp_path / "missing"))
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    out = subprocess.run([sys.executable, str(BUILD_CONFIG), "--cutlass-include"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "include")


def test_schedule_fingerprint_and_the_prebuilt_check(tmp_path):
    """Objects compiled from different csrc/schedule/ headers must not be linked together (their inline host-side
    schedule code is shared by name): each carries the headers' fingerprint, and check_prebuilt refuses a mixed set."""
    cfg = _load("build_config", BUILD_CONFIG)
    fingerprint = cfg.schedule_fingerprint()
    assert re.fullmatch(f"[0-9a-f]{{{cfg.FINGERPRINT_DIGITS}}}", fingerprint)
    copy = tmp_path / "schedule"
    shutil.copytree(cfg.SCHEDULE_DIR, copy)
    assert cfg.schedule_fingerprint(copy) == fingerprint
    (copy / "runs.h").write_text((copy / "runs.h").read_text() + "\n")
    assert cfg.schedule_fingerprint(copy) != fingerprint

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None or shutil.which("nm") is None:
        pytest.skip("needs a C++ compiler and nm")
    objects = {}
    for name, value in (("a", fingerprint), ("b", fingerprint), ("other", "0123456789ab"), ("unmarked", None)):
        src, obj = tmp_path / f"{name}.cpp", tmp_path / f"{name}.o"
        src.write_text('#include "schedule/problem.h"\n')
        defines = [f"-DDASH_SCHEDULE_FINGERPRINT_SYMBOL={cfg.FINGERPRINT_SYMBOL}{value}"] if value else []
        subprocess.run([cxx, "-std=c++17", "-c", f"-I{ROOT / 'csrc'}", *defines, str(src), "-o", str(obj)], check=True)
        objects[name] = obj
    # An object without schedule code (no mark, no shared schedule symbol) goes with any set.
    plain = tmp_path / "plain.o"
    (tmp_path / "plain.cpp").write_text("int plain() { return 1; }\n")
    subprocess.run([cxx, "-c", str(tmp_path / "plain.cpp"), "-o", str(plain)], check=True)
    # An object with the shared schedule symbol but no mark (built before the mark) stands for unknown headers.
    legacy = tmp_path / "legacy.o"
    (tmp_path / "legacy.cpp").write_text(f"int {cfg.SHARED_SCHEDULE_SYMBOL}_stand_in() {{ return 2; }}\n")
    subprocess.run([cxx, "-c", str(tmp_path / "legacy.cpp"), "-o", str(legacy)], check=True)
    got = cfg.object_fingerprints([objects["a"], objects["unmarked"], plain, legacy])
    assert got == {str(objects["a"]): fingerprint, str(objects["unmarked"]): None, str(plain): None,
                   str(legacy): cfg.UNMARKED}
    assert cfg.check_prebuilt([objects["a"], objects["b"], objects["unmarked"], plain]) == fingerprint
    assert cfg.check_prebuilt([plain]) is None
    for mixed in ([objects["a"], objects["other"]], [objects["a"], legacy], [legacy]):
        with pytest.raises(ValueError, match="one set"):
            cfg.check_prebuilt(mixed)
