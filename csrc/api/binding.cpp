// Torch binding of the kernel library: checks arguments (a second line of defence behind dash_attn/validation.py),
// fills the POD params of csrc/common/params.h and launches on the current stream. Kept in its own TU so that the
// kernel TUs never see torch headers.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "common/head_dims.h"
#include "common/kv_head_sum.h"
#include "common/params.h"
#include "common/seqlens_check.h"

namespace {

// Numbers enter error messages as strings: with torch 2.11.0+cu130 a TORCH_CHECK whose message streams an integer
// through c10::str crashes the process (SIGSEGV) instead of raising, while messages of strings alone raise.
template <class T>
std::string num(T v) {
  return std::to_string(v);
}

bool softcap_built() {
#ifdef DASH_ENABLE_SOFTCAP
  return true;
#else
  return false;
#endif
}

bool packed_built() {
#ifdef DASH_ENABLE_PACKED
  return true;
#else
  return false;
#endif
}

// The element types this build has kernels for, by the names of DASH_ATTN_DTYPES.
std::vector<std::string> supported_dtypes() {
  std::vector<std::string> names;
#ifdef DASH_ENABLE_FP16
  names.push_back("fp16");
#endif
#ifdef DASH_ENABLE_BF16
  names.push_back("bf16");
#endif
  return names;
}

dash::DType dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) {
#ifdef DASH_ENABLE_FP16
    return dash::DType::kFloat16;
#endif
  } else if (t.scalar_type() == at::kBFloat16) {
#ifdef DASH_ENABLE_BF16
    return dash::DType::kBFloat16;
#endif
  }
  TORCH_CHECK_VALUE(false, "dash_attn: dtype ", c10::toString(t.scalar_type()), " is not built into this extension");
}

dash::TensorStrides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// Packed sequences (total, heads, headdim): the row and head strides; the batch stride is unused.
dash::TensorStrides packed_strides_of(const at::Tensor& t) { return {0, t.stride(0), t.stride(1)}; }

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& like, int64_t dims, const char* layout) {
  TORCH_CHECK_VALUE(t.is_cuda(), "dash_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.dim() == dims, "dash_attn: ", name, " must have ", num(dims), " dims ", layout);
  TORCH_CHECK_VALUE(t.stride(-1) == 1, "dash_attn: ", name, " must have a contiguous last dimension");
  TORCH_CHECK_VALUE(t.scalar_type() == like.scalar_type(), "dash_attn: ", name, " must have dtype ",
                    c10::toString(like.scalar_type()));
  TORCH_CHECK_VALUE(t.get_device() == like.get_device(), "dash_attn: ", name, " is on another device than q");
  // TMA descriptors need 16-byte aligned base addresses and strides.
  TORCH_CHECK_VALUE(dash::aligned16(t.data_ptr(), dims == 4 ? strides_of(t) : packed_strides_of(t),
                                    static_cast<int64_t>(t.element_size())),
                    "dash_attn: ", name, " must be 16-byte aligned (its address and strides in bytes multiples of 16)");
}

// The layouts the kernels take: batched (batch, seqlen, heads, headdim) or packed sequences (total_tokens, heads,
// headdim).
enum class Layout { kBatched, kPacked };

// Each named tensor against q (dtype, device) in `layout`, checked in the list's order.
void check_tensors(Layout layout, const at::Tensor& q,
                   std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  const bool batched = layout == Layout::kBatched;
  for (const auto& [name, t] : tensors) {
    check_tensor(*t, name, q, batched ? 4 : 3,
                 batched ? "(batch, seqlen, heads, headdim)" : "(total_tokens, heads, headdim)");
  }
}

// cu_seqlens_q/k: contiguous int32 (batch + 1,) prefix sums of one length (at least min_entries) on `like`'s device.
// Their values are the caller's to check: dash_attn/validation.py does, on a host copy, or, inside a CUDA graph
// capture, packed_seqlens_ok on the GPU (the kernels clamp every sequence to the packed rows either way:
// common/packed_seqs.h).
void check_cu_seqlens(const at::Tensor& cu_q, const at::Tensor& cu_k, const at::Tensor& like, int64_t min_entries) {
  for (const at::Tensor* t : {&cu_q, &cu_k}) {
    const char* name = t == &cu_q ? "cu_seqlens_q" : "cu_seqlens_k";
    TORCH_CHECK_VALUE(t->is_cuda() && t->get_device() == like.get_device(), "dash_attn: ", name,
                      " must be on q's device");
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() &&
                          t->size(0) >= min_entries,
                      "dash_attn: ", name, " must be a contiguous int32 (batch + 1,) tensor");
  }
  TORCH_CHECK_VALUE(cu_q.size(0) == cu_k.size(0), "dash_attn: cu_seqlens_q and cu_seqlens_k differ in length");
}

