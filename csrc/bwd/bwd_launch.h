// Launch template of the backward: preprocess -> persistent main kernel -> postprocess, all on the caller's stream.
// Instantiated once per (hdim, dtype, mask, score transform) by csrc/instantiations/bwd_*.cu; the schedule and the
// deterministic flag are run-time parameters of the one kernel. `stages` (BwdStage bits, validated by dash_bwd_stages)
// picks which of the three kernels are launched, so the benchmark can time them one by one; their order never changes.
// After a main kernel of the same call, the postprocess is a programmatic dependent launch (bwd_postprocess.h) unless
// SMs are reserved (sm_margin > 0): its CTAs would otherwise sit on those SMs while the main kernel runs.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "bwd/bwd_config.h"
#include "bwd/bwd_kernel.h"
#include "bwd/bwd_postprocess.h"
#include "bwd/bwd_preprocess.h"
#include "bwd/bwd_seq_table.h"

namespace dash::bwd {

// Persistent grid size: one CTA per usable SM, never more CTAs than work units.
inline int32_t bwd_num_ctas(const BwdParams& params, const sched::Problem& prob) {
  const int32_t usable = std::max(1, params.num_sms - params.sm_margin);
  // Upper bound on work units for every schedule (a paired schedule has fewer units; its surplus CTAs get no items).
  const int64_t units = sched::num_kv_heads_total(prob) * sched::num_n_blocks(prob);
  return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(usable, units)));
}

// A TensorStrides into the (row, head, batch) fields of a kernel's parameter struct, which keeps them as members of
// their own (the structs' layout is the kernels' parameter space; the host fills each group in one call).
inline void set_strides(int64_t& row, int64_t& head, int64_t& batch, const TensorStrides& strides) {
  row = strides.row;
  head = strides.head;
  batch = strides.batch;
}

// The regions of the workspace the main kernel reads (LSE_log2, D) and accumulates into (dQ, semaphores).
struct BwdWorkspaceViews {
  float* lse_log2;
  float* dsum;
  float* dq_accum;
  int32_t* semaphores;
  cutlass::bfloat16_t* gemm_stats;  // RowStats::kGemmInit kernels only, else null
  float* split_partials;            // shift's split tail (split_tail_ctas > 0), else null
  int32_t* split_counters;
  unsigned long long* unit_counter;  // claimed units' counter (all calls; zeroed by the preprocess)
  int32_t* dq_claims;
  float* sink_partials;  // each Q tile's share of d sink (calls with learnable sinks)
  sched::SeqEntry* seq_table;  // packed calls scheduled per sequence (seq_table_call), else null
};

// The schedule's view of this launch: the kernel's tile sizes and mask, the persistent grid size and, where each
// sequence is scheduled on its own geometry, the sequence table.
template <class T>
sched::Problem bwd_problem(const BwdParams& params, const BwdWorkspaceViews& views) {
  const AttnShape& s = params.shape;
  sched::Problem prob{s.batch, s.nheads, s.nheads_k, s.seqlen_q, s.seqlen_k, T::kBlockM, T::kBlockN,
                      T::kMask, s.window_left, s.window_right, 0};
  prob.seqs = views.seq_table;
  prob.num_ctas = bwd_num_ctas(params, prob);
  // Shift's split tail: packed sequences skip visits past each sequence's end, so their items stay whole tiles; a
  // piece's partial dK/dV are stored with every one of the kernel's columns, so q, k and v must have kHeadDim; the
  // workspace holds the split's regions only where split_tail_ctas allows it.
  const bool split = !T::kPacked && split_tail_ctas(params) >= prob.num_ctas && s.headdim == T::kHeadDim &&
                     value_head_dim(s) == T::kHeadDim;
  prob.tail_chunk_min = split ? params.tail_chunk_min : 0;
  prob.shift_spacing = params.shift_spacing;
  return prob;
}

