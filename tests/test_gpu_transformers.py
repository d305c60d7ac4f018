"""attn_implementation="dash_attn" in Hugging Face transformers models on the GPU, bf16 (marker `gpu`; skipped without
an sm90 GPU, the built extension or transformers).

Small random models (Llama; Mistral with a sliding window; Gemma 2 with softcap, head dim 256 and alternating sliding
and full layers; Qwen 3 with head dim 128; gpt-oss with learnable attention sinks, GQA, a mixture of experts and
alternating sliding and full layers), built from configs:
- logits of dense, padded and padding-free packed batches against a float32 eager reference, within the tolerance
  scheme of test_gpu_forward.py: twice the error of the bf16 baseline implementation (sdpa; eager for Gemma 2, whose
  softcap sdpa ignores, and for gpt-oss, which has no sdpa path), or bf16 rounding; the same for the gradient of
  gpt-oss's sinks;
- 10 training steps (dense, padded and packed batches, bf16 autocast over float32 weights) run twice: bitwise the same
  losses and weights (gpt-oss's sinks included, which must have trained), deterministic through
  FLASH_ATTENTION_DETERMINISTIC=1 or torch.use_deterministic_algorithms;
- greedy generate() of 32 tokens with the KV cache: the baseline's tokens, except from a step where the two
  candidates are a near tie (random models have them; within bf16 noise either choice is right).
"""
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gpu_common import (  # noqa: E402,F401 (fixture)
    assert_within, exact_float32_matmul, supported_head_dims, tolerance, train_steps)

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "mistral", "gemma2", "qwen3", "gptoss"]
VOCAB = 512
SEQLEN = 256
WINDOW = 48
# An initializer range above the default 0.02 so that attention is far from uniform and masks matter.
COMMON = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, pad_token_id=0)
# Two logits closer than this (a few bf16 ulps at the logits' magnitude) are a tie within bf16 noise.
NEAR_TIE = 0.125


@pytest.fixture(scope="module", autouse=True)
def registered():
    from dash_attn.integrations.transformers import register
    register()


def _config(arch):
    if arch == "llama":
        return transformers.LlamaConfig(**COMMON)
    if arch == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW)
    if arch == "gemma2":
        return transformers.Gemma2Config(**COMMON, head_dim=HEAD_DIMS["gemma2"], sliding_window=WINDOW,
                                         attn_logit_softcapping=5.0, query_pre_attn_scalar=HEAD_DIMS["gemma2"])
    if arch == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=128)
    if arch == "gptoss":
        return _gpt_oss_config()
    raise ValueError(arch)


def _gpt_oss_config():
    """gpt-oss: layer 0 slides, layer 1 is full, both with sinks. Every token goes to every expert
    (num_experts_per_tok = num_local_experts): top-k routing would switch experts where two router logits nearly tie,
    and bf16 noise picks differently from the float32 reference there, a jump no logits tolerance covers. The experts
    run eagerly (a loop of matmuls and index_add_, deterministic under torch.use_deterministic_algorithms) rather than
    through transformers' grouped_mm, so that the training test measures the attention's determinism, not that of a
    grouped GEMM. max_position_embeddings is 32 times YaRN's original 4096, its default factor."""
    options = dict(COMMON, max_position_embeddings=32 * 4096)
    return transformers.GptOssConfig(**options, head_dim=64, sliding_window=WINDOW, num_local_experts=4,
                                     num_experts_per_tok=4, layer_types=["sliding_attention", "full_attention"],
                                     experts_implementation="eager")


def _baseline(arch):
    return "eager" if arch in ("gemma2", "gptoss") else "sdpa"


def _spread_sinks(state):
    """gpt-oss initialises its sinks near 0 (normal, std initializer_range); spread over a few units, some sinks take
    most of a row's mass and others almost none, so that a sink handled wrongly shows in the logits."""
    gen = torch.Generator().manual_seed(4)
    for name, t in state.items():
        if name.endswith(".sinks"):
            t.copy_(2.0 * torch.randn(t.shape, generator=gen))
    return state


# Head dim of each architecture's config where it is not COMMON's: the build must have a kernel for it.
HEAD_DIMS = {"gemma2": 256}


