"""The schedule of a planned varlen call (dash_attn/_launch.py, _with_varlen_schedule; dash_attn/_varlen.py): the
deterministic `auto` pick depends on the mask alone, and where the packed kernels schedule every sequence on its own
geometry (schedules_table.runs_per_sequence) any pack runs in one launch, whatever its sequences' bands."""
import pytest

from dash_attn import _launch, _varlen
from dash_attn._args import MaskKind, OpArgs
from dash_attn.schedules_table import AUTO, runs_per_sequence, varlen_invariant_schedule


def _args(mask, deterministic=True, schedule=AUTO):
    window = {MaskKind.FULL: (-1, -1), MaskKind.CAUSAL: (-1, 0), MaskKind.WINDOW: (16, 0)}[mask]
    return OpArgs(softmax_scale=1.0, mask=int(mask), window_left=window[0], window_right=window[1], softcap=0.0,
                  deterministic=deterministic, schedule=schedule, sm_margin=0)


@pytest.mark.parametrize("mask", list(MaskKind))
def test_deterministic_auto_takes_the_masks_pick(mask):
    assert _launch._with_varlen_schedule(_args(mask)).schedule == varlen_invariant_schedule(mask.name.lower())
    assert _launch._with_varlen_schedule(_args(mask, deterministic=False)).schedule == AUTO
    assert _launch._with_varlen_schedule(_args(mask, schedule="descending")).schedule == "descending"


def test_causal_packs_run_per_sequence():
    assert runs_per_sequence("causal", varlen_invariant_schedule("causal"))
    assert not runs_per_sequence("full", "shift_runs") and not runs_per_sequence("window", "descending")
    assert not runs_per_sequence("causal", "descending") and not runs_per_sequence("causal", AUTO)


def test_per_sequence_packs_run_in_one_launch():
    """Diagonals 100, 0 and 128: descending's batch of the longest needs wider bounds; per sequence, the longest."""
    lens_q, lens_k = [100, 700, 129], [200, 700, 257]
    assert _varlen._packed_bwd_launches(lens_q, lens_k, _args(MaskKind.CAUSAL, schedule="shift_causal_runs")) == \
        [(None, 700, 700)]
    assert _varlen._packed_bwd_launches(lens_q, lens_k, _args(MaskKind.CAUSAL, schedule="descending")) == \
        [(None, 700, 828)]
