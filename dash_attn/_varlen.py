"""The CUDA paths of the varlen ops (dash_attn/_ops.py): their checks and host copies of cu_seqlens/seqused, the
choice between the packed-sequence kernels and the dense kernels per run of equal lengths, and the unplanned packed
launches (inside a CUDA graph capture, or given seqused_q/k)."""
from __future__ import annotations

from typing import List, Optional

import torch

from . import _seq_bands, device_seqlens, validation
from ._args import MaskKind, OpArgs
from ._ext import (_bwd_tile_shape, _check_cuda, _device_guard, _held_head_dim, _kernel_head_dim, _num_sms,
                   _supported_head_dims)
from ._launch import (_lse_shape, _out_like, _resolve_schedule_for, _run_bwd, _run_fwd, _run_schedule,
                      _with_varlen_schedule)
from .schedules_table import runs_per_sequence


# ----------------------------------------------------------------------------------------------------------------------
# Varlen checks and host copies
# ----------------------------------------------------------------------------------------------------------------------

# The host copies of the last tensors read (cu_seqlens_q/k, seqused_q/k), with the tensors (held, so that their memory
# is not reused) and their version counters: a step's backward takes the tensors its forward read and gets the copies
# without waiting for the GPU a second time. An in-place change of any of them bumps its version and forces a new copy.
_last_host_copies = None


