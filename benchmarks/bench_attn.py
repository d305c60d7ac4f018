"""Forward and backward TFLOPS of dash_attn (per backward schedule, deterministic and not) beside the peers on this GPU.

    python benchmarks/bench_attn.py --quick          # about a minute: hdim 128, seqlen 2k and 8k, full + causal
                                                     # (no FlexAttention unless --peers names it)
    python benchmarks/bench_attn.py                  # the standard grid (benchmarks/RESULTS.md)
    python benchmarks/bench_attn.py --hdims 64 --masks causal --gqa 1,4 --schedules descending,shift_causal

Every row keeps batch x seqlen constant (--tokens, 16k by default); heads = 2048 / hdim (16 for hdim 128, 32 for
hdim 64). FLOPs come from benchmarks/flops.py. Times are medians (triton.testing.do_bench, which flushes L2 before
every call; without triton, CUDA events with an L2 flush). An implementation that is missing, refuses the problem or
fails shows "n/a" with its reason in the JSON; the run goes on. Output goes to --out: bench_attn.csv,
bench_attn.json (with the machine and versions), bench_attn.md (the tables in Markdown for RESULTS.md) and one
PNG per (direction, GQA ratio).
"""
import argparse
import csv
import dataclasses
import datetime
import gc
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO))  # an in-tree dash_attn is found when the package is not installed

import flops as flops_lib  # noqa: E402

EXIT_NO_GPU = 2
HIDDEN_SIZE = 2048  # heads x hdim of the standard grid: 16 x 128 and 32 x 64, as in benchmarks/RESULTS.md
DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
QUICK_SEQLENS = (2048, 8192)
NA = "n/a"


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    headdim: int
    causal: bool
    window: tuple = (-1, -1)  # (left, right) around the bottom-right diagonal; (-1, -1): no window
    softcap: float = 0.0      # > 0: scores = softcap * tanh(scores / softcap)

    @property
    def windowed(self):
        return tuple(self.window) != (-1, -1)

    @property
    def mask(self):
        return "window" if self.windowed else "causal" if self.causal else "full"

    @property
    def gqa(self):
        return self.nheads // self.nheads_k

    def flops(self, direction):
        if self.windowed:
            return flops_lib.window_flops(direction, self.batch, self.nheads, self.seqlen_q, self.seqlen_k,
                                          self.headdim, tuple(self.window))
        return flops_lib.flops(direction, self.batch, self.nheads, self.seqlen_q, self.seqlen_k, self.headdim,
                               self.causal)


@dataclasses.dataclass
class Timing:
    warmup_ms: float
    rep_ms: float


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def str_list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def check_schedule_columns(parser, args):
    """--schedules (deterministic) and --nondet-schedules name schedules that mode runs (bench_attn and bench_varlen)."""
    import peers
    for flag, names, known in (("--schedules", args.schedules, peers.DASH_SCHEDULES),
                               ("--nondet-schedules", args.nondet_schedules, peers.DASH_NONDET_SCHEDULES)):
        for name in names:
            if name not in known:
                parser.error(f"{flag}: unknown schedule {name!r} (use {','.join(known)})")