// The persistent main kernel alone: it needs this call's preprocess to have run on the same workspace first.
template <int kHeadDim, class Element, MaskKind kMask, ScoreMod kScoreMod, SeqLayout kLayout>
void launch_bwd_main(const BwdParams& params, const BwdWorkspaceLayout& ws, const BwdWorkspaceViews& views,
                     cudaStream_t stream) {
  using T = BwdTraits<kHeadDim, Element, kMask, kScoreMod, kLayout>;
  const AttnShape& s = params.shape;
  const sched::Problem prob = bwd_problem<T>(params, views);

  // A (batch, seqlen, heads, d) tensor as TMA sees it: (seqlen, d, head, batch); const for the loaded inputs. d is
  // the call's head dim (q, k, dq, dk: headdim; v, dout, dv: value_head_dim), which may be below kHeadDim
  // (common/head_dims.h): TMA zero-fills and clips the rest. The kernel addresses them through tile coordinates only.
  // Packed sequences are one batch entry of all rows (any stride TMA accepts will do for that mode); the producer
  // offsets each tile by its sequence's first row.
  auto make_qkv = [](auto* ptr, int32_t seqlen, int32_t d, int32_t heads, int32_t batch, const TensorStrides& st) {
    using E = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(ptr)>>, Element const, Element>;
    return make_tensor(make_gmem_ptr(static_cast<E*>(ptr)), make_shape(seqlen, d, heads, batch),
                       make_stride(st.row, _1{}, st.head, T::kPacked ? st.row : st.batch));
  };
  const int32_t dv = value_head_dim(s);
  // Rows of the tensors: the batch's sequence length, or all packed rows (at least one: a tensor map needs them).
  const int32_t rows_q = T::kPacked ? std::max(params.packed.total_q, 1) : s.seqlen_q;
  const int32_t rows_k = T::kPacked ? std::max(params.packed.total_k, 1) : s.seqlen_k;
  const int32_t batch = T::kPacked ? 1 : s.batch;
  auto mQ = make_qkv(params.q, rows_q, s.headdim, s.nheads, batch, params.q_stride);
  auto mdO = make_qkv(params.dout, rows_q, dv, s.nheads, batch, params.do_stride);
  auto mK = make_qkv(params.k, rows_k, s.headdim, s.nheads_k, batch, params.k_stride);
  auto mV = make_qkv(params.v, rows_k, dv, s.nheads_k, batch, params.v_stride);
  using BM = typename T::BM;
  using BN = typename T::BN;
  using HD = typename T::HD;

  // Every field by name, in role groups; the ones a kernel variant does not use stay value-initialized.
  BwdKernelParams<T> p{};
  // Loads: TMA descriptors of the inputs and the (rows, d, heads, batch) shapes the kernel tiles.
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(typename T::SmemLayoutQ{}), Shape<BM, HD>{}, _1{});
  p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(typename T::SmemLayoutQ{}), Shape<BM, HD>{}, _1{});
  p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK{}, Shape<BN, HD>{}, _1{});
  p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK{}, Shape<BN, HD>{}, _1{});
  p.shape_q = mQ.shape();
  p.shape_k = mK.shape();
  // Schedule: kDynamic runs as shift-causal where the kernel cannot claim units.
  p.sched = ScheduleRef{prob, params.schedule == ScheduleKind::kDynamic && !ScheduleRef::claims_units<T>()
                                  ? ScheduleKind::kShiftCausal
                                  : params.schedule};
  p.deterministic = params.deterministic;
  p.seqlen_q_rounded = ws.seqlen_q_rounded;
  p.num_m_blocks = ws.num_m_blocks;
  p.num_q_tiles = ws.num_q_tiles;
  // Scales of the score transform.
  p.scale = s.softmax_scale;
  p.scale_log2 = score_scales(s).softmax * float(M_LOG2E);
  p.softcap_pre_tanh = score_scales(s).pre_tanh;
  // Workspace: the preprocess's LSE_log2 and D, dQ's accumulator and semaphores, and the optional regions.
  p.lse_log2 = views.lse_log2;
  p.dsum = views.dsum;
  p.dq_accum = views.dq_accum;
  p.semaphores = views.semaphores;
  p.gemm_stats = views.gemm_stats;
  p.split_partials = views.split_partials;
  p.split_counters = views.split_counters;
  p.unit_counter = views.unit_counter;
  p.dq_claims = views.dq_claims;
  // Outputs: dK and dV with their strides (tma_dk / tma_dv below, for the staged epilogues).
  p.dk = params.dk;
  p.dv = params.dv;
  set_strides(p.dk_row, p.dk_head, p.dk_batch, params.dk_stride);
  set_strides(p.dv_row, p.dv_head, p.dv_batch, params.dv_stride);
  // Packed sequences are addressed as the TMA tensors address them: one batch entry per row, a sequence's entry its
  // first row (the epilogue's register stores, bwd_epilogue.h).
  if constexpr (T::kPacked) {
    p.dk_batch = p.dk_row;
    p.dv_batch = p.dv_row;
  }
  // Mask and sequence layout.
  p.window_left = s.window_left;
  p.window_right = s.window_right;
  p.packed = params.packed;
  if constexpr (T::kStagedEpilogue) {
    // dash_bwd_stages has checked that dk and dv are 16-byte aligned (base and strides), as TMA needs.
    auto mdK = make_qkv(params.dk, rows_k, s.headdim, s.nheads_k, batch, params.dk_stride);
    auto mdV = make_qkv(params.dv, rows_k, dv, s.nheads_k, batch, params.dv_stride);
    using Box = Shape<typename T::StageRows, HD>;
    p.tma_dk = make_tma_copy(SM90_TMA_STORE{}, mdK, typename T::SmemLayoutStageWG{}, Box{}, _1{});
    p.tma_dv = make_tma_copy(SM90_TMA_STORE{}, mdV, typename T::SmemLayoutStageWG{}, Box{}, _1{});
  }

  constexpr size_t smem = bwd_smem_bytes<T>();
  auto kernel = bwd_main_kernel<T>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  kernel<<<prob.num_ctas, BwdThreads::kNumThreads, smem, stream>>>(p);
}