def _host_lists(*tensors: Optional[torch.Tensor]) -> List[Optional[List[int]]]:
    """Host lists of int tensors (None stays None), read in one copy where they share a device."""
    global _last_host_copies
    versions = tuple(None if t is None else t._version for t in tensors)
    last = _last_host_copies
    if last is not None and len(last[0]) == len(tensors) and all(a is b for a, b in zip(last[0], tensors)) \
            and last[1] == versions:
        return last[2]
    present = [t for t in tensors if t is not None]
    if present and all(t.device == present[0].device for t in present):
        flat = torch.cat(present).tolist()
        lists, start = [], 0
        for t in present:
            lists.append(flat[start:start + t.shape[0]])
            start += t.shape[0]
    else:
        lists = [t.tolist() for t in present]
    found = iter(lists)
    copies = [next(found) if t is not None else None for t in tensors]
    _last_host_copies = (tensors, versions, copies)
    return copies


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether a varlen call takes the CUDA branches (any device but the CPU, whose calls run the reference)."""
    return t.device.type != "cpu"


def _used_lengths(cu: List[int], used: Optional[List[int]]) -> List[int]:
    """Each sequence's rows in use: its length from cu_seqlens, or seqused's entry."""
    return [b - a for a, b in zip(cu, cu[1:])] if used is None else list(used)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, softcap):
    """Every check of a varlen call; returns the checked extension (None on the CPU) and host copies of cu_seqlens_q,
    cu_seqlens_k, seqused_q and seqused_k (None where not given). A copy from the GPU waits for it (and then the host's
    launch work is no longer hidden behind running kernels), so they are read in one copy, none when the caller passes
    them on the CPU, and none again for the backward of the same tensors (_host_lists). Inside a CUDA graph capture
    nothing is read (None): the call runs unplanned (_varlen_fwd_unplanned)."""
    ext = None
    if _on_cuda(q):
        ext = _check_cuda(q, v, softcap)
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing or seqused_q is not None or seqused_k is not None:
            validation.check_unplanned_varlen(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                              ext.packed_built(), capturing)
        if capturing:
            return ext, None
    return ext, _checked_host_lists(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                    max_seqlen_k)


def _checked_host_lists(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k):
    """Host copies of cu_seqlens_q, cu_seqlens_k, seqused_q and seqused_k (_host_lists), their values checked."""
    host = _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    cq, ck, used_q, used_k = host
    for side, cu, used, total, max_seqlen in (("q", cq, used_q, q.shape[0], max_seqlen_q),
                                              ("k", ck, used_k, k.shape[0], max_seqlen_k)):
        validation.check_cu_seqlens_values(f"cu_seqlens_{side}", cu, total, max_seqlen, f"max_seqlen_{side}",
                                           used, f"seqused_{side}")
    return host


def _runs_unplanned(ext, host, seqused_q, seqused_k) -> bool:
    """Whether a checked varlen call takes the unplanned packed path: on CUDA, inside a capture (no host copies) or
    given seqused_q/k."""
    return ext is not None and (host is None or seqused_q is not None or seqused_k is not None)


def _runs(cq: List[int], ck: List[int]):
    """Maximal runs of consecutive packed sequences with the same (seqlen_q, seqlen_k), as (query rows, key rows,
    number of sequences, seqlen_q, seqlen_k), from host copies of cu_seqlens."""
    runs, start = [], 0
    for i in range(1, len(cq)):
        lengths = (cq[i] - cq[i - 1], ck[i] - ck[i - 1])
        if i == len(cq) - 1 or (cq[i + 1] - cq[i], ck[i + 1] - ck[i]) != lengths:
            runs.append((slice(cq[start], cq[i]), slice(ck[start], ck[i]), i - start) + lengths)
            start = i
    return runs


def _batched(x: torch.Tensor, rows: slice, count: int, seqlen: int) -> torch.Tensor:
    return x[rows].unflatten(0, (count, seqlen))


# The CUDA varlen path runs the packed-sequence kernels (one launch for all sequences, csrc/common/params.h:
# PackedSeqs) where they apply: every mask (causal and windows: each sequence's band reached by the schedule of the
# longest ones, dash_attn/_seq_bands.py) and score transform, q's head dim a built kernel's own and v's the same. They
# tile and schedule the call as a batch of the longest sequence and skip what lies past each sequence's end, so the
# deterministic schedules and their proofs are those of that batch. Elsewhere the dense kernels run once per run of
# consecutive sequences with equal lengths, as a batch of (sequences, seqlen, heads, d) views of the packed tensors
# (splitting the packed dim never copies); runs write disjoint rows, so the deterministic mode stays bitwise
# reproducible. The window is re-normalised per run, so short sequences reach the full/causal kernels. `ext` is the
# extension _check_varlen checked once for every launch.

# Which varlen path runs a call the packed kernels could take. The per-run path keeps the batched kernels' schedules,
# balanced for heads of equal length, but each run costs host time, so it takes only a few runs that each fill the GPU
# and whose kernels outlast that host time. H200, fwd+bwd, hdim 128, 16 heads, per run against the packed kernels: 2
# sequences of 10.9k + 5.5k tokens 0.88-0.89x the time, 8 x 2k 0.96-1.02x; 32 x 512 (about 0.3-0.5 ms of kernels,
# host-bound) 1.17-1.47x, 19 sequences of 0.2-1.5k tokens 3.3-6.2x.
_MAX_RUNS_PER_CALL = 4
_RUNS_HOST_SECONDS = (0.6e-3, 0.25e-3)  # per call, per run
_KERNEL_FLOPS_PER_SECOND = 450e12  # fwd+bwd, hdim 128 at 2k-16k


def _runs_beat_packed(q, k, cq, ck, mask, window_left, window_right):
    runs = [r for r in _runs(cq, ck) if r[3] > 0]
    if len(runs) > _MAX_RUNS_PER_CALL:
        return False
    block_n = _bwd_tile_shape(q.shape[-1], mask)[1]
    sms = _num_sms(q.device.index)
    if any(count * k.shape[1] * -(-seqlen_k // block_n) < sms for _, _, count, _, seqlen_k in runs):
        return False

    def keys_per_row(seqlen_k):
        if mask == MaskKind.WINDOW:
            return min(seqlen_k, (seqlen_k if window_left < 0 else window_left) +
                       (seqlen_k if window_right < 0 else window_right) + 1)
        return seqlen_k / 2 if mask == MaskKind.CAUSAL else seqlen_k

    area = sum(count * seqlen_q * keys_per_row(seqlen_k) for _, _, count, seqlen_q, seqlen_k in runs)
    kernel_seconds = 4 * q.shape[1] * area * q.shape[-1] * 3.5 / _KERNEL_FLOPS_PER_SECOND
    return kernel_seconds >= _RUNS_HOST_SECONDS[0] + _RUNS_HOST_SECONDS[1] * len(runs)


def _packed_launch(ext, q, k, v, cq, ck, lens, mask, window_left, window_right, bwd_args=None):
    """(longest q sequence, longest k sequence) when the packed-sequence kernels run this call, else None. lens: the
    (q, k) lengths of cq and ck (_used_lengths). bwd_args: a backward's arguments. Its schedule
    may run every sequence on its own geometry (schedules_table.runs_per_sequence), which takes any band. The choice
    between the packed kernels and the per-run batched path may follow the other sequences: both give a sequence the
    same bits under one schedule, as their kernels read the row statistics alike (csrc/bwd/bwd_config.h,
    reads_gemm_stats)."""
    if not ext.packed_built():
        return None
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in _supported_head_dims():
        return None
    mask_name = MaskKind(mask).name.lower()
    if _runs_beat_packed(q, k, cq, ck, mask, window_left, window_right):
        return None
    lens_q, lens_k = lens
    max_q, max_k = max(lens_q), max(lens_k)
    if max_q == 0 or max_k == 0:
        return None
    any_band = bwd_args is not None and runs_per_sequence(mask_name, bwd_args.schedule)
    if not any_band and not _bands_inside(lens_q, lens_k, mask, window_left, window_right):
        return None
    return max_q, max_k


def _bands_inside(lens_q, lens_k, mask, window_left, window_right) -> bool:
    """Whether the packed kernels' schedule of the longest lengths reaches each sequence's causal or window band
    (dash_attn/_seq_bands.py)."""
    return _seq_bands.bands_inside(lens_q, lens_k, mask, window_left, window_right)


def _device_int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


class _SinkGradSum:
    """d sink of a call run as several launches: each launch writes the share of its own rows into `part`, which
    add() adds into dsink, in launch order (a fixed order). One launch writes dsink itself. Without a sink, part is
    None and add() does nothing."""

    def __init__(self, dsink: Optional[torch.Tensor], launches: int):
        self.dsink = dsink
        self.part = dsink if dsink is None or launches == 1 else torch.empty_like(dsink)
        if self.part is not dsink:
            dsink.zero_()

    def add(self) -> None:
        if self.part is not self.dsink:
            self.dsink += self.part


def _varlen_fwd_cuda(ext, q, k, v, cu_seqlens_q, cu_seqlens_k, cq, ck, args: OpArgs, sink=None):
    out = _out_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    packed = _packed_launch(ext, q, k, v, cq, ck, (_used_lengths(cq, None), _used_lengths(ck, None)), *args.mask_args)
    if packed is not None:
        with _device_guard(q.device):
            ext.varlen_fwd(q, k, v, out, lse, _device_int32(cu_seqlens_q, q.device),
                           _device_int32(cu_seqlens_k, q.device), None, None, packed[0], packed[1], *args.kernel_args,
                           sink)
        return out, lse
    for sq, sk, count, seqlen_q, seqlen_k in _runs(cq, ck):
        q_b = _batched(q, sq, count, seqlen_q)
        k_b, v_b = _batched(k, sk, count, seqlen_k), _batched(v, sk, count, seqlen_k)
        lse_b = torch.empty(_lse_shape(q_b), dtype=torch.float32, device=q.device)
        _run_fwd(ext, q_b, k_b, v_b, _batched(out, sq, count, seqlen_q), lse_b, args.for_lengths(seqlen_q, seqlen_k),
                 sink)
        lse[:, sq].unflatten(1, (count, seqlen_q)).copy_(lse_b.transpose(0, 1))
    return out, lse


def _varlen_bwd_cuda(ext, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, cq, ck, args: OpArgs, sink=None,
                     dsink=None):
    """dsink (with a sink): float32 (nheads,), the sum of the launches' sink gradients in the order they run."""
    lens_q, lens_k = _used_lengths(cq, None), _used_lengths(ck, None)
    call_args = args
    args, short_k = _with_varlen_schedule(args, q, k, v, (lens_q, lens_k))
    packed = _packed_launch(ext, q, k, v, cq, ck, (lens_q, lens_k), *args.mask_args, bwd_args=args)
    if packed is not None:
        launches = _packed_bwd_launches(lens_q, lens_k, args)
        if len(launches) == 1:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            planned = [(None, None) + packed]
        else:  # rows no launch runs (sequences without queries or keys) keep their zeros
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            planned = [used + (launch.max_q, launch.max_k)
                       for used, launch in zip(_rows_in_use(q, launches, lens_q, lens_k), launches)]
        with _device_guard(q.device):
            _run_packed_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, _device_int32(cu_seqlens_q, q.device),
                            _device_int32(cu_seqlens_k, q.device), planned, args, short_k, sink, dsink)
        return dq, dk, dv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    runs = _runs(cq, ck)
    sink_grad = _SinkGradSum(dsink, len(runs))
    tile = _bwd_tile_shape(_held_head_dim(q, v), args.mask)
    for sq, sk, count, seqlen_q, seqlen_k in runs:
        q_b = _batched(q, sq, count, seqlen_q)
        k_b, v_b = _batched(k, sk, count, seqlen_k), _batched(v, sk, count, seqlen_k)
        lse_b = lse[:, sq].unflatten(1, (count, seqlen_q)).transpose(0, 1).contiguous()
        run_schedule = _run_schedule(args, seqlen_q, seqlen_k, short_k, tile) if args.deterministic else call_args
        run_args = run_schedule.for_lengths(seqlen_q, seqlen_k)
        _run_bwd(ext, _batched(dout, sq, count, seqlen_q), q_b, k_b, v_b, _batched(out, sq, count, seqlen_q), lse_b,
                 _batched(dq, sq, count, seqlen_q), _batched(dk, sk, count, seqlen_k),
                 _batched(dv, sk, count, seqlen_k), run_args, sink, sink_grad.part)
        sink_grad.add()
    return dq, dk, dv


