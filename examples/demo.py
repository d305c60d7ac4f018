"""Reproducible-training demo: `make demo`, or `python examples/demo.py [options]`.

Trains a tiny character-level GPT whose attention is `dash_attn.flash_attn_func`, twice from the same seed, and
checks that the two runs produce bitwise-identical losses and final weights. Everything else in the training step
(initialisation, data order, cuBLAS, the optimizer) is pinned, so the attention backward is the only place where run
to run differences could come from: with deterministic=True they must not appear; with --nondeterministic on a GPU
the dQ partial sums are added in arrival order and the runs drift apart.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, TextIO, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: import dash_attn from this checkout, as `python -m` would
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dash_attn import NONDETERMINISTIC_SCHEDULES, SCHEDULES, flash_attn_func  # noqa: E402

CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"

# cuBLAS picks its reduction split from the workspace it is given; a fixed small workspace config makes its GEMMs
# run-to-run reproducible (PyTorch's documented requirement for deterministic CUDA matmuls).
CUBLAS_WORKSPACE = ":4096:8"


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    n_heads: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class TrainConfig:
    batch: int
    seqlen: int
    steps: int
    lr: float
    # Matmuls (and therefore q, k, v) run in this dtype; parameters and optimizer state stay float32.
    compute_dtype: torch.dtype


@dataclass(frozen=True)
class Preset:
    model: ModelConfig
    train: TrainConfig


# CPU: the reference attention path, sized to finish both runs in seconds on two cores.
CPU_PRESET = Preset(ModelConfig(n_layers=2, d_model=128, n_heads=4),
                    TrainConfig(batch=8, seqlen=64, steps=100, lr=3e-3, compute_dtype=torch.float32))
# GPU: bf16 with head dim 64, one of the head dims the sm90 kernels are built for, and a sequence long enough that
# the backward has many KV tiles adding into each dQ tile.
GPU_PRESET = Preset(ModelConfig(n_layers=4, d_model=256, n_heads=4),
                    TrainConfig(batch=16, seqlen=1024, steps=200, lr=1e-3, compute_dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------------
# Data


class CharCorpus:
    """The shipped text as a tensor of character ids, with batches drawn from an explicit generator."""

    def __init__(self, path: Path = CORPUS_PATH):
        text = path.read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.ids = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, gen: torch.Generator, batch: int, seqlen: int):
        # Sampled on the CPU from the run's own generator, so both runs see the same windows in the same order
        # whatever the device and whatever else consumed the global RNG.
        starts = torch.randint(0, self.ids.numel() - seqlen - 1, (batch,), generator=gen)
        offsets = torch.arange(seqlen + 1)
        windows = self.ids[starts[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


# ----------------------------------------------------------------------------------------------------------------
# Model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool, schedule: str):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.deterministic = deterministic
        self.schedule = schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (batch, seqlen, 3, heads, head_dim): slicing the "3" axis keeps the last dimension contiguous, which is
        # the layout flash_attn_func takes without a copy.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).unbind(dim=2)
        y = flash_attn_func(q, k, v, causal=True, deterministic=self.deterministic, schedule=self.schedule)
        return self.proj(y.reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, deterministic: bool, schedule: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, deterministic, schedule)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, max_seqlen: int, deterministic: bool, schedule: str):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(max_seqlen, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, deterministic, schedule) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------------------------
# Training


class Progress:
    """One line rewritten in place on a terminal (at most a few times a second: reading the loss waits for the GPU),
    and a line every tenth of the run when the output is a log file."""

    REFRESH_S = 0.2

    def __init__(self, label: str, total: int, stream: TextIO):
        self.label = label
        self.total = total
        self.stream = stream
        self.interactive = stream.isatty()
        self.every = max(1, total // 10)
        self.start = self.shown = time.perf_counter()
        self.width = 0

    def _due(self, done: int, now: float) -> bool:
        if done == self.total:
            return True
        if self.interactive:
            return now - self.shown >= self.REFRESH_S
        return done % self.every == 0

    def update(self, step: int, loss_of_step, tokens_done: int) -> None:
        done = step + 1
        now = time.perf_counter()
        if not self._due(done, now):
            return
        self.shown = now
        elapsed = now - self.start
        line = (f"  {self.label}: step {done:>{len(str(self.total))}}/{self.total}  loss {loss_of_step():.4f}  "
                f"{tokens_done / max(elapsed, 1e-9):,.0f} tok/s  {elapsed:.1f}s")
        if self.interactive:
            # Padding clears what a longer previous line left behind.
            self.width = max(self.width, len(line))
            self.stream.write("\r" + line.ljust(self.width) + ("\n" if done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclass
class RunResult:
    losses: torch.Tensor  # float32, one entry per step, on the CPU
    params: dict          # name -> final parameter tensor
    seconds: float
    tokens_per_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_once(label: str, preset: Preset, corpus: CharCorpus, device: torch.device, seed: int,
               deterministic: bool, schedule: str, stream: TextIO) -> RunResult:
    cfg = preset.train
    torch.manual_seed(seed)  # also seeds every CUDA device
    model = TinyGPT(preset.model, corpus.vocab_size, cfg.seqlen, deterministic, schedule).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    data_gen = torch.Generator().manual_seed(seed)
    use_autocast = cfg.compute_dtype != torch.float32
    losses = torch.empty(cfg.steps, dtype=torch.float32, device=device)
    tokens_per_step = cfg.batch * cfg.seqlen
    # The first steps pay for allocator growth and kernel/library loading; leave them out of the throughput.
    warmup = min(cfg.steps - 1, max(1, cfg.steps // 10))
    progress = Progress(label, cfg.steps, stream)
    timed_from = time.perf_counter()
    for step in range(cfg.steps):
        if step == warmup:
            _sync(device)
            timed_from = time.perf_counter()
        inputs, targets = corpus.batch(data_gen, cfg.batch, cfg.seqlen)
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(device.type, dtype=cfg.compute_dtype, enabled=use_autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses[step] = loss.detach()
        progress.update(step, lambda: losses[step].item(), (step + 1) * tokens_per_step)
    _sync(device)
    seconds = time.perf_counter() - timed_from
    timed_steps = cfg.steps - warmup
    params = {name: p.detach() for name, p in model.named_parameters()}
    return RunResult(losses.cpu(), params, seconds, timed_steps * tokens_per_step / max(seconds, 1e-9))


@contextlib.contextmanager
def pinned_determinism():
    """Every op other than the attention runs its deterministic algorithm, in both modes, so that a difference
    between the runs can only come from flash_attn_func. warn_only keeps ops without such an algorithm usable.
    Deterministic mode would also fill every new tensor with NaN to expose reads of uninitialised memory; that is a
    debugging aid, not part of reproducibility, and costs an extra pass over each allocation (about a tenth of a CPU
    attention call at the demo's shapes), so it is switched off."""
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


@contextlib.contextmanager
def cpu_threads(count: Optional[int]):
    """Runs the body with `count` intra-op threads (None: leave the setting alone). Both runs use the same count,
    which is what keeps the CPU reductions in the same order."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ----------------------------------------------------------------------------------------------------------------
# Comparison and report


@dataclass
class Comparison:
    losses_identical: bool
    first_loss_diff_step: Optional[int]
    max_loss_diff: float
    params_identical: int
    params_total: int
    max_param_diff: float

    @property
    def identical(self) -> bool:
        return self.losses_identical and self.params_identical == self.params_total


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float32 losses as their bit patterns: equal bits is the claim, and unlike == it also matches NaN to NaN."""
    return x.contiguous().view(torch.int32)


def compare_runs(a: RunResult, b: RunResult) -> Comparison:
    losses_identical = torch.equal(_bits(a.losses), _bits(b.losses))
    diff = (a.losses.double() - b.losses.double()).abs()
    differing = torch.nonzero(_bits(a.losses) != _bits(b.losses)).flatten()
    first = int(differing[0]) if differing.numel() else None
    same = 0
    max_param_diff = 0.0
    for name, pa in a.params.items():
        pb = b.params[name]
        if torch.equal(pa, pb):
            same += 1
        else:
            max_param_diff = max(max_param_diff, (pa.double() - pb.double()).abs().max().item())
    return Comparison(losses_identical, first, diff.max().item() if diff.numel() else 0.0, same, len(a.params),
                      max_param_diff)


def table_interval(steps: int, max_rows: int = 12) -> int:
    """The smallest round step interval (1, 2, 5, 10, 20, 50, ...) that keeps the loss table within max_rows."""
    scale = 1
    while True:
        for base in (1, 2, 5):
            if math.ceil(steps / (base * scale)) <= max_rows:
                return base * scale
        scale *= 10


def loss_table(a: torch.Tensor, b: torch.Tensor, every: int) -> List[str]:
    steps = list(range(every - 1, a.numel(), every))
    if not steps or steps[-1] != a.numel() - 1:
        steps.append(a.numel() - 1)
    lines = [f"  {'step':>6}  {'run A loss':>12}  {'run B loss':>12}  A vs B"]
    for s in steps:
        la, lb = a[s].item(), b[s].item()
        verdict = "identical" if torch.equal(_bits(a[s:s + 1]), _bits(b[s:s + 1])) else f"differ by {abs(la - lb):.3e}"
        lines.append(f"  {s + 1:>6}  {la:>12.6f}  {lb:>12.6f}  {verdict}")
    return lines


def report(cmp: Comparison, a: RunResult, b: RunResult, deterministic: bool, on_cpu: bool, stream: TextIO) -> int:
    """Prints the comparison and the verdict; returns the process exit code."""
    w = stream.write
    w(f"\nThroughput: run A {a.tokens_per_s:,.0f} tok/s ({a.seconds:.2f}s timed), "
      f"run B {b.tokens_per_s:,.0f} tok/s ({b.seconds:.2f}s timed)\n")
    if cmp.losses_identical:
        w(f"Losses:  all {a.losses.numel()} steps bitwise identical\n")
    else:
        w(f"Losses:  first differ at step {cmp.first_loss_diff_step + 1}, max |A - B| = {cmp.max_loss_diff:.3e}\n")
    w(f"Weights: {cmp.params_identical}/{cmp.params_total} parameter tensors bitwise identical (torch.equal)")
    w("\n" if cmp.params_identical == cmp.params_total else f", max |A - B| = {cmp.max_param_diff:.3e}\n")

    if not torch.isfinite(a.losses).all() or not torch.isfinite(b.losses).all():
        w("Warning: a loss became inf or NaN; the training diverged (numerics), whatever the comparison says.\n")
    if cmp.identical:
        w("VERDICT: IDENTICAL - both runs produced bitwise-identical losses and final weights.\n")
        if not deterministic and on_cpu:
            w("(The CPU reference path sums in a fixed order, so it is reproducible even with --nondeterministic; "
              "run on an H200 to see the divergence.)\n")
        return 0
    if not deterministic:
        w("VERDICT: DIFFERENT, as expected with --nondeterministic - dQ partial sums were added in arrival order, "
          "so rounding differed and the runs drifted apart.\n")
        return 0
    w("VERDICT: FAIL - the deterministic runs are NOT bitwise identical.\n")
    return 1


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def _usage_error(message: str) -> SystemExit:
    """Exit status 2 for unusable arguments, as argparse does, so it is never mistaken for 1 (runs differ)."""
    sys.stderr.write(f"examples/demo.py: error: {message}\n")
    return SystemExit(2)


def _sm90_kernels_available() -> Optional[str]:
    """None when the sm90 kernels can run here, else the reason they cannot."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"the GPU is sm{major}{minor}, the kernels need sm90"
    try:
        from dash_attn import _C  # noqa: F401
    except ImportError:
        return "dash_attn._C is not built"
    return None


def _pick_device(requested: str) -> Tuple[torch.device, str]:
    """The device to train on and a note on why it was chosen."""
    if requested == "cpu":
        return torch.device("cpu"), "requested"
    reason = _sm90_kernels_available()
    if requested == "cuda":
        if reason is not None:
            raise _usage_error(f"--device cuda is not usable: {reason}; use --device cpu")
        return torch.device("cuda"), f"requested, {torch.cuda.get_device_name()}"
    if reason is not None:
        return torch.device("cpu"), f"auto: {reason}, so attention runs on the reference path"
    return torch.device("cuda"), f"auto: {torch.cuda.get_device_name()} with the sm90 kernels"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python examples/demo.py",
        description="Train a tiny character-level GPT twice from one seed and check that both runs are bitwise "
                    "identical. Attention is dash_attn.flash_attn_func(causal=True).")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: cuda when an sm90 GPU and dash_attn._C are present, else cpu (default)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"training steps per run (default: {CPU_PRESET.train.steps} on cpu, "
                             f"{GPU_PRESET.train.steps} on cuda)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: preset of the device)")
    parser.add_argument("--seqlen", type=int, default=None, help="characters per sequence (default: preset)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="pass deterministic=False to flash_attn_func; on a GPU the runs then diverge")
    parser.add_argument("--schedule", default="auto", choices=SCHEDULES,
                        help="backward schedule passed to flash_attn_func (default auto: the cost model picks)")
    parser.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order (default 0)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch ops on the cpu path (default 1: the ops are too small to gain "
                             "from more, and a spinning thread pool is slow when the cores are shared)")
    parser.add_argument("--log-every", type=int, default=None,
                        help="rows of the loss table every N steps (default: about a dozen rows)")
    return parser


def _preset_for(device: torch.device, args: argparse.Namespace, corpus: CharCorpus) -> Preset:
    preset = GPU_PRESET if device.type == "cuda" else CPU_PRESET
    train = preset.train
    overrides = {k: v for k, v in (("steps", args.steps), ("batch", args.batch), ("seqlen", args.seqlen))
                 if v is not None}
    if args.log_every is not None and args.log_every < 1:
        raise _usage_error(f"--log-every must be >= 1, got {args.log_every}")
    if args.threads < 1:
        raise _usage_error(f"--threads must be >= 1, got {args.threads}")
    if args.schedule in NONDETERMINISTIC_SCHEDULES and not args.nondeterministic:
        raise _usage_error(f"--schedule {args.schedule} runs only with --nondeterministic (it has no fixed dQ "
                           "accumulation order)")
    for name, value in overrides.items():
        if value < 1:
            raise _usage_error(f"--{name} must be >= 1, got {value}")
    train = replace(train, **overrides)
    if train.seqlen >= corpus.ids.numel():
        raise _usage_error(f"--seqlen must be shorter than the corpus ({corpus.ids.numel()} characters)")
    return replace(preset, train=train)


def main(argv: Optional[List[str]] = None, stream: TextIO = sys.stdout) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    corpus = CharCorpus()
    device, device_note = _pick_device(args.device)
    preset = _preset_for(device, args, corpus)
    deterministic = not args.nondeterministic
    m, t = preset.model, preset.train
    n_params = sum(p.numel() for p in TinyGPT(m, corpus.vocab_size, t.seqlen, deterministic, args.schedule)
                   .parameters())
    dtype = str(t.compute_dtype).replace("torch.", "")
    threads = f", {args.threads} CPU thread{'s' if args.threads > 1 else ''}" if device.type == "cpu" else ""
    header = [
        "dash_attn demo: train a tiny char-level GPT twice from one seed and compare the two runs bit for bit",
        f"  device     {device.type} ({device_note})",
        f"  corpus     {corpus.ids.numel():,} characters, vocabulary {corpus.vocab_size}",
        f"  model      {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads x head dim {m.head_dim}, "
        f"{n_params:,} parameters",
        f"  training   {t.steps} steps of batch {t.batch} x {t.seqlen} tokens, {dtype}, seed {args.seed}{threads}",
        f"  attention  flash_attn_func(q, k, v, causal=True, deterministic={deterministic}, "
        f"schedule={args.schedule!r})",
        "  other ops  torch.use_deterministic_algorithms(True); same initialisation and data order in both runs",
    ]
    stream.write("\n".join(header) + "\n\n")
    stream.flush()

    with pinned_determinism(), cpu_threads(args.threads if device.type == "cpu" else None):
        run_a = train_once("run A", preset, corpus, device, args.seed, deterministic, args.schedule, stream)
        run_b = train_once("run B", preset, corpus, device, args.seed, deterministic, args.schedule, stream)

    every = args.log_every or table_interval(t.steps)
    stream.write("\nLoss curve:\n" + "\n".join(loss_table(run_a.losses, run_b.losses, every)) + "\n")
    code = report(compare_runs(run_a, run_b), run_a, run_b, deterministic, device.type == "cpu", stream)
    stream.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
