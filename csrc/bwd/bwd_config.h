// Tile configuration of the sm90 backward kernel, one named struct per head dimension.
//
// The CTA has three warpgroups: warpgroup 0 holds the producer warp (TMA loads) and the dQ-writer warp; warpgroups 1
// and 2 are the consumers that issue WGMMA. Every GEMM of a step is shared by the two consumer warpgroups; the
// *WarpGroups fields say how they split each GEMM's (M, N) so that every warpgroup gets one 64-row WGMMA slice.
//
// GEMMs of one step (Q_i: kBlockM x d, K_j/V_j: kBlockN x d):
//   S^T  = K_j Q_i^T    (kBlockN x kBlockM, reduction over d)        -> "SdP" split
//   dP^T = V_j dO_i^T   (same shape)                                  -> "SdP" split
//   dV  += P^T dO_i     (kBlockN x d, reduction over kBlockM)         -> "dKV" split
//   dK  += dS^T Q_i     (same shape)                                  -> "dKV" split
//   dQ_i = dS K_j       (kBlockM x d, reduction over kBlockN)         -> "dQ" split
// Computing S and dP transposed keeps each KV row's P and dS in the warpgroup that accumulates that row of dK/dV.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/params.h"
#include "schedule/runs.h"

namespace dash::bwd {

struct BwdTileConfig {
  int32_t block_m;
  int32_t block_n;
  int32_t stages;    // depth of the Q/dO/LSE/D pipeline
  int32_t dq_parts;  // semaphores per dQ tile (BwdConfig::kDqParts)
  bool gemm_stats;   // RowStats::kGemmInit on some mask: the workspace holds the statistics' bf16 parts
};

// (warpgroups along M, warpgroups along N) of one GEMM; the product is the number of consumer warpgroups.
template <int kM, int kN>
struct WarpGroupSplit {
  static constexpr int kAlongM = kM;
  static constexpr int kAlongN = kN;
};

// Where the A operands (P^T of the dV GEMM, dS^T of the dK GEMM) come from. Register-sourced WGMMAs take a
// warpgroup's own P^T / dS^T straight from the S^T / dP^T accumulators: P^T then needs no round trip through shared
// memory, and the GEMM reads only B from shared memory. dS^T goes to shared memory regardless (the dQ GEMM needs every
// warpgroup's rows). With kPtRegisters the dK GEMM reads dS^T from there and still runs while the next step's S and
// dP GEMMs are issued; with kRegisters it reads dS^T from registers, which must stay intact until it completes, so
// each step ends by waiting for it (held into the next step, the 16 registers of dS^T made the consumers spill).
// Register sources need each warpgroup to own the same KV rows in the SdP and dKV GEMMs and the whole query extent of
// its S^T rows (SdPSplit = dKVSplit = <2, 1>).
enum class DkvOperandA { kSharedMemory, kPtRegisters, kRegisters };

// How the consumers partition the WGMMA operands in shared memory. kPerThread: from the thread index, which the
// compiler cannot prove warp-uniform, so every WGMMA descriptor is built in vector registers and moved to uniform
// ones (R2UR) right before its WGMMA. kPerWarpGroup: from the warpgroup index made warp-uniform by a shuffle, so the
// descriptors live in uniform registers (ncu: the WGMMA issue stalls ~40% shorter). The accumulator partitions are
// per thread either way.
enum class OperandPartition { kPerThread, kPerWarpGroup };

// Where the consumers take the Q tile's row statistics (LSE_log2 for P, D for dS) from. kSharedMemory: from the
// stage's copy in shared memory after the GEMM wait that needs them, one load per query column (LSE at hdim 128) or
// per element. A thread holds 16-32 query columns, and a warp-wide load costs a shared-memory wavefront per 4 bytes
// a lane asks for however many lanes share an address: at hdim 128 causal these loads were 256 of the ~2700
// wavefronts the step's instructions asked for (ncu), and they queued behind the running GEMMs' operand reads.
// kShuffle: each lane loads kBlockM / 32 values of each statistic at step start (4 wavefronts per warp at hdim 128),
// and an element's value comes from the lane holding it through a shuffle (LaneStats). Needs each warpgroup's S^T
// slice to span the whole query extent (SdPSplit::kAlongN == 1). The LSE shuffles run while the step's S and dP
// GEMMs are issued. kShuffleAhead: as kShuffle, but the LSE of step t+1 is loaded and shuffled at the end of step t
// (its stage is usually full by then), so the shuffles never wait behind the step's own GEMM traffic; its 16
// registers stay live across the step boundary.
// kGemmInit: the statistics enter through the tensor cores. The preprocess writes each query row's -LSE_log2 /
// scale_log2 and -D as two bf16 parts each (their sum is the value to 16 significant bits; GemmStatLines), the producer
// loads a Q tile's lines as a 16-wide K-major WGMMA operand, and extra WGMMAs, whose register A operand is 1 on the two
// parts of one statistic and 0 elsewhere, start the S^T accumulators at -LSE_log2 / scale_log2 and the dP^T ones at -D:
// P = exp2(acc * scale_log2) and dS = P * acc need no per-column value at all. The cost is a 16-deep k-block on each
// of the two GEMMs. Needs each warpgroup's S^T slice to span the whole query extent (SdPSplit::kAlongN == 1) and plain
// scores (soft-capping applies tanh before LSE; those kernels fall back to the config's kGemmInitFallback).
enum class RowStats { kSharedMemory, kShuffle, kShuffleAhead, kGemmInit };

// When the register-sourced dV GEMM (A = P^T) is issued. kAfterP: as soon as P is computed, so that it runs while dS
// is computed; the bf16 P^T is then live next to the fp32 P and dP. kAfterDs (FA3's order): after the dP wait, dS
// computation and dS^T store, so that the fp32 P and dP are dead before the bf16 operands exist; it then runs across
// the dS^T hand-off between the warpgroups and the dQ GEMM.
enum class DvIssue { kAfterP, kAfterDs };

// How a KV tile's dK and dV leave the consumers (bwd_epilogue.h). kRegisterStores: straight from the accumulators in
// 32-bit pieces, each warp store touching 8 rows x 16 bytes. kTmaStagedInTurn: stmatrix into a 128-byte-swizzled
// (rows, d) tile per warpgroup in the (then free) dS^T buffers, stored by one TMA per warpgroup, dK then dV through
// the same tiles; kTmaStagedAtOnce: dK and dV side by side, one hand-off (needs twice the room). The staged kinds need
// dKVSplit = <2, 1> (a warpgroup owns whole rows) and 16-byte aligned dK/dV, which dash_bwd requires of every call.
// One kind per kernel: a run-time fallback to kRegisterStores kept in the staged kernel made its step loop 1-2%
// slower (H200, 2026-11-30). H200: a build that skipped the stores ran 0.86-0.89 of the time at seqlen 1k and
// 0.98-0.99 at 16k.
enum class DkDvEpilogue { kRegisterStores, kTmaStagedInTurn, kTmaStagedAtOnce };

// Whether steps whose tile needs no mask run a copy of the step of their own (FA3's separate masking iterations).
// kOneBody: one step body; its P loop tests the mask behind a run-time branch, and the masked path's values count
// against the register budget of the whole step. kTwoBodies: the step is compiled twice, with and without the mask
// tests, and each visit takes one copy by its tile; the unmasked copy, which runs nearly every step of a long causal
// row, is allocated like a full-mask kernel's.
enum class MaskedSteps { kOneBody, kTwoBodies };

template <int kHeadDim>
struct BwdConfig;
// kDqBuffers: partial-dQ staging buffers between the consumers and the dQ writer. With two, the consumers stage step
// t+1's dQ while the writer still waits for its turn on step t's tile (deterministic mode), instead of stalling.
// kDqParts: each partial dQ tile is added as this many contiguous parts, each with its own semaphore and its own
// accumulation chain (same order). A part is released as soon as its own reduce has completed, so the next CTA of the
// chain can start on it while the later parts are still in flight: the chain advances by one part's reduce instead of
// the whole tile's. H200 (3 alternating runs): hdim 256 deterministic 0.88-0.92 of the time at full 1k-16k and
// non-deterministic 0.91-0.98, det/nd 0.92-0.99 -> 0.99-1.01; two parts at hdim 128 measured 1.00-1.13 (slower) and
// at hdim 64 0.98-1.02, so those keep one.
// kSmemGapAfterV: bytes left free between V and dS^T in shared memory. A measured layout choice, not a derived one.
// ds_store_address_swizzle: the consumers store dS^T through a view whose swizzle acts on the shared-memory address
// (cute's position-independent swizzle) instead of on the layout offset. The store addresses then become 32-bit adds
// of constants to one base instead of a 64-bit swizzle computation per stmatrix, and the consumers spill less.

// hdim 128: 64 x 128 tiles (what FA3 uses for causal). With P^T taken from registers there is no P^T buffer, which
// leaves room for two 32 KB partial-dQ staging buffers next to 2 Q/dO stages, K, V and two dS^T buffers (226 KB).
// dK from registers instead of kPtRegisters (H200, two A/B runs of 2-3 alternations): causal 0.97-1.02 of the time
// (16k 0.98; the shift order at 4k 1.07 in both runs, not `auto`'s pick there), full 0.98-1.01; the consumers'
// spills went 12 -> 0 bytes (causal) and 4 -> 0 (full). Operands per warpgroup on top of that (3 alternations):
// causal 0.97-1.01, full 1.01-1.02 (slower with the same spills; not understood), so full keeps per thread. Full again
// on 441e933 (H200, 5 alternations): 1.00 at 1k, 1.01-1.03 at 2k, 1.02-1.07 at 4k-16k, though spill-free (4 bytes
// per thread).
template <>
struct BwdConfig<128> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kDqBuffers = 2;
  static constexpr int kDqParts = 1;
  using SdPSplit = WarpGroupSplit<2, 1>;  // each warpgroup owns 64 KV rows of S^T
  using dKVSplit = WarpGroupSplit<2, 1>;  // ... and the same 64 KV rows of dK/dV
  using dQSplit = WarpGroupSplit<1, 2>;   // dQ (64 x 128): each warpgroup owns 64 columns of d
  static constexpr DkvOperandA kDkvA = DkvOperandA::kRegisters;
  // Shuffled statistics (H200, three A/B runs of 2-3 alternations): causal 0.95-1.00 of the time at 1k-16k (non-det
  // and shift_causal); windows 1.08-1.11 (20 bytes of spills), so they kept shared memory (now kGemmInit). Full:
  // 0.98-1.02 and 0.99-1.01 while the shuffles ran after the S wait; with them issued during the GEMMs
  // (consumer_loop; 2026-11-30, three runs of 3-4 alternations against shared memory): 0.975-0.992 at 4k-16k,
  // 0.95-1.02 at 2k, 0.99-1.016 at 1k, with 4 bytes of spills (check_spills.py).
  // Causal with the LSE shuffled a step ahead (H200, 2026-11-30, two runs of 4 alternations against kShuffle):
  // descending 0.92-0.97 of the time at 4k-16k, non-det and shift_causal 0.983-1.02; at full masks it spilled 36 bytes
  // (not run).
  // kGemmInit (H200, 2026-12-01, against these): full, 4 alternations at 4k/8k/16k, deterministic (shift and
  // shift_causal) 0.972-0.981 of the time, non-deterministic 0.997 / 1.019 / 0.994 (spills 4 -> 52 bytes). Causal with
  // one step body, 3 alternations at 2k/16k: 0.997-1.004 (36/40 bytes of spills); with two step bodies (masked_steps)
  // it is spill-free and, against kShuffleAhead with one body (3 alternations, 2026-12-01 ~17:20 UTC, C++ bench),
  // 16k 0.978-0.984 of the time (non-det shift_causal 565.5 -> 577.5-578.4 TFLOPS, det 563.5 -> 572.5-573.1), 8k
  // 0.98-0.99 (the kShuffleAhead kernels with two bodies: 1.03).
  // Windows with kGemmInit (their two step bodies and per-warpgroup operands as before; H200, 2026-12-01 ~17:55 UTC,
  // C++ bench, 3 alternations against shared memory, spt): (1024, 0) 16k 0.96-0.99 of the time, (512, 512) 16k
  // 0.93-0.95, 4k 0.98-1.00 (both windows, both modes); spills 28/28 -> 48/48 bytes.
  static constexpr RowStats row_stats(MaskKind) { return RowStats::kGemmInit; }
  // The statistics of the kernels that cannot take kGemmInit (soft-capped; packed causal), as measured before it.
  static constexpr RowStats gemm_init_fallback(MaskKind mask) {
    return mask == MaskKind::kCausal   ? RowStats::kShuffleAhead
           : mask == MaskKind::kWindow ? RowStats::kSharedMemory
                                       : RowStats::kShuffle;
  }
  // Full with kGemmInit and two step bodies (H200, 2026-12-01 ~17:33 UTC, C++ bench, 3 alternations against per
  // thread with one body): 16k 0.969 of the time (non-det shift 586.4-586.6 -> 605.2-605.3 TFLOPS, det shift
  // 582.7-583.5 -> 600.4-601.2), 8k 0.97, 4k 0.98-1.00 (2k noisy both ways); spills 64/100 -> 28/64 bytes. Two bodies
  // with per-thread operands: 16k 0.985-0.995 (40/76 bytes). The soft-capped full kernels (shuffled statistics) keep
  // per thread and one body.
  static constexpr OperandPartition operand_partition(MaskKind mask, RowStats stats) {
    return mask == MaskKind::kFull && stats != RowStats::kGemmInit ? OperandPartition::kPerThread
                                                                   : OperandPartition::kPerWarpGroup;
  }
  // dV after dS (H200, 3 alternations against kAfterP): full 0.98-0.99 of the time at 1k-16k, causal 0.98-1.01,
  // windows (1024, 0) and (512, 512) at 4k/16k 0.97-0.995 (spills 28 -> 32/36 bytes).
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterDs; }
  // Staged (H200, 5 alternations against kRegisterStores, 2026-11-30): full 0.92/0.97/0.99/0.99/1.00 of the time at
  // 1k/2k/4k/8k/16k, causal 0.90/0.99/0.97/0.99/1.00, windows (1024, 0) at 4k/16k 0.94; no spills at full/causal.
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind) { return DkDvEpilogue::kTmaStagedInTurn; }
  // Every hdim-128 measurement up to 2026-11-29 had this 1 KB gap (an empty P^T stand-in member padded to the
  // 1024-byte alignment of dS^T); without it the backward measured 1.5-2.5% slower at seqlen 8k-16k (H200, two
  // runs of 3 alternating repetitions, one in each order). Same bank mapping either way: the gap acts through
  // register allocation (the later buffers' offsets are constants in the addresses). Without it ptxas spills 24/20
  // bytes at full and 76/96 at causal (2026-11-30, with the dV GEMM after dS), against none with it.
  static constexpr int kSmemGapAfterV = 1024;
  // Measured on the H200 (3 alternating runs, before 9a2f1e0): causal within +-1.5%, full 1-2.5% slower. With the
  // shuffled statistics, causal (two A/B runs of 3 and 4 alternations, non-det and shift_causal): 0.95-0.99 and
  // 0.98-1.01 of the time at 1k-16k (16k 0.99 / 0.98). Full, with the dV GEMM after dS (3 alternations): 0.97-0.99
  // at 1k/2k/8k/16k, 4k 1.03 (the row that is noisy in every run; ratio of the minima 0.99). Windows: not measured.
  static constexpr bool ds_store_address_swizzle(MaskKind mask) { return mask != MaskKind::kWindow; }
  // Two step bodies (H200, 2026-11-30, two runs of 4 alternations against one body): windows (1024, 0) 0.975-0.99 of
  // the time at 4k/16k (spills 32 -> 20 bytes). Full and causal (6 alternations): 1.00-1.08 (full spill-free, 4
  // bytes before; causal 4 bytes stored before the loop), and 1.02-1.10 with the dV GEMM after P on top, so they keep
  // one body. With kGemmInit every mask takes two (see row_stats and operand_partition); with kShuffleAhead two
  // bodies measured 1.03 of the time of one at causal (2026-12-01), so the fallback kernels keep one.
  static constexpr MaskedSteps masked_steps(MaskKind mask, RowStats stats) {
    return mask == MaskKind::kWindow || stats == RowStats::kGemmInit ? MaskedSteps::kTwoBodies
                                                                      : MaskedSteps::kOneBody;
  }
};

