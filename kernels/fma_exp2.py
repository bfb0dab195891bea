"""exp2 on the FMA pipe, to share the softmax's exponentials with the MUFU unit.

An SM's MUFU unit computes 16 exp2 per clock; its FMA pipes do 128 fp32 operations. At head
dim 64 a 128 x 128 block of scores needs as long on MUFU (16384 exponentials) as its two
GEMMs need on the tensor cores, while the FMA pipe has room to spare, so moving a share of
the exponentials to a polynomial (about ten FMA-pipe operations each) shortens the softmax.

2^x = 2^floor(x) * 2^f with f = x - floor(x) in [0, 1):
- floor(x) comes from one round-down add of 1.5 * 2^23, which leaves floor(x) in the low
  mantissa bits of the sum (no float-to-int conversion: that runs at MUFU's rate);
- 2^f is a cubic, max relative error 7.5e-5, far below the 2^-9 to which P is rounded for
  the P V GEMM;
- the integer floor(x), shifted into the exponent field, is added to the cubic's bits.

Inputs are clamped to -125 (see SMALLEST_EXPONENT), so the result is never exactly
0: callers use it only where every score is finite, never for masked (-inf) scores, whose
probability must be exactly 0 for rows that see no key.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 1.5 * 2^23: adding it to |x| < 2^22 leaves the integer part of x in the low mantissa bits
# (the 0.5 * 2^23 keeps negative x from borrowing out of the leading mantissa bit).
ROUNDING_MAGIC = float(2**23 + 2**22)
# The cubic dips just below 1 at f = 0, so the result keeps a normal fp32 exponent (field
# >= 1; a field of 0 would be read as a denormal, without the implicit leading 1) only for
# x >= -125. Probabilities that small (< 3e-38) are 0 to the softmax anyway.
SMALLEST_EXPONENT = -125.0
# 2^f on [0, 1), coefficients of f^0 .. f^3: a least-squares fit weighted to equalise the
# relative error (max 7.5e-5).
EXP2_CUBIC = (0.99992526, 0.69583303, 0.22606862, 0.07802353)
# Where the exponent field of an fp32 starts.
MANTISSA_BITS = 23


@dsl_user_op
def _floor_into_mantissa(x: Float32, *, loc=None, ip=None) -> Float32:
    # Round toward -inf: the low mantissa bits of the sum are then floor(x), not round(x).
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            f"add.rm.ftz.f32 $0, $1, 0f{0x4B400000:08X};",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def _scale_by_power_of_two(rounded: Float32, mantissa: Float32, *, loc=None, ip=None) -> Float32:
    # The shift drops the magic's bits and moves floor(x) (mod 2^9) into the exponent field;
    # the 32-bit add wraps, which is the same as adding floor(x) to the exponent.
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(rounded).ir_value(loc=loc, ip=ip), Float32(mantissa).ir_value(loc=loc, ip=ip)],
            "{\n\t.reg .b32 e;\n\t"
            f"shl.b32 e, $1, {MANTISSA_BITS};\n\t"
            "add.s32 $0, e, $2;\n\t}",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def fma_exp2(x: Float32) -> Float32:
    """2^x for finite -125 <= x <= 127, on the FMA and integer pipes; below -125 it returns
    about 2^-125, never 0 (see the module)."""
    clamped = cute.arch.fmax(x, Float32(SMALLEST_EXPONENT))
    rounded = _floor_into_mantissa(clamped)
    fraction = clamped - (rounded - Float32(ROUNDING_MAGIC))
    poly = Float32(EXP2_CUBIC[3])
    for c in (EXP2_CUBIC[2], EXP2_CUBIC[1], EXP2_CUBIC[0]):
        poly = poly * fraction + Float32(c)
    return _scale_by_power_of_two(rounded, poly)
