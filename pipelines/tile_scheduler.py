"""Which (query block, head, batch) tile a CTA works on.

One CTA per output tile, launched as a grid of (query blocks, heads, batch). Grid x is the
fastest-varying launch order, so the query blocks of one head run close together in time
and share that head's K and V in L2.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


class SingleTileScheduler:
    """One tile per CTA. With ``longest_first`` (causal), block x = 0 takes the last query
    block, whose rows see the most keys, so the longest tiles start first and the short ones
    fill the tail of the wave."""

    def __init__(self, longest_first: bool):
        self.longest_first = longest_first

    @staticmethod
    def grid(num_m_blocks: cutlass.Int32, heads: cutlass.Int32, batch: cutlass.Int32):
        return (num_m_blocks, heads, batch)

    @cute.jit
    def tile(self) -> tuple[cutlass.Int32, cutlass.Int32, cutlass.Int32]:
        bx, head, batch = cute.arch.block_idx()
        m_block = bx
        if cutlass.const_expr(self.longest_first):
            m_block = cute.arch.grid_dim()[0] - 1 - bx
        return m_block, head, batch
