"""The backward producer's walk, as the batched kernels take it from csrc/bwd/bwd_tile_scheduler.h (ScheduleRef,
compiled here for the host), equals the schedule engine's plan (dash_attn.schedule.plan, on which the invariance and
deadlock proofs run): the same items, steps and visits on every CTA, for full, causal and window masks, shift's split
tail included. The walk below mirrors bwd_producer.h's producer_loop: the whole waves (ItemPhase::kWhole), then the
tail's items (ItemPhase::kTail). Units claimed at run time: shift_causal_runs' in the causal kernels, whose walk (item k
of the claim order, whichever CTA claims it) must hold the plan's visits unit by unit; not here: dynamic's claims
(no fixed order) and the packed kernels' sequence table."""
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from dash_attn import schedule, schedules_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("cta", "item", "step", "batch", "head", "head_k", "n_block", "m_block", "wait_target", "run")
# The statically laid-out schedules each mask's kernels run (window kernels run descending_lanes as descending: the
# same orders on another layout, so the plan's layout differs and it is left out there).
SCHEDULES = {"full": ("shift", "shift_runs", "descending_lanes", "descending", "spt"),
             "causal": ("shift_causal", "shift_causal_runs", "descending_lanes", "descending", "spt", "ascending"),
             "window": ("descending", "spt", "ascending", "shift", "shift_runs")}
WINDOWS = {"full": (-1, -1), "causal": (-1, 0), "window": (300, 40)}
# batch, nheads, nheads_k, seqlen_q, seqlen_k: ragged tiles, GQA, seqlen_q != seqlen_k both ways.
SHAPES = [(2, 4, 4, 1000, 1000), (3, 8, 2, 700, 900), (5, 3, 1, 333, 1500), (4, 8, 8, 4096, 512)]
CTAS = [1, 7, 32, 132]

