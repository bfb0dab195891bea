"""Masking of score tiles: keys past the end of the sequence and, when causal, keys after
the query's diagonal (aligned bottom-right: query i sees keys j <= i + seqlen_k - seqlen_q).

Only the few blocks that cross a boundary call this; the others run mask-free.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .mma_layouts import acc_rows_cols

# A thread's accumulator columns come in pairs 8 apart (0, 1, 8, 9, 16, ...): 2 of every 8.
COLUMN_PAIR_STRIDE = 8
# One 32-bit word of keep-bits per 32 elements of a row.
BITS_PER_WORD = 32


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
    bits: cutlass.Constexpr[bool] = False,
) -> None:
    """Set to -inf every score whose key is out of range for its query.

    ``coords`` holds this thread's (row, col) of each accumulator element inside the tile,
    ``coords0`` thread 0's. An MMA layout is affine in (thread, value), so every element's
    coordinate is thread 0's (known at compile time) plus this thread's offset: the limits
    are shifted by the offset once, and each element compares a constant against them.
    ``row0`` and ``col0`` place the tile.
    """
    s = acc_rows_cols(acc_s)
    c = acc_rows_cols(coords)
    c0 = acc_rows_cols(coords0)
    # Columns from this limit on are out of range, in thread 0's coordinates.
    col_limit = seqlen_k - col0 - c[0, 0][1]
    row_offset = row0 + c[0, 0][0]
    columns = cute.size(s, mode=[1])
    # With ``bits``, each row's limit becomes a word of keep-bits, one per element, that
    # ptxas turns into predicates 7 at a time (R2P) instead of one compare per element.
    # That needs thread 0's columns to be the pairs 0, 1, 8, 9, ...: checked here, at trace
    # time, since they are compile-time constants.
    use_bits = bits and all(
        c0[0, j][1] == COLUMN_PAIR_STRIDE * (j // 2) + j % 2 for j in range(columns)
    )
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        limit = col_limit
        if cutlass.const_expr(causal):
            row = row_offset + c0[r, 0][0]
            limit = cutlass.min(limit, row + 1 + seqlen_k - seqlen_q - col0 - c[0, 0][1])
        if cutlass.const_expr(use_bits):
            kept = kept_elements(limit)
            for w in cutlass.range_constexpr(cute.ceil_div(columns, BITS_PER_WORD)):
                word = keep_bits_below(kept - w * BITS_PER_WORD)
                for i in cutlass.range_constexpr(min(BITS_PER_WORD, columns - w * BITS_PER_WORD)):
                    j = w * BITS_PER_WORD + i
                    keep = cutlass.Boolean(word & (Uint32(1) << i))
                    s[r, j] = s[r, j] if keep else -Float32.inf
        else:
            for j in cutlass.range_constexpr(columns):
                # A select, not a branch: a conditional store into the register fragment
                # compiles to selects over the whole fragment.
                s[r, j] = -Float32.inf if c0[r, j][1] >= limit else s[r, j]


def kept_elements(limit):
    """How many of a thread's columns 0, 1, 8, 9, 16, 17, ... lie below ``limit``: 2 per
    full group of 8, plus the first one or two of a partial group. Plain integer arithmetic
    (the kernel runs it on Int32, the tests on ints)."""
    limit = cutlass.max(limit, 0)
    return limit // COLUMN_PAIR_STRIDE * 2 + cutlass.min(limit % COLUMN_PAIR_STRIDE, 2)


@dsl_user_op
def keep_bits_below(count: Int32, *, loc=None, ip=None) -> Uint32:
    """A word whose low ``count`` bits are set (all 32 for count >= 32, none for <= 0).

    PTX clamps shift amounts to the register width, so one shift does every case; plain
    integer shifts by 32 or more are undefined in LLVM.
    """
    shift = cutlass.max(cutlass.min(BITS_PER_WORD - count, BITS_PER_WORD), 0)
    return Uint32(
        llvm.inline_asm(
            T.i32(),
            [Uint32(0xFFFFFFFF).ir_value(loc=loc, ip=ip), Uint32(shift).ir_value(loc=loc, ip=ip)],
            "shr.b32 $0, $1, $2;",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