def _require_kernel(arch):
    head_dim = HEAD_DIMS.get(arch)
    if head_dim is not None and head_dim > max(supported_head_dims()):
        pytest.skip(f"{arch} needs head dim {head_dim}; this build has {supported_head_dims()}")


def _models(arch):
    """The same random weights as dash_attn (bf16), the baseline implementation (bf16) and eager (float32)."""
    _require_kernel(arch)
    torch.manual_seed(0)
    state = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation="eager").state_dict()
    state = _spread_sinks(state)
    models = {}
    for name, impl, dtype in (("dash", "dash_attn", torch.bfloat16), ("base", _baseline(arch), torch.bfloat16),
                              ("ref", "eager", torch.float32)):
        model = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation=impl)
        model.load_state_dict(state)
        models[name] = model.to("cuda", dtype).eval()
    return models


def _ids(batch, seqlen, seed=2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, seqlen), generator=gen, device="cuda")


def _padding_mask(batch, seqlen):
    """Row 0 padded on the left, row 1 on the right, the others not."""
    mask = torch.ones(batch, seqlen, dtype=torch.long, device="cuda")
    mask[0, :37] = 0
    if batch > 1:
        mask[1, seqlen - 61:] = 0
    return mask


def _assert_logits(name, models, keep, run):
    with torch.no_grad():
        logits = {key: run(model).float()[keep] for key, model in models.items()}
    assert torch.isfinite(logits["dash"]).all(), f"{name}: non-finite logits"
    assert_within(name, logits["dash"], logits["ref"], tolerance(logits["base"], logits["ref"], torch.bfloat16))


# ----------------------------------------------------------------------------------------------------------------------
# Logits
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_baseline(arch, padded):
    models = _models(arch)
    ids = _ids(3, SEQLEN)
    mask = _padding_mask(3, SEQLEN) if padded else None
    keep = mask.bool() if padded else torch.ones_like(ids, dtype=torch.bool)
    _assert_logits(f"{arch} logits", models, keep, lambda m: m(input_ids=ids, attention_mask=mask).logits)


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_oss_sink_gradients_match_eager(padded):
    """The gradient of the causal-LM loss reaching gpt-oss's sinks (dash_attn's d learnable_sink, cast back to the
    parameter's dtype) against float32 eager, within three times the bf16 eager baseline's error: that gradient comes
    through the whole model's bf16 backward, where the two bf16 models round in different places, so the baseline's
    error is its size, not an elementwise bound (measured: 2.1 times it at most)."""
    models = _models("gptoss")
    ids = _ids(3, SEQLEN)
    mask = _padding_mask(3, SEQLEN) if padded else None
    labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
    grads = {}
    for key, model in models.items():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[key] = {name: p.grad for name, p in model.named_parameters() if name.endswith(".sinks")}
    assert len(grads["ref"]) == 2 and grads["dash"].keys() == grads["ref"].keys()
    for name, ref in grads["ref"].items():
        got = grads["dash"][name]
        assert got is not None and torch.isfinite(got).all(), f"{name}: no finite gradient"
        base_err = (grads["base"][name].float() - ref.float()).abs().max().item()
        assert_within(f"d {name}", got, ref, max(3 * base_err, tolerance(grads["base"][name], ref, torch.bfloat16)))


