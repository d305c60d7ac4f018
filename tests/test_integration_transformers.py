"""attn_implementation="dash_attn" in Hugging Face transformers, on the CPU reference path in float32.

Tiny models with random weights (built from configs, nothing downloaded) run forward and backward through dash_attn
and through transformers' eager attention with the same weights; logits and every weight's gradient must agree within
TOL (gradients: TOL times their largest magnitude where that is above 1). Cases: no padding, left and right padding
masks, padding-free packed batches (position_ids restarting, and DataCollatorWithFlattening's cu_seq_lens keywords),
sliding windows (Mistral), softcap with alternating sliding and full layers (Gemma 2), q/k norms (Qwen 3), learnable
attention sinks with alternating sliding and full layers (gpt-oss), greedy generation with the KV cache; gpt-oss
trained twice under bfloat16 autocast (bitwise the same, the sinks trained); then registration, the errors and the
deterministic switch. Skipped where transformers is not installed.
"""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dash_attn.integrations import transformers as dash_tf  # noqa: E402
from dash_attn.reference import attention_ref  # noqa: E402
from gpu_common import (  # noqa: E402,F401  (exact_float32_matmul is autouse: the float32 reference without TF32)
    exact_float32_matmul, train_steps)

TOL = 1e-5
VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
# Windows far shorter than the 16-token sequences, so that they cut.
WINDOW = 4


