"""The torch.library custom ops behind the public entry points (dash_attn/api.py), their autograd and CUDA launches.

Layering: `flash_attn_func` / `flash_attn_varlen_func` check and normalise the arguments (metadata only, so they trace
under torch.compile) and call one custom op; the op allocates its outputs and dispatches on the device: CPU tensors run
the reference math (dash_attn.reference), CUDA tensors the compiled extension dash_attn._C. Fake implementations only
describe output shapes, and the backward is registered on the forward op, so torch.compile(fullgraph=True) sees two
opaque ops per attention call. deterministic, schedule and sm_margin travel as op arguments so traced graphs keep them.
"""
from __future__ import annotations

import contextlib
import enum
import functools
from typing import List, Optional, Tuple

import torch
from torch.utils import _python_dispatch

from . import device_seqlens, validation
from .reference import attention_bwd_ref, attention_bwd_ref_varlen, attention_ref, attention_ref_varlen


class MaskKind(enum.IntEnum):
    """Mirrors dash::MaskKind in csrc/common/params.h."""
    FULL = 0
    CAUSAL = 1
    WINDOW = 2


# Mirrors dash::ScheduleKind in csrc/common/params.h ("auto" never reaches the kernels).
SCHEDULE_IDS = {"ascending": 0, "descending": 1, "spt": 2, "shift": 3, "shift_causal": 4, "dynamic": 5, "shift_runs": 6,
                "shift_causal_runs": 7}
FALLBACK_SCHEDULE = "descending"

_NOT_BUILT = "dash_attn._C is not built: reinstall on a machine with nvcc and a CUDA build of torch"


# ----------------------------------------------------------------------------------------------------------------------
# Argument normalisation
# ----------------------------------------------------------------------------------------------------------------------

def _mask_args(window_left: int, window_right: int) -> Tuple[int, int, int]:
    """(mask kind, left, right) from a window with causal already folded in; causal is the (-1, 0) window."""
    if window_left < 0 and window_right < 0:
        return int(MaskKind.FULL), -1, -1
    if window_left < 0 and window_right == 0:
        return int(MaskKind.CAUSAL), -1, 0
    return int(MaskKind.WINDOW), window_left, window_right


def _effective_mask(mask: int, window_left: int, window_right: int, seqlen_q: int, seqlen_k: int):
    """Drops window sides that cannot mask anything for these lengths (as FlashAttention-3 does), so a window wider
    than the sequences reaches the full/causal kernels. Left bound: row i needs j >= i + sk - sq - left, void for
    every row once left >= sk - 1; right bound: j <= i + sk - sq + right, void once right >= sq - 1."""
    if mask != MaskKind.WINDOW:
        return mask, window_left, window_right
    if window_left >= max(seqlen_k - 1, 0):
        window_left = -1
    if window_right >= max(seqlen_q - 1, 0):
        window_right = -1
    return _mask_args(window_left, window_right)


def _resolve_deterministic(deterministic: Optional[bool]) -> bool:
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    return deterministic


def _reference_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# CUDA extension access (lazy: the package imports and the CPU path works without it)
# ----------------------------------------------------------------------------------------------------------------------

def _extension():
    try:
        from . import _C
    except ImportError as exc:
        raise RuntimeError(f"{_NOT_BUILT} ({exc})") from exc
    return _C


@functools.lru_cache(maxsize=None)
def _supported_head_dims() -> Tuple[int, ...]:
    return tuple(int(d) for d in _extension().supported_head_dims())


@functools.lru_cache(maxsize=None)
def _softcap_built() -> bool:
    return bool(_extension().softcap_built())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return int(_extension().num_sms(device_index))


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).L2_cache_size)


@functools.lru_cache(maxsize=None)
def _bwd_tile_shape(headdim: int, mask: int) -> Tuple[int, int]:
    block_m, block_n = _extension().bwd_tile_shape(headdim, mask)
    return int(block_m), int(block_n)


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


def _held_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    """The head dim a kernel must hold: q's and k's, or v's where larger."""
    return max(q.shape[-1], v.shape[-1])


def _check_cuda(q: torch.Tensor, v: torch.Tensor, softcap: float):
    validation.check_cuda_device(q.device)
    ext = _extension()
    validation.check_cuda_features(_held_head_dim(q, v), _supported_head_dims(), softcap, _softcap_built())
    return ext


