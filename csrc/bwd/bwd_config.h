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
#include "schedule/schedule.h"  // dq_runs (runs.h), runs_per_sequence (seq_runs.h) with resolve_schedule defined

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
// warpgroup's rows). kSharedMemory: both from shared memory. kRegisters: P^T and dS^T from registers; dS^T must stay
// intact until the dK GEMM completes, so each step ends by waiting for it (held into the next step, the 16 registers
// of dS^T make the consumers spill).
// Register sources need each warpgroup to own the same KV rows in the SdP and dKV GEMMs and the whole query extent of
// its S^T rows (SdPSplit = dKVSplit = <2, 1>).
enum class DkvOperandA { kSharedMemory, kRegisters };

// How the consumers partition the WGMMA operands in shared memory. kPerThread: from the thread index, which the
// compiler cannot prove warp-uniform, so every WGMMA descriptor is built in vector registers and moved to uniform
// ones (R2UR) right before its WGMMA. kPerWarpGroup: from the warpgroup index made warp-uniform by a shuffle, so the
// descriptors live in uniform registers and the WGMMA issue stalls shorten (ncu). The accumulator partitions are per
// thread either way.
enum class OperandPartition { kPerThread, kPerWarpGroup };

// Where the consumers take the Q tile's row statistics (LSE_log2 for P, D for dS) from. kSharedMemory: from the
// stage's copy in shared memory after the GEMM wait that needs them, one load per query column (LSE at hdim 128) or
// per element. A thread holds 16-32 query columns, and a warp-wide load costs a shared-memory wavefront per 4 bytes
// a lane asks for however many lanes share an address, so these loads take a tenth of the step's wavefronts and
// queue behind the running GEMMs' operand reads (ncu figures: docs/tuning.md).
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
// One kind per kernel: a run-time fallback to kRegisterStores inside a staged kernel slows its step loop. The stores
// weigh most at short sequences, where a KV tile has few steps to spread them over (docs/tuning.md).
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
// the whole tile's. It pays off only where a tile's add is long (hdim 256); hdim 128 and 64 keep one part.
// kSmemGapAfterV: bytes left free between V and dS^T in shared memory. Tuned, not derived: the later buffers' offsets
// are constants in the consumers' addresses, so the gap changes register allocation (see BwdConfig<128>).
// ds_store_address_swizzle: the consumers store dS^T through a view whose swizzle acts on the shared-memory address
// (cute's position-independent swizzle) instead of on the layout offset. The store addresses then become 32-bit adds
// of constants to one base instead of a 64-bit swizzle computation per stmatrix, and the consumers spill less.

// hdim 128: 64 x 128 tiles (what FA3 uses for causal). With P^T taken from registers there is no P^T buffer, which
// leaves room for two 32 KB partial-dQ staging buffers next to 2 Q/dO stages, K, V and two dS^T buffers (226 KB).
// dK from registers too (kRegisters rather than P^T alone) keeps the consumers spill-free at full and causal. The
// measurements behind each knob of this config: docs/tuning.md, "Backward, hdim 128".
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
  // kGemmInit on every mask: the P and dS loops then read no per-column statistic at all, and with two step bodies
  // (masked_steps) the step is spill-free at causal; it is as fast or faster than the other kinds on each mask.
  static constexpr RowStats row_stats(MaskKind) { return RowStats::kGemmInit; }
  // The statistics of the kernels that cannot take kGemmInit (soft-capped): each mask's fastest among the other
  // kinds (shuffled a step ahead at causal, shuffled at full, shared memory at windows, where the shuffles spilled).
  static constexpr RowStats gemm_init_fallback(MaskKind mask) {
    return mask == MaskKind::kCausal   ? RowStats::kShuffleAhead
           : mask == MaskKind::kWindow ? RowStats::kSharedMemory
                                       : RowStats::kShuffle;
  }
  // Per warpgroup, except the full-mask kernels without kGemmInit (soft-capped): with kGemmInit and two step bodies
  // per-warpgroup operands spill least and run fastest at full, while the shuffled-statistics full kernel runs
  // slower per warpgroup with no more spills (not understood).
  static constexpr OperandPartition operand_partition(MaskKind mask, RowStats stats) {
    return mask == MaskKind::kFull && stats != RowStats::kGemmInit ? OperandPartition::kPerThread
                                                                   : OperandPartition::kPerWarpGroup;
  }
  // dV after dS: the fp32 P and dP are dead before the bf16 operands exist; as fast or faster on every mask.
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterDs; }
  // Staged in turn on every mask: faster than register stores at short sequences and at windows, and spill-free at
  // full/causal (kTmaStagedAtOnce would need twice the room of the two dS^T buffers).
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind) { return DkDvEpilogue::kTmaStagedInTurn; }
  // 1 KB gap: the bank mapping is the same either way, but the later buffers' offsets are constants in the
  // addresses, and without the gap ptxas spills at full and causal and the backward runs slower at long sequences.
  static constexpr int kSmemGapAfterV = 1024;
  // Address swizzle at full and causal, where it measured as fast or faster; windows keep the layout swizzle (not
  // measured with the address swizzle).
  static constexpr bool ds_store_address_swizzle(MaskKind mask) { return mask != MaskKind::kWindow; }
  // Two step bodies for windows (fewer spills, faster) and for every kGemmInit kernel (spill-free at causal; see
  // row_stats and operand_partition). The fallback kernels keep one body, which is faster for them.
  static constexpr MaskedSteps masked_steps(MaskKind mask, RowStats stats) {
    return mask == MaskKind::kWindow || stats == RowStats::kGemmInit ? MaskedSteps::kTwoBodies
                                                                      : MaskedSteps::kOneBody;
  }
};

