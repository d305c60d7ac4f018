"""Training throughput of a ~1B-parameter Llama in Hugging Face transformers per attention implementation, and whether
dash_attn's deterministic backward makes its training bitwise reproducible.

    python benchmarks/bench_transformers.py --out /tmp/bench_tf        # seqlen 4096: about a minute on an H200
    python benchmarks/bench_transformers.py --seqlens 4096,8192 --out /tmp/bench_tf

The model: LlamaConfig with hidden 2048, 16 layers (--layers), 16 heads of dim 128 (no GQA), intermediate 5632,
vocab 32000, untied embeddings: 0.95B parameters, random weights from --seed, bf16, no gradient checkpointing. A
step: the causal-LM loss (labels = the inputs; transformers shifts them) of --batch rows of seqlen random tokens
(default: 16384 tokens a step), its backward, AdamW (lr 3e-4, fused on CUDA), gradients dropped. One process runs
every implementation from the same initial weights over the same batches:
- sdpa: torch's scaled_dot_product_attention;
- flash_attention_3, flash_attention_3_det: FlashAttention-3 through transformers (the _det run with
  FLASH_ATTENTION_DETERMINISTIC=1), where transformers accepts it: flash_attn_interface imports and belongs to an
  installed `flash-attn-3` distribution (a source build outside pip needs that dist-info); skipped otherwise;
- dash_attn, dash_attn_det: attn_implementation="dash_attn" of dash_attn.integrations.transformers.register(), with
  FLASH_ATTENTION_DETERMINISTIC=0 (the non-deterministic backward) and =1 (the deterministic one) during the run.
tokens/s = tokens per step x timed steps / their wall time, after --warmup untimed steps (the device is synchronised
after every step). Model TFLOPS counts 6 FLOPs per parameter and token (the input embedding, a lookup, left out)
plus the attention's forward and backward (benchmarks/flops.py: causal halved, backward 2.5 forwards).

Reproducibility: each implementation named by --repeat (default dash_attn_det and dash_attn) trains a second time from
the same initial weights over the same batches; the report says whether every step's loss and every parameter
(torch.equal) came out bitwise the same (dash_attn's non-deterministic backward is expected to differ, which shows
that the comparison can fail), and each run's largest loss difference to sdpa's at the same step.

What bitwise-identical weights need:
- a deterministic attention backward: dash_attn's under FLASH_ATTENTION_DETERMINISTIC=1 (transformers' switch, which
  dash_attn_det sets) or torch.use_deterministic_algorithms(True). A non-deterministic backward adds the partial dQ
  tiles in the order they arrive, so the weights part after the first optimizer step;
- the same initial weights, batches and steps: torch.manual_seed before the model is built, seeded generators for the
  data, nothing random inside a step (Llama's attention_dropout is 0);
- the rest of the step in a fixed order. For this Llama on one GPU the other ops already are (cuBLAS GEMMs on one
  stream, embedding backward, cross-entropy, RMSNorm, fused AdamW), so the switch above suffices, and the repeat
  checks it rather than assumes it. Models with scatter-adds elsewhere (MoE routing, index_add_) need
  --torch-deterministic: torch.use_deterministic_algorithms(True) for the whole run, with
  CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment before CUDA starts (cuBLAS reads it when it creates its handle;
  this option sets it). torch then raises for any op that has no deterministic kernel, and the dash_attn column is
  skipped (the flag makes it deterministic);
- the same GPU model, torch, CUDA, cuBLAS, transformers and dash_attn, and the same batch shapes: the bits are a
  property of that whole stack.

Output: tables on stdout; with --out, bench_transformers.json (machine, versions, config, every run's per-step losses
and times, the repeats) and bench_transformers.md (the tables in Markdown). Exit status: 0; 1 when nothing was
measured; 2 without the device; 3 when a deterministic implementation's repeat was not bitwise identical.
--device cpu with a tiny model (--hidden 64 --layers 2 ...) runs the same code on the CPU, where dash_attn computes
its float32 reference path (tests/test_bench_transformers.py).
"""
import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO))  # an in-tree dash_attn is found when the package is not installed

import torch  # noqa: E402