// seqused_q/k (optional): contiguous int32 (batch,) tensors on `like`'s device; null when absent.
using OptTensor = std::optional<at::Tensor>;

const int32_t* seqused_data(const OptTensor& used, const char* name, const at::Tensor& cu, const at::Tensor& like) {
  if (!used.has_value()) return nullptr;
  TORCH_CHECK_VALUE(used->is_cuda() && used->get_device() == like.get_device(), "dash_attn: ", name,
                    " must be on q's device");
  TORCH_CHECK_VALUE(used->scalar_type() == at::kInt && used->dim() == 1 && used->is_contiguous() &&
                        used->size(0) == cu.size(0) - 1,
                    "dash_attn: ", name, " must be a contiguous int32 (batch,) tensor");
  return used->data_ptr<int32_t>();
}

dash::PackedSeqs packed_seqs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_q, const at::Tensor& cu_k,
                             const OptTensor& seqused_q, const OptTensor& seqused_k) {
  TORCH_CHECK(packed_built(), "dash_attn: this extension was built without the packed-sequence kernels");
  check_cu_seqlens(cu_q, cu_k, q, 2);
  dash::PackedSeqs packed;
  packed.cu_seqlens_q = cu_q.data_ptr<int32_t>();
  packed.cu_seqlens_k = cu_k.data_ptr<int32_t>();
  packed.total_q = static_cast<int32_t>(q.size(0));
  packed.total_k = static_cast<int32_t>(k.size(0));
  packed.seqused_q = seqused_data(seqused_q, "seqused_q", cu_q, q);
  packed.seqused_k = seqused_data(seqused_k, "seqused_k", cu_k, q);
  return packed;
}

// Learnable sinks: (nheads,) float32 contiguous on q's device, or None. `what` names the tensor in the error.
float* sink_data(const OptTensor& t, const at::Tensor& q, int64_t nheads, const char* what) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 && t->size(0) == nheads &&
                        t->device() == q.device(),
                    "dash_attn: ", what, " must be a contiguous float32 (nheads,) tensor on q's device");
  return t->data_ptr<float>();
}

// The sink and its gradient buffer of a backward: both given or neither.
void set_bwd_sink(dash::BwdParams& p, const OptTensor& sink, const OptTensor& dsink, const at::Tensor& q,
                  int64_t nheads) {
  TORCH_CHECK_VALUE(sink.has_value() == dsink.has_value(), "dash_attn: sink and dsink are given together");
  p.sink = sink_data(sink, q, nheads, "sink");
  p.dsink = sink_data(dsink, q, nheads, "dsink");
}

void check_lse(const at::Tensor& lse) {
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 3,
                    "dash_attn: lse must be a contiguous float32 (batch, nheads, seqlen_q) tensor");
}

