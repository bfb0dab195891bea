"""exp2 on the FMA pipe: a cubic for the fraction, the exponent added as an integer.

An SM issues MUFU.EX2 at 16 a clock and FFMA at 128, so where a softmax's exponentials
bind (head dim 64) some of them can run as nine FMA- and ALU-pipe instructions instead:
2^x = 2^r · 2^f with r = rint(x) and f = x - r in [-0.5, 0.5]. 2^f is a cubic (relative
error 7.5e-5 over that range, under a bf16 P's half-ulp of 2e-3 and an fp16 P's 4.9e-4),
2^r is built from its exponent bits and multiplied in.
"""

from __future__ import annotations

import struct

from cutlass import Float32

from .inline_ptx import ptx_on_f32

# Below 2^-127 the result is 0 (the exponent field of 2^r reaches 0), which also maps
# -inf (a masked score) to an exact 0, as MUFU.EX2 does.
SMALLEST_EXPONENT = -127.0
# 1.5 · 2^23: adding it leaves rint(x) in the low mantissa bits of the sum.
ROUNDING_SHIFTER = 12582912.0
# The cubic's coefficients, c0 + c1 f + c2 f^2 + c3 f^3 ≈ 2^f on [-0.5, 0.5]: fitted for
# the least maximum relative error (iteratively reweighted least squares, fp32-rounded).
EXP2_CUBIC = (0.9999281167984009, 0.6932609677314758, 0.24261054396629333, 0.05517132207751274)
# fp32's exponent field starts at bit 23, and 1.0 is stored as 127 in it.
MANTISSA_BITS = 23
EXPONENT_OF_ONE = 127 << MANTISSA_BITS


def _f32_literal(value: float) -> str:
    """PTX's hex form of an fp32 constant (0fXXXXXXXX)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


_C0, _C1, _C2, _C3 = (_f32_literal(c) for c in EXP2_CUBIC)
_EXP2_ASM = (
    "{\n"
    ".reg .f32 x, t, r, f, p, two_r;\n"
    ".reg .b32 bits;\n"
    f"max.ftz.f32 x, $1, {_f32_literal(SMALLEST_EXPONENT)};\n"
    f"add.rn.ftz.f32 t, x, {_f32_literal(ROUNDING_SHIFTER)};\n"
    f"sub.rn.ftz.f32 r, t, {_f32_literal(ROUNDING_SHIFTER)};\n"
    "sub.rn.ftz.f32 f, x, r;\n"
    f"fma.rn.ftz.f32 p, f, {_C3}, {_C2};\n"
    f"fma.rn.ftz.f32 p, p, f, {_C1};\n"
    f"fma.rn.ftz.f32 p, p, f, {_C0};\n"
    "mov.b32 bits, t;\n"
    f"shl.b32 bits, bits, {MANTISSA_BITS};\n"
    f"add.s32 bits, bits, {EXPONENT_OF_ONE};\n"
    "mov.b32 two_r, bits;\n"
    "mul.rn.ftz.f32 $0, p, two_r;\n"
    "}\n"
)


def exp2_on_fma(x: Float32) -> Float32:
    """2^x for x < 128 (fp32's largest power of two) without MUFU; 0 from 2^-127 down and
    for -inf."""
    return ptx_on_f32(_EXP2_ASM, (x,), Float32, pinned=False)
