"""The dense CUDA launches behind the custom ops (dash_attn/_ops.py) and the backward schedule they run: `auto`
resolved by the invariant pick (deterministic) or the cost model (dash_attn.schedule), names turned into the ids of
dash::ScheduleKind."""
from __future__ import annotations

import contextlib
import functools
from typing import List, Optional, Tuple

import torch

from . import _kv_heads, validation
from ._args import MaskKind, OpArgs
from ._ext import (_bwd_tile_shape, _check_cuda, _device_guard, _held_head_dim, _kernel_head_dim, _l2_bytes, _num_sms,
                   _supported_head_dims)
from .schedules_table import (AUTO, FALLBACK_SCHEDULE, LANES_SCHEDULE, SCHEDULE_IDS, nondet_invariant_rule,
                              invariant_schedule, runs_per_sequence, short_keys, varlen_invariant_schedule,
                              varlen_runs_lanes_order)


# ----------------------------------------------------------------------------------------------------------------------
# Backward schedule
# ----------------------------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _choose_schedule(mask: int, seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, nheads: int, batch: int,
                     num_sms: int, window: Optional[Tuple[int, int]], nheads_k: int, deterministic: bool,
                     headdim: int, l2_bytes: int) -> str:
    """The cost model's pick (cached: the same shapes recur every training step, including under graph capture)."""
    try:
        from .schedule import choose, l2_model
    except ImportError:
        # dash_attn.schedule needs the dash_attn._sched module; without it keep the schedule that is safe everywhere.
        return FALLBACK_SCHEDULE
    return choose(MaskKind(mask).name.lower(), seqlen_q, seqlen_k, block_m, block_n, nheads, batch, num_sms,
                  window=window, nheads_k=nheads_k, deterministic=deterministic,
                  l2=l2_model(l2_bytes, block_m, block_n, headdim))


def _resolve_schedule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: OpArgs) -> Tuple[int, bool]:
    batch, seqlen_q, nheads, _ = q.shape
    return _resolve_schedule_for(args, q.device, batch, seqlen_q, k.shape[1], nheads, k.shape[2], _held_head_dim(q, v))


def _resolve_schedule_for(args: OpArgs, device: torch.device, batch: int, seqlen_q: int, seqlen_k: int, nheads: int,
                          nheads_k: int, headdim: int) -> Tuple[int, bool]:
    """(The schedule id of a launch of that (batch, seqlen) problem, whether its kernel adds dQ in the schedule's order:
    the deterministic mode, and the non-deterministic `auto` where schedules_table.NondetRunsBound.ordered_adds);
    headdim: the head dim whose kernel runs."""
    # A deterministic `dynamic` is refused in Python before this (validation.check_schedule_mode, run by the public
    # functions and by the custom ops on direct calls), and by the binding before any launch (csrc/api/binding.cpp).
    schedule, mask, ordered = args.schedule, args.mask, args.deterministic
    if schedule == AUTO:
        mask_name = MaskKind(mask).name.lower()
        kernel_dim = validation.kernel_head_dim(headdim, _supported_head_dims())
        gqa_ratio = nheads // nheads_k
        rule = None if args.deterministic else nondet_invariant_rule(mask_name, kernel_dim, gqa_ratio, seqlen_q,
                                                                     seqlen_k)
        if rule is not None:
            ordered = rule.ordered_adds
        if args.deterministic or rule is not None:
            # Non-deterministic too at the GQA ratios where descending_lanes measured ahead of the model's pick (and
            # the runs schedule ahead of descending_lanes on the causal bands the invariant rule gives to the runs;
            # docs/tuning.md, seq_runs.h runs_descending), and on long causal bands, where shift_causal_runs did.
            schedule = invariant_schedule(mask_name, kernel_dim, seqlen_k, gqa_ratio, seqlen_q=seqlen_q,
                                          tile=_bwd_tile_shape(headdim, mask))
    if schedule == AUTO:
        block_m, block_n = _bwd_tile_shape(headdim, mask)
        ctas = max(1, _num_sms(device.index) - args.sm_margin)
        window = args.window if mask == MaskKind.WINDOW else None
        schedule = _choose_schedule(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, ctas, window,
                                    nheads_k, args.deterministic, headdim, _l2_bytes(device.index))
    return SCHEDULE_IDS[schedule], ordered


