"""2^x computed with FMA-pipe instructions, for a share of the softmax's exponentials.

In the FP8 forward at head dims 64 and 128 the softmax of a key block is bound by two
pipes at once: MUFU.EX2 (16 results per clock per SM, one per score) and the issue slots
(about 7.8 instructions per score). Moving a few exponentials from MUFU to this sequence of
eight cheap instructions balances the two. The method is Cody and Waite's: 2^x = 2^j · 2^f
with j = floor(x) and f = x - j in [0, 1); j comes from a round-down add of 1.5 · 2^23 (the
sum's low mantissa bits are then j as an integer), 2^f from a degree-3 polynomial, and 2^j
is added into the exponent field. The polynomial's relative error is below 8.6e-5, far
under e4m3's rounding of P (2^-4).
"""

from __future__ import annotations

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# Below 2^-126 the result would need a subnormal: clamping keeps 2^j a normal exponent.
# (A score of -inf also lands here, so callers use this only where no score is masked.)
EXP2_MIN_ARG = "0fC2FC0000"  # -126.0
# 1.5 · 2^23: adding it rounds x to an integer held in the sum's low mantissa bits.
ROUND_SHIFTER = "0f4B400000"
# 2^f ≈ 1 + C1 f + C2 f^2 + C3 f^3 on [0, 1), fitted for the least maximal relative error.
C1, C2, C3 = "0f3F31F324", "0f3E691C61", "0f3D9DD435"  # 0.6951163, 0.22764732, 0.07706491
ONE = "0f3F800000"
# A float's exponent field starts at bit 23.
EXPONENT_SHIFT = 23


@dsl_user_op
def exp2_on_fma(x: Float32, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 128 (relative error < 8.6e-5; 2^-126 for x below -126), without MUFU."""
    result = llvm.inline_asm(
        T.f32(),
        [Float32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .f32 x, t, j, f, p; .reg .b32 e, b;\n"
        f"max.f32 x, $1, {EXP2_MIN_ARG};\n"
        f"add.rm.f32 t, x, {ROUND_SHIFTER};\n"
        f"sub.f32 j, t, {ROUND_SHIFTER};\n"
        "sub.f32 f, x, j;\n"
        f"fma.rn.f32 p, f, {C3}, {C2};\n"
        f"fma.rn.f32 p, p, f, {C1};\n"
        f"fma.rn.f32 p, p, f, {ONE};\n"
        "mov.b32 e, t;\n"
        f"shl.b32 e, e, {EXPONENT_SHIFT};\n"
        "mov.b32 b, p;\n"
        "add.s32 b, b, e;\n"
        "mov.b32 $0, b; }",
        "=f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Float32(result)