def _resolve_schedule(schedule: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: int, window_left: int,
                      window_right: int, deterministic: bool, sm_margin: int) -> int:
    batch, seqlen_q, nheads, _ = q.shape
    return _resolve_schedule_for(schedule, q.device, batch, seqlen_q, k.shape[1], nheads, k.shape[2],
                                 _held_head_dim(q, v), mask, window_left, window_right, deterministic, sm_margin)


def _resolve_schedule_for(schedule: str, device: torch.device, batch: int, seqlen_q: int, seqlen_k: int, nheads: int,
                          nheads_k: int, headdim: int, mask: int, window_left: int, window_right: int,
                          deterministic: bool, sm_margin: int) -> int:
    """The schedule id of a launch of that (batch, seqlen) problem; headdim: the head dim whose kernel runs."""
    validation.check_schedule_mode(schedule, deterministic)  # the ops are public too: never launch a det "dynamic"
    if schedule == "auto" and deterministic:
        schedule = validation.INVARIANT_SCHEDULES[MaskKind(mask).name.lower()]
    if schedule == "auto":
        block_m, block_n = _bwd_tile_shape(headdim, mask)
        ctas = max(1, _num_sms(device.index) - sm_margin)
        window = (window_left, window_right) if mask == MaskKind.WINDOW else None
        schedule = _choose_schedule(mask, seqlen_q, seqlen_k, block_m, block_n, nheads, batch, ctas, window,
                                    nheads_k, deterministic, headdim, _l2_bytes(device.index))
    return SCHEDULE_IDS[schedule]


def _varlen_schedule(schedule: str, mask: int, deterministic: bool) -> str:
    """A varlen call's schedule name: deterministic `auto` takes the varlen invariant pick for the mask, the same for
    the packed kernels and for runs of equal lengths, so that neither the path nor the neighbours change the bits."""
    if schedule == "auto" and deterministic:
        return validation.INVARIANT_VARLEN_SCHEDULES[MaskKind(mask).name.lower()]
    return schedule


def _device_guard(device: torch.device):
    return torch.cuda.device(device)


def _kernel_head_dim(q: torch.Tensor, v: torch.Tensor) -> int:
    return validation.kernel_head_dim(_held_head_dim(q, v), _supported_head_dims())


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


def _launch_fwd(q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap) -> None:
    """CUDA forward into preallocated out/lse; every check runs before the launch."""
    _run_fwd(_check_cuda(q, v, softcap), q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap)


def _run_fwd(ext, q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap) -> None:
    """The forward once _check_cuda has passed (the varlen path checks once for all of its launches)."""
    if q.numel() == 0:
        return
    if k.shape[1] == 0:  # no keys: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return
    with _device_guard(q.device), _full_width(out, _kernel_head_dim(q, v)) as out_rows:
        ext.fwd(q, k, v, out_rows, lse, softmax_scale, mask, window_left, window_right, softcap)


def _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, window_left, window_right, softcap,
                deterministic, schedule, sm_margin) -> None:
    """CUDA backward into preallocated dq/dk/dv; "auto" is resolved here, before the launch."""
    _run_bwd(_check_cuda(q, v, softcap), dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, window_left,
             window_right, softcap, deterministic, schedule, sm_margin)


def _run_bwd(ext, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, window_left, window_right, softcap,
             deterministic, schedule, sm_margin) -> None:
    """The backward once _check_cuda has passed."""
    if q.numel() == 0 or k.numel() == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    schedule_id = _resolve_schedule(schedule, q, k, v, mask, window_left, window_right, deterministic, sm_margin)
    kernel_dim = _kernel_head_dim(q, v)
    with _device_guard(q.device), _full_width(dk, kernel_dim) as dk_rows, _full_width(dv, kernel_dim) as dv_rows:
        ext.bwd(dout, q, k, v, out, lse, dq, dk_rows, dv_rows, softmax_scale, mask, window_left, window_right,
                softcap, deterministic, schedule_id, sm_margin)


# ----------------------------------------------------------------------------------------------------------------------
# Dense custom ops
# ----------------------------------------------------------------------------------------------------------------------