def _with_varlen_schedule(args: OpArgs, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          lengths: Optional[Tuple[List[int], List[int]]] = None) -> Tuple[OpArgs, int]:
    """A varlen call's arguments and short_k. Deterministic `auto` takes the varlen invariant pick for the mask, the
    same for the packed kernels and for runs of equal lengths, so that neither the path nor the neighbours change the
    bits. A sequence of up to short_k keys (schedules_table.short_keys, the dense bound; on causal masks square and
    mostly full bands) runs LANES_ORDER's orders, as its dense call under `auto` does: the packed kernels take
    short_k, runs of equal lengths run LANES_SCHEDULE there (_run_schedule). Otherwise short_k is 0.
    The non-deterministic `auto` takes the same pick on packs of unequal lengths (_unequal_pack; lengths: the
    sequences' q and k lengths, where the host has them): the cost model's pick for a batch of the longest sequence
    runs every sequence's tiles in the longest one's pattern, and ran such packs 1.04-1.98x (causal) and 1.2-1.4x
    (full) slower than the deterministic pick (docs/tuning.md, `_launch._with_varlen_schedule`); its runs of equal
    lengths launched as a batch keep `auto`."""
    if args.schedule != AUTO:
        return args, 0
    mask_name = MaskKind(args.mask).name.lower()
    kernel_dim, gqa_ratio = _kernel_head_dim(q, v), q.shape[-2] // k.shape[-2]
    if not (args.deterministic or _unequal_pack(mask_name, lengths)):
        return args, 0
    pick = varlen_invariant_schedule(mask_name)
    if not runs_per_sequence(mask_name, pick):
        return args._replace(schedule=pick), 0
    return args._replace(schedule=pick), short_keys(mask_name, kernel_dim, gqa_ratio)


def _unequal_pack(mask_name: str, lengths: Optional[Tuple[List[int], List[int]]]) -> bool:
    """Whether the non-deterministic `auto` takes the deterministic pick: a causal or full pack of unequal lengths,
    whatever the GQA ratio (with GQA 4 at hdim 128, where dense `auto` runs LANES_SCHEDULE, `shift_runs` walking the
    group's query heads ran the `mixed` pack at 1.6x that pick, benchmarks/RESULTS.md "Varlen")."""
    return mask_name in ("full", "causal") and lengths is not None and len(set(zip(*lengths))) > 1


def _run_schedule(args: OpArgs, seqlen_q: int, seqlen_k: int, short_k: int, tile: Tuple[int, int]) -> OpArgs:
    """The arguments of a varlen call's run of equal lengths launched as a batch (short_k: _with_varlen_schedule's;
    tile: the backward's (block_m, block_n)): LANES_SCHEDULE where the packed kernels would run LANES_ORDER's orders."""
    mask_name = MaskKind(args.mask).name.lower()
    return args._replace(schedule=LANES_SCHEDULE) if varlen_runs_lanes_order(mask_name, seqlen_q, seqlen_k, tile,
                                                                             short_k) else args


# ----------------------------------------------------------------------------------------------------------------------
# Dense launches
# ----------------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _full_width(result: torch.Tensor, kernel_dim: int):
    """Where `result` goes for a launch of the kernel of head dim `kernel_dim`: itself, or, where its head dim is below
    the kernel's (csrc/common/head_dims.h), the first columns of rows as wide as the kernel's, copied into `result`
    afterwards. The kernels read and write nothing past the call's head dims through TMA, but some of their stores
    write whole rows of the kernel's width (O and dK/dV at head dim 256, the zeros of KV tiles no query sees): in a
    buffer of that width they land in its spare columns instead of the next row."""
    if kernel_dim == result.shape[-1]:
        yield result
        return
    rows = result.new_empty(*result.shape[:-1], kernel_dim)[..., :result.shape[-1]]
    yield rows
    result.copy_(rows)


