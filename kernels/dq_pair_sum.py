"""dQ summed over a cluster of two key blocks (``cluster_key_blocks=2``, head dim 256)
before it goes to L2, so that each bulk reduction into the fp32 accumulator carries 128
keys' worth, as head dim 128's key blocks do, instead of 64.

At head dim 256 every 64-key CTA adds a 64 KiB fp32 tile into L2 per query block, and ncu
had those reductions fill the L2's input: 93% of its cycles, reductions 66% of its sector
rate (H100, 16k, perf/results/h100/2026-12-06-ncu-bwd-d256-full-16k.json). Sharing the
Q and dO loads alone (the same clusters, multicast) changed nothing.

Warpgroup w of each CTA computes head-dim columns [w · d/2, (w + 1) · d/2) of dQ (the
head-dim split), part w of the shared-memory tile. CTA w of the pair keeps part w:

    keeper: CTA w, warpgroup w                 sender: CTA 1 - w, warpgroup w
    arrive on RECEIVED, expecting a part       wait on SLOT_FREE (the keeper's store warp
    wait on RECEIVED                           has read the slot's previous sum)
                                               st.async its part into the keeper's slot w,
                                               each completing its bytes on RECEIVED
    slot w += its own registers, in place
    hand slot w to its store warp (DQ_FULL), whose bulk reduction adds it into L2 and,
    once the TMA engine has read it, arrives on the sender's SLOT_FREE

The sender's own slot stays unused. Both CTAs walk the same query blocks in step (the Q
and dO tiles are multicast), so each barrier's phase is the parity of the walk's step.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import nvvm

from ..pipelines.warp_roles import THREADS_PER_WARPGROUP
from .configs import accumulator_register_coords, accumulator_tile_offset
from .bulk_reduce import bulk_copy_to_cluster
from .inline_ptx import cluster_shared_address, load_shared_f32x2, store_shared_f32x2

# The pair's mbarriers in each CTA: RECEIVED (the peer's part has landed in the kept slot)
# and SLOT_FREE (the peer's store warp has read the slot this CTA's sender writes into).
PAIR_BARRIERS = 2
FP32_BYTES = 4
# Pairs of dQ values a keeper thread loads before it stores their sums (of its 32).
KEEP_CHUNK = 8


@dataclass(frozen=True)
class DQPairSum:
    """One CTA's side of the pair: its mbarriers, its dQ tile's shared::cta address, its
    rank (the part it keeps), and the tile's geometry: ``tile_m`` rows, parts of
    ``part_cols`` columns, each laid out as ``accumulator_tile_offset`` says."""

    barriers: cute.Pointer
    tile_pointer: cute.Pointer
    rank: Int32
    tile_m: int
    part_cols: int

    @property
    def tile(self) -> Int32:
        return self.tile_pointer.toint()

    @property
    def part_bytes(self) -> int:
        return self.tile_m * self.part_cols * FP32_BYTES

    def init_barriers(self) -> None:
        """One thread, before the cluster's barrier-init sync: RECEIVED counts the
        keeper's one arrival (with the part's bytes), SLOT_FREE the peer store warp's."""
        for i in range(PAIR_BARRIERS):
            cute.arch.mbarrier_init(self.barriers + i, 1)

    def slot_address(self, tile: Int32, part, thread, pair: int):
        """The byte address, in the tile at ``tile``, of pair ``pair`` (registers 2p and
        2p + 1) of ``thread``'s m64nN dQ accumulator of ``part`` (register_pair_offset)."""
        floats = part * (self.tile_m * self.part_cols) + register_pair_offset(thread, pair, self.tile_m)
        return tile + floats * FP32_BYTES

    @cute.jit
    def keep(self, acc_dq: cute.Tensor, parity: Int32):
        """The keeper warpgroup: once the sender's part has landed in the kept slot, add
        this thread's dQ accumulator to it in place, KEEP_CHUNK pairs at a time: each
        chunk's stores stand between its loads and the next chunk's, so ptxas cannot
        hoist all 32 loads (64 registers beside dK's and dV's 128)."""
        thread = cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP
        if thread == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(self.barriers, self.part_bytes)
        cute.arch.mbarrier_wait(self.barriers, parity)
        pairs = cute.size(acc_dq) // 2
        for chunk in cutlass.range_constexpr(pairs // KEEP_CHUNK):
            chunk_pairs = range(chunk * KEEP_CHUNK, (chunk + 1) * KEEP_CHUNK)
            landed = [load_shared_f32x2(self.slot_address(self.tile, self.rank, thread, p)) for p in chunk_pairs]
            for p, (first, second) in zip(chunk_pairs, landed):
                store_shared_f32x2(self.slot_address(self.tile, self.rank, thread, p), acc_dq[2 * p] + first,
                                   acc_dq[2 * p + 1] + second)

    def wait_slot_free(self, parity: Int32) -> None:
        """The sender warpgroup, before writing its part into its own slot: the keeper's
        store warp has read the sum of the previous block, which it made after the last
        copy out of this slot had landed; so both the keeper's slot and this one are free."""
        cute.arch.mbarrier_wait(self.barriers + 1, parity ^ 1)

    def ship(self, part) -> None:
        """One thread of the sender warpgroup, once its part is written (and fenced for
        the async proxy): copy it into the same slot of the keeper, completing the bytes on
        the keeper's RECEIVED barrier."""
        keeper = 1 - self.rank
        offset = part * self.part_bytes
        bulk_copy_to_cluster(self.tile_pointer + offset // FP32_BYTES, cluster_shared_address(self.tile + offset, keeper),
                             self.part_bytes, cluster_shared_address(self.barriers.toint(), keeper))

    def slot_read(self) -> None:
        """The store warp's lane 0, once the TMA engine has read the kept slot: the
        sender may write the next block's part into it."""
        cute.arch.mbarrier_arrive(self.barriers + 1, 1 - self.rank, scope=nvvm.MemScopeKind.CLUSTER)


def register_pair_offset(thread, pair: int, tile_m: int):
    """accumulator_tile_offset of the (row, col) that pair ``pair`` of ``thread``'s m64nN
    wgmma accumulator holds (registers 2p and 2p + 1: accumulator_register_coords), in
    floats within its part. The swizzle is an XOR of bit fields, and the thread's bits of
    (row, col) (its first register's) and the pair's (8 rows, 8 p columns on) do not
    overlap, so it is the thread's offset XOR the pair's, a constant: one XOR a pair, where
    the whole map made ptxas keep 32 addresses and spill (tests/test_dq_pair_sum.py checks
    it against the map for every thread and pair)."""
    row, col = accumulator_register_coords(4 * thread)
    pair_row, pair_col = accumulator_register_coords((pair // 2) * 4 * THREADS_PER_WARPGROUP + 2 * (pair % 2))
    return accumulator_tile_offset(row, col, tile_m) ^ accumulator_tile_offset(pair_row, pair_col, tile_m)


def pair_rank() -> Int32:
    """This CTA's rank in its pair of key blocks: the dQ part it keeps."""
    return cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())