def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output: q's rows and heads, v's head dim (contiguous, like q)."""
    return q.new_empty(*q.shape[:-1], v.shape[-1])


def _lse_shape(q: torch.Tensor) -> Tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, mask: int, window_left: int,
              window_right: int, softcap: float, deterministic: bool, schedule: str,
              sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    mask, window_left, window_right = _effective_mask(mask, window_left, window_right, q.shape[1], k.shape[1])
    out = _out_like(q, v)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    if q.device.type == "cpu":
        ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, False, (window_left, window_right), softcap,
                                         return_lse=True, compute_dtype=_reference_dtype(q.dtype))
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        return out, lse
    _launch_fwd(q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap)
    return out, lse


_fwd = torch.library.custom_op("dash_attn::fwd", mutates_args=())(_fwd_impl)


@_fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    return _out_like(q, v), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, softmax_scale: float, mask: int, window_left: int, window_right: int, softcap: float,
              deterministic: bool, schedule: str,
              sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask, window_left, window_right = _effective_mask(mask, window_left, window_right, q.shape[1], k.shape[1])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.device.type == "cpu":
        # The reference backward recomputes out and lse in the compute dtype: the saved float32 lse would cap the
        # accuracy of float64 gradcheck.
        window = (window_left, window_right)
        compute_dtype = _reference_dtype(q.dtype)
        ref_out, ref_lse = attention_ref(q, k, v, softmax_scale, False, window, softcap, return_lse=True,
                                         compute_dtype=compute_dtype)
        grads = attention_bwd_ref(dout, q, k, v, ref_out, ref_lse, softmax_scale, False, window, softcap,
                                  compute_dtype)
        for dst, src in zip((dq, dk, dv), grads):
            dst.copy_(src)
        return dq, dk, dv
    _launch_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, mask, window_left, window_right, softcap,
                deterministic, schedule, sm_margin)
    return dq, dk, dv


_bwd = torch.library.custom_op("dash_attn::bwd", mutates_args=())(_bwd_impl)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, mask, window_left, window_right, softcap, deterministic,
              schedule, sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, *params = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd_backward(ctx, dout, dlse, bwd=_bwd):
    # The gradient of the returned lse is not propagated (FlashAttention-3 does the same); lse is marked
    # non-differentiable so autograd never asks for it.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd(_last_dim_contiguous(dout), q, k, v, out, lse, *ctx.params)
    return (dq, dk, dv) + (None,) * len(ctx.params)


_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ----------------------------------------------------------------------------------------------------------------------
# Eager CUDA calls
# ----------------------------------------------------------------------------------------------------------------------

# The registered ops are what torch.compile, FakeTensor, torch.func and the CPU path see. A plain eager call on CUDA
# tensors runs the same bodies through an autograd.Function instead: the op dispatcher's round trip (schema checks,
# output alias checks, the autograd wrapper) cost about as much host time as the rest of a step (H200 node, fwd+bwd
# at batch 4 x 512, 16 heads: 0.73 ms of host time a step through the ops), which small shapes cannot hide.
def _eager_function(name, forward_impl, setup_context, backward):
    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                   "backward": staticmethod(backward)})


def _eager_cuda(*tensors: torch.Tensor) -> bool:
    """Whether this call may skip the registered ops: eager mode, no dispatch mode, plain CUDA tensors."""
    if torch.compiler.is_compiling() or _python_dispatch._get_current_dispatch_mode() is not None:
        return False
    return all(type(t) is torch.Tensor and t.is_cuda and not torch._C._functorch.is_functorch_wrapped_tensor(t)
               for t in tensors)


_EagerAttention = _eager_function("_EagerAttention", _fwd_impl, _fwd_setup_context,
                                  functools.partial(_fwd_backward, bwd=_bwd_impl))


# ----------------------------------------------------------------------------------------------------------------------
# Varlen custom ops
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
            validation.check_unplanned_varlen(q, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                              ext.packed_built(), _supported_head_dims(), capturing)
        if capturing:
            return ext, None
    host = _host_lists(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    cq, ck, used_q, used_k = host
    for side, cu, used, total, max_seqlen in (("q", cq, used_q, q.shape[0], max_seqlen_q),
                                              ("k", ck, used_k, k.shape[0], max_seqlen_k)):
        validation.check_cu_seqlens_values(f"cu_seqlens_{side}", cu, total, max_seqlen, f"max_seqlen_{side}",
                                           used, f"seqused_{side}")
    return ext, host


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
# PackedSeqs) where they apply: every mask (causal and windows: each sequence's band inside the longest ones') and
# score transform, q's head dim a built kernel's own and v's the same. They tile and schedule the call as a batch of the
# longest sequence and skip what lies past each sequence's end, so the deterministic schedules and their proofs are
# those of that batch. Elsewhere the dense kernels run once per run of consecutive sequences with equal lengths, as
# a batch of (sequences, seqlen, heads, d) views of the packed tensors (splitting the packed dim never copies); runs
# write disjoint rows, so the deterministic mode stays bitwise reproducible. The window is re-normalised per run, so
# short sequences reach the full/causal kernels. `ext` is the extension _check_varlen checked once for every launch.

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


def _packed_launch(ext, q, k, v, cq, ck, mask, window_left, window_right):
    """(longest q sequence, longest k sequence) when the packed-sequence kernels run this call, else None."""
    if not ext.packed_built():
        return None
    if q.shape[-1] != v.shape[-1] or q.shape[-1] not in _supported_head_dims():
        return None
    if _runs_beat_packed(q, k, cq, ck, mask, window_left, window_right):
        return None
    lens_q, lens_k = _used_lengths(cq, None), _used_lengths(ck, None)
    max_q, max_k = max(lens_q), max(lens_k)
    if max_q == 0 or max_k == 0 or not _bands_inside(lens_q, lens_k, mask, window_left, window_right):
        return None
    return max_q, max_k


def _bands_inside(lens_q, lens_k, mask, window_left, window_right) -> bool:
    """Whether each sequence's band lies inside the longest sequences' band. The packed kernels' schedule of a causal
    or window mask is the batch's, whose band lies around the longest sequences' diagonal (max_k - max_q): a sequence
    band outside it would need KV tiles that schedule never visits. A right bound needs no diagonal right of the
    batch's, a left bound none left of it."""
    if mask == MaskKind.FULL or not lens_q:
        return True
    left, right = (-1, 0) if mask == MaskKind.CAUSAL else (window_left, window_right)
    diagonal = max(lens_k) - max(lens_q)
    return not any((right >= 0 and lk - lq > diagonal) or (left >= 0 and lk - lq < diagonal)
                   for lq, lk in zip(lens_q, lens_k))


