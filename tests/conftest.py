"""Shared pytest wiring: GPU tests carry the `gpu` marker and skip cleanly without an sm90 GPU and built kernels."""
import pytest


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


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