def _packed(lengths, seed=3):
    ids = _ids(1, sum(lengths), seed)
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths]).unsqueeze(0)
    return ids, position_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_batch_matches_separate_sequences(arch):
    """A padding-free batch (position_ids restarting) under dash_attn; the baseline and reference run each sequence
    on its own, which needs no packing support from them."""
    models = _models(arch)
    lengths = (100, 37, 1, 118)
    ids, position_ids = _packed(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def run(model):
        if model is models["dash"]:
            return model(input_ids=ids, position_ids=position_ids).logits
        return torch.cat([model(input_ids=ids[:, s:s + n]).logits for s, n in zip(starts, lengths)], dim=1)

    _assert_logits(f"{arch} packed logits", models, torch.ones_like(ids, dtype=torch.bool), run)


# ----------------------------------------------------------------------------------------------------------------------
# Deterministic training
# ----------------------------------------------------------------------------------------------------------------------

def _initial_model(arch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation="dash_attn")
    return model.to("cuda").train()


def _batches(steps):
    """Dense, padded and packed batches in turn."""
    for step in range(steps):
        inputs = {"input_ids": _ids(4, SEQLEN, seed=10 + step)}
        if step % 3 == 1:
            inputs["attention_mask"] = _padding_mask(4, SEQLEN)
            inputs["labels"] = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        elif step % 3 == 2:
            inputs["input_ids"], inputs["position_ids"] = _packed((300, 11, 200, 1, 512), seed=10 + step)
        inputs.setdefault("labels", inputs["input_ids"])
        yield inputs


def _train(arch, steps=10):
    """Training steps over dense, padded and packed batches; the losses and the final weights by name."""
    return train_steps(_initial_model(arch), _batches(steps), "cuda", lr=1e-3)


def check_training_is_bitwise_reproducible(arch):
    (losses, weights), (losses2, weights2) = _train(arch), _train(arch)
    assert torch.isfinite(losses).all()
    assert torch.equal(losses, losses2), f"losses differ: {losses.tolist()} vs {losses2.tolist()}"
    differ = [name for name in weights if not torch.equal(weights[name], weights2[name])]
    assert not differ, f"weights differ after identical training: {differ}"
    # The sinks' gradient must reach them: were it lost (zero or None), the sinks would keep their initial values and
    # the comparison above would pass without testing it.
    initial = dict(_initial_model(arch).named_parameters())
    sinks = [name for name in weights if name.endswith(".sinks")]
    assert (arch == "gptoss") == bool(sinks), f"{arch}: sinks {sinks}"
    for name in sinks:
        assert torch.isfinite(weights[name]).all() and not torch.equal(weights[name], initial[name]), \
            f"{name} did not train"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_training_deterministic_through_env(arch, monkeypatch):
    _require_kernel(arch)
    monkeypatch.setenv("FLASH_ATTENTION_DETERMINISTIC", "1")
    check_training_is_bitwise_reproducible(arch)


@pytest.mark.parametrize("arch", ["llama", "gptoss"])
def test_training_deterministic_through_torch_flag(arch):
    """torch.use_deterministic_algorithms needs cuBLAS's workspace setting before CUDA starts: a fresh process. gpt-oss
    runs here only: its experts' index_add_ and gathers are deterministic under the flag (the sinks' gradient comes
    from dash_attn's deterministic backward, which the flag selects)."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import test_gpu_transformers as t; "
            "from dash_attn.integrations.transformers import register; register(); "
            f"torch.use_deterministic_algorithms(True); t.check_training_is_bitwise_reproducible({arch!r})")
    env = {k: v for k, v in os.environ.items() if k != "FLASH_ATTENTION_DETERMINISTIC"}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    result = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------------------------
# Greedy generation with the KV cache
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_baseline(arch, padded):
    models = _models(arch)
    prompt = 64
    ids = _ids(2, prompt, seed=4)
    mask = _padding_mask(2, prompt) if padded else torch.ones_like(ids)
    if padded:
        mask[1] = 1  # generation pads on the left
    options = dict(attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                   output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = models["dash"].generate(ids, **options)
        ref = models["base"].generate(ids, **options)
    tokens, ref_tokens = out.sequences[:, prompt:], ref.sequences[:, prompt:]
    assert tokens.shape == ref_tokens.shape == (2, 32)
    for row in range(2):
        differ = (tokens[row] != ref_tokens[row]).nonzero()
        if differ.numel() == 0:
            continue
        # Both saw the same prefix up to the first difference; there the two choices must be a near tie.
        step = int(differ[0])
        ours, theirs = int(tokens[row, step]), int(ref_tokens[row, step])
        for name, logits in (("dash_attn", out.logits[step][row]), ("baseline", ref.logits[step][row])):
            gap = (logits[ours] - logits[theirs]).abs().item()
            assert gap <= NEAR_TIE, (f"{arch} row {row}: tokens differ from step {step} ({ours} vs {theirs}) though "
                                     f"{name}'s logits separate them by {gap:.3f} > {NEAR_TIE}")