// hdim 64: 128 x 128 tiles. P^T from registers (H200: +8-17% over the shared-memory round trip) frees the room for
// a second partial-dQ staging buffer (+1-7%, one run). Operands per warpgroup (H200, two A/B runs of 2-3
// alternations): causal 0.95-0.99 of the time at 1k-8k and 0.98-1.00 at 16k, full 0.98-1.00. dK from registers
// too (kRegisters instead of kPtRegisters; the dK GEMM then reads only Q^T from shared memory, 256 fewer wavefronts
// a step): 0.97-0.99 of the time on full and causal masks at 1k-16k (H200, 3 alternations), with spills of 4 -> 16
// bytes (full) and 0 -> 4 (causal).
template <>
struct BwdConfig<64> {
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = 2;
  static constexpr int kDqBuffers = 2;
  static constexpr int kDqParts = 1;
  using SdPSplit = WarpGroupSplit<2, 1>;
  using dKVSplit = WarpGroupSplit<2, 1>;
  using dQSplit = WarpGroupSplit<2, 1>;  // dQ (128 x 64): each warpgroup owns 64 query rows
  static constexpr DkvOperandA kDkvA = DkvOperandA::kRegisters;
  // A thread holds 32 query columns of S^T, so reading LSE and D from shared memory cost 32 8-byte loads a step (ncu,
  // causal 16k: 508 of the step's ~3370 shared-memory wavefronts, 18%, on the pipe that bounds the step). Shuffled
  // statistics measured 1.02-1.04 (full, no spills) and 1.06-1.31 (causal, 20-44 bytes of spills) of the time; with
  // two step bodies (spill-free) causal 1.01-1.02 and full 0.98-1.02 of the time of shared memory. H200, 2026-12-01,
  // speed-only builds against shared memory (3 alternations, 4k / 16k): without any statistics loads 0.93-0.96 /
  // 0.91-0.92 of the time; the same plus one more shared-memory k-block on the S and dP GEMMs 0.97-1.01 / 0.96-0.97.
  // kGemmInit against shared memory (H200, 2026-12-01, 3 alternations, 2k / 4k / 16k, non-det and shift_causal):
  // causal 0.953-0.957 / 0.962-0.969 / 0.946-0.947, full 0.985-0.987 / 0.969-0.971 / 0.962-0.968. Windows (1024, 0)
  // measured 1.04 at 4k (the selection registers made them spill 72 -> 156 bytes), so they keep shared memory.
  static constexpr RowStats row_stats(MaskKind mask) {
    return mask == MaskKind::kWindow ? RowStats::kSharedMemory : RowStats::kGemmInit;
  }
  // Soft-capped and packed causal kernels.
  static constexpr RowStats gemm_init_fallback(MaskKind) { return RowStats::kSharedMemory; }
  static constexpr OperandPartition operand_partition(MaskKind, RowStats) { return OperandPartition::kPerWarpGroup; }
  // dV after dS (H200, 3 alternations against kAfterP): full 0.94-0.96 of the time at 1k-16k with spills 8/16 -> 0
  // bytes; causal 1.00-1.03 with one step body (4 -> 48/72 bytes). With two step bodies see masked_steps.
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterDs; }
  // H200, 5 alternations each (2026-11-30). In turn against kRegisterStores: windows (1024, 0) at 4k/16k 0.94-0.97
  // of the time, causal 0.91-0.96 at 1k/2k, 0.99-1.00 at 4k/8k, 1.005-1.009 at 16k (spills 4 -> 12 bytes), full 0.98
  // at 1k but 1.01-1.015 at 8k/16k (0 -> 8 bytes). At once against in turn (causal) and register stores (full):
  // causal 0.975-0.99 at 1k-16k, full 0.95/0.975/1.00/1.00-1.01/1.003 at 1k-16k (same spills); windows 1.00-1.02
  // (spills 40 -> 48 bytes), so they stay in turn.
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind mask) {
    return mask == MaskKind::kWindow ? DkDvEpilogue::kTmaStagedInTurn : DkDvEpilogue::kTmaStagedAtOnce;
  }
  static constexpr int kSmemGapAfterV = 0;  // the second dQ buffer needs the room
  // H200, 3 alternating runs: 1-5% faster on full and causal masks; spills 28/36 -> 20/24 bytes (full/causal).
  static constexpr bool ds_store_address_swizzle(MaskKind) { return true; }
  // Two step bodies with the dV GEMM after dS (H200, 2026-11-30, 4 alternations against one body with kAfterP at
  // causal/windows): causal 0.93-0.955 of the time at 1k-16k (non-det and shift_causal), full 0.95-0.99 (8k 1.00),
  // windows (1024, 0) 0.99-1.00. ptxas reports more spill bytes (48-84 against 8-44), but they are loop invariants
  // stored before the step loop: the unmasked body, which runs nearly every step, reloads two words a step (causal).
  // With one body, kAfterDs at causal measured 0.98-0.99 and two bodies with kAfterP 1.02-1.05.
  static constexpr MaskedSteps masked_steps(MaskKind, RowStats) { return MaskedSteps::kTwoBodies; }
};

