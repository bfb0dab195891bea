"""Hopper wgmma building blocks shared by the sm_90 kernels: operand tiles in shared memory
and one warpgroup GEMM issued as a single commit group."""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

# Shared-memory buffers read by TMA and wgmma start on 1 KiB: the 128-byte swizzle
# pattern repeats every 1024 bytes and must line up with the buffer's start.
SMEM_ALIGN_BYTES = 1024


def smem_tile_layout(dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None):
    """Swizzled row-major shared-memory layout of a (rows, cols) tile, optionally staged."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


@cute.jit
def warpgroup_gemm(
    tiled_mma: cute.TiledMma,
    acc: cute.Tensor,
    a: cute.Tensor,
    b: cute.Tensor,
    zero_init: cutlass.Constexpr[bool],
) -> None:
    """Issue one warpgroup GEMM over all k-slices and commit it as one group."""
    warpgroup.fence()
    # A fresh atom per GEMM: its accumulate flag is changed below, and a flag set on an
    # atom shared by several GEMMs would leak from one into the next.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(a.shape[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