// The shape's sizes come from the caller (batched or packed tensors); the rest, and its checks, from here.
dash::AttnShape finish_shape(dash::AttnShape s, const at::Tensor& q, double softmax_scale, int64_t mask,
                             int64_t window_left, int64_t window_right, double softcap) {
  TORCH_CHECK_VALUE(mask >= 0 && mask <= 2, "dash_attn: unknown mask id ", num(mask));
  s.dtype = dtype_of(q);
  s.mask = static_cast<dash::MaskKind>(mask);
  s.window_left = static_cast<int32_t>(window_left);
  s.window_right = static_cast<int32_t>(window_right);
  s.softmax_scale = static_cast<float>(softmax_scale);
  s.softcap = static_cast<float>(softcap);
  TORCH_CHECK_VALUE(dash::kernel_head_dim(s) != 0, "dash_attn: head dims ", num(s.headdim), " (q, k) and ",
                    num(s.headdim_v), " (v) have no kernel: multiples of ", num(dash::kHeadDimMultiple),
                    " up to the largest built head dim");
  TORCH_CHECK_VALUE(dash::heads_grouped(s), "dash_attn: nheads (", num(s.nheads),
                    ") must be divisible by nheads_k (", num(s.nheads_k), ")");
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, "dash_attn: softcap must be finite and >= 0, got ",
                    num(softcap));
  TORCH_CHECK_VALUE(s.softcap == 0.0f || softcap_built(), "dash_attn: softcap > 0 needs the soft-capped kernels, ",
                    "which this extension was built without (DASH_ATTN_SOFTCAP=0)");
  // int32 bounds (-1: unbounded); the diagonal arithmetic adds them to tile offsets, so they stay below 2^30.
  TORCH_CHECK_VALUE(window_left >= -1 && window_left < (int64_t{1} << 30) && window_right >= -1 &&
                        window_right < (int64_t{1} << 30),
                    "dash_attn: window bounds must lie in [-1, 2^30), got (", num(window_left), ", ",
                    num(window_right), ")");
  return s;
}

dash::AttnShape make_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale,
                           int64_t mask, int64_t window_left, int64_t window_right, double softcap) {
  dash::AttnShape s;
  s.batch = static_cast<int32_t>(q.size(0));
  s.seqlen_q = static_cast<int32_t>(q.size(1));
  s.nheads = static_cast<int32_t>(q.size(2));
  s.headdim = static_cast<int32_t>(q.size(3));
  s.headdim_v = static_cast<int32_t>(v.size(3));
  s.seqlen_k = static_cast<int32_t>(k.size(1));
  s.nheads_k = static_cast<int32_t>(k.size(2));
  return finish_shape(s, q, softmax_scale, mask, window_left, window_right, softcap);
}

// Packed sequences: batch sequences of at most max_seqlen_q / max_seqlen_k rows; q's head dim a built kernel's own
// and v's the same (the packed kernels' range, dash_attn/interface.py).
dash::AttnShape make_packed_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_q, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                  double softmax_scale, int64_t mask, int64_t window_left, int64_t window_right,
                                  double softcap) {
  TORCH_CHECK_VALUE(max_seqlen_q > 0 && max_seqlen_k > 0 && max_seqlen_q < (int64_t{1} << 30) &&
                        max_seqlen_k < (int64_t{1} << 30),
                    "dash_attn: max_seqlen_q and max_seqlen_k must lie in [1, 2^30)");
  dash::AttnShape s;
  s.batch = static_cast<int32_t>(cu_q.size(0) - 1);
  s.seqlen_q = static_cast<int32_t>(max_seqlen_q);
  s.seqlen_k = static_cast<int32_t>(max_seqlen_k);
  s.nheads = static_cast<int32_t>(q.size(1));
  s.headdim = static_cast<int32_t>(q.size(2));
  s.headdim_v = static_cast<int32_t>(v.size(2));
  s.nheads_k = static_cast<int32_t>(k.size(1));
  s = finish_shape(s, q, softmax_scale, mask, window_left, window_right, softcap);
  TORCH_CHECK_VALUE(dash::kernel_head_dim(s) == s.headdim && s.headdim_v == s.headdim,
                    "dash_attn: packed sequences need equal q and v head dims that are a built kernel's own");
  return s;
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
  TORCH_CHECK(err == cudaSuccess, "dash_attn: cudaDeviceGetAttribute failed: ", cudaGetErrorString(err));
  return value;
}

// Read at run time on every call: the persistent grids must fit the GPU they actually run on.
int num_sms(int64_t device_index) {
  return device_attribute(cudaDevAttrMultiProcessorCount, static_cast<int>(device_index));
}