// hdim 256: 64 x 64 tiles, one stage (a second stage of Q and dO would not fit next to K, V and the dQ staging).
template <>
struct BwdConfig<256> {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 1;
  static constexpr int kDqBuffers = 1;
  // A 64 x 256 fp32 partial dQ is 64 KB, and with one staging buffer each add's turn in its chain stalls the
  // consumers: added whole, the deterministic backward ran 4-11% behind the non-deterministic one at full 8k-16k.
  static constexpr int kDqParts = 2;
  using SdPSplit = WarpGroupSplit<1, 2>;  // S^T (64 x 64): each warpgroup owns 32 query columns
  using dKVSplit = WarpGroupSplit<1, 2>;  // dK/dV (64 x 256): each warpgroup owns 128 columns of d
  using dQSplit = WarpGroupSplit<1, 2>;
  static constexpr DkvOperandA kDkvA = DkvOperandA::kSharedMemory;  // P^T rows are shared across warpgroups
  // A warpgroup's S^T covers half the query columns, so the statistics cannot be shuffled within a warp's row.
  static constexpr RowStats row_stats(MaskKind) { return RowStats::kSharedMemory; }
  // Per warpgroup: within +-1% of per thread at every row measured (H200, 3 alternating runs).
  static constexpr OperandPartition operand_partition(MaskKind, RowStats) { return OperandPartition::kPerWarpGroup; }
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterP; }  // P^T goes through shared memory here
  // A warpgroup owns half of d, not whole rows (dKVSplit = <1, 2>).
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind) { return DkDvEpilogue::kRegisterStores; }
  static constexpr int kSmemGapAfterV = 0;
  static constexpr bool ds_store_address_swizzle(MaskKind) { return false; }  // not measured at hdim 256
  // Two step bodies (H200, 2026-11-30, two runs of 4 alternations against one body, all spill-free but windows at
  // 20 bytes either way): causal 0.95-1.02 of the time at 1k-16k, 0.98-0.99 at 16k (non-det and shift_causal); full
  // 1.00-1.02 and windows (1024, 0) 1.00-1.01, so they keep one.
  static constexpr MaskedSteps masked_steps(MaskKind mask, RowStats) {
    return mask == MaskKind::kCausal ? MaskedSteps::kTwoBodies : MaskedSteps::kOneBody;
  }
};

