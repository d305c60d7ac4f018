"""attn_implementation="dash_attn" for Hugging Face transformers (>= 4.53, which has AttentionInterface and
AttentionMaskInterface).

    from dash_attn.integrations.transformers import register
    register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dash_attn", dtype=torch.bfloat16)

The attention function follows transformers' flash-attention paths (integrations/flash_attention.py and
modeling_flash_attention_utils.py): the model builds the masks of flash_attention_2 (the 2-D padding mask, or None
when nothing is padded) and each call becomes one dash_attn call:
- a padding mask: the tokens it keeps are gathered into flash_attn_varlen_func's packed layout and the result is
  scattered back (padded query rows come back as zeros, like transformers' flash path);
- a padding-free batch (sequences packed back to back in one row, as DataCollatorWithFlattening produces): its
  cu_seq_lens_q/k and max_length_q/k keywords, or else sequence starts read from position_ids restarting, give
  flash_attn_varlen_func's cu_seqlens;
- otherwise flash_attn_func on the dense batch. Causal masks align bottom-right, so queries decoding against a longer
  KV cache see the whole cache.
sliding_window, softcap, scaling, GQA/MQA (k/v with fewer heads, passed as they are) and encoders (is_causal False)
map onto the kernels' arguments; gpt-oss's learnable attention sinks (s_aux, one logit per query head) become
learnable_sink, in float32 (CPU tensors only until the kernels take a sink). The backward is deterministic when
torch.are_deterministic_algorithms_enabled() or FLASH_ATTENTION_DETERMINISTIC=1 (transformers' switch, which its
enable_full_determinism sets).
Not supported: attention dropout (the kernels have none), 4-D attention masks, and static caches
(cache_implementation="static") without padding: a padding mask bounds the cache's filled slots, but generate() drops
an all-true one for implementations not named flash*, and then the empty slots would take part
(nothing here can tell them apart); use the default dynamic cache.

transformers stays optional: this module imports it only inside register().
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..api import flash_attn_func, flash_attn_varlen_func

ATTN_IMPLEMENTATION = "dash_attn"
# transformers' switch for a deterministic flash-attention backward (read by its flash path and set by
# transformers.enable_full_determinism).
DETERMINISTIC_ENV = "FLASH_ATTENTION_DETERMINISTIC"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def register() -> None:
    """Registers attn_implementation="dash_attn" with transformers: the attention function and, for its masks, the
    mask function of flash_attention_2. Calling it again changes nothing."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        raise ImportError("dash_attn.integrations.transformers.register() needs transformers >= 4.53 (for "
                          "AttentionInterface and AttentionMaskInterface): pip install -U transformers "
                          f"({exc})") from exc
    AttentionInterface.register(ATTN_IMPLEMENTATION, dash_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def dash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                           softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                           s_aux: Optional[torch.Tensor] = None, **kwargs) -> Tuple[torch.Tensor, None]:
    """An attention function of transformers' AttentionInterface.

    query: (batch, heads, seqlen_q, dim); key, value: (batch, heads_kv, seqlen_k, dim / dim_v); attention_mask: None
    or the (batch, seqlen_k) padding mask of the flash-attention mask function (True or 1 = a token). is_causal: None
    takes module.is_causal. kwargs: position_ids, cu_seq_lens_q/k with max_length_q/k, deterministic; the others
    transformers passes are ignored. Returns (out, None): out (batch, seqlen_q, heads, dim_v), the layout of
    transformers' flash attention; the attention weights are never formed.
    """
    _check_call(query, key, attention_mask, dropout)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    # transformers' layout is (batch, heads, seqlen, dim); the kernels' (batch, seqlen, heads, dim), as views.
    q, k, v = _kernel_dtype(*(t.transpose(1, 2) for t in (query, key, value)), module=module)
    options = dict(softmax_scale=None if scaling is None else float(scaling), causal=causal,
                   window_size=_window_size(sliding_window, causal, k.shape[1]),
                   softcap=0.0 if softcap is None else softcap,
                   deterministic=_deterministic(kwargs.get("deterministic")), learnable_sink=_learnable_sink(s_aux))
    if attention_mask is not None:
        return _padded_attention(q, k, v, attention_mask.bool(), options), None
    seqlens = _given_seqlens(kwargs)
    if seqlens is None and q.shape[1] == k.shape[1]:
        seqlens = _packed_seqlens(kwargs.get("position_ids"), q.shape[0], q.shape[1])
    if seqlens is None:
        return flash_attn_func(q, k, v, **options), None
    return _packed_attention(q, k, v, seqlens, options), None


