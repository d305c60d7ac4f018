// Producer warp of the sm90 backward: the TMA load loop that feeds the consumers' pipeline in the schedule's order.
#pragma once
#include "bwd/bwd_storage.h"

namespace dash::bwd {

// ----------------------------------------------------------------------------------------------------------------
// Producer warp: walks the schedule; per KV tile loads K_j, V_j once, per visit loads Q_i, dO_i, LSE_i, D_i into
// the next stage together with the visit's record. Tiles without visits and the end of the work travel as records
// without data. Runs ahead of the consumers by up to kStages steps; the empty barriers throttle it.
// The 32 lanes evaluate 32 visits of the schedule at once (integer arithmetic with divisions, slow on one thread);
// lane 0 issues the barriers and copies in visit order.
//
// Registers: the warpgroup runs with BwdThreads::kProducerRegs (24) per thread, and the schedule evaluation needs
// most of them. The warp-uniform loop state (item index, current tile, its visit count) is therefore kept one word
// per lane in a single register and read back with __shfl_sync where needed, instead of occupying seven registers
// of every lane across the evaluation.
template <class T>
struct ProducerWarp {
  BwdKernelParams<T> const& p;
  BwdSharedStorage<T>& ss;
  // Lane w holds word w of the loop state. Word kPipe is the leader's own: its pipeline position, bit 0 the parity
  // of the KV tiles loaded so far, the bits above the count of Q stages claimed (wrapping at 2^31, a multiple of
  // 2 * kStages, so stage and phase stay continuous). All words start at 0.
  static_assert(T::kStages == 1 || T::kStages == 2, "the packed stage count needs 2 * kStages to divide 2^31");
  // Packed sequences (SeqLayout::kPacked) add the sequence's first rows, its number of Q tiles and the steps of the
  // current tile's first and last visit that have rows (the tile's kFirst and kLast).
  // kStepLo and kStepEnd: the item's steps [lo, end) (ScheduleRef::item_steps), kPiece whether that is not all of the
  // tile's.
  enum Word : int { kPipe = 0, kItemLo, kItemHi, kStepLo, kStepEnd, kPiece, kBatch, kHeadK, kNBlock, kRowQ, kRowK,
                    kLiveM, kFirstLive, kLastLive };
  uint32_t state = 0;

  // Special registers read through volatile asm where they are used: nothing keeps them live across the loop.
  CUTLASS_DEVICE static int32_t lane_id() {
    uint32_t l;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
    return static_cast<int32_t>(l);
  }
  CUTLASS_DEVICE static int32_t cta_index() {
    uint32_t c;
    asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(c));
    return static_cast<int32_t>(c);
  }
  CUTLASS_DEVICE uint32_t word(int w) const { return __shfl_sync(0xffffffffu, state, w); }  // the whole warp, converged
  CUTLASS_DEVICE void set_word(int w, uint32_t v) {  // v: the same on every lane
    if (lane_id() == w) state = v;
  }
  CUTLASS_DEVICE int64_t item_index() const {
    return static_cast<int64_t>((uint64_t(word(kItemHi)) << 32) | word(kItemLo));
  }
  CUTLASS_DEVICE KvTileRef current_tile() const {
    return KvTileRef{static_cast<int32_t>(word(kBatch)), static_cast<int32_t>(word(kHeadK)),
                     static_cast<int32_t>(word(kNBlock))};
  }

  // Leader only: claims the next stage and publishes its record; the caller then issues the stage's loads (if any).
  template <class Record>
  CUTLASS_DEVICE int next_stage(const Record& rec, uint32_t tx_bytes) {
    const RingPos pos = ring_pos<T::kStages>(state >> 1);
    const int stage = pos.index;
    state += 2;
    wait_barrier(ss.q_empty[stage], pos.phase ^ 1, WaitSite::kQEmpty);
    ss.rec[stage] = VisitRecordOf<T>{rec};  // published by the arrive below (mbarrier arrive has release semantics)
    reinterpret_cast<TxBarrier&>(ss.q_full[stage]).arrive_and_expect_tx(tx_bytes);
    return stage;
  }