# Unplanned calls (inside a CUDA graph capture, or given seqused_q/k): the packed-sequence kernels with bounds for the
# longest sequences (the caller's max_seqlen inside a capture, else the longest rows in use, and in the backward
# those that reach every sequence's band: _bwd_launches), cu_seqlens and seqused checked on the GPU afterwards inside
# a capture (dash_attn.device_seqlens: invalid values turn every result into NaN). Rows past seqused are not the
# kernels' to write: they start as zeros (lse -inf).
def _unplanned_band(args: OpArgs):
    return None if args.mask == MaskKind.FULL else args.window


def _unplanned_bounds(host, max_seqlen_q, max_seqlen_k):
    """The bounds of an unplanned call's forward: the caller's inside a capture (host None), else the longest rows in
    use. The forward masks and tiles each sequence by its own lengths; the backward plans its own (_bwd_launches)."""
    if host is None:
        return max_seqlen_q, max_seqlen_k
    lens_q, lens_k = _used_lengths(host[0], host[2]), _used_lengths(host[1], host[3])
    return max(lens_q, default=0), max(lens_k, default=0)


def _device_seqs(q, *tensors):
    return [None if t is None else _device_int32(t, q.device) for t in tensors]


def _run_packed_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, launches, args: OpArgs, short_k: int, sink,
                    dsink):
    """The packed kernels' backward launches of one call, (seqused_q, seqused_k, max_q, max_k) each, in order; d sink
    (with a sink) summed over them in that order. short_k: _with_varlen_schedule's."""
    sink_grad = _SinkGradSum(dsink, len(launches))
    for launch_q, launch_k, max_q, max_k in launches:
        # The packed kernels keep the call's mode: on causal packs at hdim 256 with 4 query heads per KV head their
        # arrival-order adds ran 1.11-1.22x the ordered ones (benchmarks/RESULTS.md, "Varlen"), unlike the batched
        # kernels' (schedules_table.NONDET_RUNS_BOUNDS).
        schedule_id, _ = _resolve_schedule_for(args, q.device, cu_q.shape[0] - 1, max_q, max_k, q.shape[1], k.shape[1],
                                               q.shape[-1])
        ext.varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, launch_q, launch_k, max_q, max_k,
                       *args.kernel_args, args.deterministic, schedule_id, short_k, args.sm_margin, sink,
                       sink_grad.part)
        sink_grad.add()