void check_device(const at::Tensor& q) {
  int major = device_attribute(cudaDevAttrComputeCapabilityMajor, q.get_device());
  int minor = device_attribute(cudaDevAttrComputeCapabilityMinor, q.get_device());
  TORCH_CHECK(major == 9 && minor == 0, "dash_attn kernels need an sm90 (Hopper) GPU, found sm", num(major),
              num(minor));
}

using StridesOf = dash::TensorStrides (*)(const at::Tensor&);

void set_fwd_tensors(dash::FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     at::Tensor& out, at::Tensor& lse, StridesOf strides) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_stride = strides(q);
  p.k_stride = strides(k);
  p.v_stride = strides(v);
  p.o_stride = strides(out);
  p.num_sms = num_sms(q.get_device());
}

void run_fwd(dash::FwdParams& p, const char* what) {
  int rc = dash_fwd(&p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "dash_attn ", what, " kernel failed (code ", num(rc), ")");
}

void check_schedule_args(int64_t schedule, bool deterministic, int64_t sm_margin) {
  TORCH_CHECK_VALUE(dash::concrete_schedule(schedule), "dash_attn: schedule id ", num(schedule),
                    " is not a concrete schedule (auto is resolved in Python)");
  TORCH_CHECK_VALUE(dash::schedule_runs_in_mode(static_cast<dash::ScheduleKind>(schedule), deterministic),
                    "dash_attn: schedule id ", num(schedule),
                    " (dynamic) has no fixed accumulation order: it runs only with deterministic=False");
  TORCH_CHECK_VALUE(sm_margin >= 0, "dash_attn: sm_margin must be >= 0");
}

void set_bwd_tensors(dash::BwdParams& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                     at::Tensor& dk, at::Tensor& dv, StridesOf strides) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.dout = dout.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.q_stride = strides(q);
  p.k_stride = strides(k);
  p.v_stride = strides(v);
  p.o_stride = strides(out);
  p.do_stride = strides(dout);
  p.dq_stride = strides(dq);
  p.dk_stride = strides(dk);
  p.dv_stride = strides(dv);
}

// The schedule arguments, the workspace and the launch of a backward whose shape and tensors are set.
void run_bwd(dash::BwdParams& p, const at::Tensor& q, bool deterministic, int64_t schedule, int64_t sm_margin,
             const char* what) {
  p.deterministic = deterministic;
  p.schedule = static_cast<dash::ScheduleKind>(schedule);
  p.num_sms = num_sms(q.get_device());
  p.sm_margin = static_cast<int32_t>(sm_margin);
  // The workspace comes from torch's caching allocator so that CUDA-graph capture and stream semantics hold.
  size_t bytes = dash_bwd_workspace_bytes(&p);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = bytes;
  int rc = dash_bwd(&p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, "dash_attn ", what, " kernel failed (code ", num(rc), ")");
}

void fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
         double softmax_scale, int64_t mask, int64_t window_left, int64_t window_right, double softcap,
         const OptTensor& sink) {
  check_tensors(Layout::kBatched, q, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}});
  check_device(q);
  check_lse(lse);
  c10::cuda::CUDAGuard guard(q.device());
  dash::FwdParams p;
  p.shape = make_shape(q, k, v, softmax_scale, mask, window_left, window_right, softcap);
  set_fwd_tensors(p, q, k, v, out, lse, strides_of);
  p.sink = sink_data(sink, q, p.shape.nheads, "sink");
  run_fwd(p, "forward");
}

void bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         double softmax_scale, int64_t mask, int64_t window_left, int64_t window_right, double softcap,
         bool deterministic, int64_t schedule, int64_t sm_margin, const OptTensor& sink, const OptTensor& dsink) {
  check_tensors(Layout::kBatched, q, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}, {"dq", &dq},
                                    {"dk", &dk}, {"dv", &dv}});
  check_device(q);
  check_lse(lse);
  check_schedule_args(schedule, deterministic, sm_margin);
  c10::cuda::CUDAGuard guard(q.device());
  dash::BwdParams p;
  p.shape = make_shape(q, k, v, softmax_scale, mask, window_left, window_right, softcap);
  set_bwd_tensors(p, dout, q, k, v, out, lse, dq, dk, dv, strides_of);
  set_bwd_sink(p, sink, dsink, q, p.shape.nheads);
  run_bwd(p, q, deterministic, schedule, sm_margin, "backward");
}

