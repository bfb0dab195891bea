"""FP8 attention scores accumulated in f16, and P's e4m3 codes made from them two at a time.

The FP8 wgmma accumulates in f16 at the rate it accumulates in fp32. In an f16
accumulator each 32-bit register (a "word" here) holds two adjacent columns of one row,
so the softmax of kernels/e4m3_codes.py runs on pairs:

- the row max: ``max.f16x2`` down the row's words, then the larger half;
- the codes: one ``fma.rn.f16x2`` of the raw scores with the block's scale in codes
  (8 per octave) and an offset that puts the row max at the top code. Its results lie
  on [1024, 2048), where an f16 steps by 1, so the fma's one rounding is the rounding to
  a code; a ``max.f16x2`` then clamps codes below 0;
- ``prmt`` packs the low bytes of two words into a register of P V's A operand.

fp32 scores take two FMNMX, two FFMA and an f16 conversion per pair for the same.

The offset is rounded down to an f16, so no code passes the top one, and it is a function
of the row's running max alone: every block under the same max gets the same offset, and
its P the same scale. When the max rises, O and the row sums are multiplied by
2^((new offset - old offset) / 8), the exact change of every code.

A raw score, the dot product of a row of Q's codes with one of K's, must stay inside
f16's range: the kernel is only for codes with head_dim * max |q code| * max |k code| <=
F16_SCORE_BOUND (flash4.quantize_fp8's ``fp8_max``), which no partial sum of the GEMM
passes either.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .e4m3_codes import F16_INTEGER_BASE_X2_BITS
from .inline_ptx import ptx
from .mma_layouts import acc_as_fp8_a_operand, acc_rows_cols

# The largest raw score the f16 accumulator may be asked to hold: 2^15, half of f16's
# largest finite value (65504), a power of two so that the code limits it sets are too.
F16_SCORE_BOUND = 2**15
# prmt selector of bytes 0 and 2 of the first word, then of the second: the low byte of
# each f16, which is the code (kernels/e4m3_codes.py).
LOW_BYTES_OF_TWO_WORDS = 0x6420
# -inf in both halves of a word, as a signed 32-bit value.
NEG_INF_X2 = 0xFC00FC00 - (1 << 32)
# The bits of a word's first half (the lower column) and of its second.
LOW_HALF, HIGH_HALF = 0x0000FFFF, 0xFFFF0000 - (1 << 32)


def code_limits(head_dim: int) -> tuple[int, int]:
    """The largest |value| of Q's codes and of K's (powers of two, Q's the larger) whose raw
    scores stay within F16_SCORE_BOUND at ``head_dim``: 32 and 16 at 64, 16 and 16 at 128,
    16 and 8 at 256."""
    product = F16_SCORE_BOUND // head_dim
    q_limit = 1 << ((product.bit_length()) // 2)
    return q_limit, product // q_limit


def scores_fit_f16(head_dim: int, q_max: float, k_max: float) -> bool:
    """Whether codes of Q at most ``q_max`` and of K at most ``k_max`` keep every raw score,
    and every partial sum of one, within F16_SCORE_BOUND."""
    return head_dim * q_max * k_max <= F16_SCORE_BOUND


def score_words(acc_s: cute.Tensor) -> cute.Tensor:
    """The 32-bit registers of a compact f16 accumulator fragment, in order. Every read
    and write of the scores goes through them: an f16 element access makes the compiler
    split each register into halves where the GEMM writes it, before its wait, and ptxas
    then serialises the wgmmas (C7514)."""
    pointer = cute.recast_ptr(acc_s.iterator, dtype=Int32)
    return cute.make_tensor(pointer, cute.make_layout(cute.size(acc_s) // 2))


def _word(index) -> int:
    """The word of a compact f16 fragment's element ``index`` (an even one: a pair's first)."""
    index = int(index)
    if index % 2:
        raise ValueError(f"element {index} is the second of its pair; the view must start pairs at even elements")
    return index // 2


def row_words(acc_s: cute.Tensor) -> list[list[int]]:
    """For each row of ``acc_rows_cols(acc_s)``, the indices in ``score_words`` of its
    words (columns 2j and 2j + 1 of the view are one word)."""
    view = acc_rows_cols(acc_s).layout
    rows, cols = cute.size(view, mode=[0]), cute.size(view, mode=[1])
    return [[_word(view((r, 2 * j))) for j in range(cols // 2)] for r in range(rows)]


def a_operand_words(acc_s: cute.Tensor) -> list[tuple[int, int]]:
    """For each 32-bit register of the FP8 A operand that ``acc_as_fp8_a_operand(acc_s)``
    views, the two words whose low bytes fill it, in byte order."""
    view = acc_as_fp8_a_operand(acc_s).layout
    return [(_word(view(4 * k)), _word(view(4 * k + 2))) for k in range(cute.size(view) // 4)]


def max_f16x2(x: Int32, y: Int32) -> Int32:
    return ptx("max.f16x2 $0, $1, $2;", (x, y), Int32)


def larger_half(x: Int32) -> Float32:
    """The larger of a word's two f16 values, as fp32."""
    return ptx("{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $1; max.f16 lo, lo, hi; cvt.f32.f16 $0, lo; }", (x,), Float32)