def _launch_fwd(q, k, v, out, lse, args: OpArgs, sink=None) -> None:
    """CUDA forward into preallocated out/lse; every check runs before the launch. sink: None or the (nheads,) float32
    learnable sink logits (dash_attn/_sinks.py), included in lse."""
    _run_fwd(_check_cuda(q, v, args.softcap), q, k, v, out, lse, args, sink)


def _run_fwd(ext, q, k, v, out, lse, args: OpArgs, sink=None) -> None:
    """The forward once _check_cuda has passed (the varlen path checks once for all of its launches)."""
    if q.numel() == 0:
        return
    if k.shape[1] == 0:  # no keys: every row is fully masked, and only a sink is left in its denominator
        out.zero_()
        if sink is None:
            lse.fill_(float("-inf"))
        else:
            lse.copy_(sink.view(1, -1, 1).expand_as(lse))
        return
    with _device_guard(q.device), _full_width(out, _kernel_head_dim(q, v)) as out_rows:
        ext.fwd(q, k, v, out_rows, lse, *args.kernel_args, sink)


def fwd_cuda(q, k, v, args: OpArgs, sink=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The CUDA forward into new out and lse (args already for the call's lengths: OpArgs.for_lengths)."""
    out = _out_like(q, v)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    _launch_fwd(q, k, v, out, lse, args, sink)
    return out, lse


def bwd_cuda(dout, q, k, v, out, lse, args: OpArgs, sink=None, dsink=None) -> Tuple[torch.Tensor, ...]:
    """The CUDA backward into new dq, dk, dv (and the given dsink), as fwd_cuda."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, args, sink, dsink)
    return dq, dk, dv


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, args: OpArgs, sink=None, dsink=None) -> None:
    """CUDA backward into preallocated dq/dk/dv (and dsink, float32 (nheads,), with a sink); "auto" is resolved here,
    before the launch. GQA with few KV heads, or causal with large groups, runs on KV-head copies
    (dash_attn/_kv_heads.py)."""
    ext = _check_cuda(q, v, args.softcap)
    expanded = _kv_heads.expand(q, k, v, args.mask)
    if expanded is None:
        _run_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, args, sink, dsink)
        return
    dk_x, dv_x = (torch.empty_like(x) for x in expanded)
    _run_bwd(ext, dout, q, *expanded, out, lse, dq, dk_x, dv_x, args, sink, dsink)
    _kv_heads.sum_kv(ext, dk_x, dv_x, dk, dv)


def _run_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, args: OpArgs, sink=None, dsink=None) -> None:
    """The backward once _check_cuda has passed."""
    if q.numel() == 0 or k.numel() == 0:
        # No keys: out is 0, so D = rowsum(dO * out) = 0 and the sink takes no gradient either.
        for grad in (dq, dk, dv) if dsink is None else (dq, dk, dv, dsink):
            grad.zero_()
        return
    schedule_id, ordered = _resolve_schedule(q, k, v, args)
    kernel_dim = _kernel_head_dim(q, v)
    with _device_guard(q.device), _full_width(dk, kernel_dim) as dk_rows, _full_width(dv, kernel_dim) as dv_rows:
        ext.bwd(dout, q, k, v, out, lse, dq, dk_rows, dv_rows, *args.kernel_args, ordered, schedule_id,
                args.sm_margin, sink, dsink)


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output: q's rows and heads, v's head dim (contiguous, like q)."""
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _lse_shape(q: torch.Tensor) -> Tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])
