"""Counters in global memory that put CTAs' additions into one fp32 accumulator in a fixed
order, so that the sums come out bit-identical run to run (the deterministic backward).

Each accumulator tile has a counter that starts at 0. The CTA of rank r waits until it
reads r, adds its part, waits until the addition has landed, and raises the counter to
r + 1. Ranks follow the grid's launch order (the lower block index goes first), so a CTA
only ever waits for CTAs launched before it: no cycle, no deadlock.

    wait_for_turn(counter, r)    one thread: spin on ld.acquire.gpu until counter == r
    pass_turn(counter)           one thread: red.release.gpu.add counter, 1

The same pair counts arrivals: the backward's postprocess, launched while the main kernel
runs, waits until its head's counter reaches the number of key blocks, each of which
raises it once its dQ additions have landed (``overlap_postprocess``). Every main CTA has
started before any postprocess CTA may, so that wait never holds an SM a waited-for CTA
needs.

Tickets decide which CTA writes an accumulator tile first, so that it needs no zeroing:

    take_ticket(counter)         one thread: atomic add 1, returns the old count (0: first)
    announce_landed(counter)     the first, once its store has landed: add LANDED (release)
    wait_until_landed(counter)   any later one, before it adds: spin until counter >= LANDED

A CTA takes one ticket per tile, for everything it writes there, when it is about to
write: between its ticket and its release the first holder waits for no other CTA, so no
cycle. (With a ticket per part of a tile, two CTAs each first on one part each waited for
the other's release: the backward hung on the H200.)
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def wait_for_turn(counter: cute.Pointer, rank: Int32) -> None:
    seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    while seen != rank:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")


@cute.jit
def pass_turn(counter: cute.Pointer) -> None:
    # Release: everything this thread (and, through the CTA barrier before it, its CTA)
    # wrote is visible before the next rank can read its turn.
    cute.arch.red(counter, Int32(1), op="add", dtype="s32", sem="release", scope="gpu")


# A ticket counter's value once its first holder's store has landed: above any count of
# tickets taken (one per contributing CTA).
LANDED = 1 << 24


@cute.jit
def take_ticket(counter: cute.Pointer) -> Int32:
    return Int32(cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu"))


@cute.jit
def announce_landed(counter: cute.Pointer) -> None:
    # Release, after the caller waited for its store to land (not only to be read).
    cute.arch.red(counter, Int32(LANDED), op="add", dtype="s32", sem="release", scope="gpu")


@cute.jit
def wait_until_landed(counter: cute.Pointer) -> None:
    seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
    while seen < LANDED:
        seen = cute.arch.load(counter, Int32, sem="acquire", scope="gpu")