  // Claimed units: the next unclaimed unit (its launch index) of the call's counter, whichever CTA is free first; its
  // first item is the item index from here on (units of `items` items each).
  CUTLASS_DEVICE void claim_unit(unsigned long long items) {
    unsigned long long claimed = 0;
    if (lane_id() == 0) claimed = atomicAdd(p.unit_counter, 1ull);
    claimed = __shfl_sync(0xffffffffu, claimed, 0) * items;
    set_word(kItemLo, static_cast<uint32_t>(claimed));
    set_word(kItemHi, static_cast<uint32_t>(claimed >> 32));
  }

  // The next item of phase kPhase: its tile's words set and its K/V loaded (or an empty tile's record sent); false at
  // the end of the phase's items.
  template <ItemPhase kPhase>
  CUTLASS_DEVICE bool start_item() {
    // ScheduleKind::kDynamic: a unit is one item. shift_causal_runs' units and the sequence table's: two, claimed at
    // the first.
    if constexpr (ScheduleRef::claims_units<T>() || ScheduleRef::takes_seq_table<T>()) {
      if (p.sched.template dynamic<T>()) claim_unit(1);
      if (p.sched.template claims_item_pairs<T>() && (word(kItemLo) & 1) == 0) claim_unit(2);
    }
    const int64_t it = item_index();
    if (it >= p.sched.template num_items<T, kPhase>(cta_index())) return false;
    const KvTileRef tile = p.sched.template item<T, kPhase>(cta_index(), it);
    int32_t nv = p.sched.template num_visits<T>(tile);
    // Packed sequences are scheduled as a batch of the longest one. A visit to a Q tile past the sequence's end
    // is skipped; all visits to such a tile are, so the dQ chains of the other tiles keep their turns. Visits of
    // a KV tile past the end to a Q tile inside still run (all keys masked, dQ += 0): they hold turns in those
    // chains. A KV tile left without visits stores the zero dK/dV of a tile no query sees inside the sequence, and
    // nothing past its end.
    bool skip_tile = false;
    [[maybe_unused]] int32_t len_k = 0;  // packed sequences: the sequence's keys
    if constexpr (T::kPacked) {
      const SeqRows rows = seq_rows<SeqLayout::kPacked>(p.packed, tile.batch, 0, 0);
      const int32_t live_m = (rows.len_q + T::kBlockM - 1) / T::kBlockM;
      int32_t first_live = -1, last_live = -1;
      // A sequence-table tile is scheduled on its own sequence's geometry: all its visits have rows.
      const bool own_geometry = p.sched.template claims_seq_units<T>();
      if (own_geometry && nv > 0) {
        first_live = 0;
        last_live = nv - 1;
      }
      for (int32_t t0 = 0; !own_geometry && t0 < nv; t0 += 32) {
        const int32_t step = t0 + lane_id();
        const bool live = step < nv && p.sched.template visit<T>(cta_index(), it, tile, step).m_block < live_m;
        const uint32_t mask = __ballot_sync(0xffffffffu, live);
        if (mask != 0) {
          if (first_live < 0) first_live = t0 + __ffs(mask) - 1;
          last_live = t0 + 31 - __clz(mask);
        }
      }
      set_word(kRowQ, rows.first_q);
      set_word(kRowK, rows.first_k);
      set_word(kLiveM, live_m);
      set_word(kFirstLive, first_live);
      set_word(kLastLive, last_live);
      len_k = rows.len_k;
      if (last_live < 0) {
        skip_tile = tile.n_block * T::kBlockN >= rows.len_k;
        nv = 0;
      }
    } else if constexpr (ScheduleRef::claims_units<T>()) {
      // The second item of a claimed middle unit (ShiftCausalRuns::claimed_item) lies past the last KV tile: no
      // visits, no dK/dV rows.
      skip_tile = nv == 0 && tile.n_block * T::kBlockN >= p.sched.problem.seqlen_k;
    }
    const sched::StepRange steps = p.sched.template item_steps<kPhase>(cta_index(), it, nv);
    set_word(kStepLo, steps.lo);
    set_word(kStepEnd, steps.hi);
    set_word(kPiece, steps.lo > 0 || steps.hi < nv ? VisitRecord::kPiece : 0);
    set_word(kBatch, tile.batch);
    set_word(kHeadK, tile.head_k);
    set_word(kNBlock, tile.n_block);
    const int32_t row_k = T::kPacked ? static_cast<int32_t>(word(kRowK)) : 0;
    if (lane_id() == 0 && !skip_tile) {
      if (nv == 0) {
        const VisitRecord rec{tile.batch, tile.head_k, tile.n_block, 0, 0, 0, VisitRecord::kEmptyTile};
        if constexpr (T::kPacked) {
          next_stage(PackedVisitRecord{rec, row_k, len_k}, 0);
        } else {
          next_stage(rec, 0);
        }
      } else {
        load_kv(tile, row_k);
      }
    }
    __syncwarp();
    return true;
  }

