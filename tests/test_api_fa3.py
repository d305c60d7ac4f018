"""FlashAttention-3 (and FlashAttention-2 packed) compatibility on the CPU path: the signatures in FA3's / FA2's order,
calls made positionally and by keyword against dash_attn.reference, the options refused unless off, FA3's input rules
(integer-like windows, causal with windows, windows wider than the sequences) and errors naming the function called."""
import inspect
import traceback

import numpy as np
import pytest
import torch

import dash_attn
from dash_attn import flash_attn_interface
from dash_attn.reference import attention_ref, attention_ref_varlen

from api_common import qkv, varlen_inputs

# The parameter names and order a FlashAttention-3 call site passes, which our functions must accept as they are.
FA3_DENSE = ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale", "window_size",
             "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic", "sm_margin", "return_attn_probs"]
FA3_VARLEN = (FA3_DENSE[:3] + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "seqused_q", "seqused_k"]
              + FA3_DENSE[3:])
FA3_QKVPACKED = ["qkv", "softmax_scale", "causal", "q_descale", "k_descale", "v_descale", "window_size",
                 "attention_chunk", "softcap", "deterministic", "num_heads_q", "sm_margin", "return_attn_probs"]
# FA2's (flash_attn/flash_attn_interface.py) for the packed names FA3 lacks.
FA2_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
            "return_attn_probs"]
FA2_SIGNATURES = {
    "flash_attn_kvpacked_func": ["q", "kv"] + FA2_TAIL,
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + FA2_TAIL,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + FA2_TAIL,
}
FA3_SIGNATURES = {"flash_attn_func": FA3_DENSE, "flash_attn_varlen_func": FA3_VARLEN,
                  "flash_attn_qkvpacked_func": FA3_QKVPACKED}


def _split_parameters(fn):
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)}
    return positional, keyword_only


@pytest.mark.parametrize("name", sorted(FA3_SIGNATURES))
def test_fa3_functions_take_fa3_parameters_in_fa3_order(name):
    positional, keyword_only = _split_parameters(getattr(dash_attn, name))
    assert positional == FA3_SIGNATURES[name]
    assert keyword_only == {"schedule", "learnable_sink"}
    defaults = {n: p.default for n, p in inspect.signature(getattr(dash_attn, name)).parameters.items()}
    assert defaults["window_size"] == (-1, -1) and defaults["deterministic"] is None


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
def test_fa2_packed_functions_take_fa2_parameters_in_fa2_order(name):
    positional, keyword_only = _split_parameters(getattr(dash_attn, name))
    assert positional == FA2_SIGNATURES[name]
    assert {"schedule", "sm_margin", "fa3_options"} <= keyword_only


def test_flash_attn_interface_module_has_fa3_names():
    assert flash_attn_interface.__all__ == ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func"]
    for name in flash_attn_interface.__all__:
        assert getattr(flash_attn_interface, name) is getattr(dash_attn, name)


# ----------------------------------------------------------------------------------------------------------------------
# Calls with FA3's / FA2's signatures against the reference
# ----------------------------------------------------------------------------------------------------------------------

def _assert_matches(result, reference):
    for got, want in zip(result, reference):
        torch.testing.assert_close(got, want.to(got.dtype), rtol=0, atol=1e-12)


def test_flash_attn_func_fa3_positional_and_keyword_calls():
    q, k, v = qkv(seqlen_q=7, seqlen_k=10, dtype=torch.float64)
    ref = attention_ref(q, k, v, 0.3, True, (2, 0), 1.5, return_lse=True)
    positional = flash_attn_interface.flash_attn_func(q, k, v, 0.3, True, None, None, None, None, (2, -1), 0, 1.5, 1,
                                                      None, False, 0, True)
    _assert_matches(positional, ref)
    keyword = flash_attn_interface.flash_attn_func(
        q, k, v, softmax_scale=0.3, causal=True, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(2, -1), attention_chunk=0, softcap=1.5, num_splits=1, pack_gqa=None, deterministic=False,
        sm_margin=0, return_attn_probs=True)
    _assert_matches(keyword, ref)


