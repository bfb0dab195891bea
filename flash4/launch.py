"""Launching a compiled 16-bit forward kernel: its tensors, and for a row that splits the
tail of its persistent grid (``split_tail``), the buffers the pieces meet in.

The split's shape is chosen here per call (kernels/tail_split.py, ``choose_pieces``),
from the same counts the kernel's scheduler derives: units (query blocks, or whole
clusters' blocks, times heads times batch) over walkers (SMs, or clusters). The kernel
reads the tail's size and the pieces off the buffers' shapes, so nothing recompiles.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from flash4.kernels.configs import ROWS_PER_CONSUMER_WARPGROUP, THREADS_PER_WARPGROUP, Sm90ForwardConfig
from flash4.kernels.tail_split import choose_pieces, record_floats

# A wgmma m64 accumulator gives each thread two rows of its warp's 16 (lane / 4 and
# lane / 4 + 8): a thread keeps two row maxima and two row sums.
ACC_ROWS_PER_THREAD = 2

# Per (device, config): the placeholder buffers of a split-tail row when a call cuts
# nothing (one piece tells the kernel so; it never touches them).
_PLACEHOLDERS: dict[tuple[int | None, Sm90ForwardConfig], tuple[torch.Tensor, torch.Tensor]] = {}


def split_record_shape(config: Sm90ForwardConfig) -> tuple[int, int]:
    """(consumer threads, floats per thread's record) of a split tail's workspace."""
    acc_floats = ROWS_PER_CONSUMER_WARPGROUP * config.head_dim // THREADS_PER_WARPGROUP
    return config.consumer_warpgroups * THREADS_PER_WARPGROUP, record_floats(acc_floats, ACC_ROWS_PER_THREAD)


def split_tail_buffers(
    config: Sm90ForwardConfig, batch: int, heads: int, seqlen_q: int, seqlen_k: int, sms: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ticket counters, workspace) for one call of a ``split_tail`` row."""
    ctas = config.cluster_ctas
    m_blocks = -(-seqlen_q // config.tile_m)
    m_blocks = -(-m_blocks // ctas) * ctas
    units = m_blocks // ctas * heads * batch
    tail, pieces = choose_pieces(units, sms // ctas, -(-seqlen_k // config.tile_n))
    threads, record = split_record_shape(config)
    if pieces == 1:
        key = (device.index, config)
        if key not in _PLACEHOLDERS:
            _PLACEHOLDERS[key] = (torch.empty(ctas, dtype=torch.int32, device=device),
                                  torch.empty(ctas, 1, threads, record, dtype=torch.float32, device=device))
        return _PLACEHOLDERS[key]
    return (torch.zeros(tail * ctas, dtype=torch.int32, device=device),
            torch.empty(tail * ctas, pieces, threads, record, dtype=torch.float32, device=device))


def run_forward(
    kernel: Callable[..., Any], config: Sm90ForwardConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor | None, softmax_scale_log2: float, sms: int,
) -> None:
    """One launch of ``kernel`` (``flash4.compiler.compiled_forward`` of a 16-bit row with
    ``config``) on torch's current stream."""
    counters = work = None
    if config.split_tail:
        batch, seqlen_q, heads, _ = q.shape
        counters, work = split_tail_buffers(config, batch, heads, seqlen_q, k.shape[1], sms, q.device)
    kernel(q, k, v, out, lse, softmax_scale_log2, sms, counters, work)
