"""2^x on the FMA pipe, for a share of the softmax's exponentials.

The SM's MUFU unit runs 16 exponentials a clock; at head dim 64 a warpgroup's softmax of a
64x128 block needs as many MUFU clocks as its two GEMMs need tensor-core clocks at their
peak, so the exponentials can set the pace. This one costs nine instructions on the FMA
and ALU pipes instead: x = j + f with j = round(x) (adding 1.5 * 2^23 rounds in the low
mantissa bits), 2^f for f in [-1/2, 1/2] by a cubic, and j added to the cubic's exponent
field as an integer.
"""

from __future__ import annotations

import struct

from cutlass import Float32
from cutlass.cutlass_dsl import dsl_user_op

from .inline_ptx import ptx_on_f32

# Adding 1.5 * 2^23 to an fp32 of magnitude below 2^22 rounds it to an integer, which the
# sum holds in its low mantissa bits (two's complement, offset by 2^22).
ROUND_TO_INTEGER = 1.5 * 2**23
# Below this exponent the integer j added to the cubic's exponent field (126 or 127) would
# pass zero into the sign bit; 2^-126 is already below any probability a 16-bit P holds.
SMALLEST_EXPONENT = -126.0
# Above this one the field would reach 255 (inf, NaN) and then the sign bit. 2^127 is
# already past any P that ``rebase_p`` divides by, so larger x need not be told apart.
LARGEST_EXPONENT = 127.0
# 2^f on [-1/2, 1/2], lowest degree first: the cubic of least relative error (Lawson's
# iteration on 20001 points), 7.5e-5 at most in fp32, a 25th of bf16's rounding step.
EXP2_CUBIC = (0.9999281167984009, 0.6932609677314758, 0.24261081218719482, 0.055171433836221695)
# An fp32 exponent field starts at bit 23.
MANTISSA_BITS = 23


def _ptx_f32(value: float) -> str:
    """``value`` as a PTX fp32 literal (its bits in hex), exact."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


_C0, _C1, _C2, _C3 = (_ptx_f32(c) for c in EXP2_CUBIC)
_EXP2_ON_FMA = (
    "{ .reg .f32 x, t, j, f, p; .reg .b32 e, q;\n"
    f"max.ftz.f32 x, $1, {_ptx_f32(SMALLEST_EXPONENT)};\n"
    f"min.ftz.f32 x, x, {_ptx_f32(LARGEST_EXPONENT)};\n"
    f"add.rn.f32 t, x, {_ptx_f32(ROUND_TO_INTEGER)};\n"
    f"sub.rn.f32 j, t, {_ptx_f32(ROUND_TO_INTEGER)};\n"
    "sub.rn.f32 f, x, j;\n"
    f"fma.rn.f32 p, f, {_C3}, {_C2};\n"
    f"fma.rn.f32 p, p, f, {_C1};\n"
    f"fma.rn.f32 p, p, f, {_C0};\n"
    "mov.b32 e, t;\n"
    f"shl.b32 e, e, {MANTISSA_BITS};\n"
    "mov.b32 q, p;\n"
    "add.s32 q, q, e;\n"
    "mov.b32 $0, q; }"
)


@dsl_user_op
def exp2_on_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x without MUFU, within 7.5e-5; x is clamped to [-126, 127] first: below, about
    2^-126 (where MUFU.EX2 gives 0, which no 16-bit P tells apart beside a row max of 1),
    above, about 2^127 (where MUFU.EX2 gives 2^x or inf)."""
    return ptx_on_f32(_EXP2_ON_FMA, (x,), Float32, pinned=False, loc=loc, ip=ip)
