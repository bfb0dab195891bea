"""The FP8 forward's scores from int8 Q and K (``Sm90ForwardConfig.fp8_qk_int8``): an s8 wgmma
accumulates Q Kᵀ in s32, and the fp32 softmax takes them converted, exactly.

``cvt.rn.f32.s32`` issues 16 a clock per SM (the CUDA programming guide's throughput table
for sm_90; not measured here), as slowly as MUFU's exponentials, which the FP8 loop
already avoids. Instead, for |s| < 2^22, adding 1.5 · 2^23's bits to s as an
integer gives the bits of the float 1.5 · 2^23 + s (a float on [2^23, 2^24) steps by
1, so s lands in its mantissa), and one FADD of -1.5 · 2^23 leaves s itself: one integer
add and one FADD a score, both on pipes that issue 64 and 128 a clock.

A raw score is the dot product of a row of Q's codes with one of K's, each within ±127:
at most 127 · 127 · head_dim = 4,129,024 at head dim 256, below 2^22 = 4,194,304, and no
partial sum of the GEMM passes it either.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from .inline_ptx import ptx

# int8 codes are symmetric: ±127 (flash4.quantize.INT8_MAX).
INT8_CODE_MAX = 127
# 1.5 * 2^23: floats on [2^23, 2^24) step by 1, and 1.5 * 2^23 sits in their middle, so
# 1.5 * 2^23 + s is exact for |s| < 2^22; its bits, 0x4B400000, as an integer.
SHIFT_FLOAT = 12582912.0
SHIFT_BITS = 0x4B400000
# The raw scores the shift keeps exact.
S32_SCORE_BOUND = 1 << 22


def scores_fit_shift(head_dim: int) -> bool:
    """Whether every raw score of int8 codes at ``head_dim`` stays within S32_SCORE_BOUND."""
    return INT8_CODE_MAX * INT8_CODE_MAX * head_dim < S32_SCORE_BOUND


def float_scores(acc_s: cute.Tensor, keep_shift: bool = False) -> cute.Tensor:
    """``acc_s`` (an s32 accumulator fragment, its wgmmas completed) as fp32, converted in
    place: the returned view shares its registers. ``keep_shift``: each value left as
    SHIFT_FLOAT + s, for a softmax that takes the shift off itself (one instruction a score
    instead of two)."""
    scores = cute.make_tensor(cute.recast_ptr(acc_s.iterator, dtype=Float32), acc_s.layout)
    for i in range(cute.size(acc_s)):
        shifted = ptx(f"add.s32 $0, $1, {SHIFT_BITS};", (Int32(acc_s[i]),), Int32)
        value = ptx("mov.b32 $0, $1;", (shifted,), Float32)
        scores[i] = value if keep_shift else value - Float32(SHIFT_FLOAT)
    return scores
