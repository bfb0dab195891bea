"""Benchmark adapters for peers outside torch, kept out of the flash4 package.

``flash4.bench`` loads this module when it runs from a checkout; each provider turns
(q, k, v, causal, scale) in (batch, seqlen, heads, head_dim) layout into a no-argument call
to time and a function that brings its result back to that layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    # Imported when measured, and only if installed: an absent peer is a recorded error.
    from flash_attn.cute import flash_attn_func

    # 4.0.0b36 returns (out, lse); other versions may return out alone.
    return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)), (
        lambda out: out[0] if isinstance(out, tuple) else out
    )


def _fa4_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    from flash_attn.cute import flash_attn_func

    from flash4.bench import autograd_backward

    def forward(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q_, k_, v_, softmax_scale=scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return autograd_backward(forward, q, k, v)


PROVIDERS: dict[str, Callable[..., Any]] = {"fa4": _fa4}
BACKWARD_PROVIDERS: dict[str, Callable[..., Any]] = {"fa4": _fa4_backward}
