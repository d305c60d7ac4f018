// The rows of one sequence of a call in either sequence layout (common/params.h: PackedSeqs, SeqLayout), as the
// kernels of both directions see them.
#pragma once
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "common/params.h"

namespace dash {

// Sequence `batch`: its first row in the packed q-side and k-side tensors (0 in the batched layout, where the batch
// index addresses it) and its lengths.
struct SeqRows {
  int32_t first_q, len_q;
  int32_t first_k, len_k;
};

// The lengths of one sequence, named as the kernels' parameter structs name the batched call's lengths, so that the
// mask arithmetic takes either (the batched kernels pass their parameters themselves and keep their code).
struct SeqLens {
  int32_t seqlen_q;
  int32_t seqlen_k;
};

// cu_seqlens is read as [first, end) clamped to the packed tensor's rows: a call whose prefix sums the host never saw
// (a captured CUDA graph replays whatever they hold) cannot make a kernel read or write outside its tensors. Valid
// prefix sums pass unchanged; the Python layer flags invalid ones in the results (NaN), since a kernel cannot raise.
// seqused (may be null) shortens the sequence to its rows in use, clamped the same way.
CUTLASS_DEVICE void clamped_rows(const int32_t* cu_seqlens, const int32_t* seqused, int batch, int32_t total,
                                 int32_t& first, int32_t& len) {
  first = min(max(__ldg(cu_seqlens + batch), 0), total);
  len = min(max(__ldg(cu_seqlens + batch + 1), first), total) - first;
  if (seqused != nullptr) len = min(len, max(__ldg(seqused + batch), 0));
}

template <SeqLayout kLayout>
CUTLASS_DEVICE SeqRows seq_rows(PackedSeqs const& packed, int batch, int seqlen_q, int seqlen_k) {
  if constexpr (kLayout == SeqLayout::kPacked) {
    SeqRows rows;
    clamped_rows(packed.cu_seqlens_q, packed.seqused_q, batch, packed.total_q, rows.first_q, rows.len_q);
    clamped_rows(packed.cu_seqlens_k, packed.seqused_k, batch, packed.total_k, rows.first_k, rows.len_k);
    return rows;
  } else {
    return {0, seqlen_q, 0, seqlen_k};
  }
}

// One head of one sequence of a (rows, d, heads, batch) tensor (TMA coordinates included) as (rows, d): the batch
// entry `batch`, or, packed, the one batch entry from the sequence's first row on.
template <SeqLayout kLayout, class GlobalTensor>
CUTLASS_DEVICE auto sequence_of(GlobalTensor const& m, int head, int batch, int32_t first_row) {
  using namespace cute;
  if constexpr (kLayout == SeqLayout::kPacked) {
    return domain_offset(make_coord(first_row, _0{}), m(_, _, head, 0));
  } else {
    return m(_, _, head, batch);
  }
}

}  // namespace dash
