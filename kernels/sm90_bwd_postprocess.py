"""Backward postprocess: dQ out of its fp32 accumulator.

    dQ[b, i, h, :] = dQ_accum[b, h, i, :] * softmax_scale      (rounded to the 16-bit dtype)

The main kernel adds every key block's dS K into the accumulator, fp32, rows padded to
whole query blocks, each query block's tile stored as the main kernel's shared memory
holds it (``DQTileGeometry``: its parts in order, each in ``accumulator_tile_layout``); the
softmax scale is left out of the GEMM and applied here once. Each thread loads 16 bytes
(four fp32 of one row: the layout's swizzle moves 16-byte units whole), scales them,
rounds them in pairs (one cvt per 32-bit register, ``convert_packed``) and stores 8 bytes
into dQ's (batch, seqlen, heads, head_dim) layout. The fp32 product is rounded once, to
nearest even, as torch's ``mul(..., out=dq)`` rounds it: the same bits.

One CTA per (block of rows, head, batch); consecutive threads take consecutive 16 bytes of
a row, so the stores are coalesced and the loads read whole 16-byte units of one tile.

A transposed geometry (the dQᵀ GEMM's parts, in its threads' register order) holds no four
consecutive columns of a row together, so there a CTA takes one query block: it loads the
block's accumulator in order (coalesced 16-byte loads), puts each value where it belongs
in a row-major tile in shared memory, and the rows go out from there as above.

With ``overlap`` the postprocess is a programmatic dependent of the main kernel: it may
start once every CTA of the main grid has, on the SMs that grid's last wave leaves idle.
A CTA first waits until its head's counter shows every key block's dQ landed (the main
store warp's ``signal_ready``), not for the whole grid; its memory pass is the same.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.global_semaphore import wait_for_turn
from ..pipelines.warp_roles import THREADS_PER_WARP
from .configs import DQTileGeometry, accumulator_register_coords
from .memory_pass import LOAD_BYTES, load_batches, row_vector
from .packed_convert import convert_packed
from .wgmma import rows_first

# Four warps, many CTAs: enough loads in flight per SM for a bandwidth-bound pass.
THREADS = 4 * THREADS_PER_WARP
# Rows per CTA: a block of 64 rows of head dim 128 is 32 KiB of fp32, 16 loads a thread.
BLOCK_ROWS = 64
# The staged tile's rows are head_dim + 4 floats apart: the scattered stores of a warp's
# loaded vector (8 consecutive columns of 4 rows, 2 apart) then fall in 32 different banks.
STAGED_ROW_PAD = 4


class Sm90BackwardPostprocess:
    """dQ = dQ_accum * softmax_scale in a 16-bit dtype, for one head dim and tile geometry."""

    def __init__(self, geometry: DQTileGeometry, dtype: Type[cutlass.Numeric], overlap: bool = False):
        self.geometry = geometry
        self.overlap = overlap
        self.head_dim = geometry.head_dim
        self.dtype = dtype
        self.vector = row_vector(Float32.width, self.head_dim)
        self.vectors_per_row = self.head_dim // self.vector
        self.block_rows = geometry.tile_m if geometry.transposed else BLOCK_ROWS
        self.turns = -(-self.block_rows * self.vectors_per_row // THREADS)

    @cute.jit
    def __call__(
        self,
        mAccum: cute.Tensor,  # (batch, heads, padded seqlen_q * head_dim), float32, tiled
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim), 16-bit
        # overlap: per (batch, head), how many key blocks' dQ have landed (the main
        # store warp's signal_ready), and how many there are.
        mReady: cute.Tensor,  # (batch, heads), int32
        key_blocks: Int32,
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        mdQ = rows_first(mdQ)
        blocks = cute.ceil_div(cute.size(mdQ.shape[0]), self.block_rows)
        self.kernel(mAccum, mdQ, mReady, key_blocks, softmax_scale).launch(
            grid=(blocks, cute.size(mdQ.shape[2]), cute.size(mdQ.shape[3])),
            block=[THREADS, 1, 1],
            stream=stream,
            use_pdl=self.overlap,
        )

    @cute.kernel
    def kernel(self, mAccum: cute.Tensor, mdQ: cute.Tensor, mReady: cute.Tensor, key_blocks: Int32,
               softmax_scale: Float32):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.overlap):
            # Launched while the main kernel still runs (programmatic dependent launch): wait
            # until every key block of this head has added its dQ, not for the whole grid.
            if tidx == 0:
                wait_for_turn(mReady.iterator + cute.crd2idx((batch, head), mReady.layout), key_blocks)
            cute.arch.barrier()
        first_row = m_block * self.block_rows
        # The block's rows that exist: a last block may be partial (the accumulator's
        # padding rows are never read).
        end_row = first_row + self.block_rows
        if mdQ.shape[0] < end_row:
            end_row = mdQ.shape[0]
        source = mAccum[batch, head, None]
        if cutlass.const_expr(self.geometry.transposed):
            source = self.stage_block(source, m_block, tidx)
        for turns in load_batches(self.turns):
            accums = [cute.make_rmem_tensor(cute.make_layout(self.vector), Float32) for _ in turns]
            for accum, turn in zip(accums, turns):
                index = turn * THREADS + tidx
                row = first_row + index // self.vectors_per_row
                if row < end_row:
                    column = index % self.vectors_per_row
                    if cutlass.const_expr(self.geometry.transposed):
                        offset = (row - first_row) * (self.head_dim + STAGED_ROW_PAD) + column * self.vector
                    else:
                        offset = self.geometry.offset(row, column * self.vector)
                    cute.autovec_copy(cute.local_tile(source, (self.vector,), (offset // self.vector,)), accum)
            for accum, turn in zip(accums, turns):
                index = turn * THREADS + tidx
                row = first_row + index // self.vectors_per_row
                if row < end_row:
                    column = index % self.vectors_per_row
                    scaled = cute.make_rmem_tensor(cute.make_layout(self.vector), Float32)
                    scaled.store(accum.load() * softmax_scale)
                    dq = cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype)
                    convert_packed(scaled, dq)
                    cute.autovec_copy(dq, cute.local_tile(mdQ[row, None, head, batch], (self.vector,), (column,)))
        if cutlass.const_expr(self.overlap):
            # Stream order after this grid must also cover the main kernel (its dK and dV),
            # which the waits above do not: the last CTA waits for the main grid to finish.
            grid = cute.arch.grid_dim()
            if m_block == grid[0] - 1 and head == grid[1] - 1 and batch == grid[2] - 1:
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def stage_block(self, accum: cute.Tensor, m_block: Int32, tidx: Int32) -> cute.Tensor:
        """Query block ``m_block`` of a transposed accumulator (one head's, ``accum``) as a
        row-major (tile_m, head_dim + STAGED_ROW_PAD) fp32 tile in shared memory."""
        geometry = self.geometry
        stride = self.head_dim + STAGED_ROW_PAD
        staged = cutlass.memory.SmemAllocator().allocate_tensor(
            Float32, cute.make_layout(geometry.tile_m * stride), byte_alignment=LOAD_BYTES
        )
        part_floats = geometry.part_rows * geometry.part_cols
        block = cute.local_tile(accum, (geometry.tile_m * self.head_dim,), (m_block,))
        turns = geometry.tile_m * self.head_dim // (self.vector * THREADS)
        for batch_turns in load_batches(turns):
            values = [cute.make_rmem_tensor(cute.make_layout(self.vector), Float32) for _ in batch_turns]
            for value, turn in zip(values, batch_turns):
                cute.autovec_copy(cute.local_tile(block, (self.vector,), (turn * THREADS + tidx,)), value)
            for value, turn in zip(values, batch_turns):
                first = (turn * THREADS + tidx) * self.vector
                part, inside = first // part_floats, first % part_floats
                for i in cutlass.range_constexpr(self.vector):
                    # The dQᵀ accumulator's (row, col) is dQ's (col, part's first column + row).
                    column, query = accumulator_register_coords(inside + i)
                    staged[query * stride + part * geometry.part_cols + column] = value[i]
        cute.arch.barrier()
        return staged
