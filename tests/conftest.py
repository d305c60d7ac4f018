"""Shared pytest wiring: GPU tests carry the `gpu` marker and skip cleanly without an sm90 GPU and built kernels, and
run under a time limit (gpu_watchdog.py); the `fake_cuda` fixture of the CPU-side API tests."""
import pytest

import gpu_watchdog


def _gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an sm90 GPU, found sm{major}{minor}"
    try:
        from dash_attn import _C  # noqa: F401
    except ImportError as exc:
        return f"dash_attn._C is not built ({exc})"
    return None


def _unbuilt_dtype(item, built):
    """A torch dtype among the item's parameters that the build has no kernels for, or None."""
    from dash_attn import validation
    params = getattr(getattr(item, "callspec", None), "params", {})
    return next((v for v in params.values() if v in validation.KERNEL_DTYPES and v not in built), None)


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        # GPU tests of an element type the build skipped (DASH_ATTN_DTYPES) skip rather than fail.
        from dash_attn import interface
        built = interface._supported_dtypes()
        for item in items:
            dtype = _unbuilt_dtype(item, built) if "gpu" in item.keywords else None
            if dtype is not None:
                item.add_marker(pytest.mark.skip(reason=f"this build has no {dtype} kernels (DASH_ATTN_DTYPES)"))
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    # A kernel that never returns ends the test's process with its name (gpu_watchdog.py) rather than holding the run.
    seconds = gpu_watchdog.limit_seconds() if "gpu" in item.keywords else 0
    with gpu_watchdog.watchdog(item.nodeid, seconds):
        yield


@pytest.fixture
def fake_cuda(monkeypatch):
    """Routes the CUDA launch helpers to a recording stand-in so their argument order can be checked on the CPU."""
    import torch
    from api_common import FakeExtension, patch_interface
    from dash_attn import interface, validation

    ext = FakeExtension()
    patch_interface(monkeypatch, "_extension", lambda: ext)
    monkeypatch.setattr(validation, "check_cuda_device", lambda device: None)
    patch_interface(monkeypatch, "_device_guard", lambda device: torch.no_grad())
    patch_interface(monkeypatch, "_l2_bytes", lambda device_index: 60 * 2**20)
    # The cached queries of the extension: cleared before (stand-in answers) and after (the real extension's).
    cached = (interface._supported_head_dims, interface._num_sms, interface._bwd_tile_shape,
              interface._choose_schedule, interface._softcap_built, interface._supported_dtypes)
    for query in cached:
        query.cache_clear()
    yield ext
    for query in cached:
        query.cache_clear()
