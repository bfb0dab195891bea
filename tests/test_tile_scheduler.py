"""The persistent forward's dynamic tile order (pipelines/tile_scheduler.py), in plain ints."""

from __future__ import annotations

import heapq

import pytest

from flash4.pipelines.tile_scheduler import SECTION_ROUNDS, dynamic_divisors, dynamic_sections, dynamic_tile

H200_SMS = 132


def _dynamic_tile(index: int, num_m_blocks: int, entries: int, walkers: int) -> tuple[int, int]:
    small, big = dynamic_sections(num_m_blocks, entries, walkers)
    return dynamic_tile(index, num_m_blocks, small, big, dynamic_divisors(num_m_blocks, small))


@pytest.mark.parametrize("num_m_blocks", (1, 2, 7, 8, 43, 86))
@pytest.mark.parametrize("entries", (1, 3, 16, 64, 129, 512))
@pytest.mark.parametrize("walkers", (1, 5, H200_SMS))
def test_dynamic_order_is_longest_first_in_sections(num_m_blocks, entries, walkers):
    # The order as its definition says: consecutive (head, batch) entries in sections of
    # at least SECTION_ROUNDS rounds of the grid's tiles (or one section of all), sizes
    # within one of each other, the bigger ones first; within a section every entry's last
    # query block, then the one before, and so on. Every tile exactly once.
    wanted = -(-SECTION_ROUNDS * walkers // num_m_blocks)
    count = max(entries // wanted, 1)
    sizes = [entries // count + (1 if s < entries % count else 0) for s in range(count)]
    assert count == 1 or min(sizes) * num_m_blocks >= SECTION_ROUNDS * walkers
    expected, first = [], 0
    for size in sizes:
        expected += [(m, e) for m in range(num_m_blocks - 1, -1, -1) for e in range(first, first + size)]
        first += size
    order = [_dynamic_tile(i, num_m_blocks, entries, walkers) for i in range(num_m_blocks * entries)]
    assert order == expected
    assert sorted(order) == [(m, e) for m in range(num_m_blocks) for e in range(entries)]


@pytest.mark.parametrize(
    "num_m_blocks,entries", ((86, 32), (43, 64), (22, 128), (8, 512), (8, 256), (16, 128), (32, 64))
)
def test_dynamic_order_keeps_the_sms_busy_on_causal_tiles(num_m_blocks, entries):
    # Greedy list scheduling (each tile to the CTA free first, as the counter hands them
    # out) of causal tiles: query block m sees m + 1 key blocks, plus one block's worth of
    # per-tile cost. The protocol's causal persistent grids (d64 on 192-row tiles at 16k /
    # 8k / 4k, 128-row tiles at 1k-2k, d128 and d256 at 1k-4k) keep the SMs busy 97% of
    # the time or more; long-short pairs, whole units, held 94-97% on these grids.
    def cost(m: int) -> float:
        return m + 2.0

    free = [0.0] * H200_SMS
    for i in range(num_m_blocks * entries):
        m, _ = _dynamic_tile(i, num_m_blocks, entries, H200_SMS)
        heapq.heappush(free, heapq.heappop(free) + cost(m))
    busy = sum(cost(m) for m in range(num_m_blocks)) * entries / H200_SMS
    assert busy / max(free) >= 0.97
