"""Backward preprocess: per query row, what the main backward kernel reads instead of
recomputing it in every key block.

    D[b, h, i]        = sum_d dO[b, i, h, d] * O[b, i, h, d]      (fp32)
    lse_log2[b, h, i] = LSE[b, h, i] * log2(e)
    dq_accum[b, h]    = 0                                          (fp32, padded rows)
    dq_ready[b, h]    = 0                     (int32: key blocks whose dQ has landed)

or, when the main kernel's first contribution to each query block of dQ stores instead of
adding (``dq_first_stores``), no zeros in the accumulator but in the block's ``n`` counters
(its ticket; deterministic, a turn per part):

    dq_counters[b, h, block * n + i] = 0      (i < n)

dS = P ∘ (dP − D) needs D = rowsum(P ∘ dP), which equals rowsum(dO ∘ O) because O = P V:
one dot product per row here instead of a full row of dP in the main kernel. The main
kernel recomputes P = exp2(S · scale · log2(e) − lse_log2) with one FMA per score.

Rows are padded to whole query blocks of the main kernel. Padded rows get D = 0 and
lse_log2 = +inf, so their P is exp2(−inf) = 0 and they add nothing; a row that saw no key
(LSE = −inf) gets lse_log2 = 0, harmless since all its scores are masked to −inf.

One CTA per (query block, head, batch). A row is read in 16-byte vectors by a group of
lanes of one warp, which then sum their partial products with shuffles.
"""

from __future__ import annotations

import math
from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.warp_roles import THREADS_PER_WARP
from .memory_pass import FP32_PER_VECTOR, row_vector
from .wgmma import rows_first

# Four warps: enough loads in flight per SM for a bandwidth-bound pass, with many CTAs.
THREADS = 4 * THREADS_PER_WARP


class Sm90BackwardPreprocess:
    """The preprocess for one head dim, dtype and query block size (the main kernel's)."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric], block_rows: int, dq_counters_per_block: int = 0):
        self.head_dim = head_dim
        # 0: zero the dQ accumulator; else the counters of each query block's dQ parts.
        self.dq_counters_per_block = dq_counters_per_block
        self.dtype = dtype
        self.block_rows = block_rows
        self.vector = row_vector(dtype.width, head_dim)
        # Lanes that share one row; a power of two up to a warp, so their shuffles stay
        # inside one warp.
        self.lanes_per_row = head_dim // self.vector
        if self.lanes_per_row > THREADS_PER_WARP or self.lanes_per_row & (self.lanes_per_row - 1):
            raise ValueError(f"head_dim={head_dim}: a row must span a power of two <= 32 lanes")
        self.rows_per_pass = THREADS // self.lanes_per_row
        if block_rows % self.rows_per_pass:
            raise ValueError(f"block_rows={block_rows} is not a multiple of {self.rows_per_pass}")

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q), float32
        mD: cute.Tensor,  # (batch, heads, padded seqlen_q), float32
        mLSELog2: cute.Tensor,  # (batch, heads, padded seqlen_q), float32
        mdQAccum: cute.Tensor,  # (batch, heads, padded seqlen_q * head_dim), float32
        mdQReady: cute.Tensor,  # (batch, heads), int32
        mdQCounters: Optional[cute.Tensor],  # (batch, heads, query blocks x parts), int32
        stream: cuda.CUstream,
    ):
        mO, mdO, mLSE, mD, mLSELog2, mdQAccum = (rows_first(t) for t in (mO, mdO, mLSE, mD, mLSELog2, mdQAccum))
        if cutlass.const_expr(mdQCounters is not None):
            mdQCounters = rows_first(mdQCounters)
        blocks = cute.ceil_div(cute.size(mO.shape[0]), self.block_rows)
        self.kernel(mO, mdO, mLSE, mD, mLSELog2, mdQAccum, mdQReady, mdQCounters).launch(
            grid=(blocks, cute.size(mO.shape[2]), cute.size(mO.shape[3])),
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mLSELog2: cute.Tensor,
        mdQAccum: cute.Tensor,
        mdQReady: cute.Tensor,
        mdQCounters: Optional[cute.Tensor],
    ):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        if m_block == 0 and tidx == 0:
            mdQReady[batch, head] = Int32(0)
        lane_in_row = tidx % self.lanes_per_row
        row_in_pass = tidx // self.lanes_per_row
        self._rows(mO, mdO, mLSE, mD, mLSELog2, m_block, head, batch, lane_in_row, row_in_pass)
        if cutlass.const_expr(self.dq_counters_per_block):
            if tidx < self.dq_counters_per_block:
                mdQCounters[m_block * self.dq_counters_per_block + tidx, head, batch] = Int32(0)
        else:
            self._zero_accumulator(mdQAccum, m_block, head, batch, tidx)

    @cute.jit
    def _zero_accumulator(self, mdQAccum: cute.Tensor, m_block: Int32, head: Int32, batch: Int32, tidx: Int32):
        # This block's slice of the dQ accumulator, which the main kernel adds into, in
        # 16-byte stores.
        chunk = self.block_rows * self.head_dim
        accum = cute.local_tile(mdQAccum[None, head, batch], (chunk,), (m_block,))
        zeros = cute.make_rmem_tensor(cute.make_layout(FP32_PER_VECTOR), Float32)
        zeros.fill(0.0)
        for i in cutlass.range(chunk // (FP32_PER_VECTOR * THREADS), unroll_full=True):
            cute.autovec_copy(zeros, cute.local_tile(accum, (FP32_PER_VECTOR,), (i * THREADS + tidx,)))

    @cute.jit
    def _rows(self, mO, mdO, mLSE, mD, mLSELog2, m_block, head, batch, lane_in_row, row_in_pass):
        seqlen = mO.shape[0]
        columns = cute.make_layout(self.vector)
        for p in cutlass.range_constexpr(self.block_rows // self.rows_per_pass):
            row = m_block * self.block_rows + p * self.rows_per_pass + row_in_pass
            partial = Float32(0.0)
            if row < seqlen:
                o = cute.make_rmem_tensor(columns, self.dtype)
                do = cute.make_rmem_tensor(columns, self.dtype)
                cute.autovec_copy(cute.local_tile(mO[row, None, head, batch], (self.vector,), (lane_in_row,)), o)
                cute.autovec_copy(cute.local_tile(mdO[row, None, head, batch], (self.vector,), (lane_in_row,)), do)
                products = o.load().to(Float32) * do.load().to(Float32)
                partial = products.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            self._write_row(mLSE, mD, mLSELog2, row, seqlen, head, batch, lane_in_row, partial)

    @cute.jit
    def _write_row(self, mLSE, mD, mLSELog2, row, seqlen, head, batch, lane_in_row, partial: Float32):
        """The row's D (its lanes' partial sums added) and lse_log2, by its first lane."""
        total = cute.arch.warp_reduction_sum(partial, threads_in_group=self.lanes_per_row)
        if lane_in_row == 0:
            lse_log2 = Float32.inf
            if row < seqlen:
                lse = mLSE[row, head, batch]
                lse_log2 = 0.0 if lse == -Float32.inf else lse * math.log2(math.e)
            mD[row, head, batch] = total
            mLSELog2[row, head, batch] = lse_log2