def _device_int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int32, non_blocking=True).contiguous()


def _varlen_fwd_cuda(ext, q, k, v, cu_seqlens_q, cu_seqlens_k, cq, ck, softmax_scale, mask, window_left,
                     window_right, softcap):
    out = _out_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    packed = _packed_launch(ext, q, k, v, cq, ck, mask, window_left, window_right)
    if packed is not None:
        with _device_guard(q.device):
            ext.varlen_fwd(q, k, v, out, lse, _device_int32(cu_seqlens_q, q.device),
                           _device_int32(cu_seqlens_k, q.device), None, None, packed[0], packed[1], softmax_scale,
                           mask, window_left, window_right, softcap)
        return out, lse
    for sq, sk, count, seqlen_q, seqlen_k in _runs(cq, ck):
        q_b = _batched(q, sq, count, seqlen_q)
        k_b, v_b = _batched(k, sk, count, seqlen_k), _batched(v, sk, count, seqlen_k)
        mask_b, left_b, right_b = _effective_mask(mask, window_left, window_right, seqlen_q, seqlen_k)
        lse_b = torch.empty(_lse_shape(q_b), dtype=torch.float32, device=q.device)
        _run_fwd(ext, q_b, k_b, v_b, _batched(out, sq, count, seqlen_q), lse_b, softmax_scale, mask_b, left_b,
                 right_b, softcap)
        lse[:, sq].unflatten(1, (count, seqlen_q)).copy_(lse_b.transpose(0, 1))
    return out, lse


def _varlen_bwd_cuda(ext, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, cq, ck, softmax_scale, mask,
                     window_left, window_right, softcap, deterministic, schedule, sm_margin):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    schedule = _varlen_schedule(schedule, mask, deterministic)
    packed = _packed_launch(ext, q, k, v, cq, ck, mask, window_left, window_right)
    if packed is not None:
        max_q, max_k = packed
        schedule_id = _resolve_schedule_for(schedule, q.device, len(cq) - 1, max_q, max_k, q.shape[1], k.shape[1],
                                            q.shape[-1], mask, window_left, window_right, deterministic, sm_margin)
        with _device_guard(q.device):
            ext.varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, _device_int32(cu_seqlens_q, q.device),
                           _device_int32(cu_seqlens_k, q.device), None, None, max_q, max_k, softmax_scale, mask,
                           window_left, window_right, softcap, deterministic, schedule_id, sm_margin)
        return dq, dk, dv
    for sq, sk, count, seqlen_q, seqlen_k in _runs(cq, ck):
        q_b = _batched(q, sq, count, seqlen_q)
        k_b, v_b = _batched(k, sk, count, seqlen_k), _batched(v, sk, count, seqlen_k)
        mask_b, left_b, right_b = _effective_mask(mask, window_left, window_right, seqlen_q, seqlen_k)
        lse_b = lse[:, sq].unflatten(1, (count, seqlen_q)).transpose(0, 1).contiguous()
        _run_bwd(ext, _batched(dout, sq, count, seqlen_q), q_b, k_b, v_b, _batched(out, sq, count, seqlen_q), lse_b,
                 _batched(dq, sq, count, seqlen_q), _batched(dk, sk, count, seqlen_k),
                 _batched(dv, sk, count, seqlen_k), softmax_scale, mask_b, left_b, right_b, softcap, deterministic,
                 schedule, sm_margin)
    return dq, dk, dv


