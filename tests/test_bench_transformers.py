"""CPU checks of benchmarks/bench_transformers.py: a tiny Llama through every implementation that runs on the CPU
(sdpa, dash_attn's reference path) for a step, the repeat's bitwise comparison, the outputs, the default ~1B model,
and the clear exit without a GPU. The throughput itself needs the H200. Skipped where transformers is not installed."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_transformers  # noqa: E402

TINY = ["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "128", "--vocab", "128", "--seqlens", "32", "--batch", "2", "--warmup", "1", "--steps", "1"]


def test_tiny_model_on_the_cpu(tmp_path, capsys):
    assert bench_transformers.main(TINY + ["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench_transformers.json").read_text())
    rows = {r["impl"]: r for r in data["results"]}
    assert list(rows) == list(bench_transformers.IMPL_KEYS)
    for key in ("sdpa", "dash_attn", "dash_attn_det"):
        row = rows[key]
        assert row["status"] == "ok" and row["tokens_per_s"] > 0 and len(row["losses"]) == 2, row
        assert len(row["step_ms"]) == 1
        # float32 on both sides: dash_attn's reference and sdpa differ by rounding only.
        assert row["max_abs_loss_diff_vs_sdpa"] < 1e-4
    assert rows["flash_attention_3"]["status"] == "n/a" and "CUDA" in rows["flash_attention_3"]["reason"]
    repeats = {r["impl"]: r for r in data["repeats"]}
    assert set(repeats) == {"dash_attn", "dash_attn_det"}
    det = repeats["dash_attn_det"]
    assert det["losses_identical"] and det["weights_identical"] and det["params_differing"] == 0
    assert det["params_total"] == 3 + 2 * 9  # embedding, final norm, head; a layer: q, k, v, o, 3 MLP, 2 norms
    markdown = (tmp_path / "bench_transformers.md").read_text()
    assert "| dash_attn_det |" in markdown and "- flash_attention_3 at seqlen 32: n/a" in markdown
    assert "weights bitwise equal" in capsys.readouterr().out


def test_environment_is_restored(monkeypatch):
    """The runs set FLASH_ATTENTION_DETERMINISTIC and torch's flag for themselves only."""
    monkeypatch.setenv(bench_transformers.DETERMINISTIC_ENV, "1")
    assert bench_transformers.main(TINY + ["--impls", "dash_attn", "--repeat", ""]) == 0
    assert bench_transformers.os.environ[bench_transformers.DETERMINISTIC_ENV] == "1"
    assert not torch.are_deterministic_algorithms_enabled()


def test_torch_deterministic_skips_the_non_deterministic_column(tmp_path):
    assert bench_transformers.main(TINY + ["--torch-deterministic", "--impls", "sdpa,dash_attn,dash_attn_det",
                                           "--repeat", "dash_attn_det", "--out", str(tmp_path)]) == 0
    rows = {r["impl"]: r for r in json.loads((tmp_path / "bench_transformers.json").read_text())["results"]}
    assert rows["dash_attn"]["status"] == "n/a" and "deterministic" in rows["dash_attn"]["reason"]
    assert rows["dash_attn_det"]["status"] == "ok"
    assert not torch.are_deterministic_algorithms_enabled()


def test_defaults_are_a_1b_llama_at_4096():
    args = bench_transformers.parse_args([])
    assert (args.seqlens, args.warmup, args.steps, bench_transformers.batch_for(args, 4096)) == ([4096], 3, 5, 4)
    assert args.repeat == ["dash_attn_det", "dash_attn"] and args.dtype == "bfloat16"
    config = bench_transformers.llama_config(transformers, args)
    assert config.hidden_size // config.num_attention_heads == 128 and config.num_key_value_heads == 16
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert 0.9e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    with pytest.raises(SystemExit):
        bench_transformers.parse_args(["--impls", "nonsense"])
    with pytest.raises(SystemExit):
        bench_transformers.parse_args(["--heads", "3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit where there is no CUDA device")
def test_no_gpu_gives_a_clear_message_not_a_traceback():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transformers.py")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == bench_transformers.EXIT_NO_DEVICE
    assert "needs a CUDA GPU" in run.stderr and "Traceback" not in run.stderr
