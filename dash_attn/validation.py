"""Input checks of the public API, run before any kernel launch.

Every user mistake raises ValueError naming the argument and the fix; problems of the environment (no sm90 GPU,
extension not built, kernels a build left out) raise RuntimeError.
Shape/dtype checks here only read metadata so they also run on the fake tensors torch.compile traces with;
`check_cu_seqlens_values` checks tensor contents and therefore runs inside the custom op, on real tensors.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Optional, Sequence, Tuple

import torch

from . import schedules_table
from ._args import MaskKind, _mask_args

# Backward schedule names accepted by `schedule=`; "auto" is resolved before any launch. The names, and the picks of
# deterministic `auto` by mask, are dash_attn/schedules_table.py's.
SCHEDULES = schedules_table.SCHEDULES
# Schedules without a fixed dQ accumulation order: the non-deterministic backward only.
NONDETERMINISTIC_SCHEDULES = schedules_table.NONDETERMINISTIC_SCHEDULES

# The kernels' element types, by the names of the build's DASH_ATTN_DTYPES (and of the binding's supported_dtypes).
KERNEL_DTYPE_NAMES = {"fp16": torch.float16, "bf16": torch.bfloat16}
KERNEL_DTYPES = tuple(KERNEL_DTYPE_NAMES.values())
# The same names keyed by dtype (the binding's dtype arguments).
DTYPE_KERNEL_NAMES = {dtype: name for name, dtype in KERNEL_DTYPE_NAMES.items()}
# The CPU reference also takes full precision so torch.autograd.gradcheck can run in float64.
CPU_DTYPES = KERNEL_DTYPES + (torch.float32, torch.float64)
# Head dims: any from 1 to MAX_HEADDIM. The kernels take multiples of HEADDIM_MULTIPLE (they move rows in 16-byte
# pieces and TMA needs 16-byte strides: csrc/common/head_dims.h), so the public functions zero-pad the others to the
# next one (padded_head_dim) and drop the padding from the results; the CPU reference runs the same padded call.
MAX_HEADDIM = 256
HEADDIM_MULTIPLE = 8


def padded_head_dim(headdim: int) -> int:
    """The head dim a call of head dim `headdim` (1..MAX_HEADDIM) runs with: the next multiple of HEADDIM_MULTIPLE.
    Zero columns change no score q.k (the softmax scale stays that of `headdim`); on v they add output columns of
    zeros, which are dropped, and the gradients of all padding columns are dropped likewise."""
    return -(-headdim // HEADDIM_MULTIPLE) * HEADDIM_MULTIPLE


# The exception types whose messages name the public function that was called. Exact types only: subclasses
# (torch.OutOfMemoryError, NotImplementedError, ...) carry their own meaning and pass through unchanged.
_NAMED_ERRORS = (ValueError, TypeError, RuntimeError)


def public_entry(fn):
    """Makes every ValueError, TypeError and RuntimeError raised by a call of `fn` name it: "fn(): <message>". The
    checks themselves do not know which public function runs them (the packed functions share flash_attn_func's and
    flash_attn_varlen_func's, the custom ops check tensor contents): the public functions are the only ones wrapped,
    and they call each other's unwrapped bodies, so one message names the function the user called. A message that
    already starts with it (Python's own, for a wrong keyword or argument count) is left as it is. Under
    torch.compile the checks the ops run at graph run time (cu_seqlens contents) raise outside this wrapper, unnamed.
    A new exception with the original traceback rather than an edit of exc.args: Dynamo traces this `raise` (a bad
    argument under fullgraph=True reports the named message) but not an assignment to an exception's attributes."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _NAMED_ERRORS as exc:
            message = exc.args[0] if exc.args else None
            if type(exc) in _NAMED_ERRORS and isinstance(message, str) and not message.startswith(name + "("):
                raise type(exc)(f"{name}(): {message}", *exc.args[1:]).with_traceback(exc.__traceback__) from None
            raise

    return call


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> None:
    """dtype, device, rank, shape and stride checks shared by the dense and varlen entry points."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}: "
                         "move them with .to(q.device)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}: "
                         "cast them with .to(q.dtype)")
    allowed = CPU_DTYPES if q.device.type == "cpu" else KERNEL_DTYPES
    if q.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise ValueError(f"q has dtype {q.dtype} on {q.device.type}; dash_attn takes {names} there: "
                         "cast with q.to(torch.bfloat16) (and k, v likewise)")

    rank = 3 if varlen else 4
    layout = ("(total_q, nheads, headdim) and k/v (total_k, nheads_k, headdim)" if varlen
              else "(batch, seqlen_q, nheads, headdim) and k/v (batch, seqlen_k, nheads_k, headdim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}: "
                             f"the layout is q {layout}")
    if tuple(k.shape[:-1]) != tuple(v.shape[:-1]):
        raise ValueError(f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)}")
    if not varlen and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    nheads, nheads_k = q.shape[-2], k.shape[-2]
    if nheads_k == 0 or nheads % nheads_k != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k/v ({nheads_k}) for MQA/GQA: "
                         "pick a number of key/value heads that divides the number of query heads")
    for name, headdim in (("", q.shape[-1]), (" of v", v.shape[-1])):
        if not 1 <= headdim <= MAX_HEADDIM:
            raise ValueError(f"head dim{name} {headdim} is not supported: dash_attn takes head dims from 1 to "
                             f"{MAX_HEADDIM}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
                             f"{tuple(t.stride())}: pass {name}.contiguous()")


def unpack_qkv(qkv: torch.Tensor, num_heads_q, varlen: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of a packed qkv: (batch, seqlen, 3, nheads, d), or (batch, seqlen, num_heads_q + 2 * nheads_k,
    d) with num_heads_q; varlen: (total, ...) instead of (batch, seqlen, ...)."""
    _check_tensor("qkv", qkv)
    rows = "total" if varlen else "batch, seqlen"
    dim = 1 if varlen else 2  # the packing dim
    if num_heads_q is None:
        if qkv.dim() != dim + 3 or qkv.shape[dim] != 3:
            raise ValueError(f"qkv must be ({rows}, 3, nheads, headdim), got shape {tuple(qkv.shape)}; for "
                             f"({rows}, nheads_q + 2 * nheads_k, headdim) pass num_heads_q")
        return qkv.unbind(dim)
    num_heads_q = as_int("num_heads_q", num_heads_q)
    if qkv.dim() != dim + 2:
        raise ValueError(f"qkv with num_heads_q must be ({rows}, nheads_q + 2 * nheads_k, headdim), got shape "
                         f"{tuple(qkv.shape)}")
    kv_heads = qkv.shape[dim] - num_heads_q
    if num_heads_q <= 0 or kv_heads <= 0 or kv_heads % 2 != 0:
        raise ValueError(f"num_heads_q={num_heads_q} does not split qkv's {qkv.shape[dim]} heads into num_heads_q "
                         "query heads and two equal groups of key and value heads")
    return qkv.split([num_heads_q, kv_heads // 2, kv_heads // 2], dim=dim)


def unpack_kv(kv: torch.Tensor, varlen: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """k, v as views of a packed kv: (batch, seqlen_k, 2, nheads_k, d); varlen: (total_k, 2, nheads_k, d)."""
    _check_tensor("kv", kv)
    rows = "total_k" if varlen else "batch, seqlen_k"
    dim = 1 if varlen else 2
    if kv.dim() != dim + 3 or kv.shape[dim] != 2:
        raise ValueError(f"kv must be ({rows}, 2, nheads_k, headdim), got shape {tuple(kv.shape)}")
    return kv.unbind(dim)


# A window side this wide is wider than any sequence a tensor can hold: larger values are clamped to it, so that the
# ops' int arguments never overflow (the ops drop window sides wider than the sequences, as FlashAttention-3 does).
WINDOW_CLAMP = 2**31 - 1


def as_int(name: str, value) -> int:
    """An integer-like argument (int, numpy integer, 0-d integer tensor: anything operator.index takes) as an int.
    bool is refused: True / False as a length or a head count is a mistake, not a 1 or a 0."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def check_window(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    """(window_left, window_right) as ints with causal folded in, FlashAttention-3's rules: any negative side is
    unbounded (-1); causal forces the right side to 0 whatever was given (causal == a right window of 0). Sides wider
    than the sequences are dropped later, where the lengths are known (interface._effective_mask)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    left, right = (min(max(as_int(f"window_size {side}", value), -1), WINDOW_CLAMP)
                   for side, value in (("left", left), ("right", right)))
    return left, 0 if causal else right


def _is_finite(x) -> bool:
    # Comparisons instead of math.isfinite: they also work on the symbolic floats torch.compile may trace with.
    return x == x and abs(x) != math.inf


def _finite_number(x) -> bool:
    """An int or float (not a bool) that is finite."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and _is_finite(x)


def check_softcap(softcap: float) -> float:
    if not _finite_number(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap!r}")
    return float(softcap)


# The smallest positive softmax_scale the kernels take. The backward keeps each row's log-sum-exp in score units,
# lse / scale (csrc/bwd/bwd_preprocess.h), which overflows float32 below about 6e-38 at 2^31 keys; 1e-30 leaves a
# margin of 1e7 and is far below any model's scale (1 / sqrt(head dim) >= 1 / 16).
MIN_SOFTMAX_SCALE = 1e-30


def _kernel_softmax_scale(softmax_scale) -> bool:
    """Whether the kernels take this scale (they cannot take 0: a masked score's -inf times 0 is NaN, and the backward
    folds 1 / scale into its row statistics)."""
    return _finite_number(softmax_scale) and softmax_scale >= MIN_SOFTMAX_SCALE


def default_softmax_scale(headdim: int) -> float:
    """The scale softmax_scale=None stands for: 1 / sqrt(headdim), FlashAttention's."""
    return 1.0 / math.sqrt(headdim)


def check_softmax_scale(softmax_scale) -> None:
    """The public functions' scales: the kernels' and 0, which they run as zero queries at scale 1
    (api._scoreless_queries). A negative scale would turn the row max into the row min: the exponentials overflow."""
    if softmax_scale is None or _kernel_softmax_scale(softmax_scale) \
            or (_finite_number(softmax_scale) and softmax_scale == 0):
        return
    raise ValueError(f"softmax_scale must be 0, a finite float >= {MIN_SOFTMAX_SCALE:g} or None (1/sqrt(headdim)), "
                     f"got {softmax_scale!r}")


def check_kernel_softmax_scale(softmax_scale) -> None:
    """The scales the custom ops and the functions that call them directly take (the public functions have routed 0
    already)."""
    if not _kernel_softmax_scale(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite float >= {MIN_SOFTMAX_SCALE:g}, got {softmax_scale!r} "
                         "(the public functions, dash_attn.flash_attn_func and the others, also take 0)")


def check_op_args(op: str, softmax_scale, mask, window_left, window_right, softcap, deterministic, schedule,
                  sm_margin) -> None:
    """The scalar arguments of a direct call of the custom op `op` (the public functions pass them checked and
    normalised, _args.OpArgs): the kernels' scale range, a mask that its window gives (as _args._mask_args builds it
    from a check_window pair; another mask would run silently), and the checks of the public functions' softcap,
    schedule and sm_margin. The schema has checked the types. Every message names the op."""
    try:
        check_kernel_softmax_scale(softmax_scale)
        for side, value in (("window_left", window_left), ("window_right", window_right)):
            if not -1 <= value <= WINDOW_CLAMP:
                raise ValueError(f"{side} must be -1 (unbounded) or in [0, {WINDOW_CLAMP}], got {value!r}")
        expected = _mask_args(window_left, window_right)[0]
        if mask != expected:
            raise ValueError(f"mask must be {expected} ({MaskKind(expected).name.lower()}) for the window "
                             f"({window_left}, {window_right}), got {mask!r}: full is (-1, -1), causal (-1, 0)")
        check_softcap(softcap)
        check_schedule(schedule)
        check_schedule_mode(schedule, deterministic)
        check_sm_margin(sm_margin)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: schedule must be one of {', '.join(SCHEDULES)}")


def check_schedule_mode(schedule: str, deterministic: bool) -> None:
    """After check_schedule, with `deterministic` resolved (None follows torch's flag)."""
    if deterministic and schedule in NONDETERMINISTIC_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} claims work at run time and has no fixed dQ accumulation order: it "
                         "runs only with deterministic=False; pick another schedule (or 'auto') for a deterministic "
                         "backward")


def check_sm_margin(sm_margin) -> int:
    value = as_int("sm_margin", sm_margin)
    if value < 0:
        raise ValueError(f"sm_margin must be an int >= 0 (SMs left free for other work), got {sm_margin!r}")
    return value


# FlashAttention-3's keywords for features dash_attn lacks or tuning it does not need, with their defaults.
FA3_OPTIONS = {"qv": None, "q_descale": None, "k_descale": None, "v_descale": None, "attention_chunk": 0,
               "num_splits": 1, "pack_gqa": None}


def check_fa3_options(options: dict) -> int:
    """FlashAttention-3's keywords of FA3_OPTIONS, so that its calls run unchanged: each is refused only when it asks
    for something dash_attn does not do. qv and the FP8 descale factors are features that are not built; num_splits 0
    (FA3's heuristic) or 1 (no split) is what the forward does, a larger value asks for FA3's split-KV forward, which
    is not built either; pack_gqa only changes how FA3 tiles the query heads of a KV head, not the result, and GQA
    needs no packing here: any of its values is accepted and ignored. A name outside FA3_OPTIONS is a TypeError, as
    for a Python function. Returns attention_chunk as an int (check_attention_chunk)."""
    for name in options:
        if name not in FA3_OPTIONS:
            raise TypeError(f"got an unexpected keyword argument {name!r}")
    for name, feature in (("qv", "the extra query-value product (qv)"), ("q_descale", "FP8 inputs (descale factors)"),
                          ("k_descale", "FP8 inputs (descale factors)"),
                          ("v_descale", "FP8 inputs (descale factors)")):
        if options.get(name) is not None:
            raise ValueError(f"{name} must be None: {feature} is not supported by dash_attn")
    num_splits = options.get("num_splits", 1)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits not in (0, 1):
        raise ValueError(f"num_splits must be 1 or 0 (FlashAttention-3's heuristic): its split-KV forward is not "
                         f"supported by dash_attn, got {num_splits!r}")
    pack_gqa = options.get("pack_gqa")
    if pack_gqa is not None and not isinstance(pack_gqa, bool):
        raise ValueError(f"pack_gqa must be True, False or None, got {pack_gqa!r}")
    return check_attention_chunk(options.get("attention_chunk", 0))


def check_attention_chunk(attention_chunk) -> int:
    """FlashAttention-3's attention_chunk (Llama 4's chunked attention) as an int: 0 (or None) is off, C > 0 keeps
    each query to the keys of its own chunk of C positions (dash_attn/_chunked.py)."""
    if attention_chunk is None:
        return 0
    chunk = as_int("attention_chunk", attention_chunk)
    if chunk < 0:
        raise ValueError(f"attention_chunk must be an int >= 0 (0 turns chunking off), got {attention_chunk!r}")
    return chunk


def check_fa2_options(dropout_p, alibi_slopes) -> None:
    """FlashAttention-2's positional dropout_p and alibi_slopes of the FA2-named packed functions: only their 'off'
    values (FlashAttention-3 has neither)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p must be 0.0: attention dropout is not supported by dash_attn, got {dropout_p!r}")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes must be None: ALiBi biases are not supported by dash_attn")


def check_learnable_sink(learnable_sink, q: torch.Tensor, attention_chunk: int = 0) -> None:
    """learnable_sink (gpt-oss's attention sinks, dash_attn/_sinks.py): a float32 (nheads,) tensor on q's device, one
    logit per query head. float64 q (the CPU reference, for gradcheck) also takes a float64 sink. attention_chunk
    (checked, an int) must be 0: the chunked path (dash_attn/_chunked.py) does not carry a sink."""
    if attention_chunk:
        raise ValueError(f"learnable_sink with attention_chunk={attention_chunk} is not supported: pass "
                         "attention_chunk=0 or learnable_sink=None")
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be None or a float32 torch.Tensor of shape (nheads,), got "
                        f"{type(learnable_sink).__name__}")
    allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
    if learnable_sink.dtype not in allowed:
        raise TypeError(f"learnable_sink must have dtype torch.float32, got {learnable_sink.dtype}: pass "
                        "learnable_sink.float()")
    nheads = q.shape[-2]
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), one logit per query head, got "
                         f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != q.device:
        raise ValueError(f"learnable_sink must be on the device of q ({q.device}), got {learnable_sink.device}: "
                         "move it with .to(q.device)")


def check_deterministic(deterministic) -> None:
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True, False or None (follow "
                         f"torch.are_deterministic_algorithms_enabled()), got {deterministic!r}")


def check_cu_seqlens_meta(q: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                          max_seqlen_q: int, max_seqlen_k: int) -> Tuple[int, int]:
    """Metadata of the varlen arguments: dtype, rank, device, matching batch sizes; returns max_seqlen_q/k as ints."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of int32, got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}: pass {name}.to(torch.int32)")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of length batch + 1, got shape {tuple(cu.shape)}")
        if cu.device != q.device and cu.device.type != "cpu":
            raise ValueError(f"{name} must be on the device of q ({q.device}) or on the CPU, got {cu.device}")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have length batch + 1, got "
                         f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    bounds = []
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        bounds.append(as_int(name, value))
        if bounds[-1] < 0:
            raise ValueError(f"{name} must be an int >= 0 (the longest sequence), got {value!r}")
    return bounds[0], bounds[1]


def check_seqused_meta(q: torch.Tensor, cu_seqlens_q: torch.Tensor, seqused_q, seqused_k) -> None:
    """Metadata of FlashAttention-3's seqused_q/k: None, or int32 (batch,) tensors on q's device or the CPU."""
    batch = cu_seqlens_q.shape[0] - 1
    for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if used is None:
            continue
        if not isinstance(used, torch.Tensor):
            raise ValueError(f"{name} must be None or a torch.Tensor of int32, got {type(used).__name__}")
        if used.dtype != torch.int32:
            raise ValueError(f"{name} must have dtype torch.int32, got {used.dtype}: pass {name}.to(torch.int32)")
        if used.dim() != 1 or used.shape[0] != batch:
            raise ValueError(f"{name} must be 1-D of length batch = {batch}, got shape {tuple(used.shape)}")
        if used.device != q.device and used.device.type != "cpu":
            raise ValueError(f"{name} must be on the device of q ({q.device}) or on the CPU, got {used.device}")


def check_cu_seqlens_values(name: str, values: Sequence[int], total: int, max_seqlen: int, max_name: str,
                            used: Optional[Sequence[int]] = None, used_name: str = "seqused") -> None:
    """Contents of cu_seqlens (a host copy): starts at 0, non-decreasing, ends at the packed length; seqused (a host
    copy, may be None) within each sequence's length; max_seqlen at least the longest sequence's rows in use."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing (prefix sums of sequence lengths), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the packed length {total} of the tensor, got {values[-1]}")
    if used is not None:
        for b, (n_used, n) in enumerate(zip(used, lengths)):
            if not 0 <= n_used <= n:
                raise ValueError(f"{used_name}[{b}]={n_used} must lie in [0, {n}], the length of sequence {b} in "
                                 f"{name}")
        lengths = used
    longest = max(lengths, default=0)
    if max_seqlen < longest:
        raise ValueError(f"{max_name}={max_seqlen} is smaller than the longest sequence ({longest}) in {name}: "
                         f"pass {max_name} >= {longest}")


def check_cuda_device(device: torch.device) -> None:
    """The kernels are sm90a binaries: any other GPU must fail loudly before a launch."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise RuntimeError(f"dash_attn kernels need an sm90 (Hopper) GPU, found sm{major}{minor} "
                           f"({torch.cuda.get_device_name(device)}): run on an H100/H200 or use CPU tensors for the "
                           "reference path")


# The soft-capped kernels scale scores by softmax_scale / softcap before tanh and by softcap * log2(e) after it, in
# fp32: past this the first underflows and the second overflows. A softcap this large caps nothing (pass 0).
CUDA_MAX_SOFTCAP = 1e30


def kernel_head_dim(headdim: int, supported_head_dims: Sequence[int]) -> int:
    """The compiled head dim that runs `headdim`: itself, or the smallest larger one, whose kernel treats the missing
    columns as zeros (csrc/common/head_dims.h)."""
    if headdim in supported_head_dims:
        return headdim
    larger = [d for d in supported_head_dims if d > headdim]
    if not larger:
        raise ValueError(f"head dim {headdim} is above every compiled CUDA kernel's; the build has "
                         f"{sorted(supported_head_dims)}: rebuild with DASH_ATTN_HDIMS including a head dim >= "
                         f"{headdim}")
    return min(larger)


def check_cuda_features(headdim: int, supported_head_dims: Sequence[int], softcap: float,
                        softcap_built: bool = True, dtype: Optional[torch.dtype] = None,
                        supported_dtypes: Optional[Sequence[torch.dtype]] = None) -> None:
    """Kernels this build does not have, or values they cannot represent: refuse them instead of computing
    something else."""
    kernel_head_dim(headdim, supported_head_dims)
    if supported_dtypes is not None and dtype not in supported_dtypes:
        def name(d):
            return str(d).replace("torch.", "")
        built = ", ".join(name(d) for d in supported_dtypes)
        raise RuntimeError(f"{name(dtype)} inputs need kernels this build of dash_attn skipped (it has {built}): "
                           "rebuild with DASH_ATTN_DTYPES including it, or cast the inputs")
    if softcap > CUDA_MAX_SOFTCAP:
        raise ValueError(f"softcap={softcap} is above {CUDA_MAX_SOFTCAP:g}, which the CUDA kernels cannot represent; "
                         "a softcap that large caps nothing: pass softcap=0.0")
    if softcap > 0.0 and not softcap_built:
        raise RuntimeError(f"softcap={softcap} needs the soft-capped kernels, which this build of dash_attn skipped "
                           "(DASH_ATTN_SOFTCAP=0): rebuild without it, or use softcap=0.0")


def check_unplanned_varlen(q: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q,
                           seqused_k, packed_built: bool, capturing: bool) -> None:
    """A varlen call inside a CUDA graph capture (which cannot read cu_seqlens on the host) or given seqused_q/k (whose
    rows past seqused no per-sequence view can skip) runs the packed-sequence kernels unplanned
    (dash_attn.device_seqlens): refuse what those kernels cannot take, before the launch. Head dims other than a
    kernel's own run on copies padded to one (dash_attn/_varlen.py)."""
    why = "inside a CUDA graph capture" if capturing else "with seqused_q/seqused_k"
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k)):
        if capturing and t is not None and t.device != q.device:
            raise RuntimeError(f"a varlen call inside a CUDA graph capture needs {name} on q's device "
                               f"({q.device}), got {t.device}: the captured kernels read it there at every replay")
    if not packed_built:
        raise RuntimeError(f"a varlen call {why} runs the packed-sequence kernels, which this build skipped "
                           "(DASH_ATTN_PACKED=0): rebuild without it")