def _check_call(query, key, attention_mask, dropout) -> None:
    """What the kernels cannot do, refused before any work."""
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"dash_attention_forward: {name} must be a 4-D tensor (batch, heads, seqlen, dim), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if dropout:
        raise ValueError(f"dash_attention_forward: dropout={dropout} is not supported, the dash_attn kernels have no "
                         "attention dropout: set the model config's attention dropout (e.g. attention_dropout) to 0.0, "
                         "or use another attn_implementation for training with it")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 \
                or attention_mask.shape[0] != query.shape[0]:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"dash_attention_forward: attention_mask must be None or the 2-D padding mask (batch="
                             f"{query.shape[0]}, seqlen_k) that the flash-attention mask function passes, got {shape}: "
                             "call dash_attn.integrations.transformers.register() before building the model (it "
                             "registers that mask function), and pass 2-D padding masks, not 4-D ones")


def _learnable_sink(s_aux: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """gpt-oss's sinks (a (heads,) parameter in the model's dtype) as the float32 learnable_sink dash_attn takes; the
    cast is differentiable, so the parameter still gets its gradient. dash_attn checks the shape and device."""
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or not s_aux.is_floating_point():
        raise ValueError(f"dash_attention_forward: s_aux must be None or a floating-point (heads,) tensor of attention "
                         f"sink logits, got {s_aux.dtype if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__}")
    return s_aux.to(torch.float32)


def _kernel_dtype(q, k, v, module):
    """q, k and v in one dtype that the device's path takes. float32 activations on a GPU (autocast regions, PEFT's
    float32 layer norms) are cast to the half precision the kernels take, as transformers' flash path does: autocast's
    dtype, else the model's linear weights' dtype. The CPU reference computes in float32 whatever it is given; mixed
    dtypes (under autocast, gpt-oss's rotary embedding turns q and k float32 while v stays bfloat16) take the widest
    of them there."""
    uniform = q.dtype == k.dtype == v.dtype
    if q.device.type == "cpu":
        if uniform:
            return q, k, v
        target = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        return q.to(target), k.to(target), v.to(target)
    if uniform and q.dtype != torch.float32:
        return q, k, v
    if torch.is_autocast_enabled(q.device.type):
        target = torch.get_autocast_dtype(q.device.type)
    else:
        target = next((m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.Linear)), q.dtype)
    if target not in _HALF_DTYPES:
        return q, k, v  # dash_attn's dtype check names the problem
    return q.to(target), k.to(target), v.to(target)