// Whether every stride (in elements) of a (batch, seqlen, heads, d) tensor is a multiple of n.
inline bool strides_multiple_of(const TensorStrides& s, int64_t n) {
  return s.row % n == 0 && s.head % n == 0 && s.batch % n == 0;
}

// Whether a (batch, seqlen, heads, d) fp16/bf16 tensor allows 16-byte accesses (and TMA): the base and every stride
// in bytes are multiples of 16.
inline bool aligned16(const void* ptr, const TensorStrides& strides) {
  constexpr int64_t kElemsPer16Bytes = 16 / 2;
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && strides_multiple_of(strides, kElemsPer16Bytes);
}

// Whether a config reads the statistics through the tensor cores on some mask (RowStats::kGemmInit).
template <class Cfg>
constexpr bool uses_gemm_stats() {
  return Cfg::row_stats(MaskKind::kFull) == RowStats::kGemmInit ||
         Cfg::row_stats(MaskKind::kCausal) == RowStats::kGemmInit ||
         Cfg::row_stats(MaskKind::kWindow) == RowStats::kGemmInit;
}

// Run-time view of the same table, for the host (workspace sizing, dash_bwd_tile_shape).
template <class Cfg>
constexpr BwdTileConfig tile_config_of() {
  return {Cfg::kBlockM, Cfg::kBlockN, Cfg::kStages, Cfg::kDqParts, uses_gemm_stats<Cfg>()};
}
inline BwdTileConfig bwd_tile_config(int32_t headdim) {
  switch (headdim) {
    case 64: return tile_config_of<BwdConfig<64>>();
    case 128: return tile_config_of<BwdConfig<128>>();
    case 256: return tile_config_of<BwdConfig<256>>();
    default: return {0, 0, 0, 0, false};
  }
}