# Unplanned calls (inside a CUDA graph capture, or given seqused_q/k): the packed-sequence kernels with bounds for the
# longest sequences (the caller's max_seqlen inside a capture, else the longest rows in use), cu_seqlens and seqused
# checked on the GPU afterwards (dash_attn.device_seqlens: invalid values turn every result into NaN). Rows past
# seqused are not the kernels' to write: they start as zeros (lse -inf).
def _unplanned_band(mask, window_left, window_right):
    return None if mask == MaskKind.FULL else (window_left, window_right)


def _unplanned_bounds(host, mask, window_left, window_right, max_seqlen_q, max_seqlen_k):
    """The bounds of an unplanned call: the caller's inside a capture (host None), else the longest rows in use, whose
    bands must lie inside the longest ones' (the packed kernels are the only ones that skip rows)."""
    if host is None:
        return max_seqlen_q, max_seqlen_k
    lens_q, lens_k = _used_lengths(host[0], host[2]), _used_lengths(host[1], host[3])
    if not _bands_inside(lens_q, lens_k, mask, window_left, window_right):
        raise ValueError("with seqused_q/seqused_k the packed-sequence kernels run the call, which need each sequence's "
                         "causal or window band inside the longest sequences' band (their diagonals seqused_k - "
                         "seqused_q equal, for instance): this call's bands differ")
    return max(lens_q, default=0), max(lens_k, default=0)


def _device_seqs(q, *tensors):
    return [None if t is None else _device_int32(t, q.device) for t in tensors]


def _varlen_fwd_unplanned(ext, q, k, v, seqs, bounds, softmax_scale, mask, window_left, window_right, softcap,
                          checked_on_host=False):
    """seqs: cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k (the last two may be None); bounds: max_q, max_k.
    checked_on_host: the values passed _check_varlen's host checks, so the GPU check would only repeat them."""
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
            ext.varlen_fwd(q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, softmax_scale, mask,
                           window_left, window_right, softcap)
        if not checked_on_host:
            device_seqlens.flag_invalid(ext, cu_q, cu_k, used_q, used_k, q.shape[0], k.shape[0], max_q, max_k,
                                        _unplanned_band(mask, window_left, window_right), out, lse)
    return out, lse


def _varlen_bwd_unplanned(ext, dout, q, k, v, out, lse, seqs, bounds, softmax_scale, mask, window_left, window_right,
                          softcap, deterministic, schedule, sm_margin, checked_on_host=False):
    cu_q, cu_k, used_q, used_k = _device_seqs(q, *seqs)
    max_q, max_k = device_seqlens.capped_bounds(q.shape[0], k.shape[0], *bounds)
    no_key_seen = max_q == 0 or max_k == 0 or cu_q.shape[0] == 1
    # Gradients the kernel does not write (rows past seqused, or all of them when no query sees a key) start as 0.
    untouched_rows = used_q is not None or used_k is not None or no_key_seen
    dq, dk, dv = ((torch.zeros_like if untouched_rows else torch.empty_like)(t) for t in (q, k, v))
    schedule = _varlen_schedule(schedule, mask, deterministic)
    with _device_guard(q.device):
        if not no_key_seen:
            schedule_id = _resolve_schedule_for(schedule, q.device, cu_q.shape[0] - 1, max_q, max_k, q.shape[1],
                                                k.shape[1], q.shape[-1], mask, window_left, window_right,
                                                deterministic, sm_margin)
            ext.varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, used_q, used_k, max_q, max_k,
                           softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule_id,
                           sm_margin)
        if not checked_on_host:
            device_seqlens.flag_invalid(ext, cu_q, cu_k, used_q, used_k, q.shape[0], k.shape[0], max_q, max_k,
                                        _unplanned_band(mask, window_left, window_right), dq, dk, dv)
    return dq, dk, dv


