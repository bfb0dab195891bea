"""Linear bulk copies: the TMA engine adds (``cp.reduce.async.bulk ... .add.f32``) or
stores (``cp.async.bulk``) a contiguous run of fp32 values in shared memory into global
memory, with no tensor map.

CuTe-DSL wraps the tensor-tile form only. The linear form copies bytes in order, so the
shared-memory tile may take any layout (the backward's dQ tile takes one its 8-byte stores
fill without bank conflicts) and global memory holds the same layout.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


def _issue(instruction: str, smem: cute.Pointer, gmem: cute.Pointer, num_bytes: Int32, loc, ip) -> None:
    llvm.inline_asm(
        None,
        [gmem.llvm_ptr, smem.toint(loc=loc, ip=ip).ir_value(), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        f"{instruction} [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_reduce_add_f32(smem: cute.Pointer, gmem: cute.Pointer, num_bytes: Int32, *, loc=None, ip=None) -> None:
    """Issue (one thread) the addition of ``num_bytes`` of fp32 at ``smem`` into ``gmem``,
    in the thread's current bulk async-group (commit and wait with cp_async_bulk_*). Both
    addresses and the size are multiples of 16 bytes."""
    _issue("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32", smem, gmem, num_bytes, loc, ip)


@dsl_user_op
def bulk_store(smem: cute.Pointer, gmem: cute.Pointer, num_bytes: Int32, *, loc=None, ip=None) -> None:
    """Issue (one thread) the copy of ``num_bytes`` at ``smem`` to ``gmem``, in the thread's
    current bulk async-group; the same alignment as ``bulk_reduce_add_f32``."""
    _issue("cp.async.bulk.global.shared::cta.bulk_group", smem, gmem, num_bytes, loc, ip)
