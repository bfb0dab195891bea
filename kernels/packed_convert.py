"""fp32 -> 16-bit (or e4m3) conversion into packed 32-bit registers, for wgmma's register
A operand.

A wgmma that reads A from registers reads 32-bit registers, each holding two 16-bit values.
Converting element by element (``.load().to(dtype)``) leaves ptxas to pack pairs with
extra moves, and for some tile widths (160 keys at head dim 128, 80 at head dim 256) it
sinks those moves between the wgmma instructions that read them; ptxas must then wait for
the earlier wgmmas before each move (its remark C7519, "warpgroup.arrive is injected"),
which serialises the GEMM. One ``cvt.rn.{bf16x2,f16x2}.f32`` per pair writes each register
whole, in program order before the GEMM's fence.
"""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def pack_pair(lo: Float32, hi: Float32, dtype: Type[cutlass.Numeric], *, loc=None, ip=None) -> Int32:
    """One 32-bit register holding ``lo`` (low half) and ``hi`` rounded to ``dtype``."""
    kind = {cutlass.BFloat16: "bf16x2", cutlass.Float16: "f16x2"}[dtype]
    # Marked as having side effects so the conversion stays where it is written: before the
    # warpgroup fence of the GEMM that reads the register.
    packed = llvm.inline_asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;",
        "=r,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(packed)


@dsl_user_op
def pack_quad_e4m3(x0: Float32, x1: Float32, x2: Float32, x3: Float32, *, loc=None, ip=None) -> Int32:
    """One 32-bit register holding ``x0`` (lowest byte) to ``x3`` rounded to e4m3,
    saturating at its largest finite value (448) instead of overflowing to NaN."""
    values = [Float32(x).ir_value(loc=loc, ip=ip) for x in (x0, x1, x2, x3)]
    # cvt's first source lands in the upper byte of each 16-bit pair.
    packed = llvm.inline_asm(
        T.i32(),
        values,
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        "=r,f,f,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(packed)


@cute.jit
def convert_packed(src: cute.Tensor, dst: cute.Tensor) -> None:
    """``dst[i] = src[i]`` rounded to ``dst``'s dtype (16-bit, or e4m3), filling one 32-bit
    register per instruction group: two 16-bit elements, or four e4m3.

    ``dst`` must be a compact register fragment (as ``make_fragment_A`` gives), so that its
    elements per register are consecutive; ``src`` may be any view.
    """
    words = cute.recast_tensor(dst, Int32)
    if cutlass.const_expr(dst.element_type.width == 8):
        for i in cutlass.range_constexpr(cute.size(words)):
            words[i] = pack_quad_e4m3(src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3])
    else:
        for i in cutlass.range_constexpr(cute.size(words)):
            words[i] = pack_pair(src[2 * i], src[2 * i + 1], dst.element_type)
