"""Fails when ptxas reports register spills or a stack frame in a kernel (reads `nvcc -Xptxas -v` output on stdin).

Spills in these kernels cost far more than they look: they turn register tiles into local-memory traffic inside the
WGMMA loop. The report is echoed so the register counts stay visible in the log.

A few kernels carry a measured allowance (ALLOWANCES): a byte budget for spill stores, spill loads and stack frame,
each with why the bytes are there (the measurements behind them: docs/tuning.md, "Spill allowances"). Anything above
its budget fails, so the check still catches regressions; every kernel not listed must have none.

It also fails when ptxas serialises a kernel's WGMMAs (its C75xx "Potential Performance Loss: wgmma ... serialized"):
that costs more than spills and leaves none behind (docs/tuning.md, kGemmStatParts).
"""
import re
import sys

SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
STACK = re.compile(r"(\d+) bytes stack frame")
SERIALIZED = re.compile(r"\((C75\d\d)\) Potential Performance Loss: wgmma.mma_async instructions are serialized")

# (regex on the mangled kernel name, allowed bytes, why); the first match applies. MaskKindE0 = full mask,
# E1 = causal, E2 = sliding window; ScoreModE0 = plain scores, E1 = soft-capped.
ALLOWANCES = [
    # Packed-sequence kernels (SeqLayoutE1, the varlen calls): each sequence's first rows, lengths and live steps ride
    # through the producer and the masked loops as run-time values where the batched kernels have the call's
    # constants. Not tuned and not timed against a spill-free build: the figures are ptxas' for the current code, so
    # that the check catches growth (`make check-kernels CHECK_LAYOUTS=packed`). The window kernels never run
    # shift_causal_runs but compile its visit (the schedule is a run-time choice): computing its tile's Q range once
    # moved their allocation by 4 bytes.
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE1ELNS_8ScoreModE0ELNS_9SeqLayoutE1", 120,
     "hdim 64 causal packed: 92/120, 64 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE1ELNS_8ScoreModE1ELNS_9SeqLayoutE1", 128,
     "hdim 64 causal softcap packed: 100/128, 88 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE2ELNS_8ScoreModE0ELNS_9SeqLayoutE1", 148,
     "hdim 64 window packed: 136/148, 72 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE2ELNS_8ScoreModE1ELNS_9SeqLayoutE1", 168,
     "hdim 64 window softcap packed: 156/168, 88 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE1ELNS_8ScoreModE0ELNS_9SeqLayoutE1", 48,
     "hdim 128 causal packed: 32/48, 24 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE1ELNS_8ScoreModE1ELNS_9SeqLayoutE1", 48,
     "hdim 128 causal softcap packed: 32/48, 24 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE2ELNS_8ScoreModE0ELNS_9SeqLayoutE1", 108,
     "hdim 128 window packed: 108/108, 56 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE2ELNS_8ScoreModE1ELNS_9SeqLayoutE1", 88,
     "hdim 128 window softcap packed: 88/88, 48 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi256E.*MaskKindE1.*SeqLayoutE1", 44, "hdim 256 causal packed: 28/44, 16 frame"),
    (r"bwd_main_kernel.*BwdTraitsILi256E.*MaskKindE2.*SeqLayoutE1", 92, "hdim 256 window packed: 92/92, 40 frame"),
    # Soft-capped kernels (ScoreMod::kSoftcap, ScoreModE1), not tuned: the backward keeps 1 - t^2 per element in fp16
    # (hdim 128/256) or recovers t from P (hdim 64); the forward's tanh adds a few live values. Their windows fall
    # through to the plain windows' allowances below where those cover them.
    # Shift's split tail (schedule/tail_split.h) adds a cold path to the batched full-mask backward kernels, the only
    # ones that carry it: the producer walks the tail's items in a loop of its own (bwd_producer.h, ItemPhase), whose
    # per-visit arithmetic spills there, and the consumers store a piece's partial dK/dV at its end. At hdim 128 and
    # 256 every byte below is in that loop (cuobjdump); the whole waves' loop does not spill.
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE0ELNS_8ScoreModE1", 68,
     "hdim 128 full softcap: 52/68 bytes, 32 frame (the split tail's producer loop)"),
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE1ELNS_8ScoreModE1", 40, "hdim 128 causal softcap: 40/40 bytes"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE0ELNS_8ScoreModE1", 116,
     "hdim 64 full softcap: 100/116 bytes, 104 frame (split tail)"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE1ELNS_8ScoreModE1", 84, "hdim 64 causal softcap: 72/84 bytes"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE2ELNS_8ScoreModE1", 120, "hdim 64 window softcap: 108/120 bytes"),
    (r"fwd_kernel.*FwdKernelTraitsILi64E.*MaskKindE2ELNS_8ScoreModE1", 204, "hdim 64 window forward softcap: 200/204"),
    (r"fwd_kernel.*FwdKernelTraitsILi64E.*ScoreModE1", 8, "hdim 64 forward softcap: 8 bytes"),
    # Sliding windows: the band tests carry two run-time bounds through the masked P loop. At hdim 128 the statistics
    # through the tensor cores (RowStats::kGemmInit) add spills but run faster. The window kernels (every head dim,
    # batched and packed) took 4 more bytes when the schedule's Problem grew by the sequence table's pointer
    # (schedule/seq_runs.h), which they never read: register allocation, not a new live value.
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE2", 60, "hdim 128 window: 60/60 bytes, softcap 28/28"),
    (r"bwd_main_kernel.*BwdTraitsILi256E.*MaskKindE2", 32, "hdim 256 window: 32/32 bytes, 24 frame"),
    (r"fwd_kernel.*FwdKernelTraitsILi64E.*MaskKindE2", 100, "hdim 64 window forward: 100 bytes (72-byte stack frame)"),
    # Hdim 64 with two step bodies and the dV GEMM after dS (MaskedSteps::kTwoBodies): the bytes are mostly loop
    # invariants stored once before the step loop; the unmasked body, which runs nearly every step, reloads two words
    # a step (causal). Faster than one body with fewer spills.
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE2", 96, "hdim 64 window: 84/96 bytes"),
    # Hdim 64 full and causal with the statistics through the tensor cores (RowStats::kGemmInit): the four selection
    # operands are loop invariants too, and the kernels run faster than with the shared-memory statistics.
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE1", 76, "hdim 64 causal: 64/76 bytes"),
    (r"bwd_main_kernel.*BwdTraitsILi64E.*MaskKindE0", 128, "hdim 64 full: 104/128 bytes, 88 frame (fp16 68/76)"),
    # Hdim 128 full with the statistics through the tensor cores (RowStats::kGemmInit), two step bodies and
    # per-warpgroup operands: the selection operands are loop invariants; faster than the shuffled statistics.
    (r"bwd_main_kernel.*BwdTraitsILi128E.*MaskKindE0", 44, "hdim 128 full: 28/44 bytes, 16 frame (the split tail's loop)"),
    (r"bwd_main_kernel.*BwdTraitsILi256E.*MaskKindE0", 8, "hdim 256 full: 8/8 bytes (the split tail's loop)"),
]


def allowance(kernel):
    for pattern, nbytes, _ in ALLOWANCES:
        if re.search(pattern, kernel):
            return nbytes
    return 0


def main():
    bad = []
    current = "?"
    for line in sys.stdin:
        sys.stdout.write(line)
        if "Compiling entry function" in line or "Function properties for" in line:
            current = line.strip().split()[-1]
        limit = allowance(current)
        m = SPILL.search(line)
        if m and max(int(m.group(1)), int(m.group(2))) > limit:
            bad.append(f"{current}: {m.group(0)} (allowed: {limit})")
        w = SERIALIZED.search(line)
        if w:
            bad.append(f"{line.split('function')[-1].strip()}: WGMMAs serialized ({w.group(1)})")
        s = STACK.search(line)
        if s and int(s.group(1)) > limit and "Function properties" not in line:
            bad.append(f"{current}: {s.group(0)} (allowed: {limit})")
    if bad:
        print("\ncheck-kernels: register spills / stack frames / serialized WGMMAs found:", *bad, sep="\n  ")
        return 1
    print("\ncheck-kernels: no spills beyond the measured allowances")
    return 0


if __name__ == "__main__":
    sys.exit(main())
