"""fp32 -> 16-bit (or e4m3, or e4m3 codes) conversion into packed 32-bit registers, for
wgmma's register A operand.

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
from cutlass.cutlass_dsl import dsl_user_op

from .e4m3_codes import F16_INTEGER_BASE_X2_BITS
from .inline_ptx import ptx_on_f32


@dsl_user_op
def pack_pair(lo: Float32, hi: Float32, dtype: Type[cutlass.Numeric], *, loc=None, ip=None) -> Int32:
    """One 32-bit register holding ``lo`` (low half) and ``hi`` rounded to ``dtype``."""
    kind = {cutlass.BFloat16: "bf16x2", cutlass.Float16: "f16x2"}[dtype]
    # Pinned so the conversion stays where it is written: before the warpgroup fence of the
    # GEMM that reads the register.
    return ptx_on_f32(f"cvt.rn.{kind}.f32 $0, $1, $2;", (hi, lo), Int32, pinned=True, loc=loc, ip=ip)


def _pack_quad(asm: str, quad: tuple, loc, ip) -> Int32:
    """One 32-bit register from four fp32 values ($1 to $4) by ``asm``, which writes $0."""
    return ptx_on_f32(asm, quad, Int32, pinned=True, loc=loc, ip=ip)


@dsl_user_op
def pack_quad_e4m3(x0: Float32, x1: Float32, x2: Float32, x3: Float32, *, loc=None, ip=None) -> Int32:
    """One 32-bit register holding ``x0`` (lowest byte) to ``x3`` rounded to e4m3,
    saturating at its largest finite value (448) instead of overflowing to NaN."""
    # cvt's first source lands in the upper byte of each 16-bit pair.
    return _pack_quad(
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        (x0, x1, x2, x3), loc, ip,
    )


@dsl_user_op
def pack_quad_codes(z0: Float32, z1: Float32, z2: Float32, z3: Float32, *, loc=None, ip=None) -> Int32:
    """One 32-bit register holding the e4m3 codes of ``z0`` (lowest byte) to ``z3``, each
    F16_INTEGER_BASE plus a code before rounding (kernels/e4m3_codes.py)."""
    # cvt's first source lands in the upper half; prmt picks the low byte of each half.
    return _pack_quad(
        "{ .reg .b32 lo, hi, base;\n"
        "cvt.rn.f16x2.f32 lo, $2, $1;\n"
        "cvt.rn.f16x2.f32 hi, $4, $3;\n"
        f"mov.b32 base, {F16_INTEGER_BASE_X2_BITS};\n"
        "max.f16x2 lo, lo, base;\n"
        "max.f16x2 hi, hi, base;\n"
        "prmt.b32 $0, lo, hi, 0x6420; }",
        (z0, z1, z2, z3), loc, ip,
    )


@cute.jit
def convert_packed(src: cute.Tensor, dst: cute.Tensor, codes: cutlass.Constexpr[bool] = False) -> None:
    """``dst[i] = src[i]`` rounded to ``dst``'s dtype (16-bit, or e4m3), filling one 32-bit
    register per instruction group: two 16-bit elements, or four e4m3. ``codes``: ``src``
    holds F16_INTEGER_BASE plus e4m3 codes instead of values (``pack_quad_codes``).

    ``dst`` must be a compact register fragment (as ``make_fragment_A`` gives), so that its
    elements per register are consecutive; ``src`` may be any view.
    """
    words = cute.recast_tensor(dst, Int32)
    if cutlass.const_expr(dst.element_type.width == 8):
        for i in cutlass.range_constexpr(cute.size(words)):
            quad = (src[4 * i], src[4 * i + 1], src[4 * i + 2], src[4 * i + 3])
            if cutlass.const_expr(codes):
                words[i] = pack_quad_codes(*quad)
            else:
                words[i] = pack_quad_e4m3(*quad)
    else:
        for i in cutlass.range_constexpr(cute.size(words)):
            words[i] = pack_pair(src[2 * i], src[2 * i + 1], dst.element_type)
