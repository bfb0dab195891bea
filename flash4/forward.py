"""The Hopper forward pass, host side: the selector's kernel for a problem, compiled once
per row and cached, and its launch into fresh or given out and LSE buffers. The eager
calls (flash4/interface.py, flash4/autograd.py) and the custom op that torch.compile
traces (flash4/custom_ops.py) all launch through here.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from flash4.checks import AttentionProblem
from flash4.compiler import compiled_forward, tile_counter
from flash4.devices import device_arch, device_sms, on_device
from flash4.dispatch import select
from flash4.kernels.configs import Sm90ForwardConfig

# exp(x) = exp2(x * log2(e)): the kernel exponentiates in base 2 with this folded into the scale.
LOG2_E = math.log2(math.e)

# (device index, dtype, head dim, causal, row's min_seqlen_q, clusters of heads, writes LSE)
# -> compiled kernel, and the row's configuration (whether it takes a tile counter).
# Everything in the key is static, so shapes and scales never recompile; plain values keep
# the lookup cheap (hashing the nested dataclasses of a row is not).
_KERNELS: dict[tuple[int, str, int, bool, int, bool, bool], tuple[Callable[..., Any], Sm90ForwardConfig]] = {}


def forward_kernel(
    device_index: int, problem: AttentionProblem, with_lse: bool
) -> tuple[Callable[..., Any], Sm90ForwardConfig]:
    """The compiled kernel of the selector's row for ``problem`` on this device, and the
    row's configuration."""
    entry = select(
        device_arch(device_index), problem.dtype, problem.head_dim, problem.causal, problem.seqlen_q,
        problem.group_size,
    )
    key = (
        device_index, problem.dtype, problem.head_dim, problem.causal, entry.min_seqlen_q,
        entry.config.cluster_heads, with_lse,
    )
    kernel = _KERNELS.get(key)
    if kernel is None:
        kernel = _KERNELS[key] = (compiled_forward(entry, with_lse), entry.config)
    return kernel


def launch_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    problem: AttentionProblem,
) -> None:
    """Attention of checked inputs into ``out`` and ``lse`` (None: the variant that never
    writes it)."""
    device = q.device
    kernel, config = forward_kernel(device.index, problem, lse is not None)
    scale_log2 = problem.softmax_scale * LOG2_E
    sms = device_sms(device.index)
    with on_device(device):
        kernel(q, k, v, out, lse, scale_log2, sms, tile_counter(config, device))


def run_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of checked inputs into new buffers: out (contiguous, like q) and, with
    ``with_lse``, the float32 LSE (batch, heads, seqlen_q), else None."""
    # empty_like is the cheapest allocation call torch offers (about 2 us against 5 us for
    # torch.empty with keyword arguments, on the H200's host).
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = (
        torch.empty((problem.batch, problem.heads, problem.seqlen_q), dtype=torch.float32, device=q.device)
        if with_lse
        else None
    )
    launch_forward(q, k, v, out, lse, problem)
    return out, lse
