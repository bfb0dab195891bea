"""The tail of a persistent, unmasked grid cut into pieces along the keys.

A persistent grid of W walkers (CTAs, or clusters) shares out U equally long units: after
U // W whole rounds, the U % W units of the tail run on that many walkers while the rest
idle (H200, head dim 128 at 16k: 2048 tiles on 132 SMs, 15.52 rounds that take as long as
16; a shape of whole rounds ran 2.7% faster, perf/wave_tail_probe.py). Cut into ``pieces``
runs of consecutive key blocks, the tail's units become ``pieces`` times as many shorter
ones, and the last round ends sooner.

Each piece leaves its partial result in a workspace, one record per consumer thread: the
thread's unnormalised O accumulator, then its rows' running max and partial sum (the
online softmax's state). It then takes a ticket on its unit's counter; the piece that
draws the last ticket reads the other pieces' records, merges them into its own state
and finishes the unit as if it had walked every key. No piece waits for another.

    choose_pieces(units, walkers, key_blocks)  host: (tail units, pieces); (0, 1) for none
    leave_record(record, acc_o, row_max, row_sum)  a consumer thread's partial result
    take_ticket(counter)                       one thread: atomic add 1, acq_rel; old count
    merge_records(records, piece, pieces, ...) the last piece: every other record merged
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .online_softmax import merge_state

# Pieces per tail unit: enough to bring the last round within a quarter of a unit of the
# ideal; each piece costs its unit a record write and, for the last, a read and a merge.
MAX_PIECES = 4
# A piece walks at least this many key blocks: its first block pays the pipeline's fill
# (K and Q loads before any GEMM) that a longer walk hides.
MIN_KEY_BLOCKS_PER_PIECE = 4
# A record's length is a whole number of 16-byte vectors (the loads and stores are 128-bit).
RECORD_ALIGN_FLOATS = 4


def choose_pieces(units: int, walkers: int, key_blocks: int) -> tuple[int, int]:
    """How to cut the tail of ``units`` equal units on ``walkers`` walkers, each unit
    ``key_blocks`` key blocks long: (tail units, pieces per tail unit), or (0, 1) when no
    cut shortens the last round. The last round of pieces takes ceil(tail * p / walkers)
    pieces of 1/p each; the fewest pieces that reach the shortest such round win."""
    rounds, tail = divmod(units, walkers)
    if rounds == 0 or tail == 0:
        return 0, 1
    best, best_cost = 1, 1.0
    for pieces in range(2, MAX_PIECES + 1):
        if key_blocks < pieces * MIN_KEY_BLOCKS_PER_PIECE:
            break
        cost = -(-tail * pieces // walkers) / pieces
        if cost < best_cost:
            best, best_cost = pieces, cost
    return (tail, best) if best > 1 else (0, 1)


def record_floats(acc_floats: int, rows: int) -> int:
    """One consumer thread's record: its O accumulator, then a max and a sum per row."""
    floats = acc_floats + 2 * rows
    return -(-floats // RECORD_ALIGN_FLOATS) * RECORD_ALIGN_FLOATS


@cute.jit
def leave_record(record: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor) -> None:
    """This thread's partial result into ``record`` (its slice of the workspace), made
    visible GPU-wide before the caller's ticket."""
    size, rows = cute.size(acc_o), cute.size(row_max)
    cute.autovec_copy(_flat(acc_o, size), _flat(record, size))
    stats = cute.make_rmem_tensor(2 * rows, Float32)
    for r in cutlass.range_constexpr(rows):
        stats[r] = row_max[r]
        stats[rows + r] = row_sum[r]
    cute.autovec_copy(stats, _flat(record, 2 * rows, size))
    # Release: the stores above reach L2 before the ticket that announces them.
    cute.arch.fence_acq_rel_gpu()


def _flat(tensor: cute.Tensor, size: int, offset: int = 0) -> cute.Tensor:
    """``size`` consecutive elements of ``tensor``'s storage from ``offset`` (a record, or
    a compact register fragment read in its own order)."""
    return cute.make_tensor(tensor.iterator + offset, cute.make_layout(size))


@cute.jit
def take_ticket(counter: cute.Pointer) -> Int32:
    return Int32(cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu"))


@cute.jit
def merge_records(
    records: cute.Tensor, piece: Int32, pieces: Int32,
    acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32,
) -> None:
    """The last piece of a unit: the records (piece, record floats) this thread's
    counterparts left in the other pieces merged into its online-softmax state."""
    # Acquire: the other pieces' records, released before their tickets, are read after
    # the last ticket was drawn.
    cute.arch.fence_acq_rel_gpu()
    for p in cutlass.range_constexpr(MAX_PIECES):
        if (pieces > p) & (piece != p):
            other_o, other_max, other_sum = _read_record(records[p, None], acc_o, cute.size(row_max))
            merge_state(acc_o, row_max, row_sum, scale_log2, other_o, other_max, other_sum)


@cute.jit
def _read_record(record: cute.Tensor, acc_o: cute.Tensor, rows: cutlass.Constexpr[int]):
    """Another piece's record: (its O in ``acc_o``'s layout, its row maxima, its row sums)."""
    size = cute.size(acc_o)
    other_o = cute.make_rmem_tensor_like(acc_o, Float32)
    cute.autovec_copy(_flat(record, size), _flat(other_o, size))
    stats = cute.make_rmem_tensor(2 * rows, Float32)
    cute.autovec_copy(_flat(record, 2 * rows, size), stats)
    other_max = cute.make_rmem_tensor(rows, Float32)
    other_sum = cute.make_rmem_tensor(rows, Float32)
    for r in cutlass.range_constexpr(rows):
        other_max[r] = stats[r]
        other_sum[r] = stats[rows + r]
    return other_o, other_max, other_sum