def _window_size(sliding_window: Optional[int], causal: bool, seqlen_k: int) -> Tuple[int, int]:
    """transformers' sliding_window counts the query's own token (eager masks keep key j for query i when
    i - sliding_window < j), so the kernels' window reaches sliding_window - 1 keys back; encoders take it on both
    sides, as transformers' flash path does. A window holding every key changes nothing and is left out."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"dash_attention_forward: sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if seqlen_k <= sliding_window:
        return (-1, -1)
    return (sliding_window - 1, 0) if causal else (sliding_window - 1, sliding_window - 1)


def _deterministic(requested: Optional[bool]) -> Optional[bool]:
    """An explicit deterministic keyword wins; FLASH_ATTENTION_DETERMINISTIC=1 turns it on; else None, which dash_attn
    resolves to torch.are_deterministic_algorithms_enabled()."""
    if requested is not None:
        return bool(requested)
    return True if os.environ.get(DETERMINISTIC_ENV, "0") == "1" else None


def _unpad_data(mask: torch.Tensor):
    """Indices of the kept tokens in the flattened (batch * seqlen) rows, int32 cu_seqlens and the longest row. The
    lengths are read on the host once (the max is needed as an int anyway), so cu_seqlens lives there and dash_attn
    need not copy it back for its checks."""
    lengths = mask.sum(dim=-1, dtype=torch.int32).cpu()
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def _rows(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[2:]).index_select(0, indices)


def _padded_attention(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention over the tokens a (batch, seqlen_k) padding mask keeps; the padded query rows of the result are 0."""
    batch, seqlen_q = q.shape[:2]
    # A mask shorter than the keys bounds a static cache's filled slots (the keys past it are empty slots); a longer
    # one covers a cache's whole history while k holds its last part.
    if mask.shape[1] < k.shape[1]:
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    mask = mask[:, -k.shape[1]:]
    indices_k, cu_seqlens_k, max_seqlen_k = _unpad_data(mask)
    if seqlen_q == k.shape[1]:
        indices_q, cu_seqlens_q, max_seqlen_q = indices_k, cu_seqlens_k, max_seqlen_k
    else:
        # The queries are each row's last seqlen_q positions (decoding against a cache; padding on the left).
        indices_q, cu_seqlens_q, max_seqlen_q = _unpad_data(mask[:, -seqlen_q:])
    out = flash_attn_varlen_func(_rows(q, indices_q), _rows(k, indices_k), _rows(v, indices_k),
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, **options)
    padded = out.new_zeros(batch * seqlen_q, *out.shape[1:]).index_copy(0, indices_q, out)
    return padded.view(batch, seqlen_q, *out.shape[1:])


def _given_seqlens(kwargs: dict):
    """The cu_seq_lens_q/k and max_length_q/k keywords of a padding-free batch (DataCollatorWithFlattening with
    return_flash_attn_kwargs=True), as int32 tensors and ints; None unless all four are given."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    given = [kwargs.get(name) for name in names]
    if any(x is None for x in given):
        return None
    cu_q, cu_k, max_q, max_k = given
    for name, cu in zip(names[:2], (cu_q, cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1:
            raise ValueError(f"dash_attention_forward: {name} must be a 1-D tensor of sequence starts, got "
                             f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}")
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


def _packed_seqlens(position_ids: Optional[torch.Tensor], batch: int, seqlen: int):
    """cu_seqlens of a padding-free batch, read from position_ids: one row of sequences packed back to back whose
    positions restart at their minimum (0, or padding_idx + 1 for RoBERTa-like models) where each one starts. None
    for anything else (several rows, one sequence, no position_ids), which the dense call serves."""
    if position_ids is None or batch != 1 or seqlen == 1 or position_ids.numel() != seqlen:
        return None
    positions = position_ids.reshape(-1).cpu()
    starts = torch.nonzero(positions == positions.min(), as_tuple=False).flatten()
    if starts[0] != 0:
        # Tokens before the first restart form a sequence of their own (it began in an earlier batch).
        starts = torch.cat((starts.new_zeros(1), starts))
    if starts.numel() == 1:
        return None
    cu_seqlens = torch.cat((starts, starts.new_tensor([seqlen]))).to(torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return cu_seqlens, cu_seqlens, longest, longest


def _packed_attention(q, k, v, seqlens, options: dict) -> torch.Tensor:
    """Attention over sequences packed back to back along the rows of a padding-free batch."""
    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k = seqlens
    batch = q.shape[0]
    out = flash_attn_varlen_func(*(t.reshape(-1, *t.shape[2:]) for t in (q, k, v)), cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 **options)
    return out.view(batch, -1, *out.shape[1:])
