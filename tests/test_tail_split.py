"""CPU tests of the split tail's host side: which tails are cut and into how many pieces,
the workspace's shape, and the placeholders of a call that cuts nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flash4.dispatch import select
from flash4.kernels.tail_split import MAX_PIECES, MIN_KEY_BLOCKS_PER_PIECE, choose_pieces, record_floats
from flash4.launch import split_record_shape, split_tail_buffers


@pytest.mark.parametrize(
    "units,walkers,key_blocks,expected",
    (
        # Head dim 128 at the protocol's 16k tokens: 2048 tiles on 132 SMs, 68 in the tail
        # (0.52 of a round): in thirds the last round is 2/3 of a tile (halves: still 1).
        (2048, 132, 128, (68, 3)),
        # The same in clusters of two: 1024 units on 66 walkers, 34 left.
        (1024, 66, 128, (34, 3)),
        # Too few key blocks for thirds (12 needed), and halves do not shorten 0.52 rounds.
        (2048, 132, 8, (0, 1)),
        # A quarter of a round left: halves bring it to half a tile.
        (2048 + 132 // 4 - 68, 132, 8, (33, 2)),
        # Whole rounds, fewer units than walkers, or a tail that no cut shortens.
        (264, 132, 100, (0, 1)),
        (100, 132, 100, (0, 1)),
        (131 + 132, 132, 100, (0, 1)),
    ),
)
def test_choose_pieces(units, walkers, key_blocks, expected):
    assert choose_pieces(units, walkers, key_blocks) == expected


def test_choose_pieces_never_cuts_below_the_minimum_walk():
    for units in range(133, 400):
        for key_blocks in range(1, 40):
            tail, pieces = choose_pieces(units, 132, key_blocks)
            assert 1 <= pieces <= MAX_PIECES and (pieces == 1) == (tail == 0)
            assert pieces == 1 or key_blocks >= pieces * MIN_KEY_BLOCKS_PER_PIECE
            if pieces > 1:
                # The cut's last round is shorter than a whole unit.
                assert -(-tail * pieces // 132) < pieces


def test_records_are_whole_16_byte_vectors():
    assert record_floats(64, 2) == 68 and record_floats(32, 2) == 36 and record_floats(30, 2) == 36
    config = dataclasses.replace(select("sm_90a", "bfloat16", 128, False, 4096).config, split_tail=True)
    assert split_record_shape(config) == (256, 68)


def test_split_tail_buffers_cut_or_hold_placeholders():
    config = dataclasses.replace(select("sm_90a", "bfloat16", 128, False, 4096).config, split_tail=True)
    cpu = torch.device("cpu")
    # 16 heads x 128 query blocks on 132 SMs: 68 tail tiles in thirds.
    counters, work = split_tail_buffers(config, 1, 16, 16384, 16384, 132, cpu)
    assert counters.shape == (68,) and counters.dtype == torch.int32 and not counters.any()
    assert work.shape == (68, 3, 256, 68) and work.dtype == torch.float32
    # Whole rounds: one piece, and the same placeholders every call.
    first = split_tail_buffers(config, 1, 132, 128, 16384, 132, cpu)
    again = split_tail_buffers(config, 1, 132, 128, 16384, 132, cpu)
    assert first[1].shape[1] == 1 and first[0] is again[0] and first[1] is again[1]
    # Clusters of two count whole clusters' blocks on half as many walkers.
    clustered = dataclasses.replace(config, kv_multicast=True)
    counters, work = split_tail_buffers(clustered, 1, 16, 16384, 16384, 132, cpu)
    assert counters.shape == (2 * 34,) and work.shape == (2 * 34, 3, 256, 68)


def test_split_tail_is_refused_where_units_differ_or_registers_lack():
    for head_dim, causal, seqlen in ((128, True, 4096), (256, False, 512)):
        config = select("sm_90a", "bfloat16", head_dim, causal, seqlen).config
        with pytest.raises(ValueError, match="split_tail"):
            dataclasses.replace(config, split_tail=True)
