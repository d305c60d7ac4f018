"""CPU checks of the benchmark plumbing: the one FLOPs convention (benchmarks/flops.py and its C++ mirror
csrc/bench/bench_flops.h), bench_attn.py's command line, and both benchmarks' no-GPU exit. The timings themselves
need the GPU (benchmarks/RESULTS.md)."""
import pathlib
import random
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_attn  # noqa: E402
import flops  # noqa: E402


def brute_force_causal_area(seqlen_q, seqlen_k):
    """Visible (query, key) pairs of a bottom-right aligned causal mask, counted one row at a time."""
    offset = seqlen_k - seqlen_q
    return sum(min(seqlen_k, max(0, i + offset + 1)) for i in range(seqlen_q))


SHAPES = [(1, 7), (7, 1), (17, 113), (113, 17), (128, 64), (64, 128), (1023, 1024), (1024, 1023),
          (300, 2000), (2000, 300)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES)
def test_causal_area_is_exact_when_lengths_differ(seqlen_q, seqlen_k):
    assert flops.causal_area(seqlen_q, seqlen_k) == brute_force_causal_area(seqlen_q, seqlen_k)


def test_causal_area_is_half_the_square_when_lengths_match():
    # The convention FlashAttention and cuDNN report with (benchmarks/RESULTS.md is measured with it), not the exact count.
    for s in (1, 2, 1024, 16384):
        assert flops.causal_area(s, s) == s * s / 2


