// Plain-old-data launch parameters shared by the torch binding, the kernels and the C++ microbenchmark.
// Torch-free and CUDA-free on purpose: kernel translation units and the bench include it without torch, and the
// binding fills it without seeing any CuTe type.
#pragma once
#include <cstddef>
#include <cstdint>

namespace dash {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1 };

// Mask of the attention scores. Causal is bottom-right aligned (query row i sees key j <= i + seqlen_k - seqlen_q).
// Window uses window_left/window_right (either may be -1 = unbounded) relative to the same diagonal; causal with a
// window is Window with window_right = 0.
enum class MaskKind : int32_t { kFull = 0, kCausal = 1, kWindow = 2 };

// Transform of the scaled scores before the softmax, a compile-time variant of every kernel (its own instantiation,
// so the plain kernels carry none of its code). kSoftcap: scores = softcap * tanh(scores / softcap) (logit
// soft-capping as in Gemma 2 and FlashAttention's `softcap`), used when AttnShape::softcap > 0.
enum class ScoreMod : int32_t { kNone = 0, kSoftcap = 1 };

// Backward schedules. kAuto is resolved on the host (cost model) before any launch; kernels never see it.
enum class ScheduleKind : int32_t {
  kAscending = 0,
  kDescending = 1,
  kSpt = 2,
  kShift = 3,
  kShiftCausal = 4,
  kDynamic = 5,  // non-deterministic mode only: units claimed at run time (schedule/dynamic.h)
  kShiftRuns = 6,        // invariant: shift's walk, dQ in two accumulators (schedule/runs.h)
  kShiftCausalRuns = 7,  // invariant: paired causal tiles, dQ in two accumulators (schedule/runs.h)
  kDescendingLanes = 8,  // invariant: descending's bits on a lane-per-tile layout (schedule/lanes.h)
  // Resolved only, never requested: kShiftCausalRuns on packed causal sequences, each scheduled on its own geometry
  // (schedule/seq_runs.h).
  kSeqCausalRuns = 9,
  kAuto = 99,
};

// Whether a launch can take schedule id `id`: a concrete kind (kAuto is resolved on the host before any launch).
inline bool concrete_schedule(int64_t id) {
  return id >= 0 && id <= static_cast<int64_t>(ScheduleKind::kDescendingLanes);
}

// Whether a schedule runs in this mode: kDynamic has no accumulation order (schedule/dynamic.h), so it runs only
// without determinism.
inline bool schedule_runs_in_mode(ScheduleKind kind, bool deterministic) {
  return !(deterministic && kind == ScheduleKind::kDynamic);
}

// Stages of one backward call, as bit flags for dash_bwd_stages. They exist so a profiler or the C++ benchmark can
// time each kernel on its own; training always runs kAll through dash_bwd. Unscoped so that flags combine with `|`
// into the int32_t mask of the C ABI; spell them dash::BwdStage::kMain to keep call sites readable.
enum BwdStage : int32_t {
  kPreprocess = 1,   // D = rowsum(dO * O), LSE to log2, zero the dQ semaphores
  kMain = 2,         // the persistent dK/dV/dQ-accumulate kernel
  kPostprocess = 4,  // dQ accumulator (fp32) -> dQ (scaled, element type)
  kAll = 7,
};

// Strides are in elements. Layout of q/o/dq/do: (batch, seqlen_q, nheads, headdim); k/v/dk/dv:
// (batch, seqlen_k, nheads_k, headdim); the last dimension is contiguous (stride 1).
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Whether every stride (in elements) of a (batch, seqlen, heads, d) tensor is a multiple of n.
inline bool strides_multiple_of(const TensorStrides& s, int64_t n) {
  return s.row % n == 0 && s.head % n == 0 && s.batch % n == 0;
}

// Whether a (batch, seqlen, heads, d) tensor of element_bytes-byte elements (the kernels' fp16/bf16: 2) allows
// 16-byte accesses, as TMA needs: its base and every stride in bytes are multiples of 16.
inline bool aligned16(const void* ptr, const TensorStrides& strides, int64_t element_bytes = 2) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && strides_multiple_of(strides, 16 / element_bytes);
}

struct AttnShape {
  int32_t batch = 0;
  int32_t seqlen_q = 0;
  int32_t seqlen_k = 0;
  int32_t nheads = 0;
  int32_t nheads_k = 0;
  int32_t headdim = 0;
  DType dtype = DType::kBFloat16;
  MaskKind mask = MaskKind::kFull;
  int32_t window_left = -1;
  int32_t window_right = -1;
  float softmax_scale = 1.0f;
  float softcap = 0.0f;  // 0 = off
  // Head dim of v (and of o, dout, dv) where it differs from q's and k's; 0: the same.
  int32_t headdim_v = 0;
};

// The head dim of v, o, dout and dv.
inline int32_t value_head_dim(const AttnShape& s) { return s.headdim_v > 0 ? s.headdim_v : s.headdim; }

// Whether the query heads split evenly into groups of one KV head each (MQA/GQA).
inline bool heads_grouped(const AttnShape& s) { return s.nheads_k > 0 && s.nheads % s.nheads_k == 0; }