// hdim 64: 128 x 128 tiles. P^T from registers saves the shared-memory round trip and frees the room for a second
// partial-dQ staging buffer. dK from registers too (kRegisters: the dK GEMM then reads only Q^T from shared memory).
// The measurements behind each knob of this config: docs/tuning.md, "Backward, hdim 64".
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
  // A thread holds 32 query columns of S^T, so reading LSE and D from shared memory costs 32 8-byte loads a step on
  // the shared-memory pipe that bounds the step; kGemmInit removes them at full and causal. Windows keep shared
  // memory: there the selection operands' registers make the consumers spill, which costs more than the loads.
  static constexpr RowStats row_stats(MaskKind mask) {
    return mask == MaskKind::kWindow ? RowStats::kSharedMemory : RowStats::kGemmInit;
  }
  // Soft-capped kernels.
  static constexpr RowStats gemm_init_fallback(MaskKind) { return RowStats::kSharedMemory; }
  static constexpr OperandPartition operand_partition(MaskKind, RowStats) { return OperandPartition::kPerWarpGroup; }
  // dV after dS: fewer spills and faster at full; at causal it pays off only with two step bodies (masked_steps).
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterDs; }
  // Staged at once (one hand-off for dK and dV) at full and causal, where it beats both in turn and register stores;
  // windows stage in turn, where at once spilled more without being faster.
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind mask) {
    return mask == MaskKind::kWindow ? DkDvEpilogue::kTmaStagedInTurn : DkDvEpilogue::kTmaStagedAtOnce;
  }
  static constexpr int kSmemGapAfterV = 0;  // the second dQ buffer needs the room
  // Fewer spills and faster on full and causal masks.
  static constexpr bool ds_store_address_swizzle(MaskKind) { return true; }
  // Two step bodies (with the dV GEMM after dS) on every mask: faster at causal and full. ptxas reports more spill
  // bytes than with one body, but they are loop invariants stored before the step loop: the unmasked body, which runs
  // nearly every step, reloads two words a step (causal).
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
  // consumers: added whole, the deterministic backward falls well behind the non-deterministic one at full masks.
  static constexpr int kDqParts = 2;
  using SdPSplit = WarpGroupSplit<1, 2>;  // S^T (64 x 64): each warpgroup owns 32 query columns
  using dKVSplit = WarpGroupSplit<1, 2>;  // dK/dV (64 x 256): each warpgroup owns 128 columns of d
  using dQSplit = WarpGroupSplit<1, 2>;
  static constexpr DkvOperandA kDkvA = DkvOperandA::kSharedMemory;  // P^T rows are shared across warpgroups
  // A warpgroup's S^T covers half the query columns, so the statistics cannot be shuffled within a warp's row.
  static constexpr RowStats row_stats(MaskKind) { return RowStats::kSharedMemory; }
  // Per warpgroup: as fast as per thread.
  static constexpr OperandPartition operand_partition(MaskKind, RowStats) { return OperandPartition::kPerWarpGroup; }
  static constexpr DvIssue dv_issue(MaskKind) { return DvIssue::kAfterP; }  // P^T goes through shared memory here
  // A warpgroup owns half of d, not whole rows (dKVSplit = <1, 2>).
  static constexpr DkDvEpilogue dkdv_epilogue(MaskKind) { return DkDvEpilogue::kRegisterStores; }
  static constexpr int kSmemGapAfterV = 0;
  static constexpr bool ds_store_address_swizzle(MaskKind) { return false; }  // not measured at hdim 256
  // Two step bodies at causal only, where most steps need no mask tests; full and windows gained nothing from them.
  static constexpr MaskedSteps masked_steps(MaskKind mask, RowStats) {
    return mask == MaskKind::kCausal ? MaskedSteps::kTwoBodies : MaskedSteps::kOneBody;
  }
};

