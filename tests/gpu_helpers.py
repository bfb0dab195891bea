"""Helpers shared by the GPU tests."""

from __future__ import annotations

import math

import torch


def poison_allocator() -> None:
    """Fill blocks of the caching allocator with NaN and hand them back: tensors allocated
    next (outputs, gradients) start as NaN unless every element is written. Both of its
    pools: one large block, and small (<= 1 MiB) ones, which come from a pool of their own."""
    blocks = [torch.full((1 << 26,), math.nan, device="cuda")]
    blocks += [torch.full((1 << 18,), math.nan, device="cuda") for _ in range(64)]
    del blocks
