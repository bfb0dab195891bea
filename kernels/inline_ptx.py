"""Inline PTX for the few instructions CuTe-DSL does not wrap (or wraps pinned in place)."""

from __future__ import annotations

from typing import Type, Union

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# PTX register constraints of the result types: a 32-bit integer or an fp32 register.
_RESULT_CONSTRAINT = {Int32: "=r", Float32: "=f"}


def ptx_on_f32(
    asm: str, inputs: tuple, result: Type[Union[Int32, Float32]], pinned: bool, loc=None, ip=None
) -> Union[Int32, Float32]:
    """``asm`` with the fp32 ``inputs`` as $1, $2, ... writing ``result``'s register $0.
    ``pinned``: marked as having side effects, so the code stays where it is written (a
    conversion before the fence of the GEMM that reads it); else the compilers may move it."""
    value = llvm.inline_asm(
        T.i32() if result is Int32 else T.f32(),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in inputs],
        asm,
        ",".join([_RESULT_CONSTRAINT[result]] + ["f"] * len(inputs)),
        has_side_effects=pinned,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return result(value)


def ptx(asm: str, inputs: tuple, result: Type[Union[Int32, Float32]], pinned: bool = False, loc=None, ip=None):
    """``asm`` with ``inputs`` (32-bit integer registers for Int32 values, fp32 ones for the
    rest) as $1, $2, ... writing ``result``'s register $0; ``pinned`` as in ``ptx_on_f32``."""
    words = [isinstance(x, Int32) for x in inputs]
    value = llvm.inline_asm(
        T.i32() if result is Int32 else T.f32(),
        [(Int32(x) if word else Float32(x)).ir_value(loc=loc, ip=ip) for x, word in zip(inputs, words)],
        asm,
        ",".join([_RESULT_CONSTRAINT[result]] + ["r" if word else "f" for word in words]),
        has_side_effects=pinned,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return result(value)


@dsl_user_op
def permute_bytes(low: Int32, high: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """``prmt.b32``: byte i of the result is byte ``selector``'s nibble i of the eight bytes
    of (``high``, ``low``), ``low``'s bytes numbered 0-3 and ``high``'s 4-7."""
    value = llvm.inline_asm(
        T.i32(),
        [Int32(low).ir_value(loc=loc, ip=ip), Int32(high).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#06x};",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)
