"""Online softmax over the rows of a wgmma accumulator, kept in registers.

Per query row the state is the running max ``m`` of the raw scores and the running sum
``l`` of ``exp2((s - m) * scale_log2)``, where ``scale_log2 = softmax_scale * log2(e)``
folds the softmax scale and the change of base into one multiply. Four threads share a
row (a quad), so the max is reduced over the quad at once; the sum stays a per-thread
partial until ``finalize`` since only the final value needs the whole row.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .mma_layouts import acc_rows_cols

# The four threads of a quad hold the columns of one accumulator row.
THREADS_PER_ROW = 4


class OnlineSoftmax:
    def __init__(self, scale_log2: Float32, rows: int):
        self.scale_log2 = scale_log2
        self.rows = rows
        self.row_max = cute.make_rmem_tensor(rows, Float32)
        self.row_sum = cute.make_rmem_tensor(rows, Float32)

    @cute.jit
    def update(
        self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]
    ) -> cute.Tensor:
        """Turn scores into unnormalised probabilities in place; return each row's factor
        ``exp2((m_old - m_new) * scale_log2)`` for rescaling O. Only a ``masked`` block can
        leave a row with no finite score."""
        s = acc_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            row = s[r, None].load()
            m_new = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            if cutlass.const_expr(not is_first):
                m_new = cute.arch.fmax(m_new, self.row_max[r])
            m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=THREADS_PER_ROW)
            m_old = self.row_max[r]
            self.row_max[r] = m_new
            # A row that has seen only masked keys has max -inf; subtracting 0 instead keeps
            # exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            m_safe = m_new
            if cutlass.const_expr(masked):
                m_safe = 0.0 if m_new == -Float32.inf else m_new
            p = cute.math.exp2(row * self.scale_log2 - m_safe * self.scale_log2, fastmath=True)
            s[r, None].store(p)
            partial = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = partial
            else:
                scale = cute.math.exp2((m_old - m_safe) * self.scale_log2, fastmath=True)
                row_scale[r] = scale
                self.row_sum[r] = self.row_sum[r] * scale + partial
        return row_scale

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor) -> None:
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(self.rows):
            o[r, None].store(o[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, lse: cute.Tensor) -> cute.Tensor:
        """Write each row's natural-log LSE into ``lse``; return 1/l for normalising O.

        A row that saw no key (l = 0) gets 1/l = 0, so its output is 0, and LSE = -inf.
        """
        inv_sum = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=THREADS_PER_ROW)
            empty = total == 0.0
            inv_sum[r] = 0.0 if empty else cute.arch.rcp_approx(total)
            lse[r] = (
                -Float32.inf
                if empty
                else self.row_max[r] * self.scale_log2 * math.log(2.0) + cute.math.log(total, fastmath=True)
            )
        return inv_sum