void check_packed_lse(const at::Tensor& lse, const at::Tensor& q) {
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 &&
                        lse.size(0) == q.size(1) && lse.size(1) == q.size(0) && lse.is_cuda(),
                    "dash_attn: lse must be a contiguous float32 CUDA (nheads, total_q) tensor");
}

// What a packed-sequence call of either direction checks and sets before its tensors: the device, lse (nheads,
// total_q), the shape and the sequences.
template <class Params>
void set_packed_call(Params& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lse,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const OptTensor& seqused_q,
                     const OptTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                     int64_t mask, int64_t window_left, int64_t window_right, double softcap) {
  check_device(q);
  check_packed_lse(lse, q);
  p.shape = make_packed_shape(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale, mask, window_left,
                              window_right, softcap);
  p.packed = packed_seqs(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k);
}

void varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const OptTensor& seqused_q,
                const OptTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                int64_t mask, int64_t window_left, int64_t window_right, double softcap, const OptTensor& sink) {
  check_tensors(Layout::kPacked, q, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}});
  dash::FwdParams p;
  set_packed_call(p, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, mask, window_left, window_right, softcap);
  c10::cuda::CUDAGuard guard(q.device());
  set_fwd_tensors(p, q, k, v, out, lse, packed_strides_of);
  p.sink = sink_data(sink, q, p.shape.nheads, "sink");
  run_fwd(p, "packed forward");
}

void varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const OptTensor& seqused_q,
                const OptTensor& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                int64_t mask, int64_t window_left, int64_t window_right, double softcap, bool deterministic,
                int64_t schedule, int64_t short_k, int64_t sm_margin, const OptTensor& sink,
                const OptTensor& dsink) {
  check_tensors(Layout::kPacked, q, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}, {"dq", &dq},
                                    {"dk", &dk}, {"dv", &dv}});
  dash::BwdParams p;
  set_packed_call(p, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, mask, window_left, window_right, softcap);
  check_schedule_args(schedule, deterministic, sm_margin);
  TORCH_CHECK_VALUE(short_k >= 0 && short_k <= INT32_MAX, "dash_attn: short_k must be in [0, 2^31 - 1], got ",
                    num(short_k));
  p.seq_short_k = static_cast<int32_t>(short_k);
  c10::cuda::CUDAGuard guard(q.device());
  set_bwd_tensors(p, dout, q, k, v, out, lse, dq, dk, dv, packed_strides_of);
  set_bwd_sink(p, sink, dsink, q, p.shape.nheads);
  run_bwd(p, q, deterministic, schedule, sm_margin, "packed backward");
}

// A device flag (int32 scalar, 1 = valid) for cu_seqlens_q/k of a packed call the host did not check: the kernels
// and the rule of common/seqlens_check.h. left/right_bounded: the mask's band has that bound.
at::Tensor packed_seqlens_ok(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, const OptTensor& seqused_q,
                             const OptTensor& seqused_k, int64_t total_q, int64_t total_k, int64_t max_q,
                             int64_t max_k, bool left_bounded, bool right_bounded) {
  TORCH_CHECK_VALUE(cu_seqlens_q.is_cuda(), "dash_attn: cu_seqlens_q must be a CUDA tensor");
  check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q, 1);
  for (int64_t value : {total_q, total_k, max_q, max_k}) {
    TORCH_CHECK_VALUE(value >= 0 && value <= INT32_MAX, "dash_attn: packed lengths must lie in [0, 2^31)");
  }
  c10::cuda::CUDAGuard guard(cu_seqlens_q.device());
  at::Tensor ok = at::empty({}, cu_seqlens_q.options());
  dash::SeqlensCheck check;
  check.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  check.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
  check.seqused_q = seqused_data(seqused_q, "seqused_q", cu_seqlens_q, cu_seqlens_q);
  check.seqused_k = seqused_data(seqused_k, "seqused_k", cu_seqlens_k, cu_seqlens_q);
  check.batch = static_cast<int32_t>(cu_seqlens_q.size(0) - 1);
  check.total_q = static_cast<int32_t>(total_q);
  check.total_k = static_cast<int32_t>(total_k);
  check.max_q = static_cast<int32_t>(max_q);
  check.max_k = static_cast<int32_t>(max_k);
  check.left_bounded = left_bounded;
  check.right_bounded = right_bounded;
  check.ok = ok.data_ptr<int32_t>();
  const int err = dash_check_seqlens(&check, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "dash_attn: cu_seqlens check launch failed: ", cudaGetErrorString(cudaError_t(err)));
  return ok;
}

