"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed process group.

Layout (load-balanced for causal masks): the sequence is cut into 2W equal chunks for a group of W ranks and rank r
holds chunks r and 2W-1-r, concatenated along the sequence dimension (`shard_sequence` / `unshard_sequence`). Every
rank then has the same causal work.

Forward: K/V pairs travel round the ring (rank r sends to r+1, receives from r-1; the next pair is in flight while the
current one computes). At step s rank r holds the K/V of rank (r - s) mod W and runs dash_attn's kernel (or the CPU
reference) once per live (Q chunk, KV chunk) pair: full where the Q chunk is later, causal on the diagonal, skipped
where it is earlier. The partial outputs are merged through their log-sum-exp in step order.

Backward: the same walk with the saved output and log-sum-exp. dQ is accumulated in fp32 in step order on the Q's
rank; each K/V pair travels with fp32 dK/dV accumulators that every rank adds its partial to, so the K/V owned by
rank o receives its partials from ranks o, o+1, ..., o+W-1 in that order.

Determinism: every sum has an order fixed by (rank, step), and each per-step kernel call is deterministic when
`deterministic` is: results are bitwise reproducible run to run for a fixed world size. Different world sizes cut the
sums differently, so their bits differ (within floating-point tolerance). `simulate` runs the same algorithm in one
process with the same order, which the tests compare bitwise against the distributed run.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import validation
from ._args import MaskKind, OpArgs
from .schedules_table import AUTO

__all__ = ["shard_sequence", "unshard_sequence", "ring_attn_func", "simulate"]


def _chunks_of(rank: int, world: int) -> Tuple[int, int]:
    return rank, 2 * world - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of a full-sequence tensor: chunks rank and 2W-1-rank of 2W equal chunks along `dim`."""
    if x.shape[dim] % (2 * world_size) != 0:
        raise ValueError(f"shard_sequence(): the sequence length {x.shape[dim]} must be a multiple of 2 x world_size "
                         f"({2 * world_size})")
    parts = x.chunk(2 * world_size, dim=dim)
    a, b = _chunks_of(rank, world_size)
    return torch.cat([parts[a], parts[b]], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (in rank order), the inverse of shard_sequence."""
    world = len(shards)
    parts: List[Optional[torch.Tensor]] = [None] * (2 * world)
    for r, s in enumerate(shards):
        first, second = s.chunk(2, dim=dim)
        a, b = _chunks_of(r, world)
        parts[a], parts[b] = first, second
    return torch.cat(parts, dim=dim)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums run in fp32, or in the inputs' own precision where that is higher (float64)."""
    return torch.promote_types(dtype, torch.float32)


def _pair_mask(q_chunk: int, kv_chunk: int, causal: bool) -> Optional[int]:
    if not causal:
        return MaskKind.FULL
    if q_chunk > kv_chunk:
        return MaskKind.FULL
    return MaskKind.CAUSAL if q_chunk == kv_chunk else None