def _config(arch):
    if arch == "llama":
        return transformers.LlamaConfig(**TINY)
    if arch == "mistral":
        return transformers.MistralConfig(**TINY, sliding_window=WINDOW)
    if arch == "qwen3":
        return transformers.Qwen3Config(**TINY, head_dim=16)
    if arch == "gemma2":
        # A small softcap so that tanh's curved part is reached; layer 0 slides, layer 1 is full.
        return transformers.Gemma2Config(**TINY, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=2.0,
                                         query_pre_attn_scalar=24)
    if arch == "gptoss":
        # max_position_embeddings 32 times YaRN's original 4096, its default factor; layer 0 slides, layer 1 is full.
        options = dict(TINY, max_position_embeddings=32 * 4096, intermediate_size=64)
        return transformers.GptOssConfig(**options, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
    raise ValueError(arch)


@pytest.fixture(scope="module", autouse=True)
def registered():
    dash_tf.register()


def _models(arch):
    """The same random weights under attn_implementation="dash_attn" and "eager", float32, in eval mode."""
    torch.manual_seed(0)
    dash = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation="dash_attn").float()
    eager = transformers.AutoModelForCausalLM.from_config(_config(arch), attn_implementation="eager").float()
    with torch.no_grad():
        for name, p in dash.named_parameters():
            if name.endswith(".sinks"):  # gpt-oss initialises them near 0: spread them so that they matter
                p.copy_(2.0 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    eager.load_state_dict(dash.state_dict())
    assert dash.config._attn_implementation == "dash_attn"
    return dash.eval(), eager.eval()


def _step(model, keep, **inputs):
    """Logits and the gradients of a fixed random projection of the kept positions' logits."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights)[keep].sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_close(dash_out, eager_out, keep):
    (logits, grads), (ref_logits, ref_grads) = dash_out, eager_out
    torch.testing.assert_close(logits[keep], ref_logits[keep], atol=TOL, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        # Gradients reach ~10 (the embedding's sums every position's, and the tied output layer's): float32 rounding
        # of sums in another order scales with them, so the bound is TOL times the gradient's largest magnitude.
        tol = TOL * max(1.0, ref_grads[name].abs().max().item())
        err = (grads[name] - ref_grads[name]).abs().max().item()
        assert err <= tol, f"{name}: max abs error {err:.3e} > {tol:.3e}"


def _ids(batch, seqlen):
    return torch.randint(1, VOCAB, (batch, seqlen), generator=torch.Generator().manual_seed(2))


# ----------------------------------------------------------------------------------------------------------------------
# Forward and backward against eager
# ----------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2", "gptoss"])
def test_no_padding_matches_eager(arch):
    dash, eager = _models(arch)
    ids = _ids(2, 16)
    keep = torch.ones(2, 16, dtype=torch.bool)
    _assert_close(_step(dash, keep, input_ids=ids), _step(eager, keep, input_ids=ids), keep)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gptoss"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_matches_eager(arch, side):
    dash, eager = _models(arch)
    ids = _ids(3, 16)
    mask = torch.ones(3, 16, dtype=torch.long)
    pads = (5, 0, 11)  # a row without padding among them
    for row, n in enumerate(pads):
        if n:
            mask[row, :n] = 0 if side == "left" else 1
            if side == "right":
                mask[row, 16 - n:] = 0
    keep = mask.bool()
    _assert_close(_step(dash, keep, input_ids=ids, attention_mask=mask),
                  _step(eager, keep, input_ids=ids, attention_mask=mask), keep)


def _packed_batch(lengths):
    ids = _ids(1, sum(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, position_ids


def _separate_runs(model, ids, lengths):
    """The reference of a packed batch: each sequence through the model on its own, logits concatenated, the
    gradients those of the sum of the per-sequence losses (the same projection weights, sliced)."""
    model.zero_grad(set_to_none=True)
    weights = torch.randn((1, ids.shape[1], VOCAB), generator=torch.Generator().manual_seed(1))
    outputs, start = [], 0
    for n in lengths:
        logits = model(input_ids=ids[:, start:start + n]).logits
        (logits * weights[:, start:start + n]).sum().backward()
        outputs.append(logits.detach())
        start += n
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.cat(outputs, dim=1), grads


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_packed_position_ids_match_separate_sequences(arch):
    dash, eager = _models(arch)
    lengths = (5, 7, 1, 9)
    ids, position_ids = _packed_batch(lengths)
    keep = torch.ones(ids.shape, dtype=torch.bool)
    _assert_close(_step(dash, keep, input_ids=ids, position_ids=position_ids), _separate_runs(eager, ids, lengths),
                  keep)


def test_packed_flash_kwargs_match_separate_sequences(monkeypatch):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s keywords give the sequences, not position_ids."""
    dash, eager = _models("llama")
    lengths = (6, 4, 10)
    ids, position_ids = _packed_batch(lengths)
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": ids[0, s:s + n].tolist()} for s, n in zip((0, 6, 10), lengths)])
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["position_ids"], position_ids)
    flash_kwargs = {name: batch[name] for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    # Position ids of one sequence: only the keywords can give the boundaries.
    monkeypatch.setattr(dash_tf, "_packed_seqlens", lambda *args: None)
    keep = torch.ones(ids.shape, dtype=torch.bool)
    _assert_close(_step(dash, keep, input_ids=ids, position_ids=position_ids, **flash_kwargs),
                  _separate_runs(eager, ids, lengths), keep)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "gptoss"])
@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_eager(arch, padded):
    """Decoding against the KV cache: one query row (bottom-right causal) per step, after a prefill."""
    dash, eager = _models(arch)
    ids = _ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[0, :4] = 0
    options = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = dash.generate(ids, output_logits=True, return_dict_in_generate=True, **options)
        ref = eager.generate(ids, output_logits=True, return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(ref.logits), atol=TOL, rtol=0)


def _gptoss_batches(steps):
    """Dense, padded and packed batches in turn."""
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10 + step))
        inputs = {"input_ids": ids, "labels": ids}
        if step % 3 == 1:
            inputs["attention_mask"] = torch.ones_like(ids)
            inputs["attention_mask"][0, :5] = 0
            inputs["labels"] = ids.masked_fill(inputs["attention_mask"] == 0, -100)
        elif step % 3 == 2:
            inputs["input_ids"], inputs["position_ids"] = _packed_batch((9, 1, 14, 8))
            inputs["labels"] = inputs["input_ids"]
        yield inputs


