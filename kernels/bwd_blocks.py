"""Which query blocks a key block of the Hopper backward visits, in what order, which of
them need a mask, and (deterministic mode) in which turn its dQ goes. Plain integer
arithmetic, so the same functions run inside the kernel (on Int32) and in the CPU tests
(on ints): tests/test_bwd_blocks.py checks them against brute force."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def query_block_range(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """[first, last) query blocks that see some key of key block ``n_block``.

    Plain integer arithmetic, so the same function runs inside the kernel (on Int32) and in
    the CPU tests (on ints). Causal: query row i sees keys <= i + seqlen_k - seqlen_q.
    """
    m_begin = 0
    if causal:
        m_begin = cutlass.max(n_block * tile_n - seqlen_k + seqlen_q, 0) // tile_m
    return m_begin, cute.ceil_div(seqlen_q, tile_m)


def mirror_block(n_block, key_blocks):
    """``mirror_pairs``: the CTA at grid index ``n_block`` (of ceil(key_blocks / 2)) walks
    key block ``n_block`` and then this one, when it is another (not the middle block of
    an odd count)."""
    return key_blocks - 1 - n_block


def query_block_at(step, n_block, m_end, key_blocks, rotate: bool):
    """The query block that key block ``n_block`` works on at ``step`` of its walk.

    In order, the walk is its query blocks [m_begin, m_end), step == query block. Rotated
    (``rotate_query_blocks``; non-causal, so m_begin == 0), key block n starts at query
    block n * (m_end // key_blocks), or n mod m_end when there are fewer query blocks than
    key blocks, and wraps around: the key blocks of a head run side by side, and in order
    they would all reach a query block at once, so with ``dq_first_stores`` all but one
    would wait for that one's store to land. (The start's product stays below
    max(m_end, key_blocks): no 32-bit overflow at any length.)
    """
    m_block = step
    if rotate:
        m_block = (step + n_block * cutlass.max(m_end // key_blocks, 1) % m_end) % m_end
    return m_block


def masked_block_end(n_block, m_begin, m_end, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """Query blocks in [m_begin, this) need a mask; the rest see every key of the block.

    A key block that runs past seqlen_k is masked for all its query blocks (the rows of K
    past the end are zeros, not -inf); otherwise, when causal, the blocks before the first
    row that sees the block's last key. Branch-free, like ``query_block_range``.
    """
    end = m_begin
    if causal:
        full_row = (n_block + 1) * tile_n - 1 - seqlen_k + seqlen_q
        end = cutlass.max(cutlass.min(cute.ceil_div(cutlass.max(full_row, 0), tile_m), m_end), m_begin)
    # 1 when the block runs past seqlen_k, else 0.
    past_end = cutlass.min(cutlass.max((n_block + 1) * tile_n - seqlen_k, 0), 1)
    return end + past_end * (m_end - end)


def dq_turn_rank(n_block, m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """Key block ``n_block``'s place among the contributors to query block ``m_block``'s dQ
    in deterministic mode: they add in rank order 0, 1, ...

    Without a mask, every key block walks the query blocks from the first: ranks follow the
    key blocks. Causal, key block n starts at the query block its first key's rows reach,
    so the block nearest the diagonal reaches m_block first and block 0 last: ranks run
    from the last contributing key block down, matching arrival. (The grid then launches
    the key blocks last to first, so a CTA only ever waits for CTAs launched before it.)
    Called only for query blocks that ``n_block`` sees, so the division is of a non-negative
    number. Plain integer arithmetic, like ``query_block_range``.
    """
    rank = n_block
    if causal:
        last_key_block = cutlass.min(
            cute.ceil_div(seqlen_k, tile_n) - 1, ((m_block + 1) * tile_m - 1 + seqlen_k - seqlen_q) // tile_n
        )
        rank = last_key_block - n_block
    return rank
