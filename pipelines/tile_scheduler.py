"""Which (query block, head, batch) tiles a CTA works on, and in which order.

Tiles are numbered with the query block fastest, then head, then batch, so tiles that run
at the same time mostly share one head's K and V in L2. A CTA walks *positions*; each
position names one tile.

- One tile per CTA: a grid of (query blocks, heads, batch); each CTA runs its loop once.
- Persistent: ``min(work, max_ctas)`` CTAs, one per SM, each looping over positions
  i, i + grid, i + 2 grid, ... While one tile's epilogue runs, the producer already loads
  the next tile's K and Q, hiding the fill latency a fresh CTA pays at every tile.
- Persistent in causal pairs: query block m (m + 1 key blocks when seqlen_q = seqlen_k) is
  paired with block num_m - 1 - m (num_m - m key blocks), so every pair costs the same
  num_m + 1 blocks and a static round-robin over pairs stays balanced; unpaired causal
  tiles differ in length up to num_m-fold, and a static split of them left SMs idle.

With ``longest_first`` (causal, one tile per CTA), query blocks are launched from the last
to the first: the longest tiles start first and the short ones fill the tail.

- Persistent, ``dynamic`` (causal): positions are handed out at run time, to whichever CTA
  is free first (pipelines/tile_queue.py), in sections of (head, batch) entries: within a
  section the last query block of each entry, then the one before, and so on, so the
  longest tiles go first and the shortest fill the end. A section holds at least
  SECTION_ROUNDS rounds of the grid's tiles, so the next section's longest tiles start
  while this one's last rounds run; sections differ by one entry at most. Pairs, whole
  units, leave a partial last round of the grid idle instead (a model of equal key
  blocks: 94-97% of the SMs' time on the protocol's causal shapes, 97-99.6% this way). A
  section's K and V stay in L2 while its tiles run: an order over all entries at once
  (every head's last query block first) lost 2-19% on the H200 (perf/h200-findings.md).

With ``cluster_ctas`` > 1 (clusters sharing K and V by multicast), the CTAs of a cluster
take adjacent query blocks of one head, the CTA's rank in the cluster picking its block;
a persistent grid shares out *units*, one cluster's blocks each (causal: in balanced pairs
of units, a unit costing the key blocks of its last query block), so the CTAs of a
cluster walk the same tiles in lock step. ``num_m_blocks`` must then be a multiple of
``cluster_ctas``. With ``cluster_heads``, the CTAs of a cluster take the same query block
of adjacent heads instead (heads of one K/V head under grouped-query attention): a unit is
then one query block of ``cluster_ctas`` heads, and ``heads`` must be a multiple of
``cluster_ctas``. A one-tile grid then clusters along its head axis.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


# A dynamic order's section holds at least this many rounds of the grid's tiles (see above).
SECTION_ROUNDS = 2


def split(value, divisor):
    """(value // divisor, value % divisor): one multiply and shift for a fast divisor."""
    if isinstance(divisor, cute.FastDivmodDivisor):
        return divmod(value, divisor)
    return value // divisor, value % divisor


def dynamic_sections(num_m_blocks, entries, walkers):
    """(small, big): the dynamic order's sections hold ``small`` (head, batch) entries each,
    the first ``big`` of them one more."""
    wanted = (SECTION_ROUNDS * walkers + num_m_blocks - 1) // num_m_blocks
    sections = cutlass.max(entries // wanted, 1)
    small = entries // sections
    return small, entries - small * sections


def dynamic_divisors(num_m_blocks, small):
    """What dynamic_tile divides by: the tiles of a big and of a small section, and the
    entries of each."""
    return (small + 1) * num_m_blocks, small * num_m_blocks, small + 1, small


def dynamic_tile(index, num_m_blocks, small, big, divisors):
    """(query block, entry) of sorted position ``index`` in the dynamic order: sections of
    (head, batch) entries, longest tiles first within each. Branch-free integer arithmetic,
    so the same function runs in the kernel (Int32, fast divisors) and in the CPU tests
    (ints)."""
    big_section, small_section, big_size, small_size = divisors
    big_tiles = big * (small + 1) * num_m_blocks
    in_big = cutlass.min(cutlass.max(big_tiles - index, 0), 1)
    rest = cutlass.max(index - big_tiles, 0)
    big_first, big_inside = split(index, big_section)
    small_first, small_inside = split(rest, small_section)
    big_row, big_entry = split(big_inside, big_size)
    small_row, small_entry = split(small_inside, small_size)
    start = in_big * big_first * (small + 1) + (1 - in_big) * (big * (small + 1) + small_first * small)
    row = in_big * big_row + (1 - in_big) * small_row
    entry = in_big * big_entry + (1 - in_big) * small_entry
    return num_m_blocks - 1 - row, start + entry


class TileScheduler:
    def __init__(
        self,
        num_m_blocks: Int32,
        heads: Int32,
        batch: Int32,
        persistent: bool,
        causal_pairs: bool,
        longest_first: bool,
        cluster_ctas: int = 1,
        cluster_heads: bool = False,
        dynamic: bool = False,
        max_ctas: Int32 = 0,
        state: tuple | None = None,
        fast_divmod: bool = True,
    ):
        """``max_ctas``: a persistent grid's limit (see ``grid``), which sizes the dynamic
        order's sections; ``state``: what ``host_state`` made, when the DSL rebuilds it."""
        if causal_pairs and not persistent:
            raise ValueError("causal pairs are a persistent schedule")
        if dynamic and (causal_pairs or not persistent or cluster_ctas > 1):
            raise ValueError("dynamic is a persistent schedule of single tiles, without pairs or clusters")
        self.num_m_blocks = num_m_blocks
        self.heads = heads
        self.batch = batch
        self.persistent = persistent
        self.causal_pairs = causal_pairs
        self.longest_first = longest_first
        self.cluster_ctas = cluster_ctas
        self.cluster_heads = cluster_heads
        self.dynamic = dynamic
        self.fast_divmod = fast_divmod
        # A position's tile is found by divisions by run-time values; each is ~25 dependent
        # instructions, which every consumer warp paid at every tile start (ncu, head dim 64
        # causal 512: 5% of their stall samples). A fast divisor is one multiply and shift;
        # it is built where the scheduler is made, on the host, and the scheduler passed to
        # the kernel as an argument. ``fast_divmod=False`` keeps the divisions: ptxas runs
        # those on the uniform datapath and the multiply-and-shift on the vector one
        # (kernels.configs.Sm90ForwardConfig.fast_tile_divmod).
        if state is None:
            state = self.host_state(max_ctas)
        self.sections, self.divisors = state

    def host_state(self, max_ctas: Int32) -> tuple:
        """(the dynamic order's (small, big), the divisors a position's tile needs)."""
        heads = self.head_units() if self.persistent else self.heads
        sections = (Int32(0), Int32(0))
        divisors = (self.tiles_per_head(), heads)
        if self.dynamic:
            walkers = self.grid(max_ctas)[0]
            sections = dynamic_sections(self.num_m_blocks, self.heads * self.batch, walkers)
            divisors = (heads, *dynamic_divisors(self.num_m_blocks, sections[0]))
        if self.fast_divmod:
            divisors = tuple(cute.fast_divmod_create_divisor_v2(d) for d in divisors)
        return sections, divisors

    # A scheduler is a kernel argument, read inside the kernel's dynamic tile loop, so the
    # DSL must be able to carry it as run-time values: its sizes and what the host made.
    # A static order's plain divisors (functions of its sizes) are rebuilt in the kernel
    # instead and not carried: ptxas keeps every carried value in a uniform register, and
    # two fewer leave more for the key loop (the FP8 head-dim-64 one, back then: 365 SASS
    # instructions against 368 carrying them; 3.6% faster, perf/h200-findings.md).
    def _carries_state(self) -> bool:
        return self.fast_divmod or self.dynamic

    def __extract_mlir_values__(self) -> list:
        values = [Int32(x).ir_value() for x in (self.num_m_blocks, self.heads, self.batch)]
        if not self._carries_state():
            return values
        values += [Int32(x).ir_value() for x in self.sections]
        for divisor in self.divisors:
            values += divisor.__extract_mlir_values__() if self.fast_divmod else [Int32(divisor).ir_value()]
        return values

    def __new_from_mlir_values__(self, values: list) -> "TileScheduler":
        sizes, state = [Int32(v) for v in values[:3]], None
        if self._carries_state():
            sections, rest = (Int32(values[3]), Int32(values[4])), values[5:]
            state = (sections, tuple(
                d.__new_from_mlir_values__(rest[i * 2:i * 2 + 2]) if self.fast_divmod else Int32(rest[i])
                for i, d in enumerate(self.divisors)
            ))
        return TileScheduler(
            *sizes, self.persistent, self.causal_pairs, self.longest_first, self.cluster_ctas,
            self.cluster_heads, self.dynamic, state=state, fast_divmod=self.fast_divmod,
        )

    def units_per_head(self) -> Int32:
        """What a persistent grid hands out per head: query blocks, or whole clusters' blocks."""
        if self.cluster_ctas > 1 and not self.cluster_heads:
            return self.num_m_blocks // self.cluster_ctas
        return self.num_m_blocks

    def head_units(self) -> Int32:
        """The heads a persistent grid counts: single heads, or whole clusters' heads."""
        if self.cluster_heads:
            return self.heads // self.cluster_ctas
        return self.heads

    def pairs_per_head(self) -> Int32:
        return (self.units_per_head() + 1) // 2

    def tiles_per_head(self) -> Int32:
        """The positions' fastest-varying count: pairs, units or query blocks of one head."""
        if self.causal_pairs:
            return self.pairs_per_head()
        if self.persistent:
            return self.units_per_head()
        return self.num_m_blocks

    def work_units(self) -> Int32:
        """What the CTAs (or persistent clusters) share out: pairs of units, or units."""
        if self.causal_pairs:
            return self.pairs_per_head() * self.head_units() * self.batch
        if self.persistent:
            return self.units_per_head() * self.head_units() * self.batch
        return self.num_m_blocks * self.heads * self.batch

    def end(self) -> Int32:
        """One past the last position."""
        if self.causal_pairs:
            return 2 * self.work_units()
        return self.work_units()

    def grid(self, max_ctas: Int32) -> tuple:
        if self.persistent and self.cluster_ctas > 1:
            clusters = cutlass.min(self.work_units(), max_ctas // self.cluster_ctas)
            return (clusters * self.cluster_ctas, 1, 1)
        if self.persistent:
            return (cutlass.min(self.work_units(), max_ctas), 1, 1)
        return (self.num_m_blocks, self.heads, self.batch)

    @cute.jit
    def walkers(self) -> Int32:
        """How many CTAs (or clusters) of a persistent grid take turns over the positions."""
        if cutlass.const_expr(self.cluster_ctas > 1):
            return cute.arch.grid_dim()[0] // self.cluster_ctas
        return cute.arch.grid_dim()[0]

    @cute.jit
    def first(self) -> Int32:
        """This CTA's first position."""
        bx, by, bz = cute.arch.block_idx()
        walker = bx
        if cutlass.const_expr(self.persistent and self.cluster_ctas > 1):
            walker = bx // self.cluster_ctas
        position = walker
        if cutlass.const_expr(self.causal_pairs):
            position = 2 * walker
        if cutlass.const_expr(not self.persistent):
            position = bx + self.num_m_blocks * (by + self.heads * bz)
        return position

    @cute.jit
    def next(self, position: Int32) -> Int32:
        """This CTA's position after ``position``; past ``end()`` for a one-tile CTA."""
        following = position + self.end()
        if cutlass.const_expr(self.persistent):
            following = position + self.walkers()
        if cutlass.const_expr(self.causal_pairs):
            # The second tile of this pair, then the first tile of this CTA's next pair.
            following = position + 1
            if position % 2 == 1:
                following = position + 2 * self.walkers() - 1
        return following

    @cute.jit
    def valid(self, position: Int32) -> cutlass.Boolean:
        """Whether ``position`` names a tile: with an odd number of units, the middle one is
        paired with itself and only its first position counts."""
        ok = position < self.end()
        if cutlass.const_expr(self.causal_pairs):
            pair = split(position // 2, self.divisors[0])[1]
            ok = ok and (position % 2 == 0 or 2 * pair + 1 != self.units_per_head())
        return ok

    @cute.jit
    def tile(self, position: Int32) -> tuple[Int32, Int32, Int32]:
        """(query block, head, batch) of the tile at ``position``."""
        if cutlass.const_expr(self.dynamic):
            m_block, entry = dynamic_tile(position, self.num_m_blocks, *self.sections, self.divisors[1:])
            batch, head = split(entry, self.divisors[0])
            return m_block, head, batch
        index = position
        if cutlass.const_expr(self.causal_pairs):
            index = position // 2
        rest, m_block = split(index, self.divisors[0])
        batch, head = split(rest, self.divisors[1])
        if cutlass.const_expr(self.causal_pairs):
            # The long unit first, then its short mate.
            if position % 2 == 0:
                m_block = self.units_per_head() - 1 - m_block
        elif cutlass.const_expr(self.longest_first):
            m_block = self.num_m_blocks - 1 - m_block
        if cutlass.const_expr(self.persistent and self.cluster_ctas > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            if cutlass.const_expr(self.cluster_heads):
                head = head * self.cluster_ctas + rank
            else:
                m_block = m_block * self.cluster_ctas + rank
        return m_block, head, batch
