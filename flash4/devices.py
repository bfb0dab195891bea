"""The CUDA device a call runs on: its architecture, its SM count, and a context that sends
launches to it. Looked up once per device and cached: a call's host path reads them."""

from __future__ import annotations

import contextlib
import functools
from typing import ContextManager

import torch

from flash4.dispatch import arch_of_capability


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    """The architecture flash4 builds for on CUDA device ``index``."""
    return arch_of_capability(*torch.cuda.get_device_capability(index))


@functools.lru_cache(maxsize=None)
def device_sms(index: int) -> int:
    """SMs of CUDA device ``index``: persistent kernels launch one CTA per SM."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_device(device: torch.device) -> ContextManager:
    """A context in which launches go to ``device``: switching the current device costs
    microseconds a call, so only when ``device`` is not the current one already."""
    if device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)
