"""The packed lengths of the captured varlen GPU test (tests/test_gpu_captured_varlen.py), shared with the CPU
schedule test that checks what its kernels schedule for the invalid cu_seqlens (tests/test_schedule_seq_runs.py)."""

NHEADS, NHEADS_K = 8, 2
# Three arrangements of one packed length (1627 rows, 9 sequences): the capture's, the same lengths reordered, and a
# longest sequence (500) below the captured bound (1023).
LENGTHS = {
    "captured": (1, 64, 65, 0, 1023, 128, 129, 200, 17),
    "reordered": (200, 17, 1, 1023, 0, 129, 128, 65, 64),
    "shorter": (500, 500, 300, 300, 27, 0, 0, 0, 0),
}
BOUND = 1023
TOTAL = sum(LENGTHS["captured"])

INVALID = {
    "last_not_total": [0, 1, 65, 130, 130, 1153, 1281, 1410, 1610, 1626],
    "longer_than_bound": [0, 1, 65, 130, 130, 1200, 1281, 1410, 1610, 1627],
    "decreasing": [0, 1, 65, 30, 130, 1153, 1281, 1410, 1610, 1627],
    "far_out_of_range": [0, 2 ** 30, -2 ** 30, 2 ** 31 - 1, 5, -1, 1281, 1410, 1610, 1627],
}


def kernel_lengths(cu_seqlens, total):
    """The sequence lengths the packed kernels read from cu_seqlens: each entry clamped to the packed rows, an end
    never before its start (csrc/common/packed_seqs.h, clamped_rows)."""
    lengths = []
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        first = min(max(start, 0), total)
        lengths.append(min(max(end, first), total) - first)
    return lengths