def splat_f16x2(x: Float32) -> Int32:
    """``x`` rounded to f16, in both halves of a word."""
    return ptx("cvt.rn.f16x2.f32 $0, $1, $1;", (x,), Int32)


def round_down_to_f16(x: Float32) -> Float32:
    """The largest f16 not above ``x``, as fp32."""
    return ptx("{ .reg .f16 h; cvt.rm.f16.f32 h, $1; cvt.f32.f16 $0, h; }", (x,), Float32)


def row_max(words: cute.Tensor, indices: list) -> Float32:
    """The largest raw score among the words ``indices``, as fp32, by a tree of
    ``max.f16x2`` (its depth, not its length, is the chain the softmax waits on)."""
    level = [words[i] for i in indices]
    while len(level) > 1:
        pairs = [max_f16x2(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + level[len(pairs) * 2:]
    return larger_half(level[0])


def codes_in_place(words: cute.Tensor, indices: list, code_scale: Int32, offset: Int32) -> None:
    """Each word of ``indices`` becomes F16_INTEGER_BASE plus its two codes, clamped at
    code 0: ``max(score * code_scale + offset, base)`` on both halves."""
    for i in indices:
        codes = ptx("fma.rn.f16x2 $0, $1, $2, $3;", (words[i], code_scale, offset), Int32)
        words[i] = max_f16x2(codes, Int32(F16_INTEGER_BASE_X2_BITS))


def pack_codes(acc_s: cute.Tensor, p: cute.Tensor) -> None:
    """P V's FP8 A operand ``p`` from the code words of the f16 accumulator ``acc_s``."""
    words = score_words(acc_s)
    p_words = cute.recast_tensor(p, Int32)
    for k, (lo, hi) in enumerate(a_operand_words(acc_s)):
        # Pinned: the register must be written before the fence of the GEMM that reads it.
        p_words[k] = ptx(
            f"prmt.b32 $0, $1, $2, {LOW_BYTES_OF_TWO_WORDS:#06x};", (words[lo], words[hi]), Int32, pinned=True
        )


def mask_words(acc_s: cute.Tensor, out_of_range) -> None:
    """-inf into every score whose column ``out_of_range(r, col)`` (a column of
    ``acc_rows_cols(acc_s)``) says so, a word at a time: both halves' bits chosen by masks."""
    words = score_words(acc_s)
    for r, indices in enumerate(row_words(acc_s)):
        for j, i in enumerate(indices):
            keep = cutlass.select_(out_of_range(r, 2 * j), Int32(0), Int32(LOW_HALF)) | cutlass.select_(
                out_of_range(r, 2 * j + 1), Int32(0), Int32(HIGH_HALF)
            )
            words[i] = (words[i] & keep) | (Int32(NEG_INF_X2) & ~keep)