def test_flash_attn_varlen_func_fa3_positional_and_keyword_calls():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    used_k = torch.tensor([3, 1, 5], dtype=torch.int32)
    ref = attention_ref_varlen(q, k, v, cu_q, cu_k, 0.3, False, (1, 2), 0.5, return_lse=True, seqused_k=used_k)
    positional = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, None, used_k, 0.3,
                                                             False, None, None, None, None, (1, 2), 0, 0.5, 0, True,
                                                             True, 0, True)
    _assert_matches(positional, ref)
    keyword = flash_attn_interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, seqused_q=None,
        seqused_k=used_k, softmax_scale=0.3, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
        window_size=(1, 2), attention_chunk=0, softcap=0.5, num_splits=1, pack_gqa=False, deterministic=None,
        sm_margin=0, return_attn_probs=True)
    _assert_matches(keyword, ref)


def test_flash_attn_qkvpacked_func_fa3_positional_and_keyword_calls():
    packed = torch.randn(2, 9, 4 + 2 * 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q, k, v = packed[:, :, :4], packed[:, :, 4:6], packed[:, :, 6:]
    ref = attention_ref(q, k, v, 0.3, True, (3, 0), 2.0, return_lse=True)
    positional = flash_attn_interface.flash_attn_qkvpacked_func(packed, 0.3, True, None, None, None, (3, 0), 0, 2.0,
                                                                False, 4, 0, True)
    _assert_matches(positional, ref)
    keyword = flash_attn_interface.flash_attn_qkvpacked_func(
        packed, softmax_scale=0.3, causal=True, q_descale=None, k_descale=None, v_descale=None, window_size=(3, 0),
        attention_chunk=0, softcap=2.0, deterministic=False, num_heads_q=4, sm_margin=0, return_attn_probs=True)
    _assert_matches(keyword, ref)


def test_fa2_kvpacked_positional_calls():
    q, k, v = qkv(dtype=torch.float64)
    kv = torch.stack([k, v], 2)
    # FA2's third positional parameter is dropout_p: 0.0 binds there, not to softmax_scale.
    torch.testing.assert_close(dash_attn.flash_attn_kvpacked_func(q, kv, 0.0), attention_ref(q, k, v), rtol=0,
                               atol=1e-12)
    ref = attention_ref(q, k, v, 0.3, True, (2, 0), 1.5, return_lse=True)
    _assert_matches(dash_attn.flash_attn_kvpacked_func(q, kv, 0.0, 0.3, True, (2, 0), 1.5, None, False, True), ref)


def test_fa2_varlen_packed_positional_calls():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(3, 0, 6), lens_k=(3, 0, 6), nheads_k=4)
    ref = attention_ref_varlen(q, k, v, cu_q, cu_q, 0.3, True, (2, 0), 1.5, return_lse=True)
    qkv_packed = torch.stack([q, k, v], 1)
    _assert_matches(dash_attn.flash_attn_varlen_qkvpacked_func(qkv_packed, cu_q, max_q, 0.0, 0.3, True, (2, 0), 1.5,
                                                               None, False, True), ref)
    kv = torch.stack([k, v], 1)
    _assert_matches(dash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_q, max_q, max_q, 0.0, 0.3, True, (2, 0),
                                                              1.5, None, False, True), ref)


@pytest.mark.parametrize("pack_gqa", [None, True, False])
@pytest.mark.parametrize("num_splits", [0, 1])
def test_tuning_hints_are_accepted_and_change_nothing(pack_gqa, num_splits):
    q, k, v = qkv(dtype=torch.float64)
    assert torch.equal(dash_attn.flash_attn_func(q, k, v, causal=True, num_splits=num_splits, pack_gqa=pack_gqa),
                       dash_attn.flash_attn_func(q, k, v, causal=True))


def test_fa3_keywords_reach_the_fa2_packed_functions():
    q, k, v = qkv(dtype=torch.float64)
    kv = torch.stack([k, v], 2)
    assert torch.equal(dash_attn.flash_attn_kvpacked_func(q, kv, causal=True, num_splits=0, pack_gqa=True, qv=None),
                       dash_attn.flash_attn_func(q, k, v, causal=True))


# ----------------------------------------------------------------------------------------------------------------------
# Options refused unless off, with errors naming the function that was called
# ----------------------------------------------------------------------------------------------------------------------

def _dense_call(name):
    q, k, v = qkv()
    if name == "flash_attn_func":
        return lambda **kw: dash_attn.flash_attn_func(q, k, v, **kw)
    if name == "flash_attn_qkvpacked_func":
        return lambda **kw: dash_attn.flash_attn_qkvpacked_func(torch.stack([q[:, :, :2], k, v], 2), **kw)
    return lambda **kw: dash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw)


