"""Shared pytest setup: tests marked ``gpu`` run only on a Hopper (sm_90) GPU.

The ``gpu`` marker itself is declared in pyproject.toml.
"""

from __future__ import annotations

import pytest
import torch

# The kernels are built for sm_90a, which runs only on compute capability 9.0 exactly.
_GPU_TEST_CAPABILITY = (9, 0)


def _gpu_skip_reason() -> str | None:
    """Why the gpu tests cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none available)"
    capability = torch.cuda.get_device_capability()
    if capability != _GPU_TEST_CAPABILITY:
        return f"needs compute capability {_GPU_TEST_CAPABILITY}, this GPU has {capability}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)
