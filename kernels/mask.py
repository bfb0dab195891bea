"""Masking of score tiles: keys past the end of the sequence and, when causal, keys after
the query's diagonal (aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q).

Only the few blocks that cross a boundary call this; the others run mask-free.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32

from .f16_scores import mask_words
from .mma_layouts import acc_rows_cols


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    coords: cute.Tensor,
    coords0: cute.Tensor,
    row0: Int32,
    col0: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
    cols: cutlass.Constexpr = None,
) -> None:
    """Set to -inf every score whose key is out of range for its query.

    ``coords`` holds this thread's (row, col) of each accumulator element inside the tile,
    ``coords0`` thread 0's. An MMA layout is affine in (thread, value), so every element's
    coordinate is thread 0's (known at compile time) plus this thread's offset: the limits
    are shifted by the offset once, and each element compares a constant against them.
    ``row0`` and ``col0`` place the tile. ``cols``: mask only the first that many columns
    of the ``acc_rows_cols`` view (the caller overwrites the rest).
    """
    s = acc_rows_cols(acc_s)
    c = acc_rows_cols(coords)
    c0 = acc_rows_cols(coords0)
    # Columns from this limit on are out of range, in thread 0's coordinates.
    col_limit = seqlen_k - col0 - c[0, 0][1]
    row_offset = row0 + c[0, 0][0]

    def limit_of(r: int):
        limit = col_limit
        if cutlass.const_expr(causal):
            row = row_offset + c0[r, 0][0]
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q - col0 - c[0, 0][1])
        return limit

    if cutlass.const_expr(acc_s.element_type == Float16):
        if cutlass.const_expr(cols is not None):
            raise ValueError("cols: the f16 scores' mask covers whole rows")
        limits = [limit_of(r) for r in range(cute.size(s, mode=[0]))]
        mask_words(acc_s, lambda r, j: c0[r, j][1] >= limits[r])
        return
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        limit = limit_of(r)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1]) if cutlass.const_expr(cols is None) else cols):
            # A select, not a branch: a conditional store into the register fragment
            # compiles to selects over the whole fragment.
            s[r, j] = -Float32.inf if c0[r, j][1] >= limit else s[r, j]