def _varlen_call(name):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs(lens_q=(3, 0, 6), lens_k=(3, 0, 6))
    if name == "flash_attn_varlen_func":
        return lambda **kw: dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kw)
    if name == "flash_attn_varlen_qkvpacked_func":
        return lambda **kw: dash_attn.flash_attn_varlen_qkvpacked_func(torch.stack([q[:, :2], k, v], 1), cu_q, max_q,
                                                                        **kw)
    return lambda **kw: dash_attn.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, max_q, max_k,
                                                                   **kw)


ALL_FUNCTIONS = sorted(FA3_SIGNATURES) + sorted(FA2_SIGNATURES)


def _call_of(name):
    return _varlen_call(name) if "varlen" in name else _dense_call(name)


def _error(name, exc_type, **kwargs):
    with pytest.raises(exc_type) as info:
        _call_of(name)(**kwargs)
    return str(info.value)


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
@pytest.mark.parametrize("kwargs, argument", [
    (dict(window_size=(1.5, 0)), "window_size left"),
    (dict(window_size=(True, 0)), "window_size left"),
    (dict(causal=1), "causal"),
    (dict(softcap=float("inf")), "softcap"),
    (dict(softcap=float("nan")), "softcap"),
    (dict(softmax_scale=float("nan")), "softmax_scale"),
    (dict(schedule="fastest"), "schedule must be one of"),
    (dict(sm_margin=-1), "sm_margin"),
    (dict(deterministic="yes"), "deterministic"),
    (dict(q_descale=torch.ones(1)), "q_descale"),
    (dict(attention_chunk=-1), "attention_chunk"),
])
def test_errors_name_the_argument_and_the_function_called(name, kwargs, argument):
    message = _error(name, ValueError, **kwargs)
    assert message.startswith(f"{name}(): ") and argument in message, message


@pytest.mark.parametrize("name", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_kvpacked_func",
                                  "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func"])
@pytest.mark.parametrize("kwargs, argument", [(dict(qv=torch.zeros(1)), "qv must be None"),
                                              (dict(num_splits=2), "num_splits must be 1 or 0"),
                                              (dict(num_splits=True), "num_splits"),
                                              (dict(pack_gqa="yes"), "pack_gqa must be")])
def test_fa3_options_refused_unless_off(name, kwargs, argument):
    assert _error(name, ValueError, **kwargs).startswith(f"{name}(): {argument}")


@pytest.mark.parametrize("name", sorted(FA2_SIGNATURES))
@pytest.mark.parametrize("kwargs, argument", [(dict(dropout_p=0.1), "dropout_p must be 0.0"),
                                              (dict(dropout_p="0"), "dropout_p"),
                                              (dict(alibi_slopes=torch.zeros(4)), "alibi_slopes must be None")])
def test_fa2_options_refused_unless_off(name, kwargs, argument):
    assert _error(name, ValueError, **kwargs).startswith(f"{name}(): {argument}")


def test_fa2_dropout_given_positionally_is_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^flash_attn_kvpacked_func\(\): dropout_p must be 0.0"):
        dash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), 0.1)


@pytest.mark.parametrize("name", ALL_FUNCTIONS)
def test_unknown_keywords_are_a_type_error_naming_the_function(name):
    message = _error(name, TypeError, dropout=0.1)
    assert message.startswith(f"{name}()") and "unexpected keyword argument 'dropout'" in message


def test_layout_and_cu_seqlens_errors_name_the_packed_function():
    with pytest.raises(ValueError, match=r"^flash_attn_kvpacked_func\(\): kv must be"):
        dash_attn.flash_attn_kvpacked_func(torch.zeros(2, 9, 4, 16), torch.zeros(2, 9, 3, 2, 16))
    q, k, v, cu_q, _, max_q, _ = varlen_inputs(lens_q=(3, 0, 6), lens_k=(3, 0, 6))
    bad = torch.tensor([0, 5, 3, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_kvpacked_func\(\): cu_seqlens_k must be non-decreasing"):
        dash_attn.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, bad, max_q, max_q)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_qkvpacked_func\(\): max_seqlen_q=5 is smaller"):
        dash_attn.flash_attn_varlen_qkvpacked_func(torch.stack([q[:, :2], k, v], 1), cu_q, 5)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_qkvpacked_func\(\): max_seqlen_q must be an int"):
        dash_attn.flash_attn_varlen_qkvpacked_func(torch.stack([q[:, :2], k, v], 1), cu_q, 6.0)


def test_named_errors_keep_the_traceback_of_the_check_that_raised():
    q, k, v = qkv()
    with pytest.raises(ValueError) as info:
        dash_attn.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), window_size=(0.5, 0))
    assert "check_window" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert info.value.__suppress_context__  # one message, not the unnamed one above it


