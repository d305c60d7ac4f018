"""Gantt charts of simulated backward schedules (dash_attn.schedule.gantt, gantt_compare; needs matplotlib)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:  # dash_attn.schedule imports this module: its names are imported where they run
    from .schedule import Plan, SimResult


def _draw_gantt(ax, plan: Plan, res: SimResult, max_ctas: int, title: Optional[str]) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    v = res.visits
    rows = v["cta"]
    shown = rows < max_ctas
    cmap = plt.get_cmap("tab20")
    colour_key = (v["batch"].astype(np.int64) * plan.nheads + v["head"]) % 10

    def boxes(start, end, mask):
        s, e, y = start[mask], end[mask], rows[mask]
        return np.stack([np.stack([s, y - 0.4], 1), np.stack([e, y - 0.4], 1), np.stack([e, y + 0.4], 1),
                         np.stack([s, y + 0.4], 1)], 1)

    ce = res.compute_start + res.c
    ax.add_collection(PolyCollection(boxes(res.compute_start, ce, shown),
                                     facecolors=cmap(2 * colour_key[shown] + 1), edgecolors="none"))
    ax.add_collection(PolyCollection(boxes(res.reduce_start, res.reduce_end, shown),
                                     facecolors=cmap(2 * colour_key[shown]), edgecolors="none"))
    stalled = shown & (res.reduce_start > ce + 1e-12)
    if stalled.any():
        ax.add_collection(PolyCollection(boxes(ce, res.reduce_start, stalled), facecolors="red", edgecolors="none"))
    on_path = np.zeros(rows.size, dtype=bool)
    on_path[res.critical_path] = True
    if (on_path & shown).any():
        ax.add_collection(PolyCollection(boxes(res.compute_start, res.reduce_end, on_path & shown),
                                         facecolors="none", edgecolors="black", linewidths=0.6))
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(facecolor=cmap(1), label="compute (light, per query head)"),
                       Patch(facecolor=cmap(0), label="dQ reduction (dark)"),
                       Patch(facecolor="red", label="stall on a dQ semaphore"),
                       Patch(facecolor="none", edgecolor="black", label="critical path")],
              loc="lower right", fontsize=7, framealpha=0.85)
    ax.set_xlim(0, res.makespan * 1.01 if res.makespan > 0 else 1)
    ax.set_ylim(min(plan.num_ctas, max_ctas) - 0.5, -0.5)
    ax.set_xlabel(f"time (c = {res.c:g}, r = {res.r:g})")
    ax.set_ylabel("CTA" + (f" (first {max_ctas} of {plan.num_ctas})" if plan.num_ctas > max_ctas else ""))
    ax.set_title(title or (f"{plan.schedule}, {plan.mask}, seqlen {plan.seqlen_q}x{plan.seqlen_k}, "
                           f"{plan.nheads} heads x batch {plan.batch}, {plan.num_ctas} CTAs: makespan "
                           f"{res.makespan:g} (lower bound {res.lower_bound:.4g})"), fontsize=9)


def gantt(plan: Plan, path: str, c: float = 1.0, r: float = 0.5, max_ctas: int = 64,
          result: Optional[SimResult] = None, title: Optional[str] = None) -> SimResult:
    """Gantt chart (PNG) of the simulated plan: one row per CTA (the first `max_ctas`), compute in light and
    reduction in dark shades coloured by query head, semaphore stalls in red, the critical path outlined."""
    if plan.sequences:
        raise ValueError("gantt draws one launch; pass plan.sequences[i] for a varlen plan")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .schedule import simulate

    res = result if result is not None else simulate(plan, c, r, record=True)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=90)
    _draw_gantt(ax, plan, res, max_ctas, title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return res


def gantt_compare(plans: Sequence[Plan], path: str, c: float = 1.0, r: float = 0.5, max_ctas: int = 64) -> None:
    """Several plans stacked on one shared time axis (one panel each), as in docs/schedule_causal.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .schedule import simulate

    fig, axes = plt.subplots(len(plans), 1, figsize=(11, 2.2 * len(plans) + 0.6), dpi=80, sharex=True, squeeze=False)
    results = [simulate(p, c, r, record=True) for p in plans]
    for ax, p, res in zip(axes[:, 0], plans, results):
        _draw_gantt(ax, p, res, max_ctas, f"{p.schedule}: makespan {res.makespan:g} "
                                          f"(lower bound {res.lower_bound:.4g})")
    horizon = max(res.makespan for res in results)
    for ax in axes[:, 0]:
        ax.set_xlim(0, horizon * 1.01)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
