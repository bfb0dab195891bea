"""A persistent grid's tiles handed out at run time: each CTA's producer warp takes its next
tile from a counter in global memory (one atomic add a tile, ``take_ticket``) when it has
issued the loads of its current one, and passes the tile's position to the consumer
warpgroups through a two-slot ring in shared memory. So the CTA that runs out of work
first takes the next tile, whatever its length (``TileScheduler`` with ``dynamic``).

    producer warp (every lane)            consumers (every thread)
    push(state, position)                 pop(state) -> position
      wait empty[s]                         wait full[s]
      positions[s] = position               read positions[s]
      arrive full[s] (release)              arrive empty[s]

After its last tile the producer pushes a position past the tiles, which ends the
consumers' loop. The counter starts at 0 in every launch (the host zeroes it); the grid's
first tiles go to CTAs by block index, so ticket t names position grid + t.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.pipeline as cpipe
from cutlass import Int32

from .global_semaphore import take_ticket
from .warp_roles import THREADS_PER_WARP

# Positions in flight between the producer and the consumers: the tile being consumed and
# the one the producer loads ahead (its K/V ring runs at most a few blocks ahead).
TILE_QUEUE_STAGES = 2


def tile_queue_barrier_words() -> int:
    """mbarrier words the queue needs in shared memory: one full and one empty per slot."""
    return 2 * TILE_QUEUE_STAGES


@dataclass(frozen=True)
class TileQueue:
    """The ring (every producer-warp lane arrives on *full*, every consumer thread on
    *empty*) and its slots (int32 positions in shared memory)."""

    ring: cpipe.PipelineAsync
    positions: cute.Tensor

    @staticmethod
    def make(barriers: cute.Pointer, positions: cute.Tensor, consumer_threads: int) -> "TileQueue":
        ring = cpipe.PipelineAsync.create(
            barrier_storage=barriers,
            num_stages=TILE_QUEUE_STAGES,
            producer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, THREADS_PER_WARP),
            consumer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, consumer_threads),
            # The kernel fences and syncs once after initialising every ring.
            defer_sync=True,
        )
        return TileQueue(ring, positions)

    @cute.jit
    def push(self, state, position: Int32):
        """The producer warp: hand ``position`` to the consumers; returns the next state."""
        self.ring.producer_acquire(state)
        self.positions[state.index] = position
        self.ring.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def pop(self, state):
        """A consumer thread: the next position, and the next state."""
        self.ring.consumer_wait(state)
        position = self.positions[state.index]
        self.ring.consumer_release(state)
        state.advance()
        return position, state


@cute.jit
def next_ticket(counter: cute.Pointer) -> Int32:
    """The producer warp: lane 0 takes the next ticket, every lane gets it."""
    ticket = Int32(0)
    if cute.arch.lane_idx() == 0:
        ticket = take_ticket(counter)
    return cute.arch.shuffle_sync(ticket, 0)


def producer_state() -> cpipe.PipelineState:
    return cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, TILE_QUEUE_STAGES)


def consumer_state() -> cpipe.PipelineState:
    return cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, TILE_QUEUE_STAGES)
