"""Masking of score tiles: keys past the end of the sequence and, when causal, keys after
the query's diagonal (aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q).

Only the few blocks that cross a boundary call this; the others run mask-free.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .mma_layouts import acc_rows_cols


@cute.jit
def mask_scores(
    acc_s: cute.Tensor,
    coords: cute.Tensor,
    row0: Int32,
    col0: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    causal: cutlass.Constexpr[bool],
) -> None:
    """Set to -inf every score whose key is out of range for its query.

    ``coords`` holds each accumulator element's (row, col) inside the tile (the MMA's
    partition of an identity tensor); ``row0`` and ``col0`` place the tile.
    """
    s = acc_rows_cols(acc_s)
    c = acc_rows_cols(coords)
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        # Columns (tile-local) from this limit on are masked for this row.
        limit = seqlen_k - col0
        if cutlass.const_expr(causal):
            row = row0 + c[r, 0][0]
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q - col0)
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            if c[r, j][1] >= limit:
                s[r, j] = -Float32.inf