def test_old_positional_order_fails_loudly():
    # Before FA3's order, window_size sat in the sixth place: a call made that way now binds it to qv and is refused.
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^flash_attn_func\(\): qv must be None"):
        dash_attn.flash_attn_func(q, k, v, 0.4, False, (1, 2))


# ----------------------------------------------------------------------------------------------------------------------
# FA3's input rules
# ----------------------------------------------------------------------------------------------------------------------

INTEGER_LIKE = [pytest.param(int, id="int"), pytest.param(np.int64, id="numpy-int64"),
                pytest.param(np.int32, id="numpy-int32"),
                pytest.param(lambda x: torch.tensor(x), id="0-d-tensor"),
                pytest.param(lambda x: torch.tensor(x, dtype=torch.int32), id="0-d-int32-tensor")]


@pytest.mark.parametrize("make", INTEGER_LIKE)
def test_integer_like_window_values(make):
    q, k, v = qkv(seqlen_q=7, seqlen_k=10, dtype=torch.float64)
    out = dash_attn.flash_attn_func(q, k, v, window_size=(make(2), make(1)))
    assert torch.equal(out, dash_attn.flash_attn_func(q, k, v, window_size=(2, 1)))
    torch.testing.assert_close(out, attention_ref(q, k, v, window_size=(2, 1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("make", INTEGER_LIKE)
def test_integer_like_varlen_bounds(make):
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    assert torch.equal(dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, make(max_q), make(max_k), causal=True),
                       dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True))


@pytest.mark.parametrize("value", [1.0, np.float64(2.0), torch.tensor(2.0), torch.tensor(True), np.bool_(True),
                                   torch.tensor([1, 2]), "2", None])
def test_window_values_that_are_not_integers_are_refused(value):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^flash_attn_func\(\): window_size right must be an int"):
        dash_attn.flash_attn_func(q, k, v, window_size=(1, value))


@pytest.mark.parametrize("window", [(-1, 3), (2, 3), (2, 0), (-1, -1), (-5, 100), (4, 1000)])
def test_causal_forces_the_right_window_to_zero(window):
    q, k, v = qkv(seqlen_q=7, seqlen_k=10, dtype=torch.float64)
    out = dash_attn.flash_attn_func(q, k, v, causal=True, window_size=window)
    left = window[0] if window[0] >= 0 else -1
    assert torch.equal(out, dash_attn.flash_attn_func(q, k, v, causal=False, window_size=(left, 0)))
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True, window_size=window), rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [(-2, -7), (-3, 0), (-100, 2)])
def test_any_negative_side_is_unbounded(window):
    q, k, v = qkv(seqlen_q=7, seqlen_k=10, dtype=torch.float64)
    expected = tuple(-1 if w < 0 else w for w in window)
    assert torch.equal(dash_attn.flash_attn_func(q, k, v, window_size=window),
                       dash_attn.flash_attn_func(q, k, v, window_size=expected))


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(7, 10), (10, 7), (1, 9)])
def test_windows_wider_than_the_sequences_are_unbounded(seqlen_q, seqlen_k):
    q, k, v = qkv(seqlen_q=seqlen_q, seqlen_k=seqlen_k, dtype=torch.float64, requires_grad=True)
    full = dash_attn.flash_attn_func(q, k, v)
    for window in ((seqlen_k - 1, seqlen_q - 1), (seqlen_k, 10**6), (2**40, 2**63 - 1)):
        assert torch.equal(dash_attn.flash_attn_func(q, k, v, window_size=window), full), window
    # With causal the right side is 0 whatever its width; the left side still drops out once it spans every key.
    causal = dash_attn.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(dash_attn.flash_attn_func(q, k, v, causal=True, window_size=(seqlen_k - 1, 10**9)), causal)
    wide = dash_attn.flash_attn_func(q, k, v, causal=True, window_size=(2**40, 2**40))
    assert torch.equal(wide, causal)
    wide.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    causal.sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.equal(got, want)


def test_varlen_windows_wider_than_max_seqlen_are_unbounded():
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_inputs()
    full = dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert torch.equal(dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                        window_size=(max_k - 1, max_q - 1)), full)
    ref = attention_ref_varlen(q, k, v, cu_q, cu_k, None, True, (1, 5))
    torch.testing.assert_close(dash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                                window_size=(1, 5)), ref, rtol=0, atol=1e-12)

