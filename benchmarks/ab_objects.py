"""A/B of kernel builds in one session: the extension relinked with each variant's kernel objects in turn, a benchmark
run after each link, the variants alternating round by round, and one table of the mean TFLOPS per cell.

    python benchmarks/ab_objects.py --variant new=git:HEAD --variant old=git:HEAD~3 \\
        --objects bwd_hdim128_bf16_full,bwd_hdim128_bf16_full_packed --rounds 3 -- \\
        python benchmarks/bench_attn.py --bwd-only --hdims 128 --masks full --gqa 4 --rounds 2 --no-plot

A variant is a folder of instantiation objects (`make prebuild` names them) or a git revision, whose `--objects` are
compiled first (a worktree of that revision, `make build/prebuilt/NAME.o`, all cores). The objects a variant does not
hold are compiled here once, with the build's head dims and dtypes (DASH_ATTN_HDIMS, DASH_ATTN_DTYPES, ...), and
reused by every link, so a relink takes seconds: give every variant the same object names. Objects compiled from
different csrc/schedule/ headers do not link together (setup.py refuses them: their inline host-side schedule
code would mix), so a variant that changes the schedule holds a whole set (`make prebuild`). The benchmark command
gets `--out <folder>` appended and must write a JSON file there whose "results" rows carry "tflops" (bench_attn.py's
bench_attn.json, bench_varlen.py's bench_varlen.json); a cell is a row's other fields. Variants alternate
(A B A B ...), so that a slow spell of the GPU does not fall on one of them only; peers timed in the same runs (FA3,
cuDNN) show how much the machine moved.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Fields of a result row that are measurements, not the cell's name.
VALUE_KEYS = {"tflops", "ms", "round_ms", "status", "reason"}


def parse(argv: List[str]) -> Tuple[argparse.Namespace, List[str]]:
    if "--" not in argv:
        raise SystemExit("ab_objects.py: give the benchmark command after --")
    ours, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FOLDER|NAME=git:REV",
                        help="a variant: the folder of its kernel objects, or a git revision to build them from "
                             "(two or more)")
    parser.add_argument("--objects", default="",
                        help="comma list of instantiation names (csrc/instantiations/*.cu stems) that git variants "
                             "build")
    parser.add_argument("--rounds", type=int, default=3, help="links of each variant, alternating (default 3)")
    parser.add_argument("--out", default=str(ROOT / "build" / "ab"), help="folder for every run's results")
    args = parser.parse_args(ours)
    variants = {}
    objects = [name for name in args.objects.split(",") if name]
    for spec in args.variant:
        name, sep, source = spec.partition("=")
        if not sep or not name or not (source.startswith("git:") or pathlib.Path(source).is_dir()):
            parser.error(f"--variant takes NAME=FOLDER with an existing folder or NAME=git:REV, got {spec!r}")
        if source.startswith("git:") and not objects:
            parser.error(f"--variant {spec}: a git revision needs --objects")
        variants[name] = source if source.startswith("git:") else pathlib.Path(source).resolve()
    if len(variants) < 2 or args.rounds < 1 or not command:
        parser.error("two or more variants, --rounds >= 1 and a benchmark command after -- are needed")
    return argparse.Namespace(variants=variants, objects=objects, rounds=args.rounds, out=pathlib.Path(args.out)), \
        command


def build_objects(rev: str, names: List[str], folder: pathlib.Path) -> pathlib.Path:
    """`names`' objects compiled from revision `rev` (a detached worktree, removed afterwards) into `folder`."""
    source = folder / "src"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(source), rev], check=True)
    try:
        targets = [f"build/prebuilt/{name}.o" for name in names]
        subprocess.run(["make", "-C", str(source), f"-j{os.cpu_count() or 1}", *targets], check=True)
        folder.joinpath("objects").mkdir(exist_ok=True)
        for target in targets:
            (source / target).replace(folder / "objects" / pathlib.Path(target).name)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(source)], check=True)
    return folder / "objects"


def relink(objects: pathlib.Path) -> None:
    """The extension rebuilt in place with `objects`' kernel objects (setup.py's DASH_ATTN_PREBUILT_DIR)."""
    for so in (ROOT / "dash_attn").glob("_C*.so"):
        so.unlink()
    env = dict(os.environ, DASH_ATTN_PREBUILT_DIR=str(objects))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)


def cells_of(folder: pathlib.Path) -> Dict[str, float]:
    """TFLOPS per cell of a run's results (every *.json in its folder); cells without a timing are left out."""
    cells = {}
    for result in sorted(folder.glob("*.json")):
        for row in json.loads(result.read_text()).get("results", []):
            if row.get("tflops"):
                name = ", ".join(f"{k}={row[k]}" for k in sorted(row) if k not in VALUE_KEYS)
                cells[name] = row["tflops"]
    return cells


def table(runs: Dict[str, List[Dict[str, float]]]) -> str:
    """One line per cell: each variant's mean over its runs (the runs in brackets), then each against the first."""
    names = list(runs)
    means = {}
    for name, results in runs.items():
        values = collections.defaultdict(list)
        for cells in results:
            for key, tflops in cells.items():
                values[key].append(tflops)
        means[name] = values
    lines = [" | ".join(["cell"] + names + [f"{n} / {names[0]}" for n in names[1:]])]
    for key in sorted(set().union(*means.values())):
        got = [means[n].get(key, []) for n in names]
        cols = [f"{sum(v) / len(v):.0f} ({', '.join(f'{x:.0f}' for x in v)})" if v else "n/a" for v in got]
        ratios = [f"{sum(v) / len(v) / (sum(got[0]) / len(got[0])):.3f}" if v and got[0] else "n/a" for v in got[1:]]
        lines.append(" | ".join([key] + cols + ratios))
    return "\n".join(lines)


def main(argv=None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, source in args.variants.items():
        if isinstance(source, str):
            args.variants[name] = build_objects(source[len("git:"):], args.objects, args.out / name)
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in args.variants}
    for round_index in range(args.rounds):
        for name, objects in args.variants.items():
            relink(objects)
            out = pathlib.Path(tempfile.mkdtemp(prefix=f"{name}_{round_index}_", dir=args.out))
            subprocess.run(command + ["--out", str(out)], check=True)
            runs[name].append(cells_of(out))
            # The table so far after every run, so that a command cut off by a time limit still leaves one.
            (args.out / "ab.txt").write_text(table(runs) + "\n")
            print(f"ab_objects: round {round_index + 1} {name} done ({out})", flush=True)
    report = table(runs)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
