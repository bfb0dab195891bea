"""Named hardware barriers (``bar.sync`` / ``bar.arrive``) used by flash4's kernels.

Barrier 0 is what ``__syncthreads`` uses, so flash4's own ids start at 1. A barrier id is a
per-CTA resource (16 on sm_90): kernels take theirs from this one enum, never a bare literal.
The ids of one kernel must differ; the forward's and the backward's may coincide, since no
CTA runs both: with four consumer warpgroups the forward's fourth turn takes DS_TILE's id
and its fourth O slab DS_WRITTEN_0's.
"""

from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute

# Named barriers per CTA on sm_90, 0 included.
HARDWARE_BARRIERS = 16


class NamedBarrier(enum.IntEnum):
    # The consumer warpgroups' shared epilogue: every thread's O is in shared memory
    # before the one thread that issues the TMA store reads it.
    EPILOGUE = 1
    # Turn-taking of the consumer warpgroups (ping-pong): warpgroup i waits on
    # WARPGROUP_TURN_0 + i before it issues its GEMMs (2 to 5).
    WARPGROUP_TURN_0 = 2
    # Backward: every part of the consumer warpgroups' shared dSᵀ tile is written before
    # any dQ GEMM reads it. (After the three ping-pong turn barriers, 2..4.)
    DS_TILE = 5
    # Backward: warpgroup i arrives on DQ_FULL_0 + i when its part of the fp32 dQ tile is
    # written (the dQ store warp syncs there before its TMA reduction), and syncs on
    # DQ_EMPTY_0 + i before it writes the part again (the store warp arrives once the TMA
    # engine has read it). 128 + 32 threads each; 6, 7 and 8, 9.
    DQ_FULL_0 = 6
    DQ_EMPTY_0 = 8
    # Forward with one O store per consumer warpgroup: warpgroup i's 128 threads meet on
    # EPILOGUE_WARPGROUP_0 + i around writing their slab of O (10 to 13).
    EPILOGUE_WARPGROUP_0 = 10
    # Backward with staggered warpgroups (no DS_TILE meeting): warpgroup i arrives on
    # DS_WRITTEN_0 + i once its rows of a query block's dSᵀ tile are written, and the other
    # syncs there before its dQ GEMM reads them (warpgroup 1 at the start of its step,
    # warpgroup 0 before writing its next rows). 256 threads each; 13, 14.
    DS_WRITTEN_0 = 13


class WarpgroupPingPong:
    """Orders the GEMM issue of the consumer warpgroups round-robin.

    While one warpgroup issues its tensor-core work, the others run softmax on the CUDA
    cores; the tensor cores then stay busy with one warpgroup's GEMMs at a time instead of
    every warpgroup fighting for them and then all idling in softmax together.

    Protocol, with ``n`` warpgroups and barrier ``T_i = WARPGROUP_TURN_0 + i`` counting
    ``2 * 128`` threads: warpgroup ``i`` calls ``wait_turn`` (sync on ``T_i``) before
    issuing and ``pass_turn`` (arrive on ``T_{i+1 mod n}``) right after. ``start`` makes
    warpgroup 0 arrive on its own barrier once, so it is the first to go.
    """

    def __init__(self, warpgroup: cutlass.Int32, num_warpgroups: int, threads_per_warpgroup: int):
        if num_warpgroups not in (2, 3, 4):
            raise ValueError(f"ping-pong needs 2, 3 or 4 consumer warpgroups, got {num_warpgroups}")
        self.warpgroup = warpgroup
        self.num_warpgroups = num_warpgroups
        # A turn barrier is passed by the waiting warpgroup plus the one handing over.
        self.threads = 2 * threads_per_warpgroup

    @cute.jit
    def start(self) -> None:
        if self.warpgroup == 0:
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.WARPGROUP_TURN_0), number_of_threads=self.threads
            )

    def wait_turn(self) -> None:
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.WARPGROUP_TURN_0) + self.warpgroup,
            number_of_threads=self.threads,
        )

    def pass_turn(self) -> None:
        nxt = self.warpgroup + 1
        if cutlass.const_expr(self.num_warpgroups == 2):
            nxt = 1 - self.warpgroup
        else:
            nxt = nxt % self.num_warpgroups
        cute.arch.barrier_arrive(
            barrier_id=int(NamedBarrier.WARPGROUP_TURN_0) + nxt, number_of_threads=self.threads
        )
