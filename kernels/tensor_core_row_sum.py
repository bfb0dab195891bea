"""The FP8 softmax's row sum taken on the tensor cores: l += P · 1, beside O += P V.

In the FP8 forward at head dims 64 and 128 the consumers' issue slots bind, not the tensor
cores: without its row-sum additions (48 FADDs a thread per key block at head dim 128, a
sixth of the loop) the softmax ran 4-6% faster (perf/h200-findings.md). A block's row sums
are a GEMM with a column of ones: P, already in registers as the A operand of P V, times
an all-ones e4m3 tile in shared memory, (``ROW_SUM_COLUMNS`` x tile_n) K-major. The wgmma
joins P V's commit group, so its cost is N = 8 against P V's N = head_dim on the tensor
cores, and two adds per row on the CUDA cores; every column of its accumulator holds the
row's sum, so no quad reduction follows either.

What it sums is the e4m3-rounded P that P V multiplies: O is normalised by exactly the
weights it was built from. A true LSE needs the sum before rounding, so only the kernel
variant compiled without an LSE takes this path. FP8 wgmma accumulates in about 14 bits
(tests/test_fp8_gpu.py): the sum of a block may lose 2^-13 per 32-key step, below half a
step of the 16-bit output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from .configs import ROW_SUM_COLUMNS, ROWS_PER_CONSUMER_WARPGROUP
from .wgmma import issue_gemm, smem_tile_layout

# Four e4m3 ones in a 32-bit word: sign 0, exponent 0111 (the bias), mantissa 000.
E4M3_ONES_WORD = 0x38383838
E4M3_PER_WORD = 4


def ones_tile_layout(dtype: Type[cutlass.Numeric], tile_n: int):
    """The all-ones B operand in shared memory: (ROW_SUM_COLUMNS, tile_n), K-major."""
    return smem_tile_layout(dtype, ROW_SUM_COLUMNS, tile_n)


@cute.jit
def fill_ones(ones: cute.Pointer, tile_n: cutlass.Constexpr[int], tidx: Int32, threads: cutlass.Constexpr[int]):
    """Every thread of the CTA writes its share of the ones tile (each byte the same, so the
    swizzle does not matter). Call before the CTA's first barrier."""
    words = cute.make_tensor(cute.recast_ptr(ones, dtype=Int32), cute.make_layout(ROW_SUM_COLUMNS * tile_n // E4M3_PER_WORD))
    for i in cutlass.range_constexpr(cute.ceil_div(cute.size(words), threads)):
        word = i * threads + tidx
        if word < cute.size(words):
            words[word] = Int32(E4M3_ONES_WORD)
    # wgmma reads shared memory through the async proxy: make these generic-proxy writes
    # visible to it.
    cute.arch.fence_view_async_shared()


@dataclass(frozen=True)
class TensorCoreRowSum:
    """One consumer warpgroup's row-sum GEMM: its tiled MMA (64 rows x ROW_SUM_COLUMNS),
    accumulator and the ones tile as its B fragment."""

    tiled_mma: cute.TiledMma
    acc: cute.Tensor
    ones: cute.Tensor

    @staticmethod
    def make(
        dtype: Type[cutlass.Numeric], warpgroups: int, sOnes: cute.Tensor, warpgroup_first_thread: Int32
    ) -> "TensorCoreRowSum":
        """``warpgroup_first_thread``: the first thread of the calling consumer warpgroup
        (its slice of the CTA's MMA, as for the other GEMMs)."""
        major_k = cute.nvgpu.OperandMajorMode.K
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dtype, dtype, major_k, major_k, Float32, (warpgroups, 1, 1),
            (ROWS_PER_CONSUMER_WARPGROUP, ROW_SUM_COLUMNS), a_source=warpgroup.OperandSource.RMEM,
        )
        wg_mma = tiled_mma.get_slice(warpgroup_first_thread)
        rows = warpgroups * ROWS_PER_CONSUMER_WARPGROUP
        return TensorCoreRowSum(
            tiled_mma=tiled_mma,
            acc=cute.make_rmem_tensor(wg_mma.partition_shape_C((rows, ROW_SUM_COLUMNS)), Float32),
            ones=wg_mma.make_fragment_B(wg_mma.partition_B(sOnes)),
        )

    def issue(self, p: cute.Tensor) -> None:
        """The row sums of ``p`` (P V's A operand) into ``acc``, in the open commit group."""
        issue_gemm(self.tiled_mma, self.acc, p, self.ones, True)
