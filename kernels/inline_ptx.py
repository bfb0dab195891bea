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


@dsl_user_op
def cluster_shared_address(address: Int32, rank: Int32, *, loc=None, ip=None) -> Int32:
    """``mapa``: where the shared::cta ``address`` of this CTA lies in the shared::cluster
    window of the CTA ranked ``rank`` in the cluster (the same variable over there)."""
    value = llvm.inline_asm(
        T.i32(),
        [Int32(address).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip)],
        "mapa.shared::cluster.u32 $0, $1, $2;",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@dsl_user_op
def store_remote_f32x2(address: Int32, first: Float32, second: Float32, barrier: Int32, *, loc=None,
                       ip=None) -> None:
    """``st.async`` of two fp32 to the shared::cluster ``address`` (8-byte aligned) of
    another CTA, completing 8 bytes of the transaction count of the mbarrier at its
    shared::cluster ``barrier``: the data is visible to whoever waits on that barrier."""
    llvm.inline_asm(
        None,
        [Int32(address).ir_value(loc=loc, ip=ip), Int32(barrier).ir_value(loc=loc, ip=ip),
         Float32(first).ir_value(loc=loc, ip=ip), Float32(second).ir_value(loc=loc, ip=ip)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [$0], {$2, $3}, [$1];",
        "r,r,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def load_shared_f32x2(address: Int32, *, loc=None, ip=None) -> tuple[Float32, Float32]:
    """``ld.shared.v2.f32`` at the shared::cta ``address`` (8-byte aligned), kept in place
    (after the mbarrier wait that makes the data visible) by being marked as having side
    effects."""
    pair = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32(), T.f32()]),
        [Int32(address).ir_value(loc=loc, ip=ip)],
        "ld.shared.v2.f32 {$0, $1}, [$2];",
        "=f,=f,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (Float32(llvm.extractvalue(T.f32(), pair, [0], loc=loc, ip=ip)),
            Float32(llvm.extractvalue(T.f32(), pair, [1], loc=loc, ip=ip)))


@dsl_user_op
def store_shared_f32x2(address: Int32, first: Float32, second: Float32, *, loc=None, ip=None) -> None:
    """``st.shared.v2.f32`` at the shared::cta ``address`` (8-byte aligned)."""
    llvm.inline_asm(
        None,
        [Int32(address).ir_value(loc=loc, ip=ip), Float32(first).ir_value(loc=loc, ip=ip),
         Float32(second).ir_value(loc=loc, ip=ip)],
        "st.shared.v2.f32 [$0], {$1, $2};",
        "r,f,f",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