// The statistics as RowStats::kGemmInit reads them (GemmStatLines): -LSE_log2 / scale_log2 and -D of each query row as
// two bf16 parts (the rounding of the value, then of the rest), 16 significant bits: the exponent of P is off by at
// most |LSE_log2| * 2^-17, below bf16's rounding of P itself for any LSE_log2 under 64. A Q tile's rows r and
// r + kBlockM / 2 share a 16-byte line (LSE parts of r, D parts of r, then the same of r + kBlockM / 2), so a tile is
// kBlockM / 2 lines. Rows without a key and padded rows take -kNoKeyScore, a finite stand-in for -inf: the WGMMA
// multiplies the other parts of the line by 0, and 0 * inf would be NaN.
// D's 16 bits leave dS = P (dP - D) off by up to P |D| 2^-17, far below bf16's rounding of dS except where dP - D
// cancels exactly (one key per query: dS = 0, and dQ came out at 1.5-4.3e-5 instead of 0 with unit-scale inputs;
// FA3-style fp32 D is not exact there either, its dP and D being the same sum in two orders). The tests bound that
// error (dash_attn/reference.py, row_statistic_error_bound). bf16 parts keep it relative at every scale, so
// gradients scale exactly with dO. Tried (2026-12-01): D as two fp16 parts scaled per Q tile (22 bits) needs the
// tile's scale in the WGMMA's A registers each step; with a bf16 fallback for tiles outside fp16's range ptxas
// serialised the WGMMAs (1.17-1.22x the time), and without one typical training gradients (|D| ~ 1e-8) fall below
// the fp16 range's 22-bit window anyway.
constexpr int kGemmStatParts = 2;
constexpr size_t kGemmStatRowBytes = 2 * kGemmStatParts * 2;  // per query row; two rows to a line
constexpr float kNoKeyScore = 1e30f;

