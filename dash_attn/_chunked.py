"""attention_chunk (FlashAttention-3's keyword, Llama 4's chunked attention) on the varlen op, with no kernels of
its own.

The rule, as FlashAttention-3 defines the keyword: with attention_chunk = C > 0, query row
i of a sequence of seqlen_q queries and seqlen_k keys sits at position p = i + seqlen_k - seqlen_q (the bottom-right
aligned diagonal of the causal and window masks) and sees key j only when floor(p / C) == floor(j / C), on top of its
causal or window band. A query at p < 0 (seqlen_q > seqlen_k) shares its chunk with no key.

The decomposition: the positions of a sequence, from min(0, seqlen_k - seqlen_q) to seqlen_k - 1, are cut at the
multiples of C, and each piece is one varlen segment holding the queries and the keys at its positions. The segments
tile each sequence's query rows and key rows in order, so the packed tensors go to the varlen op as they are (no
gather, no scatter) and only cu_seqlens change. Why the bands carry over: in the piece [a, a + C) both the last query
and the last key sit at e = min(a + C, seqlen_k), so the segment's len_k - len_q = (e - max(a, 0)) - (e - max(a, d))
= max(a, d) - max(a, 0) (d = seqlen_k - seqlen_q) is exactly the offset between its first query's position and its
first key's: the varlen op's bottom-right alignment puts every query at its own diagonal, for every piece, edge pieces
included. Pieces left of position 0 hold queries and no keys (out 0, lse -inf, as any row that sees no key), pieces
left of the first query keys and no queries (their gradients 0); the varlen op takes such empty sides.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from ._varlen import _checked_host_lists, _used_lengths


def _sequence_segments(seqlen_q: int, seqlen_k: int, chunk: int) -> List[Tuple[int, int]]:
    """(query rows, key rows) of each chunk a sequence's positions touch, in order."""
    diagonal = seqlen_k - seqlen_q
    first = min(diagonal, 0)
    segments = []
    for start in range(first - first % chunk, seqlen_k, chunk):  # Python's % rounds the first chunk down
        end = min(start + chunk, seqlen_k)
        segments.append((max(end - max(start, diagonal), 0), max(end - max(start, 0), 0)))
    return segments


def _segment_args(segments: List[Tuple[int, int]]):
    """cu_seqlens_q, cu_seqlens_k (int32, on the host: the varlen op reads them there without waiting for a GPU) and
    max_seqlen_q, max_seqlen_k of the (at least two) segments. Plain max(), no default=: torch.compile traces it."""
    cu = torch.zeros(len(segments) + 1, 2, dtype=torch.int64)
    cu[1:] = torch.tensor(segments, dtype=torch.int64).cumsum(0)
    cu = cu.to(torch.int32)
    return cu[:, 0].contiguous(), cu[:, 1].contiguous(), max(s[0] for s in segments), max(s[1] for s in segments)


def _refuse_capture(q: torch.Tensor) -> None:
    if q.device.type != "cpu" and torch.cuda.is_current_stream_capturing():
        raise ValueError("attention_chunk > 0 cannot run inside a CUDA graph capture: its chunks become varlen "
                         "segments planned on the host; call it outside the capture or with attention_chunk=0")


def chunked_attention(q, k, v, chunk: int, run_varlen):
    """flash_attn_func's (out, lse) with attention_chunk = chunk: the batch as varlen sequences of equal lengths, cut
    into chunks. None when one chunk holds all positions (the chunks then mask nothing: the dense call runs as it
    is). run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k) runs the
    varlen op with the call's other arguments."""
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    segments = _sequence_segments(seqlen_q, seqlen_k, chunk)
    if len(segments) <= 1 or batch == 0:
        return None
    _refuse_capture(q)
    cu_q, cu_k, max_q, max_k = _segment_args(segments * batch)
    out, lse = run_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, None, None, max_q, max_k)
    return out.unflatten(0, (batch, seqlen_q)), lse.unflatten(1, (batch, seqlen_q)).transpose(0, 1).contiguous()


def chunked_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                             chunk: int, run_varlen):
    """flash_attn_varlen_func's (out, lse) with attention_chunk = chunk: every sequence cut into chunks, one varlen
    call over all of them. None when no sequence spans two chunks (the call then runs as it is). The rows in use
    (seqused_q/k) are chunked as the sequence; the rows past them become segments of their own, queries without keys
    and keys without queries, so that they take no part, as without chunks."""
    _refuse_capture(q)
    cq, ck, used_q, used_k = _checked_host_lists(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                                 max_seqlen_q, max_seqlen_k)
    rows_q, rows_k = _used_lengths(cq, None), _used_lengths(ck, None)
    lens_q, lens_k = _used_lengths(cq, used_q), _used_lengths(ck, used_k)
    per_sequence = [_sequence_segments(n_q, n_k, chunk) for n_q, n_k in zip(lens_q, lens_k)]
    if all(len(segments) <= 1 for segments in per_sequence):
        return None
    segments = []
    for own, n_q, n_k, used_rows_q, used_rows_k in zip(per_sequence, rows_q, rows_k, lens_q, lens_k):
        segments += own
        if n_q > used_rows_q:
            segments.append((n_q - used_rows_q, 0))
        if n_k > used_rows_k:
            segments.append((0, n_k - used_rows_k))
    cu_q, cu_k, max_q, max_k = _segment_args(segments)
    return run_varlen(q, k, v, cu_q, cu_k, None, None, max_q, max_k)
