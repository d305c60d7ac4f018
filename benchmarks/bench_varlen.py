"""Varlen backward TFLOPS: flash_attn_varlen_func's backward, deterministic against non-deterministic, per pack.

Each row packs sequences of the listed lengths (16k tokens in all) with 2048 / hdim query heads (MHA) and times the
backward alone (the forward's output kept, L2 flushed before every timed call), rounds interleaved; the table shows
each column's median over the rounds. FLOPs: benchmarks/flops.py per sequence (backward = 2.5 x forward, causal
halved). Columns: `nd` the non-deterministic backward (`auto`), `det` the deterministic one (`auto`: the varlen
invariant pick), one more per name in --schedules (deterministic, that schedule named) and in --nondet-schedules
(non-deterministic, that schedule named), and det / nd.

    python benchmarks/bench_varlen.py [--hdims 128,64] [--masks causal,full] [--schedules descending]
        [--nondet-schedules shift_causal_runs] [--rounds 3] [--out FOLDER]

With --out the medians also go to FOLDER/bench_varlen.json, one row per (hdim, mask, pack, column).
"""
import argparse
import json
import pathlib
import sys
import types

import torch

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # an in-tree dash_attn, as bench_attn.py finds it
import dash_attn  # noqa: E402
from bench_attn import EXIT_NO_GPU, Timer, check_schedule_columns, int_list, str_list  # noqa: E402
from flops import flops, tflops  # noqa: E402

PACKS = {  # name: sequence lengths
    "16x1k": [1024] * 16,
    "4x4k": [4096] * 4,
    "mixed": [3000, 700, 5000, 1200, 2000, 4484],
    "docs": [6000, 3100, 2200, 1500, 1100, 800, 600, 500, 300, 284],  # a long-tailed spread of document lengths
    "1x16k": [16384],
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--hdims", type=int_list, default=[128, 64])
    p.add_argument("--masks", type=str_list, default=["causal", "full"], help="comma list of causal,full")
    p.add_argument("--packs", type=str_list, default=list(PACKS),
                   help=f"comma list of {','.join(PACKS)} or of explicit lengths joined by '+' (e.g. 3000+700)")
    p.add_argument("--schedules", type=str_list, default=[], help="deterministic schedules to time beside auto")
    p.add_argument("--nondet-schedules", type=str_list, default=[],
                   help="non-deterministic schedules to time beside auto")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--gqa", type=int, default=1, help="query heads per KV head (2048 / hdim query heads)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--rep-ms", type=float, default=40)
    p.add_argument("--out", type=pathlib.Path, help="folder for bench_varlen.json")
    args = p.parse_args(argv)
    for pack in args.packs:
        pack_lengths(pack)
    check_schedule_columns(p, args)
    return args


def pack_lengths(pack):
    """A named pack's lengths, or the lengths of a pack spelled as lengths joined by '+'."""
    if pack in PACKS:
        return PACKS[pack]
    try:
        lens = [int(n) for n in pack.split("+")]
    except ValueError:
        lens = []
    if not lens or min(lens) <= 0:
        raise SystemExit(f"--packs: {pack!r} is neither one of {', '.join(PACKS)} nor positive lengths joined by '+'")
    return lens


def backward_closure(lens, hdim, causal, dtype, deterministic, schedule, gqa):
    nheads = 2048 // hdim
    cu = torch.tensor([0] + lens, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q, k, v = (torch.randn(sum(lens), heads, hdim, device="cuda", dtype=dtype, requires_grad=True)
               for heads in (nheads, nheads // gqa, nheads // gqa))
    out = dash_attn.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal,
                                           deterministic=deterministic, schedule=schedule)
    out = out[0] if isinstance(out, tuple) else out
    dout = torch.randn_like(out)
    n_flops = sum(flops("bwd", 1, nheads, n, n, hdim, causal) for n in lens)
    return (lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)), n_flops


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen.py needs a CUDA GPU (none visible to torch)", file=sys.stderr)
        return EXIT_NO_GPU
    timer = Timer(torch, types.SimpleNamespace(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    columns = ([("nd", False, "auto"), ("det", True, "auto")] + [(f"det {s}", True, s) for s in args.schedules] +
               [(f"nd {s}", False, s) for s in args.nondet_schedules])
    print(f"| hdim | mask | pack | {' | '.join(c[0] for c in columns)} | det/nd |")
    print("|---|---|---|" + "---|" * (len(columns) + 1))
    rows = []
    for hdim in args.hdims:
        for mask in args.masks:
            for pack in args.packs:
                lens = pack_lengths(pack)
                runs = [backward_closure(lens, hdim, mask == "causal", dtype, det, s, args.gqa)
                        for _, det, s in columns]
                rates = [[] for _ in columns]
                for _ in range(args.rounds):
                    for rate, (fn, n_flops) in zip(rates, runs):
                        rate.append(tflops(n_flops, timer(fn)))
                med = [sorted(r)[len(r) // 2] for r in rates]
                cells = " | ".join(f"{m:.0f}" for m in med)
                print(f"| {hdim} | {mask} | {pack} | {cells} | {med[1] / med[0]:.3f} |", flush=True)
                rows += [{"hdim": hdim, "mask": mask, "pack": pack, "gqa": args.gqa, "dtype": args.dtype,
                          "column": column[0], "tflops": m} for column, m in zip(columns, med)]
                del runs
                torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_varlen.json").write_text(json.dumps({"results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
