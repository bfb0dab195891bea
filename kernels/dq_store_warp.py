"""The backward's dQ store warp (warp 1 of the producer warpgroup) and its side of the
hand-over: per query block, each consumer warpgroup writes its part of dQ to shared memory
and arrives on that part's DQ_FULL barrier; this warp adds the part into the head's fp32
accumulator by one bulk reduction (the TMA engine reads shared memory), or stores it
(``dq_first_stores``: the block's first contribution), and once the engine has read every
part, arrives on DQ_EMPTY so the warpgroups may write the next block's. Deterministic
mode orders the contributions to a query block by turns in global memory; first stores
without it by tickets (pipelines/global_semaphore.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.global_semaphore import announce_landed, pass_turn, take_ticket, wait_for_turn, wait_until_landed
from ..pipelines.named_barriers import NamedBarrier
from ..pipelines.warp_roles import THREADS_PER_WARP, THREADS_PER_WARPGROUP
from .bulk_reduce import bulk_reduce_add_f32, bulk_store
from .bwd_blocks import dq_turn_rank, query_block_at
from .configs import Sm90BackwardConfig
from .memory_pass import FP32_PER_VECTOR

# The producer warpgroup's warp that issues dQ's bulk reductions (warp 0 loads), so the
# consumers hand a written dQ part over and go on instead of waiting for the TMA engine's
# read (H200 sweep: +1-7%, d256 full 16k 401 -> 431 TFLOP/s). A whole warp takes part in
# the hand-off barriers; lane 0 issues.
DQ_STORE_WARP = 1
# A dQ hand-off barrier counts one consumer warpgroup and the store warp.
DQ_HANDOFF_THREADS = THREADS_PER_WARPGROUP + THREADS_PER_WARP


@dataclass(frozen=True)
class DQReduction:
    """dQ's way out: the fp32 tile in shared memory, one part per consumer warpgroup, that
    the TMA engine adds into this head's accumulator, a part at a time as one linear bulk
    reduction. The accumulator holds each query block's parts in order, each laid out as
    in shared memory (``accumulator_tile_layout``; the postprocess reads it so)."""

    smem: cute.Tensor
    accum: cute.Tensor
    # This head's counters: deterministic, its turns, one per query block and part; with
    # dq_first_stores alone, its tickets, one per query block (None otherwise).
    counters: Optional[cute.Tensor]


class DQStoreWarp:
    """The store warp of one backward kernel configuration. ``rotate``: the key blocks'
    walks are rotated (``query_block_at``), as the consumers walk them."""

    def __init__(self, config: Sm90BackwardConfig, rotate: bool):
        self.config = config
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim
        self.causal = config.causal
        self.rotate = rotate
        # The order in which the warpgroups hand a block's parts over: staggered, warpgroup 0
        # computes each block's dQ a step after warpgroup 1.
        parts = tuple(range(config.consumer_warpgroups))
        self.hand_over_order = parts[::-1] if config.staggered_warpgroups else parts

    @cute.jit
    def add_part(self, dq_out: DQReduction, part, n_block: Int32, m_block: Int32, seqlen_q: Int32,
                 seqlen_k: Int32, ticket: Optional[Int32]):
        """One warp (lane 0 issues): the bulk reduction of dQ part ``part`` of query block
        ``m_block`` into the accumulator, where that part's place is the next
        ``part_floats`` values after the earlier parts and blocks.

        Deterministic: the contributions to a query block's part go in a fixed order
        (``dq_turn_rank``), each waiting until the one before has landed, not only been
        read: a turn counter per part reaches this block's rank when it may go.

        dq_first_stores: the first contribution (rank 0, or the block's ``ticket`` 0, see
        ``run``) stores instead of adding, into an accumulator nobody zeroed."""
        parts = self.config.consumer_warpgroups
        counter = m_block * parts + part
        lane = cute.arch.lane_idx()
        first = False
        if cutlass.const_expr(self.config.deterministic):
            if lane == 0:
                rank = dq_turn_rank(n_block, m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal)
                wait_for_turn(dq_out.counters.iterator + counter, rank)
            if cutlass.const_expr(self.config.dq_first_stores):
                first = dq_turn_rank(n_block, m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal) == 0
        elif cutlass.const_expr(self.config.dq_first_stores):
            first = ticket == 0
        part_floats = self.tile_m * self.head_dim // parts
        if lane == 0:
            smem = dq_out.smem[None, None, part].iterator
            gmem = dq_out.accum.iterator + (m_block * parts + part) * part_floats
            part_bytes = part_floats * (Float32.width // 8)
            if cutlass.const_expr(self.config.dq_first_stores):
                if first:
                    bulk_store(smem, gmem, part_bytes)
                else:
                    bulk_reduce_add_f32(smem, gmem, part_bytes)
            else:
                bulk_reduce_add_f32(smem, gmem, part_bytes)
        cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(self.config.deterministic):
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            if lane == 0:
                pass_turn(dq_out.counters.iterator + counter)

    @cute.jit
    def ticket_for(self, dq_out: DQReduction, m_block: Int32) -> Int32:
        """dq_first_stores, not deterministic: this CTA's ticket for query block
        ``m_block``, every lane holding lane 0's. One ticket covers all parts, so the
        first holder stores them all and waits for no other CTA between its ticket and its
        stores (pipelines/global_semaphore.py); with a ticket per part, two CTAs each first
        on one part could each wait for the other's. Taken before the warpgroups hand the
        parts over, so the atomic's round trip overlaps their GEMMs."""
        ticket = Int32(0)
        if cute.arch.lane_idx() == 0:
            ticket = take_ticket(dq_out.counters.iterator + m_block)
        return cute.arch.shuffle_sync(ticket, 0)

    @cute.jit
    def zero_unseen(self, dq_out: DQReduction, m_blocks: Int32):
        """dq_first_stores, causal, seqlen_q > seqlen_k: query blocks [0, ``m_blocks``) see
        no key at all, so no CTA stores their dQ, and nothing zeroed the accumulator. Key
        block 0's store warp (m_blocks is where its query blocks start) stores their zeros."""
        floats = m_blocks * self.tile_m * self.head_dim
        vectors = floats // FP32_PER_VECTOR
        flat = cute.make_tensor(dq_out.accum.iterator, cute.make_layout(floats))
        zeros = cute.make_rmem_tensor(cute.make_layout(FP32_PER_VECTOR), Float32)
        zeros.fill(0.0)
        lane = cute.arch.lane_idx()
        for i in cutlass.range(cute.ceil_div(vectors, THREADS_PER_WARP), unroll=1):
            vector = i * THREADS_PER_WARP + lane
            if vector < vectors:
                cute.autovec_copy(zeros, cute.local_tile(flat, (FP32_PER_VECTOR,), (vector,)))
        # Every lane's stores come before lane 0's release in signal_ready.
        cute.arch.sync_warp()

    @cute.jit
    def run(self, dq_out: DQReduction, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, m_begin: Int32,
            m_end: Int32):
        """The dQ store warp: per query block and part, wait until the
        warpgroup has written its part, add (or first store) it into the accumulator, and
        once the TMA engine has read every part, let the warpgroups write the next block's.
        The first block's parts are free from the start; after the last, nothing waits for
        them, so the last read is awaited only for shared memory to outlive it."""
        parts = self.config.consumer_warpgroups
        tickets_taken = self.config.dq_first_stores and not self.config.deterministic
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.config.dq_first_stores and self.causal):
            if n_block == 0:
                self.zero_unseen(dq_out, m_begin)
        if m_begin < m_end:
            for part in cutlass.range_constexpr(parts):
                cute.arch.barrier_arrive(
                    barrier_id=int(NamedBarrier.DQ_EMPTY_0) + part, number_of_threads=DQ_HANDOFF_THREADS
                )
        key_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        for step in cutlass.range(m_begin, m_end, unroll=1):
            m_block = query_block_at(step, n_block, m_end, key_blocks, self.rotate)
            ticket = None
            if cutlass.const_expr(tickets_taken):
                ticket = self.ticket_for(dq_out, m_block)
            for i in cutlass.range_constexpr(parts):
                part = self.hand_over_order[i]
                cute.arch.barrier(barrier_id=int(NamedBarrier.DQ_FULL_0) + part, number_of_threads=DQ_HANDOFF_THREADS)
                if cutlass.const_expr(tickets_taken and i == 0):
                    # A later ticket adds once the first holder's stores have landed.
                    if lane == 0 and ticket != 0:
                        wait_until_landed(dq_out.counters.iterator + m_block)
                self.add_part(dq_out, part, n_block, m_block, seqlen_q, seqlen_k, ticket)
            if cutlass.const_expr(tickets_taken):
                if ticket == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    if lane == 0:
                        announce_landed(dq_out.counters.iterator + m_block)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if step + 1 < m_end:
                for part in cutlass.range_constexpr(parts):
                    cute.arch.barrier_arrive(
                        barrier_id=int(NamedBarrier.DQ_EMPTY_0) + part, number_of_threads=DQ_HANDOFF_THREADS
                    )

    @cute.jit
    def signal_ready(self, ready: cute.Tensor, head: Int32, batch: Int32):
        """The store warp, after its last reduction: once every addition of this key block
        into dQ has landed (not only been read from shared memory), count it for the
        head's postprocess. A CTA without query blocks counts too."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if cute.arch.lane_idx() == 0:
            pass_turn(ready.iterator + cute.crd2idx((batch, head), ready.layout))
