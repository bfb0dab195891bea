"""What the bandwidth-bound passes (FP8 quantization, the backward's pre- and postprocess)
share: how wide a thread's loads are and how many it keeps in flight.

A thread's work in such a pass is a list of turns, one 16-byte load and one store each.
Written as a loop of load-convert-store, it keeps one load in flight: ptxas keeps a load
behind an earlier store to memory it cannot tell apart, and the next convert waits for the
load. ``load_batches`` splits the turns into batches whose loads are all issued (unrolled
at trace time) before the batch's first store.
"""

from __future__ import annotations

from typing import Iterator

# 16-byte global loads: the widest a thread issues.
LOAD_BYTES = 16
# fp32 values per 16-byte access.
FP32_PER_VECTOR = LOAD_BYTES // 4
# Loads a thread keeps in flight: at 4.8 TB/s and about 1 us of latency an H200 SM needs
# some 36 KB in flight, nine warps' worth of eight 16-byte loads a lane.
LOADS_IN_FLIGHT = 8


def row_vector(dtype_bits: int, head_dim: int) -> int:
    """Elements of ``dtype_bits`` bits per 16-byte load, checked to tile a row of
    ``head_dim`` elements."""
    vector = LOAD_BYTES * 8 // dtype_bits
    if head_dim % vector:
        raise ValueError(f"head_dim={head_dim} must be a multiple of {vector} for 16-byte loads")
    return vector


def load_batches(turns: int, loads_per_turn: int = 1) -> Iterator[range]:
    """The turns ``0 .. turns - 1`` in consecutive batches of at most LOADS_IN_FLIGHT loads
    (at least one turn)."""
    per_batch = max(1, LOADS_IN_FLIGHT // loads_per_turn)
    for first in range(0, turns, per_batch):
        yield range(first, min(first + per_batch, turns))