// Workspace of one backward call (dash_bwd_workspace_bytes), byte offsets from the workspace base, each region
// 128-byte aligned:
//   dq_accum   fp32 (dq_runs, batch, nheads, seqlen_q rounded up to kBlockM, d), tiles in the dQ writer's permuted
//              order; two runs for the invariant schedules (schedule/runs.h), one otherwise
//   lse_log2   fp32 (batch, nheads, seqlen_q_rounded)
//   dsum       fp32 (batch, nheads, seqlen_q_rounded)   D = rowsum(dO * O)
//   gemm_stats bf16 (batch, nheads, seqlen_q_rounded, 4)  GemmStatLines (RowStats::kGemmInit configs only)
//   semaphores int32 (dq_runs, batch, nheads, num_m_blocks, dq_parts)  completed dQ adds per accumulator part
//   split_partials fp32 (2 * split_ctas, 2, block_n * d)  partial dK, dV of the pieces of shift's split tail
//   split_counters int32 (split_ctas)  pieces finished per tail unit (schedule/tail_split.h, bwd_epilogue.h)
//   unit_counter uint64  next unclaimed unit (ScheduleKind::kDynamic)
//   dq_claims  int32 (batch, nheads, num_m_blocks)  visits loaded per Q tile (kDynamic: elects each tile's first add)
// Index of a Q tile in the per-tile regions (dq_accum tiles, semaphores): the preprocess, the dQ writer and the
// postprocess all address a tile through it.
__host__ __device__ inline int64_t q_tile_index(int32_t batch, int32_t head, int32_t nheads, int32_t num_m_blocks,
                                                int32_t m_block) {
  return (int64_t(batch) * nheads + head) * num_m_blocks + m_block;
}
// Index of accumulator `run` of Q tile tile_index in the same regions: the runs follow one another, num_q_tiles apart.
__host__ __device__ inline int64_t run_tile_index(int64_t tile_index, int32_t run, int64_t num_q_tiles) {
  return tile_index + run * num_q_tiles;
}
// The semaphores of Q tile `tile_index` (q_tile_index, run_tile_index), one per dQ part.
template <int kHeadDim, class Sem>
__host__ __device__ inline Sem* tile_semaphores(Sem* semaphores, int64_t tile_index) {
  return semaphores + tile_index * BwdConfig<kHeadDim>::kDqParts;
}