def _train_gptoss(steps=4):
    """gpt-oss (float32 weights) trained through dash_attn under bfloat16 autocast, as test_gpu_transformers.py trains
    it on the GPU, over dense, padded and packed batches: the losses and the final weights by name."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("gptoss"), attn_implementation="dash_attn").train()
    return train_steps(model, _gptoss_batches(steps), "cpu", lr=1e-2)


def test_gptoss_training_is_reproducible_and_trains_the_sinks():
    """On CPU tensors dash_attn runs its reference, so two runs from one seed agree bit for bit; the sinks' gradient
    must reach them (they move from their initial values)."""
    (losses, weights), (losses2, weights2) = _train_gptoss(), _train_gptoss()
    assert torch.isfinite(losses).all() and torch.equal(losses, losses2)
    assert all(torch.equal(weights[name], weights2[name]) for name in weights)
    torch.manual_seed(0)
    initial = dict(transformers.AutoModelForCausalLM.from_config(_config("gptoss")).named_parameters())
    sinks = [name for name in weights if name.endswith(".sinks")]
    assert len(sinks) == 2 and all(not torch.equal(weights[name], initial[name]) for name in sinks)


# ----------------------------------------------------------------------------------------------------------------------
# The attention function on its own
# ----------------------------------------------------------------------------------------------------------------------

class _Module(torch.nn.Module):
    def __init__(self, is_causal=True):
        super().__init__()
        self.is_causal = is_causal
        self.proj = torch.nn.Linear(8, 8)


def _qkv(batch=2, heads=4, heads_kv=2, seqlen_q=10, seqlen_k=10, dim=16):
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(batch, heads, seqlen_q, dim, generator=gen),
            torch.randn(batch, heads_kv, seqlen_k, dim, generator=gen),
            torch.randn(batch, heads_kv, seqlen_k, dim, generator=gen))


def _reference(q, k, v, **options):
    return attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), **options)


@pytest.mark.parametrize("module_causal, is_causal", [(False, None), (True, False)])
def test_encoder_attention_is_not_causal(module_causal, is_causal):
    q, k, v = _qkv()
    out, weights = dash_tf.dash_attention_forward(_Module(module_causal), q, k, v, None, scaling=0.3,
                                                  is_causal=is_causal)
    assert weights is None and out.shape == (2, 10, 4, 16)
    torch.testing.assert_close(out, _reference(q, k, v, softmax_scale=0.3), atol=TOL, rtol=0)


def test_softcap_and_decoding_rows():
    """A few queries against a longer cache: causal aligned bottom-right; softcap passed through."""
    q, k, v = _qkv(seqlen_q=3, seqlen_k=12)
    out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, None, softcap=1.5)
    torch.testing.assert_close(out, _reference(q, k, v, causal=True, softcap=1.5), atol=TOL, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_convention(causal):
    """sliding_window counts the query's own token: window_size (sliding_window - 1, 0), both sides for encoders."""
    q, k, v = _qkv(seqlen_q=12, seqlen_k=12)
    out, _ = dash_tf.dash_attention_forward(_Module(causal), q, k, v, None, sliding_window=5)
    window = (4, 0) if causal else (4, 4)
    torch.testing.assert_close(out, _reference(q, k, v, causal=causal, window_size=window), atol=TOL, rtol=0)
    assert dash_tf._window_size(12, True, 12) == (-1, -1)  # a window holding every key is left out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_s_aux_becomes_learnable_sink(dtype):
    """gpt-oss's s_aux, a (heads,) parameter in the model's dtype, reaches dash_attn as a float32 learnable_sink, and
    its gradient comes back in its dtype."""
    q, k, v = _qkv(seqlen_q=6, seqlen_k=9)
    s_aux = torch.tensor([-1.0, 0.0, 2.0, 5.0], dtype=dtype, requires_grad=True)
    out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, None, s_aux=s_aux, sliding_window=5)
    expected = _reference(q, k, v, causal=True, window_size=(4, 0), learnable_sink=s_aux.detach().float())
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)
    out.sum().backward()
    assert s_aux.grad.dtype == dtype and torch.isfinite(s_aux.grad).all()
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, mask, s_aux=s_aux)
    ref1 = _reference(q[1:], k[1:, :, 3:], v[1:, :, 3:], causal=True, learnable_sink=s_aux.detach().float())
    torch.testing.assert_close(out[1], ref1[0], atol=TOL, rtol=0)


