"""The pair's dQ sum (kernels/dq_pair_sum.py) without a GPU: where each register lands."""

from __future__ import annotations

import dataclasses

import pytest

from flash4.kernels.configs import accumulator_register_coords, accumulator_tile_offset
from flash4.kernels.dq_pair_sum import register_pair_offset

THREADS, PAIRS, TILE_M = 128, 32, 64


def test_register_pairs_land_where_the_accumulator_tile_map_puts_them():
    # The kernel computes a pair's place as the thread's offset XOR the pair's: it must be
    # accumulator_tile_offset of the (row, col) the pair holds, for every thread and pair
    # of an m64n128 accumulator, and no two pairs may share a place.
    places = set()
    for thread in range(THREADS):
        for pair in range(PAIRS):
            register = 2 * pair
            row, col = accumulator_register_coords((register // 4) * 4 * THREADS + 4 * thread + register % 4)
            assert register_pair_offset(thread, pair, TILE_M) == accumulator_tile_offset(row, col, TILE_M)
            places.add(register_pair_offset(thread, pair, TILE_M))
    assert len(places) == THREADS * PAIRS


@pytest.mark.parametrize(
    "change,refused",
    (
        (dict(causal=True), "unmasked"),
        (dict(deterministic=True, dq_first_stores=False), "unmasked and not deterministic"),
        (dict(dq_first_stores=True), "zeroed accumulator"),
        (dict(cluster_key_blocks=3), "1, or 2"),
    ),
)
def test_key_block_clusters_refuse_what_they_cannot_run(change, refused):
    from flash4.backward import backward_config

    base = dataclasses.replace(backward_config(256, False, seqlen_k=16384), cluster_key_blocks=2)
    with pytest.raises(ValueError, match=refused):
        dataclasses.replace(base, **change)


def test_key_block_clusters_need_the_head_dim_split():
    from flash4.backward import backward_config

    with pytest.raises(ValueError, match="head-dim split"):
        dataclasses.replace(backward_config(128, False, seqlen_k=16384), cluster_key_blocks=2)
