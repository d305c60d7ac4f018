"""`python -m dash_attn schedule`: arguments its model cannot take are usage errors (exit status 2, a message naming
the option), never a traceback; valid ones reach dash_attn.schedule."""
import pytest

from dash_attn import __main__ as cli


@pytest.mark.parametrize("args, message", [
    (["--seqlen", "0"], "argument --seqlen: must be an integer >= 1, got 0"),
    (["--seqlen", "-5"], "argument --seqlen: must be an integer >= 1"),
    (["--seqlen-k", "0"], "argument --seqlen-k: must be an integer >= 1"),
    (["--hdim", "7"], "argument --hdim: must be a multiple of 8 up to 256"),
    (["--hdim", "0"], "argument --hdim: must be a multiple of 8"),
    (["--hdim", "264"], "argument --hdim: must be a multiple of 8 up to 256"),
    (["--heads", "0"], "argument --heads: must be an integer >= 1"),
    (["--heads", "4", "--heads-k", "3"], "argument --heads-k: must divide --heads (4), got 3"),
    (["--batch", "0"], "argument --batch: must be an integer >= 1"),
    (["--num-sms", "0"], "argument --num-sms: must be an integer >= 1"),
    (["--block", "0", "64"], "argument --block: must be an integer >= 1"),
    (["--window", "-3", "0"], "argument --window: must be an integer >= -1"),
    (["--seqlen", "abc"], "argument --seqlen: invalid integer value: 'abc'"),
    (["--mask", "full", "--seqlen"], "argument --seqlen: expected one argument"),
])
def test_schedule_refuses_unusable_arguments(capsys, monkeypatch, args, message):
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: pytest.fail(f"{name} imported"))
    assert cli.main(["schedule"] + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m dash_attn schedule: error: ") and message in err, err
    assert "Traceback" not in err


def test_schedule_checks_leave_help_and_valid_arguments_to_the_command(capsys, monkeypatch):
    seen = []

    class _Command:
        __name__ = "dash_attn.schedule"

        @staticmethod
        def main(argv):
            seen.append(argv)
            return 0

    monkeypatch.setattr(cli.importlib, "import_module", lambda name: _Command)
    valid = ["--mask", "window", "--window", "-1", "0", "--seqlen", "1024", "--hdim", "64", "--heads", "8",
             "--heads-k", "2", "--block", "64", "128", "--plot-schedule", "spt"]
    assert cli.main(["schedule"] + valid) == 0
    assert cli.main(["schedule", "--seqlen", "0", "--help"]) == 0
    assert seen == [valid, ["--seqlen", "0", "--help"]]


def test_schedule_runs_with_small_valid_arguments(capsys):
    pytest.importorskip("dash_attn._sched")
    assert cli.main(["schedule", "--mask", "causal", "--seqlen", "512", "--hdim", "64", "--heads", "2"]) == 0
    assert "auto:" in capsys.readouterr().out


@pytest.mark.parametrize("mask, seqlen, expected", [("full", 8192, "shift_runs"), ("causal", 8192, "shift_causal_runs"),
                                                     ("full", 1024, "descending_lanes")])
def test_schedule_reports_what_auto_runs(capsys, monkeypatch, mask, seqlen, expected):
    """The deterministic auto line is the API's pick (by mask, head dim, key length), and without a GPU the L2 term
    models the H200."""
    import torch

    from dash_attn import schedule
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert schedule.main(["--mask", mask, "--seqlen", str(seqlen), "--heads", "4", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert f"auto: deterministic {expected} " in out
    assert f"{expected:<18}" in out and "<- deterministic auto" in out
    assert "L2 tiles=0 " not in out


def test_gantt_has_a_legend(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from dash_attn import schedule
    labels = []
    original = matplotlib.axes.Axes.legend

    def legend(self, *args, **kwargs):
        labels.extend(h.get_label() for h in kwargs.get("handles", []))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "legend", legend)
    schedule.gantt(schedule.plan("shift_runs", "full", 512, 512, 64, 128, 2, 2, 8), str(tmp_path / "g.png"))
    assert (tmp_path / "g.png").exists()
    assert any("compute" in s for s in labels) and any("stall" in s for s in labels)
    assert any("critical path" in s for s in labels) and any("reduction" in s for s in labels)