class _Step:
    """The per-step work of one rank against one traveling K/V pair (shared by the distributed run and `simulate`,
    so both add in the same order)."""

    def __init__(self, scale: float, causal: bool, deterministic: bool, sm_margin: int = 0):
        self.scale, self.causal, self.deterministic, self.sm_margin = scale, causal, deterministic, sm_margin

    def _op_args(self, mask: MaskKind) -> OpArgs:
        """The ops' scalar arguments for one (Q chunk, KV chunk) pair of this mask."""
        return OpArgs(softmax_scale=self.scale, mask=int(mask), window_left=-1,
                      window_right=0 if mask == MaskKind.CAUSAL else -1, softcap=0.0,
                      deterministic=self.deterministic, schedule=AUTO, sm_margin=self.sm_margin)

    def forward(self, q_parts, kv_parts, q_chunks, kv_chunks, acc):
        """Adds this step's partial outputs into acc[i] = (out fp32, lse fp32 (batch, seqlen, heads, 1))."""
        for i, (q, a) in enumerate(zip(q_parts, q_chunks)):
            for (k, v), b in zip(kv_parts, kv_chunks):
                mask = _pair_mask(a, b, self.causal)
                if mask is None:
                    continue
                out, lse = torch.ops.dash_attn.fwd(q, k, v, *self._op_args(mask))
                lse = lse.transpose(1, 2).unsqueeze(-1)
                out = out.to(_acc_dtype(out.dtype))
                lse = lse.to(out.dtype)
                if acc[i] is None:
                    acc[i] = (out, lse)
                    continue
                acc_out, acc_lse = acc[i]
                new_lse = torch.logaddexp(acc_lse, lse)
                acc[i] = (acc_out * torch.exp(acc_lse - new_lse) + out * torch.exp(lse - new_lse), new_lse)

    def backward(self, dout_parts, q_parts, out_parts, lse_parts, kv_parts, q_chunks, kv_chunks, dq_acc, dkv_acc):
        """Adds this step's partial dQ into dq_acc[i] and partial dK/dV into dkv_acc[j] (fp32)."""
        for i, (q, a) in enumerate(zip(q_parts, q_chunks)):
            for j, ((k, v), b) in enumerate(zip(kv_parts, kv_chunks)):
                mask = _pair_mask(a, b, self.causal)
                if mask is None:
                    continue
                dq, dk, dv = torch.ops.dash_attn.bwd(dout_parts[i], q, k, v, out_parts[i], lse_parts[i],
                                                     *self._op_args(mask))
                dq_acc[i].add_(dq)
                dkv_acc[j][0].add_(dk)
                dkv_acc[j][1].add_(dv)


def _halves(x: torch.Tensor) -> List[torch.Tensor]:
    return [t.contiguous() for t in x.chunk(2, dim=1)]


