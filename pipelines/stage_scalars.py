"""A few float32 values that travel with a ring stage (the FP8 forward's descales).

The producer thread copies each value from global memory into the stage's slot with a
4-byte ``cp.async`` and has the stage's *full* barrier count their landing as one more
arrival (``cp.async.mbarrier.arrive.noinc``): the ring is made with
``1 + SCALAR_ARRIVALS`` producer arrivals a stage, so a consumer that has waited for the
stage reads the values from shared memory.

    producer (one lane)                      consumer
    acquire(s): wait empty[s], expect tx     -
    TMA -> full[s]; cp.async x n; arrive     wait full[s]; read slot s (ld.shared)

Why not let each consumer read them from global memory: a read at a tile's start waits
the load's whole latency (L2 or DRAM) whenever the tile's Q is already in shared memory,
since ptxas puts the first use of a tile-constant descale before the tile's first S GEMM
(perf/sass_local.py shows it). Issued with the stage's TMA, the load's latency hides
behind the bytes the consumers wait for anyway; the consumers make no global load at all.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

# The producer arrivals a stage's values add to its *full* barrier: the one cp.async
# arrival of the lane that copied them.
SCALAR_ARRIVALS = 1
# cp.async copies 4, 8 or 16 bytes; one float32 per copy.
SCALAR_BITS = 32


def element_address(tensor: cute.Tensor, coord: tuple) -> cute.Pointer:
    """The address of one element of ``tensor``: a source for ``StageScalars.load``."""
    return tensor.iterator + cute.crd2idx(coord, tensor.layout)


def scalar_words(values: int, stages: int) -> int:
    """float32 words the values of a ring take in shared memory."""
    return values * stages


class StageScalars:
    """``values`` float32 per stage of a ring, in ``smem`` laid out (values, stages)."""

    def __init__(self, smem: cute.Tensor, values: int):
        self.smem = smem
        self.values = values

    @staticmethod
    def make(words: cute.Pointer, values: int, stages: int) -> "StageScalars":
        """Over ``scalar_words(values, stages)`` float32 words at ``words``."""
        return StageScalars(cute.make_tensor(words, cute.make_layout((values, stages))), values)

    def load(self, sources: tuple, stage: Int32, full_barrier: cute.Pointer) -> None:
        """Producer warp, after the stage's acquire: copy ``sources`` (one float32 each, a
        pointer into global memory) into slot ``stage``, and arrive on ``full_barrier``
        when they have landed. One lane issues both: the arrival tracks the cp.asyncs of
        the thread that makes it."""
        if len(sources) != self.values:
            raise ValueError(f"sources: {len(sources)} pointers for a ring of {self.values} values a stage")
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=SCALAR_BITS)
        with cute.arch.elect_one():
            for i, source in enumerate(sources):
                src = cute.make_tensor(source, cute.make_layout(1))
                dst = cute.make_tensor(element_address(self.smem, (i, stage)), cute.make_layout(1))
                cute.copy(atom, src, dst)
            cute.arch.cp_async_mbarrier_arrive_noinc(full_barrier)

    def read(self, stage: Int32) -> tuple:
        """Consumer, after waiting for the stage and before releasing it: its values."""
        return tuple(Float32(self.smem[i, stage]) for i in range(self.values))