def parse_args(argv):
    import peers
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="hdim 128, seqlen 2k and 8k, fewer repeats (~1 minute)")
    p.add_argument("--hdims", type=int_list, default=None, help="comma list (default 128,64)")
    p.add_argument("--seqlens", type=int_list, default=None, help="comma list (default 1024..16384)")
    p.add_argument("--seqlen-k", type=int, default=None,
                   help="keys of every row (default: the row's seqlen); batch = tokens / seqlen_q")
    p.add_argument("--masks", type=str_list, default=["full", "causal"], help="comma list of full,causal,window")
    p.add_argument("--window", type=int_list, default=[1024, 0],
                   help="LEFT,RIGHT of the window mask around the diagonal, -1 = unbounded (default 1024,0)")
    p.add_argument("--gqa", type=int_list, default=[1], help="comma list of nheads/nheads_k ratios (default 1)")
    p.add_argument("--softcap", type=float, default=0.0,
                   help="soft-capped scores, softcap * tanh(scores / softcap) (default 0: off; SDPA has none)")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen per row (default 16384)")
    p.add_argument("--nheads", type=int, default=None, help="query heads (default 2048 / hdim)")
    p.add_argument("--schedules", type=str_list, default=list(peers.DASH_SCHEDULES),
                   help="dash_attn deterministic schedules (default all: %s)" % ",".join(peers.DASH_SCHEDULES))
    p.add_argument("--nondet-schedules", type=str_list, default=[],
                   help="extra non-deterministic columns, one per visit order (%s; default none: the non-det "
                        "column is auto's pick)" % ",".join(peers.DASH_NONDET_SCHEDULES))
    p.add_argument("--peers", type=str_list, default=None,
                   help="peers to run (default all present: %s; --quick leaves out flex, whose per-shape "
                        "torch.compile takes longer than the rest of a quick run)" % ",".join(peers.PEER_KEYS))
    p.add_argument("--no-peers", action="store_true", help="dash_attn only")
    p.add_argument("--sink", action="store_true",
                   help="add dash_attn columns with a learnable sink per query head (non-det and det, auto)")
    p.add_argument("--sm-margin", type=int, default=0, help="SMs dash_attn's backward leaves free (default 0)")
    p.add_argument("--no-dash", action="store_true", help="peers only")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--fwd-only", action="store_true")
    direction.add_argument("--bwd-only", action="store_true")
    p.add_argument("--warmup-ms", type=float, default=None, help="warm-up per measurement (default 25, quick 10)")
    p.add_argument("--rep-ms", type=float, default=None, help="timed time per measurement (default 100, quick 40)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the whole grid this many times, cell after cell, and report each cell's median round "
                        "(one pass drifts by 3-7%% between cells of the same kernel; checks run in round 1 only)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the dash_attn sanity checks (error vs SDPA, bitwise repeat of deterministic grads)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", type=pathlib.Path, default=HERE / "out", help="output folder (default benchmarks/out)")
    args = p.parse_args(argv)

    if args.peers is None:
        args.peers = [k for k in peers.PEER_KEYS if not (args.quick and k == "flex")]
    args.hdims = args.hdims or ([128] if args.quick else [128, 64])
    args.seqlens = args.seqlens or list(QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (10.0 if args.quick else 25.0)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (40.0 if args.quick else 100.0)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.seqlen_k is not None and args.seqlen_k < 1:
        p.error("--seqlen-k must be >= 1")
    for mask in args.masks:
        if mask not in ("full", "causal", "window"):
            p.error(f"--masks: unknown mask {mask!r} (use full,causal,window)")
    if len(args.window) != 2 or min(args.window) < -1 or args.window == [-1, -1]:
        p.error("--window takes LEFT,RIGHT, each >= -1 and not both -1 (that is the full mask)")
    check_schedule_columns(p, args)
    for key in args.peers:
        if key not in peers.PEER_KEYS:
            p.error(f"--peers: unknown peer {key!r} (use {','.join(peers.PEER_KEYS)})")
    if args.no_peers:
        args.peers = []
    args.directions = ["fwd"] if args.fwd_only else ["bwd"] if args.bwd_only else ["fwd", "bwd"]
    return args


def problems(args):
    for gqa in args.gqa:
        for hdim in args.hdims:
            nheads = args.nheads or max(1, HIDDEN_SIZE // hdim)
            if nheads % gqa:
                print(f"note: skipping GQA {gqa} for hdim {hdim}: {nheads} heads are not divisible by it")
                continue
            for mask in args.masks:
                for seqlen in args.seqlens:
                    yield Problem(max(1, args.tokens // seqlen), seqlen, args.seqlen_k or seqlen, nheads,
                                  nheads // gqa, hdim, mask == "causal",
                                  tuple(args.window) if mask == "window" else (-1, -1), args.softcap)


# ---------------------------------------------------------------- timing

class Timer:
    """Median time of a closure in ms, L2 flushed before every timed call."""

    def __init__(self, torch, timing):
        self.torch = torch
        self.timing = timing
        try:
            import triton.testing
            self._do_bench = triton.testing.do_bench
            self.method = f"triton.testing.do_bench (median, L2 flushed), triton {triton.__version__}"
        except ImportError:
            self._do_bench = None
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            # Twice the L2 so a flush evicts everything; the fallback only matters for a torch without the attribute.
            l2_bytes = getattr(props, "L2_cache_size", 0) or (128 << 20)
            self._flush = torch.empty(2 * l2_bytes, dtype=torch.uint8, device="cuda")
            self.method = "CUDA events (median, L2 flushed by a memset)"

    def __call__(self, fn):
        if self._do_bench is not None:
            try:
                return float(self._do_bench(fn, warmup=self.timing.warmup_ms, rep=self.timing.rep_ms,
                                            return_mode="median"))
            except TypeError:  # older triton: no return_mode
                return float(self._do_bench(fn, warmup=self.timing.warmup_ms, rep=self.timing.rep_ms,
                                            quantiles=[0.5]))
        return self._events(fn)

    def _events(self, fn):
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        torch.cuda.synchronize()
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate_ms = max(start.elapsed_time(end) / 3, 1e-3)
        for _ in range(max(1, int(self.timing.warmup_ms / estimate_ms))):
            fn()
        n_rep = max(5, int(self.timing.rep_ms / estimate_ms))
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n_rep)]
        for s, e in pairs:
            self._flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in pairs)
        return times[len(times) // 2]


# ---------------------------------------------------------------- progress

class Progress:
    """tqdm when importable; else an in-place counter on a terminal, or a line per 10% in a log file (so a
    captured log keeps its tail for the tables)."""

    def __init__(self, total):
        self.total = total
        self.done = 0
        self._tty = sys.stderr.isatty()
        self._next_mark = 0.1
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, unit="run", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self._bar = None

    def step(self, text):
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update(1)
        elif self._tty:
            sys.stderr.write(f"\r[{self.done}/{self.total}] {text[:70]:<70}")
            sys.stderr.flush()
        elif self.done >= self._next_mark * self.total:
            self._next_mark += 0.1
            sys.stderr.write(f"[{self.done}/{self.total}] {text}\n")
            sys.stderr.flush()

    def close(self):
        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            sys.stderr.write("\n")


# ---------------------------------------------------------------- measuring

def short_error(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


class Runner:
    def __init__(self, torch, args, impls):
        self.torch = torch
        self.args = args
        self.impls = impls
        self.timer = Timer(torch, Timing(args.warmup_ms, args.rep_ms))
        self.rows = []
        self.checks = []
        self.context_lost = None

    def _alive(self):
        """After a failure, make sure the CUDA context survived; a sticky error would poison every later number."""
        if self.context_lost:
            return False
        try:
            self.torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any error here means the context is gone
            self.context_lost = short_error(exc)
            print(f"\nerror: the CUDA context is lost ({self.context_lost}); the remaining runs are marked n/a")
        return not self.context_lost

    def inputs(self, problem):
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(0)
        shape_q = (problem.batch, problem.seqlen_q, problem.nheads, problem.headdim)
        shape_k = (problem.batch, problem.seqlen_k, problem.nheads_k, problem.headdim)
        make = lambda shape: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
        return make(shape_q), make(shape_k), make(shape_k), make(shape_q)

    def record(self, problem, impl, direction, ms=None, status="ok", reason=""):
        tflops = flops_lib.tflops(problem.flops(direction), ms) if ms else None
        self.rows.append({
            "direction": direction, "hdim": problem.headdim, "nheads": problem.nheads, "nheads_k": problem.nheads_k,
            "gqa": problem.gqa, "batch": problem.batch, "seqlen_q": problem.seqlen_q, "seqlen_k": problem.seqlen_k,
            "mask": problem.mask, "window": list(problem.window), "impl": impl.key, "label": impl.label,
            "family": impl.family,
            "deterministic": impl.deterministic, "schedule": impl.schedule or "", "ms": ms, "tflops": tflops,
            "status": status, "reason": reason,
        })

    def measure(self, problem, impl, direction, tensors, check=True):
        if not self._alive():
            self.record(problem, impl, direction, status=NA, reason=f"CUDA context lost earlier: {self.context_lost}")
            return
        reason = impl.unavailable_reason(problem)
        if reason:
            self.record(problem, impl, direction, status=NA, reason=reason)
            return
        q, k, v, dout = tensors
        fn = None
        timed = False
        try:
            with impl.context():
                fn = impl.make_fwd(q, k, v, problem) if direction == "fwd" else impl.make_bwd(q, k, v, dout, problem)
                ms = self.timer(fn)
            self.record(problem, impl, direction, ms)
            timed = True
            if direction == "bwd" and impl.family == "dash" and impl.deterministic and check and not self.args.no_check:
                with impl.context():
                    self.check_repeatable(problem, impl, fn)
        except Exception as exc:  # noqa: BLE001 - a failing peer is a table entry, never a crash
            if timed:  # the time stands; the failure belongs to the repeat check
                self.checks.append({"check": "bitwise_repeat", "problem": dataclasses.asdict(problem),
                                    "impl": impl.key, "error": short_error(exc), "ok": False})
            else:
                self.record(problem, impl, direction, status=NA, reason=short_error(exc))
            self._alive()
        finally:
            del fn
            gc.collect()
            self.torch.cuda.empty_cache()

    def check_repeatable(self, problem, impl, fn):
        """Deterministic columns must give bitwise-equal gradients call after call; record it next to the speed."""
        first = [g.clone() for g in fn()]
        same = all(self.torch.equal(a, b) for a, b in zip(first, fn()))
        self.checks.append({"check": "bitwise_repeat", "problem": dataclasses.asdict(problem), "impl": impl.key,
                            "ok": same})
        if not same:
            print(f"\nWARNING: {impl.key} gave different gradients on two calls ({problem})")

    def check_accuracy(self, problem, tensors):
        """Relative L2 error of dash_attn's output and gradients against SDPA (bf16 vs bf16: ~1e-2 at most)."""
        import peers
        dash = next((i for i in self.impls if i.key == "dash_nondet"), None)
        if dash is None or dash.unavailable_reason(problem) or not self._alive():
            return
        q, k, v, dout = tensors
        results = {}
        try:
            for name, impl in (("dash", dash), ("ref", peers.SdpaImpl("fa2")), ("ref", peers.SdpaImpl("efficient"))):
                if name in results or impl.unavailable_reason(problem):
                    continue
                try:
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    out = impl.forward(*leaves, problem)
                    grads = self.torch.autograd.grad(out, leaves, dout)
                    results[name] = [out.detach().float()] + [g.float() for g in grads]
                except RuntimeError as exc:
                    if name == "dash":
                        raise
                    results.setdefault("ref_errors", []).append(short_error(exc))
            if "ref" not in results:
                return
            errs = {n: float((a - b).norm() / b.norm().clamp_min(1e-30))
                    for n, a, b in zip(("out", "dq", "dk", "dv"), results["dash"], results["ref"])}
            ok = all(e == e and e < 2e-2 for e in errs.values())
            self.checks.append({"check": "rel_l2_vs_sdpa", "problem": dataclasses.asdict(problem), "errors": errs,
                                "ok": ok})
            if not ok:
                print(f"\nWARNING: dash_attn differs from SDPA on {problem}: {errs}")
        except Exception as exc:  # noqa: BLE001
            self.checks.append({"check": "rel_l2_vs_sdpa", "problem": dataclasses.asdict(problem),
                                "error": short_error(exc), "ok": False})
            self._alive()
        finally:
            results.clear()
            gc.collect()
            self.torch.cuda.empty_cache()

    def run(self, problem_list):
        tasks = [(p, i, d) for p in problem_list for i in self.impls for d in self.args.directions
                 if d == "bwd" or i.time_fwd]
        rounds = self.args.rounds
        progress = Progress(len(tasks) * rounds)
        current = None
        tensors = None
        try:
            for r in range(rounds):
                for problem, impl, direction in tasks:
                    if problem != current:
                        tensors = None
                        gc.collect()
                        self.torch.cuda.empty_cache()
                        current = problem
                        tensors = self.inputs(problem)
                        if not self.args.no_check and r == 0:
                            self.check_accuracy(problem, tensors)
                    progress.step(f"{f'round {r + 1}/{rounds} ' if rounds > 1 else ''}hdim{problem.headdim} "
                                  f"{problem.mask} {problem.seqlen_q} gqa{problem.gqa} {impl.label} {direction}")
                    self.measure(problem, impl, direction, tensors, check=(r == 0))
        finally:
            progress.close()
        self.rows = median_rounds(self.rows)


def median_rounds(rows):
    """One row per cell: the round with the median time (the lower one of two middles), with every round's time in
    round_ms; a cell without a timed round keeps its first row."""
    cells = {}
    for r in rows:
        key = tuple((k, json.dumps(v)) for k, v in r.items() if k not in ("ms", "tflops", "status", "reason"))
        cells.setdefault(key, []).append(r)
    merged = []
    for group in cells.values():
        timed = sorted((r for r in group if r["ms"]), key=lambda r: r["ms"])
        row = dict(timed[(len(timed) - 1) // 2] if timed else group[0])
        row["round_ms"] = ";".join(f"{r['ms']:.4f}" for r in group if r["ms"])
        merged.append(row)
    return merged


# ---------------------------------------------------------------- reporting

def group_rows(rows):
    groups = {}
    for r in rows:
        groups.setdefault((r["direction"], r["gqa"], r["hdim"], r["mask"]), []).append(r)
    return groups


def summarize(rows):
    """Per backward problem: dash det/non-det ratio and dash best-det over the best deterministic peer."""
    out = []
    by_problem = {}
    for r in rows:
        if r["direction"] == "bwd":
            by_problem.setdefault((r["gqa"], r["hdim"], r["mask"], r["seqlen_q"]), []).append(r)
    for (gqa, hdim, mask, seqlen), group in by_problem.items():
        ok = [r for r in group if r["tflops"]]
        nondet = next((r for r in ok if r["impl"] == "dash_nondet"), None)
        # The sink columns price a different call (bench --sink): they compete with neither side.
        dets = [r for r in ok if r["family"] == "dash" and r["deterministic"] and not r["impl"].endswith("_sink")]
        det_peers = [r for r in ok if r["family"] == "peer" and r["deterministic"]]
        best_det = max(dets, key=lambda r: r["tflops"], default=None)
        best_peer = max(det_peers, key=lambda r: r["tflops"], default=None)
        out.append({
            "gqa": gqa, "hdim": hdim, "mask": mask, "seqlen": seqlen,
            "dash_nondet_tflops": nondet["tflops"] if nondet else None,
            "dash_best_det_schedule": best_det["schedule"] if best_det else None,
            "dash_best_det_tflops": best_det["tflops"] if best_det else None,
            "det_over_nondet": best_det["tflops"] / nondet["tflops"] if best_det and nondet else None,
            "best_det_peer": best_peer["impl"] if best_peer else None,
            "best_det_peer_tflops": best_peer["tflops"] if best_peer else None,
            "speedup_over_best_det_peer": best_det["tflops"] / best_peer["tflops"] if best_det and best_peer else None,
        })
    return out


def format_tflops(value):
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def build_tables(rows, summary, impls):
    """[(title, [header, row, ...])], one table per (direction, GQA, hdim, mask), rows = seqlen."""
    tables = []
    summary_by = {(s["gqa"], s["hdim"], s["mask"], s["seqlen"]): s for s in summary}
    order = lambda kv: (kv[0][1], -kv[0][2], kv[0][3] != "full", kv[0][0] != "fwd")  # noqa: E731
    for (direction, gqa, hdim, mask), group in sorted(group_rows(rows).items(), key=order):
        cols = [i for i in impls if any(r["impl"] == i.key for r in group)]
        cells = {(r["seqlen_q"], r["impl"]): r for r in group}
        mask_text = f"window {tuple(group[0]['window'])}" if mask == "window" else mask
        title = (f"{direction.upper()} TFLOPS  hdim {hdim}  {mask_text}  heads q/kv {group[0]['nheads']}/"
                 f"{group[0]['nheads_k']}  ({group[0]['batch'] * group[0]['seqlen_q']} tokens per row)")
        header = ["seqlen"] + [c.label for c in cols]
        if direction == "bwd":
            header += ["best det", "det/nd", "vs det peer"]
        table = [header]
        for s in sorted({r["seqlen_q"] for r in group}):
            line = [str(s)]
            for c in cols:
                r = cells.get((s, c.key))
                line.append(format_tflops(r["tflops"]) if r and r["tflops"] else NA)
            if direction == "bwd":
                sm = summary_by.get((gqa, hdim, mask, s), {})
                line.append(sm.get("dash_best_det_schedule") or NA)
                line.append(f"{sm['det_over_nondet']:.3f}" if sm.get("det_over_nondet") else NA)
                line.append(f"{sm['speedup_over_best_det_peer']:.2f}x" if sm.get("speedup_over_best_det_peer") else NA)
            table.append(line)
        tables.append((title, table))
    return tables


def render_text(tables):
    lines = []
    for title, table in tables:
        lines.append(f"\n{title}")
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines.extend("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table)
    return "\n".join(lines)


def render_markdown(tables, meta, notes):
    """The same tables as Markdown, ready to paste into benchmarks/RESULTS.md."""
    lines = [f"Measured {meta['date_utc']} on {meta['gpu']} ({meta['sm_count']} SMs), commit "
             f"{meta['git_commit'] or 'unknown'}{' (dirty)' if meta['git_dirty'] else ''}, torch {meta['torch']}, "
             f"CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, triton {meta['triton']}. Timing: {meta['timing']}.", ""]
    for title, table in tables:
        lines += [f"### {' '.join(title.split())}", "", "| " + " | ".join(table[0]) + " |",
                  "|" + "---|" * len(table[0])]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        lines.append("")
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def unavailable_notes(rows):
    """One line per implementation that produced n/a, with its first reason."""
    seen = {}
    for r in rows:
        if r["status"] != "ok" and r["impl"] not in seen:
            seen[r["impl"]] = f"{r['label']}: n/a ({r['reason']})"
    return list(seen.values())


def plot(rows, impls, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return [f"no plot: matplotlib missing ({exc})"]
    written = []
    labels = {i.key: i.label for i in impls}
    panels_by_figure = {}
    for (direction, gqa, hdim, mask), group in group_rows(rows).items():
        panels_by_figure.setdefault((direction, gqa), {})[(hdim, mask)] = group
    for (direction, gqa), panels in sorted(panels_by_figure.items()):
        hdims = sorted({h for h, _ in panels}, reverse=True)
        masks = [m for m in ("full", "causal", "window") if any(pm == m for _, pm in panels)]
        fig, axes = plt.subplots(len(hdims), len(masks), figsize=(6 * len(masks), 4 * len(hdims)), squeeze=False)
        for (hdim, mask), group in panels.items():
            ax = axes[hdims.index(hdim)][masks.index(mask)]
            for impl in impls:
                pts = sorted((r["seqlen_q"], r["tflops"]) for r in group if r["impl"] == impl.key and r["tflops"])
                if pts:
                    style = "-" if impl.family == "dash" else "--"
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=labels[impl.key])
            ax.set_xscale("log", base=2)
            seqlens = sorted({r["seqlen_q"] for r in group})
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s % 1024 == 0 else str(s) for s in seqlens])
            ax.set_title(f"{direction} hdim {hdim} {mask} (GQA {gqa})")
            ax.set_xlabel("seqlen (batch x seqlen constant)")
            ax.set_ylabel("TFLOPS")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"bench_attn_{direction}_gqa{gqa}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def git_commit():
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None, None
    if commit.returncode != 0:
        return None, None
    return commit.stdout.strip(), bool(dirty.stdout.strip())


def machine_info(torch, timer):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    commit, dirty = git_commit()
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit, "git_dirty": dirty,
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": props.name, "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}", "python": sys.version.split()[0],
        "timing": timer.method,
    }
    for name in ("dash_attn", "triton"):
        try:
            info[name] = getattr(__import__(name), "__version__", "unknown")
        except ImportError:
            info[name] = None
    return info


def write_outputs(out_dir, meta, rows, summary, checks, notes):
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "bench_attn.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()) if rows else ["direction"])
        writer.writeheader()
        writer.writerows(rows)
    json_path = out_dir / "bench_attn.json"
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "results": rows, "summary": summary, "checks": checks, "notes": notes}, f, indent=1)
    return [str(csv_path), str(json_path)]