def _merged(acc, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.cat([o for o, _ in acc], dim=1).to(dtype)
    lse = torch.cat([l.squeeze(-1).transpose(1, 2) for _, l in acc], dim=2).float().contiguous()
    return out, lse


class _Ring:
    """Point-to-point ring of a process group: send to the next rank, receive from the previous one."""

    def __init__(self, group):
        self.group = dist.group.WORLD if group is None else group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)

    def start(self, tensors: Sequence[torch.Tensor]):
        """Sends `tensors` on and receives the previous rank's into fresh buffers; returns (requests, buffers)."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        return dist.batch_isend_irecv(ops), bufs

    @staticmethod
    def finish(pending):
        reqs, bufs = pending
        for r in reqs:
            r.wait()
        return bufs


class _RingAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, deterministic, group, sm_margin):
        ring = _Ring(group)
        step = _Step(scale, causal, deterministic, sm_margin)
        q_parts = _halves(q)
        q_chunks = _chunks_of(ring.rank, ring.world)
        acc = [None, None]
        kv = [k.contiguous(), v.contiguous()]
        for s in range(ring.world):
            pending = ring.start(kv) if s + 1 < ring.world else None  # the next pair travels while this one computes
            src = (ring.rank - s) % ring.world
            step.forward(q_parts, list(zip(_halves(kv[0]), _halves(kv[1]))), q_chunks, _chunks_of(src, ring.world),
                         acc)
            if pending is not None:
                kv = ring.finish(pending)
        out, lse = _merged(acc, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
        ctx.group, ctx.sm_margin = group, sm_margin
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        step = _Step(ctx.scale, ctx.causal, ctx.deterministic, ctx.sm_margin)
        q_parts, out_parts, dout_parts = _halves(q), _halves(out), _halves(dout.contiguous())
        lse_parts = [t.contiguous() for t in lse.chunk(2, dim=2)]
        q_chunks = _chunks_of(ring.rank, ring.world)
        acc = _acc_dtype(q.dtype)
        dq_acc = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in q_parts]
        travel = [k.contiguous(), v.contiguous(), torch.zeros(k.shape, dtype=acc, device=k.device),
                  torch.zeros(v.shape, dtype=acc, device=v.device)]
        for s in range(ring.world):
            src = (ring.rank - s) % ring.world
            dk_parts, dv_parts = _halves(travel[2]), _halves(travel[3])
            dkv_acc = list(zip(dk_parts, dv_parts))
            step.backward(dout_parts, q_parts, out_parts, lse_parts, list(zip(_halves(travel[0]), _halves(travel[1]))),
                          q_chunks, _chunks_of(src, ring.world), dq_acc, dkv_acc)
            travel[2], travel[3] = torch.cat(dk_parts, dim=1), torch.cat(dv_parts, dim=1)
            if s + 1 < ring.world:  # the pair and its accumulators move on
                travel = ring.finish(ring.start(travel))
        # One more hop brings the accumulators back to their owner (the K/V need not travel).
        dk, dv = ring.finish(ring.start(travel[2:]))
        dq = torch.cat(dq_acc, dim=1).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _scale(q: torch.Tensor, softmax_scale: Optional[float]) -> float:
    """The step kernels' scale: the public functions' default for None; the ops take no scale 0 (the public functions
    run it as zero queries, which the ring does not)."""
    if softmax_scale is None:
        return validation.default_softmax_scale(q.shape[-1])
    validation.check_kernel_softmax_scale(softmax_scale)
    return float(softmax_scale)


@validation.public_entry
def ring_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: Optional[float] = None,
                   causal: bool = False, deterministic: Optional[bool] = None, group=None,
                   sm_margin: int = 0) -> torch.Tensor:
    """Attention of this rank's shard of q against the whole (sharded) k/v of `group`.

    q, k, v: (batch, local_seqlen, heads, headdim) shards made by shard_sequence (k/v may have fewer heads: GQA).
    Returns this rank's shard of the output. deterministic=None follows torch.are_deterministic_algorithms_enabled().
    sm_margin: SMs the per-step kernels leave to the communication kernels (the transfers overlap the compute); the
    deterministic results do not depend on it.
    """
    if not dist.is_initialized():
        raise ValueError("ring_attn_func(): torch.distributed is not initialized (init_process_group first)")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("ring_attn_func(): q, k, v must be (batch, local_seqlen, heads, headdim)")
    if q.shape[1] % 2 or k.shape[1] != q.shape[1]:
        raise ValueError("ring_attn_func(): q and k/v shards must have the same even length (two chunks each, "
                         "from shard_sequence)")
    scale = _scale(q, softmax_scale)
    det = torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic)
    return _RingAttn.apply(q, k, v, scale, bool(causal), det, group, int(sm_margin))


@validation.public_entry
def simulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, world_size: int,
             softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = True):
    """The ring algorithm of `world_size` ranks run in one process on full-sequence tensors, with the distributed
    run's order of every sum: returns (out, dq, dk, dv) as full sequences."""
    scale = _scale(q, softmax_scale)
    step = _Step(scale, causal, deterministic)
    W = world_size
    qs, ks, vs, dos = ([shard_sequence(t, r, W) for r in range(W)] for t in (q, k, v, dout))
    outs, lses = [], []
    for r in range(W):
        acc = [None, None]
        for s in range(W):
            src = (r - s) % W
            step.forward(_halves(qs[r]), list(zip(_halves(ks[src]), _halves(vs[src]))), _chunks_of(r, W),
                         _chunks_of(src, W), acc)
        out, lse = _merged(acc, q.dtype)
        outs.append(out)
        lses.append(lse)
    acc = _acc_dtype(q.dtype)
    dqs = [[torch.zeros(t.shape, dtype=acc, device=t.device) for t in _halves(qs[r])] for r in range(W)]
    dkv = {o: [(torch.zeros(t.shape, dtype=acc, device=t.device), torch.zeros(t.shape, dtype=acc, device=t.device))
               for t in _halves(ks[o])] for o in range(W)}
    # K/V of owner o meets rank o + s at step s: its partials arrive from o, o+1, ..., o+W-1.
    for s in range(W):
        for r in range(W):
            src = (r - s) % W
            step.backward(_halves(dos[r]), _halves(qs[r]), _halves(outs[r]),
                          [t.contiguous() for t in lses[r].chunk(2, dim=2)],
                          list(zip(_halves(ks[src]), _halves(vs[src]))), _chunks_of(r, W), _chunks_of(src, W),
                          dqs[r], dkv[src])
    out = unshard_sequence(outs)
    dq = unshard_sequence([torch.cat(d, dim=1).to(q.dtype) for d in dqs])
    dk = unshard_sequence([torch.cat([a for a, _ in dkv[o]], dim=1).to(k.dtype) for o in range(W)])
    dv = unshard_sequence([torch.cat([b for _, b in dkv[o]], dim=1).to(v.dtype) for o in range(W)])
    return out, dq, dk, dv