// Whether a config reads the statistics through the tensor cores on some mask (RowStats::kGemmInit).
template <class Cfg>
constexpr bool uses_gemm_stats() {
  return Cfg::row_stats(MaskKind::kFull) == RowStats::kGemmInit ||
         Cfg::row_stats(MaskKind::kCausal) == RowStats::kGemmInit ||
         Cfg::row_stats(MaskKind::kWindow) == RowStats::kGemmInit;
}

// Whether the kernel of (config, mask) in bf16 or fp16, soft-capped or not, reads the row statistics through the
// tensor cores (RowStats::kGemmInit) rather than the config's gemm_init_fallback. Soft-capped kernels take the
// fallback (soft-capping applies tanh before LSE). So do the fp16 kernels: the GEMM-read statistics carry D in 16
// significant bits (GemmStatLines), and where dP - D cancels exactly (a query with a single key) the error that leaves
// in dS exceeds fp16's output rounding (FA3's test bound there). BwdTraits::kGemmStats reads it. It does not ask
// whether the kernel is the packed-sequence one: packed and batched kernels read the statistics alike, so a varlen
// call of a sequence gives its dense call's bits under the same schedule (README, docs/schedules.md). The packed
// kernels' epilogue keeps the sequence lookups out of the step loop (bwd_epilogue.h), so they spill no more than
// the batched ones with it.
template <class Cfg>
constexpr bool reads_gemm_stats(MaskKind mask, bool bf16, bool softcap) {
  return Cfg::row_stats(mask) == RowStats::kGemmInit && !softcap && bf16;
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
// gradients scale exactly with dO. Not fp16 parts scaled per Q tile: the tile's scale would be a per-step WGMMA
// operand, and typical training gradients (|D| ~ 1e-8) fall outside such a window anyway (docs/tuning.md).
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
//   unit_counter uint64  next unclaimed unit (units claimed at run time: bwd_tile_scheduler.h)
//   dq_claims  int32 (batch, nheads, num_m_blocks)  visits loaded per Q tile (kDynamic: elects each tile's first add)
//   seq_table  SeqEntry (batch + 1), int32 (batch)  packed calls scheduled per sequence (seq_table_call)
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
         split_counters = 0, unit_counter = 0, dq_claims = 0, sink_partials = 0, seq_table = 0, total = 0;
  bool has_seq_table = false;
};

// Packed calls under shift_causal_runs (causal) or shift_runs (full) schedule every sequence on its own geometry
// (schedule/seq_runs.h), from a table the backward builds on the device.
inline bool seq_table_call(const BwdParams& params) {
  return params.packed.cu_seqlens_q != nullptr && sched::runs_per_sequence(params.schedule, params.shape.mask);
}
// The table's unit counts are int32: nheads_k * (KV tiles of every sequence) must stay below 2^31 for every tile
// width (a sequence of L keys has at most L / 64 + 1 of them). dash_bwd refuses larger calls.
inline bool seq_units_fit(const BwdParams& params) {
  return int64_t(params.shape.nheads_k) * (int64_t(params.packed.total_k) / 64 + params.shape.batch) < INT32_MAX;
}
// Bytes of the table: batch + 1 entries, then the launch order (batch int32).
inline size_t seq_table_bytes(int32_t batch) {
  return (size_t(batch) + 1) * sizeof(sched::SeqEntry) + size_t(batch) * sizeof(int32_t);
}

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
                                               int32_t dq_runs, bool seq_table) {
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
  w.sink_partials = off;  // one float per Q tile; used by calls with learnable sinks only
  off = align(off + bh * w.num_m_blocks * sizeof(float));
  w.has_seq_table = seq_table;
  w.seq_table = off;
  if (seq_table) off = align(off + seq_table_bytes(s.batch));
  w.total = off;
  return w;
}

// The layout of a call: kernel_head_dim(params.shape) is the head dim of the kernel that runs it. The requested
// schedule sizes the dQ runs (one that resolves to a single-run schedule leaves the second run unused).
inline BwdWorkspaceLayout bwd_workspace_layout(const BwdParams& params, int32_t kernel_headdim) {
  return bwd_workspace_layout(params.shape, kernel_headdim, split_tail_ctas(params), sched::dq_runs(params.schedule),
                              seq_table_call(params));
}

// Thread roles of the CTA.
struct BwdThreads {
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = 128 * kNumMmaWarpGroups;
  static constexpr int kNumThreads = 128 + kNumMmaThreads;  // producer warpgroup + consumers
  static constexpr int kProducerWarp = 0;                    // warp 0: TMA loads
  static constexpr int kDqWriterWarp = 1;                    // warp 1: dQ bulk reduce-add
  // setmaxnreg budgets: 128 * (kProducerRegs + 2 * kConsumerRegs) must fit the 64K register file. Keep it below
  // the full file: 32 + 2 * 240 (exactly 64K) hangs, 24 + 2 * 240 runs.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
};

}  // namespace dash::bwd
