"""The backward kernel's walk over query blocks, checked against brute force on CPU: the
same functions the kernel runs (plain integer arithmetic) on Python ints."""

from __future__ import annotations

import random

import pytest

from flash4.kernels.bwd_blocks import dq_turn_rank, masked_block_end, mirror_block, query_block_at, query_block_range



def visible(i: int, j: int, seqlen_q: int, seqlen_k: int, causal: bool) -> bool:
    return j < seqlen_k and (not causal or j <= i + seqlen_k - seqlen_q)


def cases():
    rng = random.Random()
    fixed = [(1, 1), (17, 17), (128, 128), (1000, 1000), (1000, 17), (17, 1000), (129, 300), (300, 129)]
    drawn = [(rng.randint(1, 700), rng.randint(1, 700)) for _ in range(12)]
    return fixed + drawn


@pytest.mark.parametrize("tile_m,tile_n", ((64, 128), (128, 128), (64, 64)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_query_blocks_cover_every_visible_pair_and_unmasked_blocks_need_no_mask(tile_m, tile_n, causal):
    TILE_N = tile_n
    for seqlen_q, seqlen_k in cases():
        for n_block in range(-(-seqlen_k // TILE_N)):
            m_begin, m_end = query_block_range(n_block, seqlen_q, seqlen_k, tile_m, TILE_N, causal)
            masked_end = masked_block_end(n_block, m_begin, m_end, seqlen_q, seqlen_k, tile_m, TILE_N, causal)
            assert 0 <= m_begin <= masked_end <= m_end, (seqlen_q, seqlen_k, n_block)
            keys = range(n_block * TILE_N, (n_block + 1) * TILE_N)
            for i in range(seqlen_q):
                walked = m_begin * tile_m <= i < m_end * tile_m
                if any(visible(i, j, seqlen_q, seqlen_k, causal) for j in keys):
                    assert walked, f"row {i} sees key block {n_block} but is skipped ({seqlen_q}, {seqlen_k})"
                if masked_end * tile_m <= i < m_end * tile_m:
                    # Run without a mask: every key of the block must be visible to the row.
                    assert all(visible(i, j, seqlen_q, seqlen_k, causal) for j in keys), (
                        f"row {i} in an unmasked block misses keys of block {n_block} ({seqlen_q}, {seqlen_k})"
                    )
            # The first walked block holds a row that sees the key block (no wasted block).
            first_rows = range(m_begin * tile_m, min((m_begin + 1) * tile_m, seqlen_q))
            assert any(visible(i, j, seqlen_q, seqlen_k, causal) for i in first_rows for j in keys)


@pytest.mark.parametrize("tile_m,tile_n", ((64, 128), (128, 128), (64, 64)))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_deterministic_dq_turns_are_a_launch_ordered_permutation(tile_m, tile_n, causal):
    # For every query block, the key blocks that walk it take ranks 0..count-1, once each
    # (else a turn counter never reaches some rank: a hang). Each waits only for a CTA
    # launched before it (key blocks launch first to last, or causal last to first): CTAs
    # launch in order, so the one it waits for is running or done. Causal, the ranks also
    # follow arrival: rank r reaches the query block no later in its walk than rank r + 1.
    for seqlen_q, seqlen_k in cases():
        n_blocks = -(-seqlen_k // tile_n)
        launch = list(reversed(range(n_blocks))) if causal else list(range(n_blocks))
        # query block -> (rank, key block, steps into the key block's walk)
        contributors: dict[int, list[tuple[int, int, int]]] = {}
        for n_block in range(n_blocks):
            m_begin, m_end = query_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)
            for m_block in range(m_begin, m_end):
                rank = dq_turn_rank(n_block, m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal)
                contributors.setdefault(m_block, []).append((rank, n_block, m_block - m_begin))
        for m_block, found in contributors.items():
            found.sort()
            assert [rank for rank, _, _ in found] == list(range(len(found))), (seqlen_q, seqlen_k, m_block, found)
            for (_, before, before_step), (rank, after, after_step) in zip(found, found[1:]):
                assert launch.index(before) < launch.index(after), (seqlen_q, seqlen_k, m_block, rank)
                if causal:
                    assert before_step <= after_step, (seqlen_q, seqlen_k, m_block, rank)


@pytest.mark.parametrize("tile_m,tile_n", ((64, 128), (128, 128), (64, 64)))
def test_rotated_walks_visit_every_query_block_once_and_start_apart(tile_m, tile_n):
    # Non-causal: each key block's rotated walk is a permutation of its query blocks (else a
    # query block misses its dQ, or gets it twice), and the key blocks of a head start at
    # different query blocks whenever there are no more key blocks than query blocks.
    # Without rotation the walk is the query blocks in order.
    for seqlen_q, seqlen_k in cases():
        key_blocks = -(-seqlen_k // tile_n)
        starts = []
        for n_block in range(key_blocks):
            m_begin, m_end = query_block_range(n_block, seqlen_q, seqlen_k, tile_m, tile_n, False)
            walk = [query_block_at(step, n_block, m_end, key_blocks, True) for step in range(m_begin, m_end)]
            assert sorted(walk) == list(range(m_begin, m_end)), (seqlen_q, seqlen_k, n_block, walk)
            assert [query_block_at(step, n_block, m_end, key_blocks, False) for step in range(m_begin, m_end)] == list(
                range(m_begin, m_end)
            )
            starts.append(walk[0])
        if key_blocks <= -(-seqlen_q // tile_m):
            assert len(set(starts)) == key_blocks, (seqlen_q, seqlen_k, starts)


def test_rotated_walk_start_fits_32_bits_at_any_length():
    # The start's product n * max(M // N, 1) stays below max(M, N), so the kernel's Int32
    # arithmetic holds up to 2^31 query or key blocks (2^37 tokens at 64-row blocks).
    for m_end, key_blocks in ((1 << 20, 3), (3, 1 << 20), (1 << 25, 1 << 25), (65536, 32768), (7, 7)):
        n_block = key_blocks - 1
        assert n_block * max(m_end // key_blocks, 1) < max(m_end, key_blocks)
        assert 0 <= query_block_at(m_end - 1, n_block, m_end, key_blocks, True) < m_end


@pytest.mark.parametrize("tile_m,tile_n", ((64, 128), (128, 128), (64, 64)))
def test_mirror_pairs_walk_every_key_block_once_and_equal_causal_work(tile_m, tile_n):
    for seqlen_q, seqlen_k in cases():
        key_blocks = -(-seqlen_k // tile_n)
        walked, work = [], []
        for n_block in range(-(-key_blocks // 2)):
            mirror = mirror_block(n_block, key_blocks)
            blocks = [n_block] + ([mirror] if mirror > n_block else [])
            walked += blocks
            work.append(sum(end - begin for begin, end in
                            (query_block_range(n, seqlen_q, seqlen_k, tile_m, tile_n, True) for n in blocks)))
        assert sorted(walked) == list(range(key_blocks))
        if seqlen_q == seqlen_k and key_blocks % 2 == 0:
            # Square causal: a block's walk shortens by tile_n / tile_m query blocks per
            # key block, so a block and its mirror add up to the same count (the ragged
            # last query block aside).
            assert max(work) - min(work) <= 1