import flops as flops_lib  # noqa: E402
from bench_attn import git_commit  # noqa: E402
# transformers' switch for a deterministic flash-attention backward, which dash_attn's integration reads too.
from dash_attn.integrations.transformers import DETERMINISTIC_ENV  # noqa: E402

EXIT_NO_DEVICE = 2
EXIT_NOT_REPRODUCIBLE = 3
CUBLAS_WORKSPACE = ":4096:8"
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Impl:
    key: str                  # the column's name
    attn_implementation: str  # transformers' name for it
    deterministic: bool       # FLASH_ATTENTION_DETERMINISTIC during its runs


IMPLS = (Impl("sdpa", "sdpa", False),
         Impl("flash_attention_3", "flash_attention_3", False),
         Impl("flash_attention_3_det", "flash_attention_3", True),
         Impl("dash_attn", "dash_attn", False),
         Impl("dash_attn_det", "dash_attn", True))
IMPL_KEYS = tuple(i.key for i in IMPLS)


@dataclasses.dataclass
class Run:
    losses: list   # every step's loss, warm-up included
    step_s: list   # wall seconds of each timed step
    peak_bytes: int
    final: list    # the parameters after the last step, kept only for a repeat's comparison


def int_list(text):
    return [int(x) for x in text.split(",") if x.strip()]


def str_list(text):
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=int_list, default=[4096], help="comma list (default 4096)")
    p.add_argument("--batch", type=int, default=0, help="rows a step (default: --tokens / seqlen, at least 1)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens a step when --batch is not given")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--impls", type=str_list, default=list(IMPL_KEYS),
                   help="comma list of %s (default all; FA3 skips itself where it does not import)" % ",".join(
                       IMPL_KEYS))
    p.add_argument("--repeat", type=str_list, default=["dash_attn_det", "dash_attn"],
                   help="implementations trained twice for the bitwise comparison (default dash_attn_det,dash_attn)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16, help="query heads; head dim = hidden / heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=0, help="K/V heads (default: --heads, no GQA)")
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="weights and activations (default bfloat16)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) for the whole run (sets CUBLAS_WORKSPACE_CONFIG)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (a tiny model, for tests)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="folder for the JSON and Markdown (default: none)")
    args = p.parse_args(argv)
    for name in args.impls + args.repeat:
        if name not in IMPL_KEYS:
            p.error(f"unknown implementation {name!r} (use {','.join(IMPL_KEYS)})")
    if args.steps < 1 or args.warmup < 0 or args.batch < 0 or args.tokens < 1 or not args.seqlens:
        p.error("--steps >= 1, --warmup >= 0, --batch >= 0, --tokens >= 1 and at least one seqlen")
    if args.hidden % args.heads or args.heads % (args.kv_heads or args.heads):
        p.error("--hidden must be a multiple of --heads, and --heads of --kv-heads")
    args.kv_heads = args.kv_heads or args.heads
    return args