  // Leader only: K and V of `tile` into their buffers, once the consumers are done with the previous tile's.
  CUTLASS_DEVICE void load_kv(const KvTileRef& tile, int32_t row_k) {
    Tensor mK = p.tma_k.get_tma_tensor(p.shape_k);
    Tensor mV = p.tma_v.get_tma_tensor(p.shape_k);
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
    wait_barrier(ss.kv_empty, (state & 1) ^ 1, WaitSite::kKvEmpty);
    reinterpret_cast<TxBarrier&>(ss.kv_full).arrive_and_expect_tx(2 * T::kKBytes);
    using KvTileShape = Shape<typename T::BN, typename T::HD>;
    Tensor gK = local_tile(sequence_of<T::kLayout>(mK, tile.head_k, tile.batch, row_k), KvTileShape{},
                           make_coord(tile.n_block, _0{}));
    Tensor gV = local_tile(sequence_of<T::kLayout>(mV, tile.head_k, tile.batch, row_k), KvTileShape{},
                           make_coord(tile.n_block, _0{}));
    auto [tKgK, tKsK] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    // L2 hints: K/V are read by this CTA alone; Q, dO and the dQ accumulator (bwd_dq_writer.h) by every CTA of the
    // head, so they should outlive K/V in L2.
    copy(p.tma_k.with(ss.kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tKgK, tKsK);
    copy(p.tma_v.with(ss.kv_full, 0, TMA::CacheHintSm90::EVICT_FIRST), tVgV, tVsV);
    state ^= 1;
  }

  // The current item's visits, 32 evaluated at once by the lanes: each visit's record, and its Q, dO and statistics
  // loaded into its stage by the leader.
  template <ItemPhase kPhase>
  CUTLASS_DEVICE void load_visits() {
    Tensor mQ = p.tma_q.get_tma_tensor(p.shape_q);
    Tensor mdO = p.tma_do.get_tma_tensor(p.shape_q);
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
    for (int32_t t0 = static_cast<int32_t>(word(kStepLo)); t0 < static_cast<int32_t>(word(kStepEnd)); t0 += 32) {
      VisitRef mine{0, 0, 0};
      {
        const int32_t step = t0 + lane_id();
        const int32_t end = static_cast<int32_t>(word(kStepEnd));
        const KvTileRef tile = current_tile();
        const int64_t it = item_index();
        if (step < end) mine = p.sched.template visit<T, kPhase>(cta_index(), it, tile, step);
      }
      const int32_t end = static_cast<int32_t>(word(kStepEnd));
#pragma unroll 1
      for (int32_t j = 0; j < min(32, end - t0); ++j) {
        const int32_t head = __shfl_sync(0xffffffffu, mine.head, j);
        const int32_t m_block = __shfl_sync(0xffffffffu, mine.m_block, j);
        // The run (schedule/runs.h) rides in bit 30 of the wait target: one shuffle for both (targets < 2^30).
        const int32_t target_run = __shfl_sync(0xffffffffu, mine.wait_target | (mine.run << 30), j);
        const int32_t wait_target = target_run & ((1 << 30) - 1);
        const KvTileRef tile = current_tile();
        const int32_t t = t0 + j;
        // Packed sequences: the tile's first and last visits with rows carry kFirst and kLast.
        const int32_t first_t = static_cast<int32_t>(word(T::kPacked ? kFirstLive : kStepLo));
        const int32_t last_t = T::kPacked ? static_cast<int32_t>(word(kLastLive)) : end - 1;
        const bool skip = T::kPacked && m_block >= static_cast<int32_t>(word(kLiveM));
        const int32_t row_q = T::kPacked ? static_cast<int32_t>(word(kRowQ)) : 0;
        const int32_t piece = static_cast<int32_t>(word(kPiece));
        // Every word() is a whole-warp shuffle: all of them above this point, where the warp is converged.
        if (lane_id() != 0 || skip) continue;
        const int32_t flags = (t == first_t ? VisitRecord::kFirst : 0) | (t == last_t ? VisitRecord::kLast : 0) | piece |
                              ((target_run >> 30) != 0 ? VisitRecord::kRun1 : 0);
        // kDynamic elects each dQ tile's first add as the visit is loaded (not when the lanes evaluate 32 steps
        // ahead, which would give a tile's later Q tiles to whoever evaluated them first): the first visit loaded
        // stores (wait target 0), every later one adds after that store (bwd_dq_writer.h). A CTA loads its visits in
        // its execution order, so every add waits only for an earlier election: no cycle, whatever the claims. The
        // atomic's latency overlaps next_stage's wait for the stage.
        int32_t target = wait_target;
        if constexpr (ScheduleRef::claims_units<T>()) {
          if (p.sched.template dynamic<T>()) {
            const int64_t tile_index = q_tile_index(tile.batch, head, get<2>(p.shape_q), p.num_m_blocks, m_block);
            target = atomicAdd(p.dq_claims + tile_index, 1) == 0 ? 0 : 1;
          }
        }
        const int stage = next_stage(
            VisitRecord{tile.batch, tile.head_k, tile.n_block, head, m_block, target, flags},
            2 * T::kQBytes + (T::kGemmStats ? T::kGemmStatBytes : 2 * T::kRowStatBytes));
        using QTileShape = Shape<typename T::BM, typename T::HD>;
        Tensor gQ = local_tile(sequence_of<T::kLayout>(mQ, head, tile.batch, row_q), QTileShape{},
                               make_coord(m_block, _0{}));
        Tensor gdO = local_tile(sequence_of<T::kLayout>(mdO, head, tile.batch, row_q), QTileShape{},
                                make_coord(m_block, _0{}));
        Tensor sQs = sQ(_, _, stage);
        Tensor sdOs = sdO(_, _, stage);
        auto [tQgQ, tQsQ] =
            tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQs), group_modes<0, 2>(gQ));
        auto [tOgO, tOsO] =
            tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdOs), group_modes<0, 2>(gdO));
        copy(p.tma_q.with(ss.q_full[stage], 0, TMA::CacheHintSm90::EVICT_LAST), tQgQ, tQsQ);
        copy(p.tma_do.with(ss.q_full[stage], 0, TMA::CacheHintSm90::EVICT_LAST), tOgO, tOsO);
        const int64_t row0 = (int64_t(tile.batch) * get<2>(p.shape_q) + head) * p.seqlen_q_rounded +
                             int64_t(m_block) * T::kBlockM;
        if constexpr (T::kGemmStats) {
          SM90_BULK_COPY_G2S::copy(p.gemm_stats + row0 * (kGemmStatRowBytes / 2), &ss.q_full[stage],
                                   ss.gemm_stats[stage], T::kGemmStatBytes);
        } else {
          SM90_BULK_COPY_G2S::copy(p.lse_log2 + row0, &ss.q_full[stage], ss.lse[stage], T::kRowStatBytes);
          SM90_BULK_COPY_G2S::copy(p.dsum + row0, &ss.q_full[stage], ss.dsum[stage], T::kRowStatBytes);
        }
      }
      __syncwarp();
    }
  }

  CUTLASS_DEVICE void next_item() {
    const uint64_t next = static_cast<uint64_t>(item_index()) + 1;
    set_word(kItemLo, static_cast<uint32_t>(next));
    set_word(kItemHi, static_cast<uint32_t>(next >> 32));
  }
};

template <class T>
CUTLASS_DEVICE void producer_loop(BwdKernelParams<T> const& p, BwdSharedStorage<T>& ss) {
  ProducerWarp<T> warp{p, ss};
  while (warp.template start_item<ItemPhase::kWhole>()) {
    warp.template load_visits<ItemPhase::kWhole>();
    warp.next_item();
  }
  if constexpr (ScheduleRef::splits_tail<T>()) {
    while (warp.template start_item<ItemPhase::kTail>()) {
      warp.template load_visits<ItemPhase::kTail>();
      warp.next_item();
    }
  }
  if (ProducerWarp<T>::lane_id() == 0) warp.next_stage(VisitRecord{0, 0, 0, 0, 0, 0, VisitRecord::kEnd}, 0);
}

}  // namespace dash::bwd