WALK = r"""
#include <cstdio>
#include "bwd/bwd_tile_scheduler.h"
using namespace dash;
using namespace dash::bwd;
template <MaskKind M, int BM, int BN>
struct Batched {
  static constexpr MaskKind kMask = M;
  static constexpr int kBlockM = BM, kBlockN = BN;
  static constexpr bool kPacked = false;
};
template <class F, ItemPhase kPhase>
int64_t walk_phase(const ScheduleRef& s, int32_t cta, int64_t k) {
  for (; k < s.template num_items<F, kPhase>(cta); ++k) {
    const KvTileRef t = s.template item<F, kPhase>(cta, k);
    const int32_t nv = s.template num_visits<F>(t);
    const sched::StepRange r = s.template item_steps<kPhase>(cta, k, nv);
    for (int32_t step = r.lo; step < r.hi; ++step) {
      const VisitRef v = s.template visit<F, kPhase>(cta, k, t, step);
      std::printf("%d %lld %d %d %d %d %d %d %d %d\n", cta, (long long)k, step, t.batch, v.head, t.head_k, t.n_block,
                  v.m_block, v.wait_target, v.run);
    }
  }
  return k;
}
template <MaskKind M, int BM, int BN>
void walk(sched::Problem p, ScheduleKind kind) {
  using F = Batched<M, BM, BN>;
  const ScheduleRef s(p, kind);
  // Claimed units: every CTA sees the one claim order, walked once here.
  const int32_t ctas = s.template claims_runs_units<F>() ? 1 : p.num_ctas;
  for (int32_t cta = 0; cta < ctas; ++cta) {
    const int64_t k = walk_phase<F, ItemPhase::kWhole>(s, cta, 0);
    if constexpr (ScheduleRef::splits_tail<F>()) walk_phase<F, ItemPhase::kTail>(s, cta, k);
  }
}
template <MaskKind M>
bool walk_tiles(const sched::Problem& p, ScheduleKind kind) {
  if (p.block_m == 64 && p.block_n == 128) return walk<M, 64, 128>(p, kind), true;
  if (p.block_m == 128 && p.block_n == 128) return walk<M, 128, 128>(p, kind), true;
  if (p.block_m == 64 && p.block_n == 64) return walk<M, 64, 64>(p, kind), true;
  return false;
}
int main() {
  int b, h, hk, sq, sk, bm, bn, c, kind, mask, left, right;
  while (std::scanf("%d %d %d %d %d %d %d %d %d %d %d %d", &b, &h, &hk, &sq, &sk, &bm, &bn, &c, &kind, &mask, &left,
                    &right) == 12) {
    const sched::Problem p{b, h, hk, sq, sk, bm, bn, MaskKind(mask), left, right, c};
    const bool known = mask == 0   ? walk_tiles<MaskKind::kFull>(p, ScheduleKind(kind))
                       : mask == 1 ? walk_tiles<MaskKind::kCausal>(p, ScheduleKind(kind))
                                   : walk_tiles<MaskKind::kWindow>(p, ScheduleKind(kind));
    if (!known) return 2;
    std::printf("end\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to compile csrc/bwd/bwd_tile_scheduler.h for the host")
    folder = tmp_path_factory.mktemp("walk")
    (folder / "walk.cpp").write_text(WALK)
    exe = folder / "walk"
    subprocess.run(["g++", "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(folder / "walk.cpp"), "-o", str(exe)],
                   check=True)
    return exe


def kernel_walks(exe, problems, mask):
    """Per problem (batch, nheads, nheads_k, seqlen_q, seqlen_k, block_m, block_n, ctas, schedule name): the visits
    the kernel's producer walks, one row per visit in COLUMNS' order."""
    left, right = WINDOWS[mask]
    tail = f"{schedules_table.mask_id(mask)} {left} {right}"
    lines = [" ".join(str(x) for x in pr[:8]) + f" {schedule.SCHEDULE_IDS[pr[8]]} {tail}" for pr in problems]
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", check=True, capture_output=True, text=True).stdout
    blocks = out.split("end\n")[:-1]
    return [np.array([[int(x) for x in row.split()] for row in block.splitlines()], dtype=np.int64).reshape(-1, 10)
            for block in blocks]


def plan_rows(pr, mask):
    b, h, hk, sq, sk, bm, bn, ctas, name = pr
    window = WINDOWS[mask] if mask == "window" else None
    visits = schedule.plan(name, mask, sq, sk, bm, bn, h, b, ctas, window, hk).visits
    return np.stack([np.asarray(visits[c], dtype=np.int64) for c in COLUMNS], axis=1)


def assert_claimed_walk(got, want, pr):
    """The claim order's walk (item k: tile k % 2 of unit k // 2, whichever CTA claims it) against the dealt plan: the
    same visits (what each does, not which CTA runs it), every unit a pair (u, N-1-u) of one KV head or one tile
    alone. The engine's verify checks each claimed unit against its dealt one."""
    a, b = (v[np.lexsort(v.T[::-1])] for v in (got[:, 2:], want[:, 2:]))
    assert np.array_equal(a, b), pr
    n_tiles = -(-pr[4] // pr[6])  # seqlen_k / block_n, rounded up
    for u in np.unique(got[:, 1] // 2):
        tiles = np.unique(got[got[:, 1] // 2 == u][:, [3, 5, 6]], axis=0)  # batch, head_k, n_block
        pair = len(tiles) == 2 and (tiles[0, :2] == tiles[1, :2]).all() and tiles[:, 2].sum() == n_tiles - 1
        assert len(tiles) == 1 or pair, pr


def sorted_rows(rows):
    return rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]


@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("hdim", [64, 128, 256])
def test_kernel_walk_equals_the_engines_plan(walker, hdim, mask):
    bm, bn = schedule.tile_shape(hdim, mask)
    problems = [(*shape, bm, bn, ctas, name) for shape in SHAPES for ctas in CTAS for name in SCHEDULES[mask]]
    split = 0  # problems where shift ran a tile in pieces on several CTAs (its split tail)
    for pr, got in zip(problems, kernel_walks(walker, problems, mask)):
        want = plan_rows(pr, mask)
        if mask == "causal" and pr[8] == "shift_causal_runs":
            assert_claimed_walk(got, want, pr)
            continue
        assert got.shape == want.shape, pr
        assert np.array_equal(sorted_rows(got), sorted_rows(want)), pr
        tiles_on_ctas = np.unique(got[:, [0, 3, 5, 6]], axis=0)[:, 1:]
        split += len(np.unique(tiles_on_ctas, axis=0)) < len(tiles_on_ctas)
    assert (split > 0) == (mask == "full")