// Packed sequences (FlashAttention's varlen layout). When cu_seqlens_q is set, q, o, dq and dout are
// (total_q, nheads, d) and k, v, dk and dv (total_k, nheads_k, d): sequence b owns rows [cu_seqlens[b],
// cu_seqlens[b + 1]) of each, AttnShape::batch counts the sequences, AttnShape::seqlen_q/k are the longest ones (the
// kernels tile and schedule as for a batch of that size and skip the tiles past each sequence's end), the batch
// strides are unused and lse is (nheads, total_q). cu_seqlens_* are device int32 arrays of batch + 1 prefix sums.
// seqused_q/k (optional, FlashAttention-3's varlen arguments): device int32 arrays of batch entries, the rows of each
// sequence in use, from its first row; the rows past them are left as they are (the Python layer zeroes them).
struct PackedSeqs {
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int32_t total_q = 0;
  int32_t total_k = 0;
  const int32_t* seqused_q = nullptr;  // optional; null: every row of each sequence is in use
  const int32_t* seqused_k = nullptr;
};

// How a call's sequences are laid out, a compile-time variant of every kernel: kBatched (batch, seqlen, heads, d)
// tensors of equal lengths, kPacked the PackedSeqs layout.
enum class SeqLayout : int32_t { kBatched = 0, kPacked = 1 };

struct FwdParams {
  AttnShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // (batch, nheads, seqlen_q), natural log
  TensorStrides q_stride, k_stride, v_stride, o_stride;
  int32_t num_sms = 0;  // read from the device at run time by the caller
  PackedSeqs packed;    // SeqLayout::kPacked calls only
  // Learnable sinks (gpt-oss): (nheads,) float32 logits, one per query head, each adding exp(sink) to its rows'
  // softmax denominators (with no value vector); null: none. lse includes them.
  const float* sink = nullptr;
};

// A chunk of shift's split tail also pays a K/V load and a partial dK/dV store, and the last piece of a tile adds up
// to V / chunk partials: chunks shorter than this cost more than the idle CTAs they fill.
constexpr int32_t kDefaultTailChunkMin = 16;

// Where shift puts the KV tiles of a head that run side by side (schedule/shift.h). kSpread (the default): KV tile j
// starts at Q tile 2 j where there are at least twice as many Q tiles as KV tiles (hdim 128), so the contributors of
// a dQ tile arrive two steps apart and each deterministic add has a step of slack for the previous CTA's reduce to
// complete. kAdjacent: the DASH paper's j (one step apart).
enum class ShiftSpacing : int32_t { kSpread = 0, kAdjacent = 1 };

struct BwdParams {
  AttnShape shape;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;  // (batch, nheads, seqlen_q), natural log, from the forward
  // Inputs arrive by TMA: 16-byte aligned bases and strides (in bytes). dK and dV leave by TMA too and need the same;
  // dq needs 4 bytes (it is written 16 bytes at a time where it allows, else 4). dash_bwd refuses (-1) otherwise.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides q_stride, k_stride, v_stride, o_stride, do_stride, dq_stride, dk_stride, dv_stride;
  bool deterministic = false;
  ScheduleKind schedule = ScheduleKind::kDescending;  // never kAuto here
  int32_t num_sms = 0;    // device SM count, read at run time
  int32_t sm_margin = 0;  // SMs left free; the persistent grid uses num_sms - sm_margin CTAs (at least 1)
  void* workspace = nullptr;       // dash_bwd_workspace_bytes(params) bytes, any content (kernels zero what they need)
  size_t workspace_bytes = 0;
  PackedSeqs packed;  // SeqLayout::kPacked calls only
  // Packed causal calls scheduled per sequence (seq_runs.h): sequences of up to this many keys run Descending.
  int32_t seq_short_k = 0;
  // Shortest chunk, in steps, of shift's split last wave (schedule/tail_split.h); 0: never split. Users keep the
  // default; the benchmark varies it to measure the split (dash_bench --tail-chunks).
  int32_t tail_chunk_min = kDefaultTailChunkMin;
  // Users keep the default; the benchmark varies it (dash_bench --shift-spacings).
  ShiftSpacing shift_spacing = ShiftSpacing::kSpread;
  // Learnable sinks: the forward's (nheads,) float32 logits, or null. The lse given includes them, so the dQ/dK/dV
  // kernels need nothing else; dsink (nheads,) float32 receives d sink_h = -sum over the rows of exp(sink_h - lse) * D
  // (computed with D by the preprocess, reduced in a fixed order). Both set or both null.
  const float* sink = nullptr;
  float* dsink = nullptr;
};

}  // namespace dash

// C ABI of the kernel library (csrc/fwd, csrc/bwd). Return 0 on success, else a cudaError_t value or -1 for an
// unsupported configuration (the binding validates first, so -1 is a bug guard, not a user error path).
extern "C" {
int dash_fwd(const dash::FwdParams* params, void* stream);
size_t dash_bwd_workspace_bytes(const dash::BwdParams* params);
int dash_bwd(const dash::BwdParams* params, void* stream);
// Runs only the stages set in `stages` (dash::BwdStage bits), always in the order preprocess -> main -> postprocess,
// with the same validation as dash_bwd (which is dash_bwd_stages with dash::BwdStage::kAll); -1 also when `stages`
// is 0 or has a bit outside kAll. The stages communicate through params->workspace only, so split calls must pass
// the same params and workspace and keep that order. kMain needs a kPreprocess on the same workspace before every
// launch: preprocess writes the log2 LSE and D rows it reads and zeroes the semaphores it counts on (the accumulator
// needs no zeroing: each tile's first add is a store). kPostprocess reads the accumulator the last kMain left.
int dash_bwd_stages(const dash::BwdParams* params, int32_t stages, void* stream);
// Tile shape the backward kernel uses for (headdim, mask): lets the host plan/simulate exactly what runs.
void dash_bwd_tile_shape(int32_t headdim, int32_t mask, int32_t* block_m, int32_t* block_n);
}