// Every element of `results` becomes NaN on the GPU unless the flag of packed_seqlens_ok says valid.
void poison_unless_ok(const at::Tensor& ok, const std::vector<at::Tensor>& results) {
  TORCH_CHECK_VALUE(ok.is_cuda() && ok.scalar_type() == at::kInt && ok.numel() == 1,
                    "dash_attn: ok must be the int32 CUDA flag of packed_seqlens_ok");
  TORCH_CHECK_VALUE(results.size() <= static_cast<size_t>(dash::kMaxPoisonTargets), "dash_attn: at most ",
                    dash::kMaxPoisonTargets, " results per call");
  dash::PoisonTargets targets;
  for (const at::Tensor& t : results) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == ok.get_device(), "dash_attn: results must be on ok's device");
    // Dense and non-overlapping: the elements fill numel() words from data_ptr() in some order.
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), "dash_attn: results must be dense");
    dash::PoisonTarget& target = targets.targets[targets.count++];
    target.data = t.data_ptr();
    target.words = t.numel();
    if (t.scalar_type() == at::kFloat) {
      target.word_bytes = 4;
      target.nan_bits = 0x7fc00000u;
    } else if (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) {
      target.word_bytes = 2;
      target.nan_bits = t.scalar_type() == at::kBFloat16 ? 0x7fc0u : 0x7e00u;
    } else {
      TORCH_CHECK_VALUE(false, "dash_attn: results must be float32, bfloat16 or float16");
    }
  }
  targets.ok = ok.data_ptr<int32_t>();
  c10::cuda::CUDAGuard guard(ok.device());
  const int err = dash_poison_unless_ok(&targets, num_sms(ok.get_device()), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "dash_attn: result poisoning launch failed: ", cudaGetErrorString(cudaError_t(err)));
}