template <int kHeadDim, class Element, MaskKind kMask, ScoreMod kScoreMod, SeqLayout kLayout>
void launch_bwd(const BwdParams& params, cudaStream_t stream, int32_t stages) {
  using T = BwdTraits<kHeadDim, Element, kMask, kScoreMod, kLayout>;
  const AttnShape& s = params.shape;
  const BwdWorkspaceLayout ws = bwd_workspace_layout(params, kHeadDim);
  char* base = static_cast<char*>(params.workspace);
  const bool split = ws.split_ctas > 0;
  const BwdWorkspaceViews views{reinterpret_cast<float*>(base + ws.lse_log2), reinterpret_cast<float*>(base + ws.dsum),
                                reinterpret_cast<float*>(base + ws.dq_accum),
                                reinterpret_cast<int32_t*>(base + ws.semaphores),
                                T::kGemmStats ? reinterpret_cast<cutlass::bfloat16_t*>(base + ws.gemm_stats) : nullptr,
                                split ? reinterpret_cast<float*>(base + ws.split_partials) : nullptr,
                                split ? reinterpret_cast<int32_t*>(base + ws.split_counters) : nullptr,
                                reinterpret_cast<unsigned long long*>(base + ws.unit_counter),
                                reinterpret_cast<int32_t*>(base + ws.dq_claims),
                                reinterpret_cast<float*>(base + ws.sink_partials),
                                T::kPacked && ws.has_seq_table
                                    ? reinterpret_cast<sched::SeqEntry*>(base + ws.seq_table)
                                    : nullptr};
  const dim3 tile_grid(ws.num_m_blocks, s.nheads, s.batch);

  PreprocessParams pre{};
  // Inputs: o, dout (with their strides) and the forward's LSE.
  pre.o = params.o;
  pre.dout = params.dout;
  pre.lse = params.lse;
  set_strides(pre.o_row, pre.o_head, pre.o_batch, params.o_stride);
  set_strides(pre.do_row, pre.do_head, pre.do_batch, params.do_stride);
  // Shapes.
  pre.seqlen_q = s.seqlen_q;
  pre.seqlen_q_rounded = ws.seqlen_q_rounded;
  pre.nheads = s.nheads;
  pre.num_m_blocks = ws.num_m_blocks;
  pre.headdim = value_head_dim(s);
  pre.packed = params.packed;
  // Workspace it writes (LSE_log2, D, the GEMM stats) and zeroes (semaphores, split and dynamic counters).
  pre.lse_log2 = views.lse_log2;
  pre.dsum = views.dsum;
  pre.gemm_stats = views.gemm_stats;
  pre.inv_scale_log2 = 1.f / (score_scales(s).softmax * float(M_LOG2E));
  pre.semaphores = views.semaphores;
  pre.dq_runs = ws.dq_runs;
  pre.num_q_tiles = ws.num_q_tiles;
  pre.split_counters = views.split_counters;
  pre.num_split_counters = ws.split_ctas;
  pre.unit_counter = views.unit_counter;
  pre.dq_claims = views.dq_claims;
  // Learnable sinks: their gradient comes from D and lse, so the preprocess stage computes it.
  pre.sink = params.sink;
  pre.sink_partials = views.sink_partials;
  if ((stages & BwdStage::kPreprocess) && ws.num_m_blocks > 0) {
    bwd_preprocess_kernel<kHeadDim, T::kBlockM, Element, kLayout, T::kGemmStats>
        <<<tile_grid, kPreprocessThreads, 0, stream>>>(pre);
    if (params.sink != nullptr) {
      sink_grad_kernel<<<s.nheads, 32, 0, stream>>>(pre.sink_partials, params.dsink, s.batch, s.nheads,
                                                    ws.num_m_blocks);
    }
  }
  if ((stages & BwdStage::kPreprocess) && views.seq_table != nullptr) {
    const SeqTableParams table{params.packed, bwd_problem<T>(params, views), params.seq_short_k, views.seq_table};
    bwd_seq_table_kernel<<<1, kSeqTableThreads, 0, stream>>>(table);
  }

  if (stages & BwdStage::kMain) {
    launch_bwd_main<kHeadDim, Element, kMask, kScoreMod, kLayout>(params, ws, views, stream);
  }

  PostprocessParams post{};
  // dQ: the accumulator it reads and the output it writes, with its strides.
  post.dq_accum = views.dq_accum;
  post.dq = params.dq;
  set_strides(post.dq_row, post.dq_head, post.dq_batch, params.dq_stride);
  post.aligned16 = aligned16(params.dq, params.dq_stride);
  post.scale = s.softmax_scale;
  // Shapes.
  post.seqlen_q = s.seqlen_q;
  post.nheads = s.nheads;
  post.num_m_blocks = ws.num_m_blocks;
  post.headdim = s.headdim;
  post.packed = params.packed;
  // The main kernel's tiling and schedule, for the tiles' completion counts (semaphores) and accumulator runs.
  post.semaphores = views.semaphores;
  post.problem = bwd_problem<T>(params, views);
  post.schedule = sched::resolve_schedule(params.schedule, post.problem);
  post.num_q_tiles = ws.num_q_tiles;
  if ((stages & BwdStage::kPostprocess) && ws.num_m_blocks > 0) {
    cudaLaunchAttribute overlap{};
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = tile_grid;
    cfg.blockDim = dim3(T::kNumMmaThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cfg.attrs = &overlap;
    cfg.numAttrs = (stages & BwdStage::kMain) && params.sm_margin == 0 ? 1 : 0;
    cudaLaunchKernelEx(&cfg, bwd_postprocess_kernel<T>, post);
  }
}

template <int kHeadDim, class Element, MaskKind kMask, ScoreMod kScoreMod>
void run_bwd_(const BwdParams& params, cudaStream_t stream, int32_t stages) {
  launch_bwd<kHeadDim, Element, kMask, kScoreMod, SeqLayout::kBatched>(params, stream, stages);
}

// Packed sequences (params.packed set; shape.batch sequences of at most shape.seqlen_q / seqlen_k rows).
template <int kHeadDim, class Element, MaskKind kMask, ScoreMod kScoreMod>
void run_bwd_packed_(const BwdParams& params, cudaStream_t stream, int32_t stages) {
  launch_bwd<kHeadDim, Element, kMask, kScoreMod, SeqLayout::kPacked>(params, stream, stages);
}

}  // namespace dash::bwd