def _rows_in_use(q, launches, lens_q, lens_k):
    """Per launch with members, (seqused_q, seqused_k) on q's device: the members' rows in use, 0 for the others."""
    rows = []
    for launch in launches:
        chosen = set(launch.members)
        rows.append([[n if b in chosen else 0 for b, n in enumerate(lens)] for lens in (lens_q, lens_k)])
    table = torch.tensor(rows, dtype=torch.int32).to(q.device, non_blocking=True)  # (launches, 2, batch)
    return [(table[i, 0], table[i, 1]) for i in range(len(launches))]


def _bwd_launches(q, lens, used_q, used_k, bounds, args: OpArgs):
    """The backward launches of an unplanned call, as (seqused_q, seqused_k, max_q, max_k) on q's device. Inside a
    capture (lens None: nothing read on the host) one with the caller's bounds, whose bands the GPU check holds to
    theirs (device_seqlens). Otherwise the rows in use of each sequence, (lens_q, lens_k) from the host copies
    _check_varlen read for this call, plan them (dash_attn/_seq_bands.py): bounds whose schedule reaches every
    sequence's band, or, where no one band holds them all, one launch per group of sequences, the others' rows in
    use set to 0 (the kernels then write nothing of theirs)."""
    if lens is None:
        return [(used_q, used_k) + tuple(bounds)]
    lens_q, lens_k = lens
    launches = _packed_bwd_launches(lens_q, lens_k, args)
    if launches[0].members is None:
        return [(used_q, used_k, launches[0].max_q, launches[0].max_k)]
    return [used + (launch.max_q, launch.max_k)
            for used, launch in zip(_rows_in_use(q, launches, lens_q, lens_k), launches)]