def test_mixed_dtypes_take_the_widest_on_the_cpu():
    """Under autocast gpt-oss's rotary embedding hands q and k over in float32 and v in bfloat16; the CPU reference
    takes the three in the widest of their dtypes."""
    q, k, v = _qkv()
    v = v.bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # which the reference's matmuls follow too
        out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, None)
        expected = _reference(q, k, v.float(), causal=True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)


def test_static_cache_mask_bounds_keys():
    """A padding mask shorter than the keys (a static cache's filled slots) bounds them; padded rows come back 0."""
    q, k, v = _qkv(seqlen_q=1, seqlen_k=16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, mask)
    ref0 = _reference(q[:1], k[:1, :, :9], v[:1, :, :9], causal=True)
    ref1 = _reference(q[1:], k[1:, :, 3:9], v[1:, :, 3:9], causal=True)
    torch.testing.assert_close(out, torch.cat((ref0, ref1)), atol=TOL, rtol=0)


def test_padded_query_rows_are_zero():
    q, k, v = _qkv()
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 7:] = 0
    out, _ = dash_tf.dash_attention_forward(_Module(), q, k, v, mask)
    assert out[0, 7:].abs().max() == 0


# ----------------------------------------------------------------------------------------------------------------------
# Registration, errors, deterministic switch, optional import
# ----------------------------------------------------------------------------------------------------------------------

def test_register_is_idempotent():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    dash_tf.register()
    dash_tf.register()
    assert ALL_ATTENTION_FUNCTIONS["dash_attn"] is dash_tf.dash_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["dash_attn"] is ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"]
    assert list(ALL_ATTENTION_FUNCTIONS.keys()).count("dash_attn") == 1
    _models("llama")


def test_training_dropout_is_refused():
    config = _config("llama")
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="dash_attn").train()
    with pytest.raises(ValueError, match="dropout=0.1 is not supported.*attention_dropout"):
        model(_ids(1, 8))
    model.eval()(_ids(1, 8))  # eval mode passes dropout 0


def test_unsupported_inputs_are_refused():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="s_aux must be None or a floating-point"):
        dash_tf.dash_attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="learnable_sink must have shape \\(nheads,\\) = \\(4,\\)"):
        dash_tf.dash_attention_forward(_Module(), q, k, v, None, s_aux=torch.zeros(2))
    with pytest.raises(ValueError, match="attention_mask must be None or the 2-D padding mask"):
        dash_tf.dash_attention_forward(_Module(), q, k, v, torch.zeros(2, 1, 10, 10))
    with pytest.raises(ValueError, match="query must be a 4-D tensor"):
        dash_tf.dash_attention_forward(_Module(), q[0], k, v, None)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        dash_tf.dash_attention_forward(_Module(), q, k, v, None, sliding_window=0)


def _recorded_deterministic(monkeypatch, **kwargs):
    seen = []
    real = dash_tf.flash_attn_func

    def spy(*args, **options):
        seen.append(options["deterministic"])
        return real(*args, **options)

    monkeypatch.setattr(dash_tf, "flash_attn_func", spy)
    dash_tf.dash_attention_forward(_Module(), *_qkv(), None, **kwargs)
    return seen[0]


def test_deterministic_switch(monkeypatch):
    monkeypatch.delenv(dash_tf.DETERMINISTIC_ENV, raising=False)
    assert _recorded_deterministic(monkeypatch) is None  # dash_attn follows torch's flag
    monkeypatch.setenv(dash_tf.DETERMINISTIC_ENV, "1")
    assert _recorded_deterministic(monkeypatch) is True
    assert _recorded_deterministic(monkeypatch, deterministic=False) is False
    monkeypatch.setenv(dash_tf.DETERMINISTIC_ENV, "0")
    assert _recorded_deterministic(monkeypatch) is None


def test_import_dash_attn_does_not_import_transformers():
    code = ("import sys, dash_attn, dash_attn.integrations, dash_attn.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