def _varlen_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
                     max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int,
                     window_right: int, softcap: float, deterministic: bool, schedule: str,
                     sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor]:
    mask, window_left, window_right = _effective_mask(mask, window_left, window_right, max_seqlen_q, max_seqlen_k)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ext, host = _check_varlen(q, k, v, *seqs, max_seqlen_q, max_seqlen_k, softcap)
    if _runs_unplanned(ext, host, seqused_q, seqused_k):
        bounds = _unplanned_bounds(host, mask, window_left, window_right, max_seqlen_q, max_seqlen_k)
        return _varlen_fwd_unplanned(ext, q, k, v, seqs, bounds, softmax_scale, mask, window_left, window_right,
                                     softcap, checked_on_host=host is not None)
    if ext is not None:
        return _varlen_fwd_cuda(ext, q, k, v, cu_seqlens_q, cu_seqlens_k, host[0], host[1], softmax_scale, mask,
                                window_left, window_right, softcap)
    out = _out_like(q, v)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, False,
                                            (window_left, window_right), softcap, return_lse=True,
                                            compute_dtype=_reference_dtype(q.dtype), seqused_q=seqused_q,
                                            seqused_k=seqused_k)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


_varlen_fwd = torch.library.custom_op("dash_attn::varlen_fwd", mutates_args=())(_varlen_fwd_impl)


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule, sm_margin):
    return _out_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _varlen_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     seqused_q: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
                     max_seqlen_k: int, softmax_scale: float, mask: int, window_left: int, window_right: int,
                     softcap: float, deterministic: bool, schedule: str,
                     sm_margin: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask, window_left, window_right = _effective_mask(mask, window_left, window_right, max_seqlen_q, max_seqlen_k)
    seqs = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ext, host = _check_varlen(q, k, v, *seqs, max_seqlen_q, max_seqlen_k, softcap)
    if _runs_unplanned(ext, host, seqused_q, seqused_k):
        bounds = _unplanned_bounds(host, mask, window_left, window_right, max_seqlen_q, max_seqlen_k)
        return _varlen_bwd_unplanned(ext, dout, q, k, v, out, lse, seqs, bounds, softmax_scale, mask, window_left,
                                     window_right, softcap, deterministic, schedule, sm_margin,
                                     checked_on_host=host is not None)
    if ext is not None:
        return _varlen_bwd_cuda(ext, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, host[0], host[1],
                                softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule,
                                sm_margin)
    window = (window_left, window_right)
    compute_dtype = _reference_dtype(q.dtype)
    used = dict(seqused_q=seqused_q, seqused_k=seqused_k)
    ref_out, ref_lse = attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, False, window,
                                            softcap, return_lse=True, compute_dtype=compute_dtype, **used)
    grads = attention_bwd_ref_varlen(dout, q, k, v, ref_out, ref_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale,
                                     False, window, softcap, compute_dtype, **used)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for dst, src in zip((dq, dk, dv), grads):
        dst.copy_(src)
    return dq, dk, dv


_varlen_bwd = torch.library.custom_op("dash_attn::varlen_bwd", mutates_args=())(_varlen_bwd_impl)


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule,
                     sm_margin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_VARLEN_SEQ_INPUTS = 4  # cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k: after q, k, v, before the scalars


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    seqs, params = inputs[3:3 + _VARLEN_SEQ_INPUTS], inputs[3 + _VARLEN_SEQ_INPUTS:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *seqs)
    ctx.params = params
    ctx.mark_non_differentiable(lse)


def _varlen_fwd_backward(ctx, dout, dlse, bwd=_varlen_bwd):
    q, k, v, out, lse, *seqs = ctx.saved_tensors
    dq, dk, dv = bwd(_last_dim_contiguous(dout), q, k, v, out, lse, *seqs, *ctx.params)
    return (dq, dk, dv) + (None,) * (_VARLEN_SEQ_INPUTS + len(ctx.params))


_varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)
_EagerVarlenAttention = _eager_function("_EagerVarlenAttention", _varlen_fwd_impl, _varlen_fwd_setup_context,
                                        functools.partial(_varlen_fwd_backward, bwd=_varlen_bwd_impl))
