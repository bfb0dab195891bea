"""Which (query block, head, batch) tiles a CTA works on.

Tiles are numbered with the query block fastest, then head, then batch, so tiles that run
at the same time mostly share one head's K and V in L2.

- One tile per CTA: a grid of (query blocks, heads, batch); each CTA runs its loop once.
- Persistent: ``min(tiles, max_ctas)`` CTAs, one per SM; CTA i takes tiles i, i + grid,
  i + 2 grid, ... While one tile's epilogue runs, the producer already loads the next
  tile's K and Q, hiding the fill latency that a fresh CTA pays at every tile.

With ``longest_first`` (causal), query blocks are taken from the last to the first: the
last block's rows see the most keys, so the longest tiles start first and the short ones
fill the tail.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class TileScheduler:
    def __init__(
        self,
        num_m_blocks: Int32,
        heads: Int32,
        batch: Int32,
        persistent: bool,
        longest_first: bool,
    ):
        self.num_m_blocks = num_m_blocks
        self.heads = heads
        self.batch = batch
        self.persistent = persistent
        self.longest_first = longest_first

    # A scheduler is read inside the kernel's dynamic tile loop, so the DSL must be able to
    # carry it through the loop as run-time values (its three sizes).
    def __extract_mlir_values__(self) -> list:
        return [Int32(x).ir_value() for x in (self.num_m_blocks, self.heads, self.batch)]

    def __new_from_mlir_values__(self, values: list) -> "TileScheduler":
        return TileScheduler(*(Int32(v) for v in values), self.persistent, self.longest_first)

    def num_tiles(self) -> Int32:
        return self.num_m_blocks * self.heads * self.batch

    def grid(self, max_ctas: Int32) -> tuple:
        if self.persistent:
            return (cutlass.min(self.num_tiles(), max_ctas), 1, 1)
        return (self.num_m_blocks, self.heads, self.batch)

    @cute.jit
    def first(self) -> Int32:
        """This CTA's first tile index."""
        bx, by, bz = cute.arch.block_idx()
        index = bx
        if cutlass.const_expr(not self.persistent):
            index = bx + self.num_m_blocks * (by + self.heads * bz)
        return index

    @cute.jit
    def stride(self) -> Int32:
        """Distance to this CTA's next tile: past the last tile when one tile per CTA."""
        step = self.num_tiles()
        if cutlass.const_expr(self.persistent):
            step = cute.arch.grid_dim()[0]
        return step

    @cute.jit
    def tile(self, index: Int32) -> tuple[Int32, Int32, Int32]:
        """(query block, head, batch) of tile ``index``."""
        m_block = index % self.num_m_blocks
        rest = index // self.num_m_blocks
        head = rest % self.heads
        batch = rest // self.heads
        if cutlass.const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_block
        return m_block, head, batch