// fp32 values of one piece's partial dK and dV (a KV tile's worth of each).
inline size_t split_slot_floats(const BwdTileConfig& cfg, int32_t kernel_headdim) {
  return 2 * size_t(cfg.block_n) * size_t(kernel_headdim);
}

struct BwdWorkspaceLayout {
  int32_t num_m_blocks = 0;
  int32_t seqlen_q_rounded = 0;
  int32_t split_ctas = 0;
  int32_t dq_runs = 1;
  int64_t num_q_tiles = 0;  // batch * nheads * num_m_blocks: the distance between runs (run_tile_index)
  size_t dq_accum = 0, lse_log2 = 0, dsum = 0, gemm_stats = 0, semaphores = 0, split_partials = 0,
         split_counters = 0, unit_counter = 0, dq_claims = 0, total = 0;
};

// Grid size the split-tail regions are sized for: shift's tail is split (schedule/tail_split.h) only in batched
// full-mask calls whose schedule resolves to shift; num_sms bounds the grid of every sm_margin, so one workspace
// serves them all.
inline int32_t split_tail_ctas(const BwdParams& params) {
  if (params.packed.cu_seqlens_q != nullptr || params.tail_chunk_min <= 0) return 0;
  if (params.shape.mask != MaskKind::kFull) return 0;  // Shift::tail
  // kDynamic runs shift_causal's fallback off causal masks (schedule.h: resolve_schedule).
  if (params.schedule != ScheduleKind::kShift && params.schedule != ScheduleKind::kShiftCausal &&
      params.schedule != ScheduleKind::kDynamic) {
    return 0;
  }
  return params.num_sms > 0 ? params.num_sms : 0;
}