def batch_for(args, seqlen):
    return args.batch or max(1, args.tokens // seqlen)


# ---------------------------------------------------------------- set-up

def require_device(device):
    """A clear message and exit status 2 where the device is missing."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench_transformers.py needs a CUDA GPU and found none (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda}). Run it on the H200 machine, or pass --device cpu with a tiny model; nothing "
              "was measured.", file=sys.stderr)
        sys.exit(EXIT_NO_DEVICE)


def import_transformers():
    try:
        import transformers
        from dash_attn.integrations.transformers import register
    except ImportError as exc:
        print(f"bench_transformers.py needs transformers (pip install .[transformers]): {exc}",
              file=sys.stderr)
        sys.exit(EXIT_NO_DEVICE)
    register()
    return transformers


def llama_config(transformers, args):
    return transformers.LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab,
        max_position_embeddings=max(args.seqlens), tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)


def build_model(transformers, args, device, dtype):
    """The model, built on the device from --seed, and a copy of its initial parameters that every run starts from
    (one model for all runs: its weights are reloaded, which is faster than building it again)."""
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(llama_config(transformers, args), dtype=dtype,
                                                              attn_implementation="sdpa")
    model.train()
    initial = [p.detach().clone() for p in model.parameters()]
    return model, initial


def make_batches(args, seqlen, device):
    """Every step's input ids, the same for every implementation."""
    gen = torch.Generator(device=device).manual_seed(args.seed + seqlen)
    shape = (batch_for(args, seqlen), seqlen)
    return [torch.randint(0, args.vocab, shape, generator=gen, device=device)
            for _ in range(args.warmup + args.steps)]


def train_flops(model, args, seqlen):
    """One step's FLOPs: 6 per parameter and token outside the input embedding, plus attention forward + backward."""
    batch = batch_for(args, seqlen)
    embedding = model.get_input_embeddings().weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - embedding
    head_dim = args.hidden // args.heads
    attention = sum(flops_lib.flops(d, batch, args.heads, seqlen, seqlen, head_dim, True) for d in ("fwd", "bwd"))
    return 6 * dense * batch * seqlen + args.layers * attention


def skip_reason(impl, args, device):
    """Why an implementation cannot run here, or None."""
    if impl.attn_implementation == "flash_attention_3":
        if device.type != "cuda":
            return "FlashAttention-3 needs a CUDA GPU"
        try:
            importlib.import_module("flash_attn_interface")
        except Exception as exc:  # a broken build raises more than ImportError
            return f"flash_attn_interface (FlashAttention-3) does not import ({type(exc).__name__}: {exc})"
    if impl.key == "dash_attn" and args.torch_deterministic:
        return "--torch-deterministic makes dash_attn's backward deterministic: see dash_attn_det"
    return None


@contextlib.contextmanager
def env_var(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---------------------------------------------------------------- training

def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, initial, batches, args, device, keep_final):
    """Trains from the initial parameters over the batches; per-step losses and timed steps' wall times."""
    with torch.no_grad():
        for p, p0 in zip(model.parameters(), initial):
            p.copy_(p0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_s = [], []
    synchronize(device)
    for step, ids in enumerate(batches):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        synchronize(device)
        if step >= args.warmup:
            step_s.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    final = [p.detach().clone() for p in model.parameters()] if keep_final else None
    return Run(torch.stack(losses).float().tolist(), step_s, peak, final)


def guarded_train(model, initial, batches, args, device, impl, keep_final):
    """(Run, None), or (None, (status, reason)) when the implementation cannot be set or the step fails; the run goes
    on with the next implementation."""
    try:
        model.set_attn_implementation(impl.attn_implementation)
    except Exception as exc:  # transformers refuses an implementation it finds unusable with ImportError/ValueError
        return None, ("n/a", f"transformers refused it: {type(exc).__name__}: {exc}")
    try:
        with env_var(DETERMINISTIC_ENV, "1" if impl.deterministic else "0"):
            return train(model, initial, batches, args, device, keep_final), None
    except torch.cuda.OutOfMemoryError as exc:
        failure = ("oom", str(exc).splitlines()[0])
    except Exception as exc:
        traceback.print_exc()
        failure = ("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    model.zero_grad(set_to_none=True)
    return None, failure


def result_row(impl, seqlen, batch, run, failure, step_flops):
    row = {"seqlen": seqlen, "batch": batch, "impl": impl.key, "status": "ok", "reason": "",
           "tokens_per_s": None, "step_ms_median": None, "model_tflops": None, "peak_gib": None, "losses": None,
           "step_ms": None, "max_abs_loss_diff_vs_sdpa": None}
    if run is None:
        row["status"], row["reason"] = failure
        return row
    per_second = len(run.step_s) / sum(run.step_s)
    row.update(tokens_per_s=batch * seqlen * per_second, step_ms_median=1e3 * statistics.median(run.step_s),
               model_tflops=step_flops * per_second / 1e12, peak_gib=run.peak_bytes / 2**30, losses=run.losses,
               step_ms=[1e3 * s for s in run.step_s])
    return row


def compare_runs(impl, seqlen, first, second):
    """Whether a repeat reproduced the first run bit for bit: every step's loss and every parameter."""
    differing = [i for i, (a, b) in enumerate(zip(first.final, second.final)) if not torch.equal(a, b)]
    max_diff = max(((first.final[i].float() - second.final[i].float()).abs().max().item() for i in differing),
                   default=0.0)
    return {"seqlen": seqlen, "impl": impl.key, "deterministic": impl.deterministic,
            "losses_identical": first.losses == second.losses, "weights_identical": not differing,
            "params_differing": len(differing), "params_total": len(first.final), "max_abs_weight_diff": max_diff,
            "losses_repeat": second.losses}


def measure_seqlen(model, initial, args, device, impls, seqlen):
    """Every implementation at one sequence length: the result rows and the repeats' comparisons."""
    batch = batch_for(args, seqlen)
    batches = make_batches(args, seqlen, device)
    step_flops = train_flops(model, args, seqlen)
    rows, repeats = [], []
    for impl in impls:
        reason = skip_reason(impl, args, device)
        if reason:
            rows.append(result_row(impl, seqlen, batch, None, ("n/a", reason), step_flops))
            continue
        keep = impl.key in args.repeat
        run, failure = guarded_train(model, initial, batches, args, device, impl, keep)
        rows.append(result_row(impl, seqlen, batch, run, failure, step_flops))
        print(f"  {impl.key}: {describe(rows[-1])}", flush=True)
        if run is None or not keep:
            continue
        again, failure = guarded_train(model, initial, batches, args, device, impl, True)
        if again is None:
            repeats.append({"seqlen": seqlen, "impl": impl.key, "status": failure[0], "reason": failure[1]})
            continue
        comparison = compare_runs(impl, seqlen, run, again)
        comparison["tokens_per_s_repeat"] = result_row(impl, seqlen, batch, again, None, step_flops)["tokens_per_s"]
        repeats.append(comparison)
        run.final = again.final = None
        print(f"  {impl.key} again: losses {'bitwise equal' if comparison['losses_identical'] else 'DIFFER'}, "
              f"weights {'bitwise equal' if comparison['weights_identical'] else 'DIFFER'}", flush=True)
    sdpa = next((r["losses"] for r in rows if r["impl"] == "sdpa" and r["losses"]), None)
    for row in rows:
        if sdpa and row["losses"]:
            row["max_abs_loss_diff_vs_sdpa"] = max(abs(a - b) for a, b in zip(row["losses"], sdpa))
    return rows, repeats


def describe(row):
    if row["status"] != "ok":
        return f"{row['status']} ({row['reason']})"
    return (f"{row['tokens_per_s']:.0f} tokens/s, median step {row['step_ms_median']:.1f} ms, "
            f"last loss {row['losses'][-1]:.4f}")


# ---------------------------------------------------------------- report

def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def tables(rows, repeats):
    """(title, [header, *rows]) pairs of strings for the text and Markdown output, and the notes (why a cell is n/a)."""
    out, notes = [], []
    for seqlen in sorted({r["seqlen"] for r in rows}):
        mine = [r for r in rows if r["seqlen"] == seqlen]
        sdpa = next((r["tokens_per_s"] for r in mine if r["impl"] == "sdpa" and r["tokens_per_s"]), None)
        table = [["impl", "tokens/s", "vs sdpa", "median step ms", "model TFLOPS", "peak GiB", "last loss",
                  "max abs loss diff to sdpa"]]
        for r in mine:
            if r["status"] != "ok":
                table.append([r["impl"], r["status"]] + [""] * 6)
                notes.append(f"{r['impl']} at seqlen {seqlen}: {r['status']} ({r['reason']})")
                continue
            table.append([r["impl"], fmt(r["tokens_per_s"], ".0f"),
                          fmt(r["tokens_per_s"] / sdpa if sdpa else None, ".3f"), fmt(r["step_ms_median"], ".1f"),
                          fmt(r["model_tflops"], ".1f"), fmt(r["peak_gib"], ".1f"), fmt(r["losses"][-1], ".4f"),
                          fmt(r["max_abs_loss_diff_vs_sdpa"], ".2e")])
        out.append((f"seqlen {seqlen}, batch {mine[0]['batch']} ({seqlen * mine[0]['batch']} tokens a step)", table))
    if repeats:
        table = [["seqlen", "impl", "losses bitwise equal", "weights bitwise equal", "params differing",
                  "max abs weight diff"]]
        for r in repeats:
            if "weights_identical" not in r:
                table.append([str(r["seqlen"]), r["impl"], r["status"], "", "", ""])
                notes.append(f"{r['impl']} at seqlen {r['seqlen']}, repeat: {r['status']} ({r['reason']})")
                continue
            table.append([str(r["seqlen"]), r["impl"], "yes" if r["losses_identical"] else "no",
                          "yes" if r["weights_identical"] else "no", f"{r['params_differing']}/{r['params_total']}",
                          fmt(r["max_abs_weight_diff"], ".3e")])
        out.append(("the same training run twice (same seed, same batches)", table))
    return out, notes


def render_text(tabs, notes):
    lines = []
    for title, table in tabs:
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines += ["", title]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(lines + [""] + [f"note: {note}" for note in notes])


def render_markdown(tabs, notes, meta):
    lines = [f"Measured {meta['date_utc']} on {meta['device']}, commit {meta['git_commit'] or 'unknown'}"
             f"{' (dirty)' if meta['git_dirty'] else ''}, torch {meta['torch']}, transformers "
             f"{meta['transformers']}. Model: {meta['model']}; {meta['steps']}.", ""]
    for title, table in tabs:
        lines += [f"### {title}", "", "| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
        lines += ["| " + " | ".join(row) + " |" for row in table[1:]]
        lines.append("")
    return "\n".join(lines + [f"- {note}" for note in notes]) + "\n"


def machine_info(transformers, args, device, model):
    commit, dirty = git_commit()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name} ({props.multi_processor_count} SMs), CUDA {torch.version.cuda}"
    else:
        name = "CPU"
    params = sum(p.numel() for p in model.parameters())
    import dash_attn
    return {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_commit": commit, "git_dirty": dirty, "device": name, "torch": torch.__version__,
            "transformers": transformers.__version__, "dash_attn": getattr(dash_attn, "__version__", "unknown"),
            "python": sys.version.split()[0], "params": params,
            "model": (f"Llama, {params:,} parameters, {args.layers} layers, hidden {args.hidden}, {args.heads} "
                      f"heads ({args.kv_heads} K/V) of dim {args.hidden // args.heads}, intermediate "
                      f"{args.intermediate}, vocab {args.vocab}, {args.dtype}"),
            "steps": (f"AdamW lr {args.lr:g}, {args.warmup} warm-up + {args.steps} timed steps"
                      f"{', torch.use_deterministic_algorithms(True)' if args.torch_deterministic else ''}"),
            "args": {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}}


def write_outputs(out_dir, meta, rows, repeats, tabs, notes):
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "bench_transformers.json", out_dir / "bench_transformers.md"
    json_path.write_text(json.dumps({"meta": meta, "results": rows, "repeats": repeats}, indent=1))
    md_path.write_text(render_markdown(tabs, notes, meta))
    return [str(json_path), str(md_path)]


def main(argv=None):
    args = parse_args(argv)
    if args.torch_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before CUDA starts
    require_device(args.device)
    transformers = import_transformers()
    device = torch.device(args.device)
    previous_flag = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(args.torch_deterministic)
    try:
        model, initial = build_model(transformers, args, device, getattr(torch, args.dtype))
        meta = machine_info(transformers, args, device, model)
        print(f"{meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, commit "
              f"{meta['git_commit'] or 'unknown'}\n{meta['model']}; {meta['steps']}")
        impls = [i for i in IMPLS if i.key in args.impls]
        rows, repeats = [], []
        for seqlen in args.seqlens:
            print(f"seqlen {seqlen}, batch {batch_for(args, seqlen)}:", flush=True)
            got = measure_seqlen(model, initial, args, device, impls, seqlen)
            rows += got[0]
            repeats += got[1]
    finally:
        torch.use_deterministic_algorithms(previous_flag)
    tabs, notes = tables(rows, repeats)
    print(render_text(tabs, notes))
    if args.out is not None:
        print("wrote " + ", ".join(write_outputs(args.out, meta, rows, repeats, tabs, notes)))
    broken = [r for r in repeats if r.get("deterministic") and not (r["losses_identical"] and r["weights_identical"])]
    for r in broken:
        print(f"NOT REPRODUCIBLE: {r['impl']} at seqlen {r['seqlen']}: {r['params_differing']} of "
              f"{r['params_total']} parameters differ after the same training run", file=sys.stderr)
    if broken:
        return EXIT_NOT_REPRODUCIBLE
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
