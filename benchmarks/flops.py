"""The one FLOPs convention every dash_attn benchmark and report uses.

Forward = 4 * batch * nheads * (unmasked score area) * headdim: two matmuls (Q K^T and P V), two FLOPs per
multiply-add. Backward = 2.5 x forward: five matmuls (S recomputed, dP, dV, dK, dQ) against the forward's two.
The causal area is half the square when seqlen_q == seqlen_k, the convention FlashAttention and cuDNN report with,
so numbers stay comparable with theirs (including benchmarks/RESULTS.md). When seqlen_q != seqlen_k the causal
mask is aligned bottom-right (query row i sees key j <= i + seqlen_k - seqlen_q) and the unmasked area is counted
exactly, because no half-square convention exists there.

csrc/bench/bench_flops.h mirrors these formulas for the torch-free C++ benchmark; change both together.
"""

BWD_FLOPS_PER_FWD = 2.5


def causal_area(seqlen_q, seqlen_k):
    """Number of (query, key) pairs a bottom-right aligned causal mask leaves visible."""
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    # Row i sees clamp(i + c, 0, seqlen_k) keys with c = seqlen_k - seqlen_q + 1: rows [0, first_partial) see
    # nothing, rows [first_partial, first_full) see i + c keys, rows [first_full, seqlen_q) see every key.
    c = seqlen_k - seqlen_q + 1
    first_partial = min(seqlen_q, max(0, 1 - c))
    first_full = min(seqlen_q, max(first_partial, seqlen_k - c))
    partial_rows = first_full - first_partial
    partial = partial_rows * c + (first_partial + first_full - 1) * partial_rows // 2
    return partial + (seqlen_q - first_full) * seqlen_k


def band_area(seqlen_q, seqlen_k, left, right):
    """Visible pairs of a sliding window: row i sees keys [i + d - left, i + d + right] within [0, seqlen_k),
    d = seqlen_k - seqlen_q; a negative bound is absent. Counted exactly (no half-square convention for bands)."""
    d = seqlen_k - seqlen_q
    area = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + d - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + d + right)
        area += max(0, hi - lo + 1)
    return area


def score_area(seqlen_q, seqlen_k, causal):
    return causal_area(seqlen_q, seqlen_k) if causal else seqlen_q * seqlen_k


def fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    """FLOPs of one attention forward; nheads counts query heads (GQA shares K/V but not the work)."""
    return 4 * batch * nheads * score_area(seqlen_q, seqlen_k, causal) * headdim


def bwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    return BWD_FLOPS_PER_FWD * fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal)


def flops(direction, batch, nheads, seqlen_q, seqlen_k, headdim, causal):
    """direction is "fwd" or "bwd"."""
    if direction == "fwd":
        return fwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal)
    if direction == "bwd":
        return bwd_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal)
    raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


def window_flops(direction, batch, nheads, seqlen_q, seqlen_k, headdim, window):
    """FLOPs of a sliding-window attention, window = (left, right): the visible band only (band_area)."""
    fwd = 4 * batch * nheads * band_area(seqlen_q, seqlen_k, *window) * headdim
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return fwd if direction == "fwd" else BWD_FLOPS_PER_FWD * fwd


def tflops(n_flops, ms):
    """Rate in TFLOPS for n_flops done in ms milliseconds."""
    return n_flops / (ms * 1e-3) / 1e12
