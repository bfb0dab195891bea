"""Hopper building blocks shared by the sm_90 kernels: swizzled operand tiles in shared
memory, their TMA partitions, and warpgroup GEMMs issued as commit groups; and
the row-first view of flash4's tensors that all of them index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warp import LdMatrix8x8x16bOp
from cutlass.tensor_utils import LayoutEnum

from .configs import ACCUMULATOR_ROW_FLOATS, ACCUMULATOR_SWIZZLE, FP32_ADDRESS_BITS, SMEM_ALIGN_BYTES



def smem_tile_layout(dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None):
    """Swizzled row-major shared-memory layout of a (rows, cols) tile, optionally staged."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def accumulator_tile_layout(rows: int, cols: int, stages: int):
    """Staged shared-memory layout of an fp32 (rows, cols) tile that wgmma accumulators are
    stored into a pair of columns at a time, and that leaves as one linear bulk copy.

    ``smem_tile_layout`` stacks the 32-column swizzle atoms down the rows, 128 bytes per
    row, so rows r and r + 1 land in the same bank groups and every 8-byte store of a warp
    takes twice the ideal wavefronts (ncu at head dim 128: mio-throttle and short-scoreboard
    stalls three times flash-attn-4's). Here a row holds 64 floats, two swizzle lines, and
    four consecutive rows fall in four different 32-byte bank groups; wider tiles repeat
    the pattern per 64 columns. ``configs.accumulator_tile_offset`` is the same map as
    arithmetic."""
    if cols % ACCUMULATOR_ROW_FLOATS:
        raise ValueError(f"cols={cols}: a multiple of {ACCUMULATOR_ROW_FLOATS} fp32 columns")
    outer = cute.make_layout(
        (rows, (ACCUMULATOR_ROW_FLOATS, cols // ACCUMULATOR_ROW_FLOATS), stages),
        stride=(ACCUMULATOR_ROW_FLOATS, (1, rows * ACCUMULATOR_ROW_FLOATS), rows * cols),
    )
    bits, base, shift = ACCUMULATOR_SWIZZLE
    return cute.make_composed_layout(cute.make_swizzle(bits, base + FP32_ADDRESS_BITS, shift), 0, outer)


def register_order_tile_layout(rows: int, cols: int, stages: int):
    """Staged shared-memory layout of an fp32 (rows, cols) tile that a warpgroup's
    threads store their accumulator registers into in order, 16 bytes at a time
    (``configs.accumulator_register_offset`` says which value lands where): a linear tile,
    in ``accumulator_tile_layout``'s composed form (a swizzle of no bits) so that the
    kernels take either."""
    linear = cute.make_layout((rows, cols, stages), stride=(cols, 1, rows * cols))
    return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, linear)


def rows_first(t: cute.Tensor) -> cute.Tensor:
    """A (batch, seqlen, heads, head_dim) tensor viewed as (seqlen, head_dim, heads, batch),
    and a (batch, heads, seqlen) one as (seqlen, heads, batch): the tiled modes first, as
    TMA and the kernels' tiles index them. Same memory, other mode order."""
    order = [1, 3, 2, 0] if cute.rank(t.layout) == 4 else [2, 1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=order))


def tma_tile(
    atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, tile: tuple, block, col_block=0, cta_rank=0,
    ctas: int = 1,
):
    """(smem, gmem) partitions for a TMA copy between ``smem`` and the ``tile``-shaped tiles
    of the 2-D ``gmem``: ``block`` picks the row of tiles (None keeps it as the last mode),
    ``col_block`` the column of tiles. A multicast atom over ``ctas`` CTAs: the share of
    the CTA ranked ``cta_rank`` in the cluster."""
    tiles = cute.local_tile(gmem, tile, (block, col_block))
    return cpasync.tma_partition(
        atom, cta_rank, cute.make_layout(ctas), cute.group_modes(smem, 0, 2), cute.group_modes(tiles, 0, 2)
    )


@dataclass(frozen=True)
class RegisterOperandA:
    """A GEMM's A operand held in registers (``a_source=RMEM``), filled from its tile in
    shared memory by ldmatrix: the wgmma then reads only B from shared memory, whose 128
    bytes per clock an SS wgmma of N = 64 uses up alone. ``load`` fills ``fragment``."""

    fragment: cute.Tensor
    copy: cute.TiledCopy
    source: cute.Tensor

    @staticmethod
    def make(tiled_mma: cute.TiledMma, wg_mma, dtype: Type[cutlass.Numeric], smem: cute.Tensor, tidx) -> "RegisterOperandA":
        """``wg_mma``: this warpgroup's slice of ``tiled_mma``; ``smem``: the whole 2-D A tile.
        For 8-bit types ldmatrix moves 16-bit pairs, which lands them in the same layout."""
        copy = cute.make_tiled_copy_A(
            cute.make_copy_atom(LdMatrix8x8x16bOp(transpose=False, num_matrices=4), dtype), tiled_mma
        )
        fragment = wg_mma.make_fragment_A(wg_mma.partition_shape_A(smem.shape))
        return RegisterOperandA(fragment, copy, copy.get_slice(tidx).partition_S(smem))

    def load(self) -> None:
        cute.copy(self.copy, self.source, self.copy.retile(self.fragment))


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
    issue_gemm(tiled_mma, acc, a, b, zero_init)
    warpgroup.commit_group()


@cute.jit
def issue_gemm(
    tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, zero_init: cutlass.Constexpr[bool]
) -> None:
    """The wgmmas of one GEMM over all k-slices, without the fence before them or the
    commit after: for GEMMs that share one commit group."""
    # A fresh atom per GEMM: its accumulate flag is changed below, and a flag set on an
    # atom shared by several GEMMs would leak from one into the next.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(a.shape[2])):
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