// Each KV head's dK/dV shares of a backward run on copies of the KV heads (dash_attn/_kv_heads.py), summed in one pass:
// outs[i] (..., heads_k, dim) = the sum of ins[i] (..., heads_k * copies, dim) over each KV head's copies, in
// sum_groups' order. Returns false, launching nothing, where the kernel does not take the call (a copy count without
// a kernel, an odd head dim, a layout it cannot address); the caller then sums in torch ops, with the same bits.
bool sum_kv_heads(const std::vector<at::Tensor>& ins, const std::vector<at::Tensor>& outs, int64_t copies) {
  TORCH_CHECK_VALUE(!ins.empty() && ins.size() == outs.size() && ins.size() <= size_t(dash::kMaxKvHeadSums),
                    "dash_attn: sum_kv_heads takes one to ", num(dash::kMaxKvHeadSums), " (in, out) pairs");
  if (copies < 2 || copies > INT32_MAX || !dash_kv_head_sum_supported(static_cast<int32_t>(copies))) return false;
  dash::KvHeadSums sums;
  sums.copies = static_cast<int32_t>(copies);
  sums.bfloat16 = ins[0].scalar_type() == at::kBFloat16;
  for (size_t i = 0; i < ins.size(); ++i) {
    const at::Tensor &in = ins[i], &out = outs[i];
    TORCH_CHECK_VALUE(in.is_cuda() && out.is_cuda() && in.get_device() == ins[0].get_device() &&
                          out.get_device() == ins[0].get_device(),
                      "dash_attn: sum_kv_heads tensors must be on one CUDA device");
    TORCH_CHECK_VALUE((in.scalar_type() == at::kBFloat16 || in.scalar_type() == at::kHalf) &&
                          in.scalar_type() == ins[0].scalar_type() && out.scalar_type() == in.scalar_type(),
                      "dash_attn: sum_kv_heads takes bfloat16 or float16 tensors of one dtype");
    const int64_t nd = in.dim();
    TORCH_CHECK_VALUE(nd >= 2 && out.dim() == nd && in.size(-2) == out.size(-2) * copies &&
                          in.size(-1) == out.size(-1),
                      "dash_attn: sum_kv_heads needs in (..., heads_k * copies, dim) and out (..., heads_k, dim)");
    int64_t rows = 1;
    for (int64_t d = 0; d + 2 < nd; ++d) {
      TORCH_CHECK_VALUE(in.size(d) == out.size(d), "dash_attn: sum_kv_heads in and out differ in their leading dims");
      rows *= in.size(d);
    }
    // out's leading dims must merge into one row stride (dense within them); every pair of elements 4-byte aligned.
    const int64_t row_stride = nd > 2 ? out.stride(nd - 3) : 0;
    for (int64_t d = nd - 4; d >= 0; --d) {
      if (out.size(d) > 1 && out.stride(d) != out.stride(d + 1) * out.size(d + 1)) return false;
    }
    const int64_t dim = in.size(-1);
    if (!in.is_contiguous() || out.stride(-1) != 1 || dim % 2 != 0 || row_stride % 2 != 0 ||
        out.stride(-2) % 2 != 0 || reinterpret_cast<uintptr_t>(in.data_ptr()) % 4 != 0 ||
        reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 != 0 || dim > INT32_MAX || out.size(-2) > INT32_MAX) {
      return false;
    }
    dash::KvHeadSum& sum = sums.sums[sums.count++];
    sum.in = in.data_ptr();
    sum.out = out.data_ptr();
    sum.rows = rows;
    sum.out_row_stride = row_stride;
    sum.out_head_stride = out.stride(-2);
    sum.heads_k = static_cast<int32_t>(out.size(-2));
    sum.dim = static_cast<int32_t>(dim);
  }
  c10::cuda::CUDAGuard guard(ins[0].device());
  const int err =
      dash_sum_kv_heads(&sums, num_sms(ins[0].get_device()), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "dash_attn: KV-head sum launch failed: ", cudaGetErrorString(cudaError_t(err)));
  return true;
}

std::vector<int64_t> supported_head_dims() {
  std::vector<int64_t> dims;
  for (int32_t h : dash::kBuiltHeadDims) {
    if (h != 0) dims.push_back(h);
  }
  return dims;
}

std::pair<int64_t, int64_t> bwd_tile_shape(int64_t headdim, int64_t mask) {
  int32_t block_m = 0, block_n = 0;
  dash_bwd_tile_shape(static_cast<int32_t>(headdim), static_cast<int32_t>(mask), &block_m, &block_n);
  return {block_m, block_n};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dash_attn Hopper kernels (use dash_attn.flash_attn_func, not these entry points)";
  m.def("fwd", &fwd, "forward: writes out and lse in place");
  m.def("bwd", &bwd, "backward: writes dq, dk, dv in place");
  m.def("supported_head_dims", &supported_head_dims);
  m.def("softcap_built", &softcap_built);
  m.def("supported_dtypes", &supported_dtypes);
  m.def("packed_built", &packed_built);
  m.def("varlen_fwd", &varlen_fwd, "packed-sequence forward: writes out and lse (nheads, total_q) in place");
  m.def("varlen_bwd", &varlen_bwd, "packed-sequence backward: writes dq, dk, dv in place");
  m.def("packed_seqlens_ok", &packed_seqlens_ok, "cu_seqlens of a packed call checked on the GPU: int32 flag");
  m.def("poison_unless_ok", &poison_unless_ok, "results set to NaN on the GPU unless the flag says valid");
  m.def("sum_kv_heads", &sum_kv_heads, "dK/dV of a backward run as MHA summed per KV head; false: not launched");
  m.def("bwd_tile_shape", &bwd_tile_shape);
  m.def("num_sms", &num_sms);
}
