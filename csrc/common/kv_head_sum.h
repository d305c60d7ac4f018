// dK and dV of a GQA backward that ran on copies of each KV head (dash_attn/_kv_heads.py): the kernels wrote one share
// per copy in the input dtype, `copies` consecutive heads per KV head; here each KV head's shares are added in float32
// and rounded once, in one pass over the shares. The order of the adds is _kv_heads.sum_groups' (the second half of
// the shares added to the first, elementwise, until one is left), so the bits are that function's on the same shares
// and depend on the values alone, never on the shape of the call.
#pragma once
#include <cstdint>

namespace dash {

// One sum: `in` holds rows x (heads_k * copies) x dim elements, contiguous; `out` rows x heads_k x dim with its own
// row and head strides (in elements) and unit column stride. dim is even and both pointers 4-byte aligned (two
// elements per load).
struct KvHeadSum {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t rows = 0;
  int64_t out_row_stride = 0, out_head_stride = 0;
  int32_t heads_k = 0, dim = 0;
};

// dK and dV of one call: one launch for both.
constexpr int kMaxKvHeadSums = 2;

struct KvHeadSums {
  KvHeadSum sums[kMaxKvHeadSums];
  int32_t count = 0;
  int32_t copies = 0;     // shares per KV head, the same for every sum
  bool bfloat16 = false;  // else float16
};

}  // namespace dash

extern "C" {
// Whether dash_sum_kv_heads has a kernel for this number of copies (each is its own, fully unrolled kernel).
bool dash_kv_head_sum_supported(int32_t copies);
// Returns a cudaError_t as int (0: launched).
int dash_sum_kv_heads(const dash::KvHeadSums* sums, int32_t num_sms, void* stream);
}