def test_backward_is_two_and_a_half_forwards_and_tflops_units():
    fwd = flops.fwd_flops(2, 16, 8192, 8192, 128, causal=False)
    assert fwd == 4 * 2 * 16 * 8192 * 8192 * 128
    assert flops.bwd_flops(2, 16, 8192, 8192, 128, causal=False) == 2.5 * fwd
    assert flops.fwd_flops(2, 16, 8192, 8192, 128, causal=True) == fwd / 2
    assert flops.tflops(1e12, 1000.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        flops.flops("both", 1, 1, 1, 1, 1, False)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile csrc/bench/bench_flops.h")
def test_cpp_mirror_matches_python(tmp_path):
    rng = random.Random(0)
    cases = SHAPES + [(rng.randint(1, 5000), rng.randint(1, 5000)) for _ in range(40)]
    src = tmp_path / "flops_check.cpp"
    lines = ['#include <cstdio>', '#include "bench/bench_flops.h"', "int main() {"]
    for sq, sk in cases:
        for causal in (0, 1):
            lines.append(f'  std::printf("%.17g %.17g\\n", dash::bench::fwd_flops(3, 5, {sq}, {sk}, 64, {causal}), '
                         f'dash::bench::bwd_flops(3, 5, {sq}, {sk}, 64, {causal}));')
    lines.append("  return 0;\n}")
    src.write_text("\n".join(lines))
    exe = tmp_path / "flops_check"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    expected = []
    for sq, sk in cases:
        for causal in (False, True):
            expected += [flops.fwd_flops(3, 5, sq, sk, 64, causal), flops.bwd_flops(3, 5, sq, sk, 64, causal)]
    assert [float(x) for x in out] == pytest.approx(expected, rel=1e-15)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to compile csrc/bench/bench_flops.h")
def test_cpp_band_area_matches_python_and_brute_force(tmp_path):
    cases = [(17, 17, 3, 0), (113, 257, 5, 3), (257, 113, -1, 40), (300, 300, 100, -1), (64, 64, 0, 0),
             (1000, 1000, 999, 0), (50, 80, 200, 200)]
    src = tmp_path / "band_check.cpp"
    lines = ['#include <cstdio>', '#include "bench/bench_flops.h"', "int main() {"]
    lines += [f'  std::printf("%.17g\\n", dash::bench::band_area({sq}, {sk}, {lf}, {rt}));' for sq, sk, lf, rt in cases]
    lines.append("  return 0;\n}")
    src.write_text("\n".join(lines))
    exe = tmp_path / "band_check"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)], check=True)
    out = [float(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    for (sq, sk, lf, rt), got in zip(cases, out):
        d = sk - sq
        brute = sum(1 for i in range(sq) for j in range(sk)
                    if (lf < 0 or j >= i + d - lf) and (rt < 0 or j <= i + d + rt))
        assert got == flops.band_area(sq, sk, lf, rt) == brute
    assert flops.band_area(1000, 1000, 999, 0) == flops.causal_area(1000, 1000) + 500


def test_rows_with_a_fixed_key_length():
    args = bench_attn.parse_args(["--masks", "full", "--hdims", "128", "--seqlens", "1024,4096", "--seqlen-k", "8192"])
    assert [(p.batch, p.seqlen_q, p.seqlen_k) for p in bench_attn.problems(args)] == [(16, 1024, 8192), (4, 4096, 8192)]
    assert {p.seqlen_k for p in bench_attn.problems(bench_attn.parse_args(["--seqlens", "2048"]))} == {2048}
    with pytest.raises(SystemExit):
        bench_attn.parse_args(["--seqlen-k", "0"])


def test_window_problems_count_the_band_only():
    args = bench_attn.parse_args(["--masks", "window", "--window", "1024,0", "--hdims", "128", "--seqlens", "4096"])
    (problem,) = list(bench_attn.problems(args))
    assert problem.mask == "window" and problem.window == (1024, 0)
    area = flops.band_area(4096, 4096, 1024, 0)
    assert problem.flops("fwd") == 4 * problem.batch * problem.nheads * area * 128
    assert problem.flops("bwd") == 2.5 * problem.flops("fwd")
    with pytest.raises(SystemExit):
        bench_attn.parse_args(["--masks", "window", "--window", "-1,-1"])


def test_quick_grid_and_defaults():
    quick = bench_attn.parse_args(["--quick"])
    assert quick.hdims == [128] and quick.seqlens == [2048, 8192]
    assert "flex" not in quick.peers  # its per-shape compile would dominate a one-minute run
    full = bench_attn.parse_args([])
    assert full.hdims == [128, 64] and full.seqlens == [1024, 2048, 4096, 8192, 16384]
    with pytest.raises(SystemExit):
        bench_attn.parse_args(["--schedules", "nonsense"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit where there is no CUDA device")
def test_extra_non_deterministic_columns():
    import peers
    args = bench_attn.parse_args(["--nondet-schedules", "dynamic,shift_causal"])
    assert args.nondet_schedules == ["dynamic", "shift_causal"]
    assert bench_attn.parse_args([]).nondet_schedules == []
    with pytest.raises(SystemExit):
        bench_attn.parse_args(["--nondet-schedules", "auto"])  # already the reference column
    impls = peers.build_impls(["shift"], [], nondet_schedules=args.nondet_schedules)
    assert [(i.key, i.deterministic, i.time_fwd) for i in impls] == [
        ("dash_nondet", False, True), ("dash_nondet_dynamic", False, False),
        ("dash_nondet_shift_causal", False, False), ("dash_det_shift", True, False)]


def test_no_gpu_gives_a_clear_message_not_a_traceback():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attn.py"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == bench_attn.EXIT_NO_GPU
    assert "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_varlen_bench_without_gpu_exits_clearly():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_varlen.py")], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == bench_attn.EXIT_NO_GPU
    assert "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr


def test_varlen_packs_hold_the_same_tokens():
    import bench_varlen
    assert {sum(lens) for lens in bench_varlen.PACKS.values()} == {16384}


def test_varlen_packs_spelled_as_lengths():
    import bench_varlen
    assert bench_varlen.pack_lengths("docs") == bench_varlen.PACKS["docs"]
    assert bench_varlen.pack_lengths("3000+700+1") == [3000, 700, 1]
    for bad in ("3000+x", "0+5", "", "nope"):
        with pytest.raises(SystemExit, match="--packs"):
            bench_varlen.pack_lengths(bad)


def test_varlen_schedule_columns_are_checked():
    import bench_varlen
    args = bench_varlen.parse_args(["--schedules", "descending", "--nondet-schedules", "shift_causal_runs,dynamic"])
    assert args.schedules == ["descending"] and args.nondet_schedules == ["shift_causal_runs", "dynamic"]
    assert args.out is None and bench_varlen.parse_args(["--out", "x"]).out == pathlib.Path("x")
    for flag, bad in (("--schedules", "dynamic"), ("--nondet-schedules", "nope")):
        with pytest.raises(SystemExit):
            bench_varlen.parse_args([flag, bad])


def test_rounds_report_each_cells_median_round():
    """--rounds N: one row per cell, the round with the median time; untimed rounds do not count."""
    def row(impl, ms, seqlen=1024):
        return {"direction": "bwd", "hdim": 128, "seqlen_q": seqlen, "mask": "full", "window": [-1, -1],
                "impl": impl, "ms": ms, "tflops": (1.0 / ms) if ms else None, "status": "ok" if ms else "n/a",
                "reason": ""}
    rows = [row("a", 3.0), row("b", 1.0), row("a", 1.0), row("b", None), row("a", 2.0), row("b", 5.0),
            row("c", None), row("a", 9.0, seqlen=2048)]
    merged = bench_attn.median_rounds(rows)
    by = {(r["impl"], r["seqlen_q"]): r for r in merged}
    assert len(merged) == 4
    assert by[("a", 1024)]["ms"] == 2.0 and by[("a", 1024)]["round_ms"] == "3.0000;1.0000;2.0000"
    assert by[("b", 1024)]["ms"] == 1.0  # lower middle of two timed rounds
    assert by[("c", 1024)]["ms"] is None and by[("c", 1024)]["round_ms"] == ""
    assert by[("a", 2048)]["ms"] == 9.0
    assert bench_attn.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench_attn.parse_args(["--rounds", "0"])


def test_ab_objects_alternates_the_variants_and_averages_each_cell(tmp_path, monkeypatch):
    import ab_objects

    folders = {name: tmp_path / name for name in ("new", "old")}
    for folder in folders.values():
        folder.mkdir()
    linked = []
    monkeypatch.setattr(ab_objects, "relink", lambda objects: linked.append(objects.name))
    # A stand-in benchmark: TFLOPS 100 per link so far for the dash cell, 50 for the peer's.
    bench = tmp_path / "bench.py"
    bench.write_text(
        "import json, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "n = len(list(out.parent.glob('*_*_*')))\n"
        "row = dict(direction='fwd', hdim=64, mask='causal', gqa=1, seqlen_q=2048)\n"
        "rows = [dict(row, impl='dash', tflops=100.0 * n), dict(row, impl='fa3', tflops=50.0), "
        "dict(row, impl='cudnn', tflops=None)]\n"
        "(out / 'bench_attn.json').write_text(json.dumps({'results': rows}))\n")
    status = ab_objects.main(["--variant", f"new={folders['new']}", "--variant", f"old={folders['old']}",
                              "--rounds", "2", "--out", str(tmp_path / "ab"), "--", sys.executable, str(bench)])
    assert status == 0 and linked == ["new", "old", "new", "old"]
    lines = (tmp_path / "ab" / "ab.txt").read_text().splitlines()
    assert lines[0] == "cell | new | old | old / new"
    # dash: new ran as links 1 and 3 (100, 300), old as 2 and 4 (200, 400); the peer is the same in every run.
    cell = "direction=fwd, gqa=1, hdim=64, impl={}, mask=causal, seqlen_q=2048"
    assert lines[1] == cell.format("dash") + " | 200 (100, 300) | 300 (200, 400) | 1.500"
    assert lines[2] == cell.format("fa3") + " | 50 (50, 50) | 50 (50, 50) | 1.000"
    assert len(lines) == 3


def test_ab_objects_refuses_a_bad_command_line(tmp_path):
    import ab_objects

    with pytest.raises(SystemExit):
        ab_objects.main(["--variant", f"a={tmp_path}", "--variant", f"b={tmp_path}"])  # no command
    with pytest.raises(SystemExit):
        ab_objects.main(["--variant", f"a={tmp_path}", "--", "true"])  # one variant
    with pytest.raises(SystemExit):
        ab_objects.main(["--variant", f"a={tmp_path / 'missing'}", "--variant", f"b={tmp_path}", "--", "true"])


def test_ab_objects_builds_a_git_variant_in_a_worktree(tmp_path, monkeypatch):
    import ab_objects

    commands = []

    def run(command, **kwargs):
        commands.append(command)
        if command[0] == "make":  # the objects appear where the Makefile puts them
            source = pathlib.Path(command[2])
            for target in command[4:]:
                (source / target).parent.mkdir(parents=True, exist_ok=True)
                (source / target).write_bytes(b"\x7fELF")

    monkeypatch.setattr(ab_objects.subprocess, "run", run)
    folder = ab_objects.build_objects("abc123", ["bwd_hdim128_bf16_full", "bwd_hdim64_bf16_full"], tmp_path / "old")
    assert sorted(p.name for p in folder.iterdir()) == ["bwd_hdim128_bf16_full.o", "bwd_hdim64_bf16_full.o"]
    add, make, remove = commands
    assert add[-2:] == [str(tmp_path / "old" / "src"), "abc123"] and "worktree" in add and "add" in add
    assert make[:3] == ["make", "-C", str(tmp_path / "old" / "src")]
    assert make[4:] == ["build/prebuilt/bwd_hdim128_bf16_full.o", "build/prebuilt/bwd_hdim64_bf16_full.o"]
    assert "remove" in remove
    with pytest.raises(SystemExit):  # a git variant needs --objects
        ab_objects.parse(["--variant", "a=git:HEAD", "--variant", f"b={tmp_path}", "--", "true"])
    args, command = ab_objects.parse(["--variant", "a=git:HEAD", "--variant", f"b={tmp_path}", "--objects", "x,y",
                                      "--", "true"])
    assert args.variants == {"a": "git:HEAD", "b": tmp_path.resolve()} and args.objects == ["x", "y"]


def test_fa3_columns_only_where_its_measurement_build_has_kernels(monkeypatch):
    """FA3's measurement build holds bf16 head dims 64/128, dense, without soft-capping: elsewhere its column says
    n/a (a call would reach a kernel never compiled and crash the process)."""
    import types

    import peers
    monkeypatch.setitem(sys.modules, "flash_attn_interface", types.ModuleType("flash_attn_interface"))
    impl = peers.Fa3Impl(deterministic=False)
    base = dict(batch=1, seqlen_q=1024, seqlen_k=1024, nheads=16, nheads_k=16, causal=True)
    assert impl.unavailable_reason(bench_attn.Problem(headdim=128, **base)) is None
    assert "head dims" in impl.unavailable_reason(bench_attn.Problem(headdim=256, **base))
    assert "soft-capping" in impl.unavailable_reason(bench_attn.Problem(headdim=64, softcap=30.0, **base))