# ---------------------------------------------------------------- main

def import_torch():
    try:
        import torch
    except ImportError as exc:
        print(f"bench_attn.py needs PyTorch ({exc}).", file=sys.stderr)
        sys.exit(EXIT_NO_GPU)
    return torch


def require_gpu(torch):
    """A clear message and exit code 2 where there is no CUDA device."""
    if not torch.cuda.is_available():
        print(f"bench_attn.py needs a CUDA GPU and found none (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda}). Run it on the H200 machine; nothing was measured.", file=sys.stderr)
        sys.exit(EXIT_NO_GPU)


def main(argv=None):
    torch = import_torch()  # before parse_args: the adapters' constants live beside torch code
    args = parse_args(argv)
    require_gpu(torch)
    import peers

    impls = peers.build_impls(args.schedules, args.peers, with_dash=not args.no_dash, sm_margin=args.sm_margin,
                              nondet_schedules=args.nondet_schedules, sink=args.sink)
    if not impls:
        print("nothing to run: --no-dash with --no-peers", file=sys.stderr)
        return 1
    runner = Runner(torch, args, impls)
    meta = machine_info(torch, runner.timer)
    meta["args"] = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    print(f"{meta['gpu']} ({meta['sm_count']} SMs, sm{meta['capability'].replace('.', '')}), torch {meta['torch']}, "
          f"CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, commit {meta['git_commit'] or 'unknown'}"
          f"{' (dirty)' if meta['git_dirty'] else ''}")
    print(f"timing: {meta['timing']}, warm-up {args.warmup_ms:g} ms, timed {args.rep_ms:g} ms per measurement")
    dash_probe = next((i for i in impls if i.family == "dash"), None)
    if dash_probe is not None:
        reason = dash_probe.unavailable_reason(None)
        if reason:
            print(f"note: dash_attn rows are skipped: {reason}. Peers still run.")

    problem_list = list(problems(args))
    runner.run(problem_list)

    summary = summarize(runner.rows)
    tables = build_tables(runner.rows, summary, impls)
    print(render_text(tables))
    notes = [i.note for i in impls if i.note and any(r["impl"] == i.key and r["tflops"] for r in runner.rows)]
    notes += unavailable_notes(runner.rows)
    notes.append("TFLOPS: benchmarks/flops.py (forward 4*b*h*sq*sk*d, causal halved, windows: the visible band "
                 "only; backward 2.5x forward).")
    if args.rounds > 1:
        notes.append(f"each cell is the median of {args.rounds} rounds over the whole grid (every round's time: "
                     "round_ms in the CSV and JSON).")
    if args.softcap > 0:
        notes.append(f"soft-capped scores (softcap {args.softcap:g}) in every column; the same FLOPs are counted.")
    print()
    for note in notes:
        print(f"note: {note}")
    failed_checks = [c for c in runner.checks if not c["ok"]]
    if runner.checks:
        print(f"checks: {len(runner.checks) - len(failed_checks)}/{len(runner.checks)} passed"
              + (" (see 'checks' in the JSON)" if failed_checks else ""))
    written = write_outputs(args.out, meta, runner.rows, summary, runner.checks, notes)
    md_path = args.out / "bench_attn.md"
    md_path.write_text(render_markdown(tables, meta, notes))
    written.append(str(md_path))
    if not args.no_plot:
        written += plot(runner.rows, impls, args.out)
    print("wrote " + ", ".join(written))
    return 0 if any(r["tflops"] for r in runner.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