// kernel_headdim: the head dim of the kernel that runs the call (common/head_dims.h); its dQ tiles are that wide.
// split_ctas: split_tail_ctas of the call; dq_runs: accumulators per dQ tile of its schedule (schedule/runs.h).
inline BwdWorkspaceLayout bwd_workspace_layout(const AttnShape& s, int32_t kernel_headdim, int32_t split_ctas,
                                               int32_t dq_runs) {
  auto align = [](size_t x) { return (x + 127) / 128 * 128; };
  BwdWorkspaceLayout w;
  const BwdTileConfig cfg = bwd_tile_config(kernel_headdim);
  if (cfg.block_m == 0) return w;
  w.num_m_blocks = (s.seqlen_q + cfg.block_m - 1) / cfg.block_m;
  w.seqlen_q_rounded = w.num_m_blocks * cfg.block_m;
  const size_t bh = size_t(s.batch) * size_t(s.nheads);
  w.dq_runs = dq_runs;
  w.num_q_tiles = int64_t(bh) * w.num_m_blocks;
  size_t off = 0;
  w.dq_accum = off;
  off = align(off + size_t(dq_runs) * bh * w.seqlen_q_rounded * size_t(kernel_headdim) * sizeof(float));
  w.lse_log2 = off;
  off = align(off + bh * w.seqlen_q_rounded * sizeof(float));
  w.dsum = off;
  off = align(off + bh * w.seqlen_q_rounded * sizeof(float));
  w.gemm_stats = off;
  if (cfg.gemm_stats) off = align(off + bh * w.seqlen_q_rounded * kGemmStatRowBytes);
  w.semaphores = off;
  off = align(off + size_t(dq_runs) * bh * w.num_m_blocks * size_t(cfg.dq_parts) * sizeof(int32_t));
  w.split_ctas = split_ctas;
  w.split_partials = off;
  off = align(off + 2 * size_t(split_ctas) * split_slot_floats(cfg, kernel_headdim) * sizeof(float));
  w.split_counters = off;
  off = align(off + size_t(split_ctas) * sizeof(int32_t));
  w.unit_counter = off;
  off = align(off + sizeof(uint64_t));
  w.dq_claims = off;
  off = align(off + bh * w.num_m_blocks * sizeof(int32_t));
  w.total = off;
  return w;
}

// The layout of a call: kernel_head_dim(params.shape) is the head dim of the kernel that runs it. The requested
// schedule sizes the dQ runs (one that resolves to a single-run schedule leaves the second run unused).
inline BwdWorkspaceLayout bwd_workspace_layout(const BwdParams& params, int32_t kernel_headdim) {
  return bwd_workspace_layout(params.shape, kernel_headdim, split_tail_ctas(params), sched::dq_runs(params.schedule));
}

// Thread roles of the CTA.
struct BwdThreads {
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = 128 * kNumMmaWarpGroups;
  static constexpr int kNumThreads = 128 + kNumMmaThreads;  // producer warpgroup + consumers
  static constexpr int kProducerWarp = 0;                    // warp 0: TMA loads
  static constexpr int kDqWriterWarp = 1;                    // warp 1: dQ bulk reduce-add
  // setmaxnreg budgets: 128 * (kProducerRegs + 2 * kConsumerRegs) must fit the 64K register file. Keep it below
  // the full file: a build with 32 + 2 * 240 (exactly 64K) hung on the H200, 24 + 2 * 240 runs.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
};

}  // namespace dash::bwd