def _packed_bwd_launches(lens_q, lens_k, args: OpArgs) -> List[_seq_bands.BwdLaunch]:
    """The packed kernels' backward launches of a call (dash_attn/_seq_bands.py); one for every sequence where they
    schedule each on its own geometry."""
    if runs_per_sequence(MaskKind(args.mask).name.lower(), args.schedule):
        return [_seq_bands.BwdLaunch(None, max(lens_q), max(lens_k))]
    return _seq_bands.bwd_launches(lens_q, lens_k, *args.mask_args, by_length=True)


# The packed kernels take a kernel's own head dim, the same for q, k and v; an unplanned call of other head dims runs
# on copies zero-padded to the kernel's (the dense kernels' rule: validation.kernel_head_dim), its results cut back.
def _kernel_width(q, v) -> Optional[int]:
    """The head dim an unplanned call's tensors are widened to, or None where theirs is that already."""
    width = _kernel_head_dim(q, v)
    return None if q.shape[-1] == v.shape[-1] == width else width


def _widened(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _varlen_fwd_unplanned(ext, q, k, v, seqs, bounds, args: OpArgs, checked_on_host=False, sink=None):
    """seqs: cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k (the last two may be None); bounds: max_q, max_k.
    checked_on_host: the values passed _check_varlen's host checks, so the GPU check would only repeat them."""
    width = _kernel_width(q, v)
    if width is not None:
        out, lse = _varlen_fwd_unplanned(ext, *(_widened(t, width) for t in (q, k, v)), seqs, bounds, args,
                                         checked_on_host, sink)
        return out[..., :v.shape[-1]].contiguous(), lse
    cu_q, cu_k, used_q, used_k = _device_seqs(q, *seqs)
    max_q, max_k = device_seqlens.capped_bounds(q.shape[0], k.shape[0], *bounds)
    # Rows the kernel leaves alone (past seqused, or every row when there are no keys) start as out 0, lse -inf.
    untouched_rows = used_q is not None or used_k is not None or max_k == 0
    out = q.new_zeros(*q.shape[:-1], v.shape[-1]) if untouched_rows else _out_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    if untouched_rows:
        lse.fill_(float("-inf"))
    with _device_guard(q.device):
        if max_k > 0 and max_q > 0 and cu_q.shape[0] > 1:
            ext.varlen_fwd(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, *args.kernel_args, sink)
        elif sink is not None and max_q > 0 and cu_q.shape[0] > 1:
            # No keys anywhere: the rows in use see only the sink (lse = sink, out 0).
            _fill_sink_lse(lse, sink, cu_q, used_q)
        if not checked_on_host:
            device_seqlens.flag_invalid(ext, cu_q, cu_k, used_q, used_k, q.shape[0], k.shape[0], max_q, max_k,
                                        _unplanned_band(args), out, lse)
    return out, lse


def _varlen_bwd_unplanned(ext, dout, q, k, v, out, lse, seqs, bounds, args: OpArgs, checked_on_host=False, sink=None,
                          dsink=None):
    width = _kernel_width(q, v)
    if width is not None:
        wide = [_widened(t, width) for t in (dout, q, k, v, out)]
        grads = _varlen_bwd_unplanned(ext, *wide, lse, seqs, bounds, args, checked_on_host, sink, dsink)
        return tuple(g[..., :t.shape[-1]].contiguous() for g, t in zip(grads, (q, k, v)))
    cu_q, cu_k, used_q, used_k = _device_seqs(q, *seqs)
    max_q, max_k = device_seqlens.capped_bounds(q.shape[0], k.shape[0], *bounds)
    no_key_seen = max_q == 0 or max_k == 0 or cu_q.shape[0] == 1
    # Gradients the kernel does not write (rows past seqused, or all of them when no query sees a key) start as 0.
    untouched_rows = used_q is not None or used_k is not None or no_key_seen
    dq, dk, dv = ((torch.zeros_like if untouched_rows else torch.empty_like)(t) for t in (q, k, v))
    lens = None
    if checked_on_host:
        cq, ck, host_q, host_k = _host_lists(*seqs)
        lens = _used_lengths(cq, host_q), _used_lengths(ck, host_k)
    args, short_k = _with_varlen_schedule(args, q, k, v)
    with _device_guard(q.device):
        if not no_key_seen:
            launches = _bwd_launches(q, lens, used_q, used_k, (max_q, max_k), args)
            _run_packed_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, launches, args, short_k, sink,
                            dsink)
        elif dsink is not None:
            dsink.zero_()  # out is 0 where no key is seen: D = 0
        if not checked_on_host:
            device_seqlens.flag_invalid(ext, cu_q, cu_k, used_q, used_k, q.shape[0], k.shape[0], max_q, max_k,
                                        _unplanned_band(args), dq, dk, dv)
    return dq, dk, dv


def _fill_sink_lse(lse, sink, cu_q, used_q) -> None:
    """lse (nheads, total_q) = sink on the rows in use (of each sequence, its first seqused_q rows, or all), on the
    GPU without a host sync."""
    rows = torch.arange(lse.shape[1], device=lse.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_q[1:], rows, right=True).clamp_(max=cu_q.shape[0] - 2)
    offset = rows - cu_q[seq]
    in_use = offset < (cu_q[seq + 1] - cu_q[seq] if used_q is None else used_q[seq])
    lse.copy_(torch.where(in_use, sink.view(-1, 1), lse))
