"""perf/bwd_smem_bound.py: the shared-memory bytes of a backward step, counted by hand for
the three flash4 rows and flash-attn-4's 80-row tile, and the ceilings they set."""

from __future__ import annotations

import pytest

from perf_tools import load


def _module():
    return load("bwd_smem_bound")


def test_head_dim_128_step_counts_each_operand_read():
    tile = _module().BackwardTile(head_dim=128, tile_m=64, tile_n=128)
    kib = 1024
    parts = tile.smem_bytes()
    # Sᵀ and dPᵀ: each warpgroup reads its 64 keys of K (V) and all 64 queries of Q (dO).
    assert parts["S, dP"] == 2 * 2 * (16 + 16) * kib
    # dV and dK from registers: B only, 64 queries x 128 columns per warpgroup.
    assert parts["dV, dK"] == 2 * 2 * 16 * kib
    # dQ by columns: all of dS (64 x 128) and half of K (128 x 64) per warpgroup.
    assert parts["dQ"] == 2 * (16 + 16) * kib
    assert parts["P, dS stores"] == 16 * kib
    assert parts["TMA Q, dO"] == 32 * kib + 2 * 64 * 4
    assert parts["dQ tile"] == 64 * kib
    assert tile.flops == 10 * 64 * 128 * 128


@pytest.mark.parametrize(
    "head_dim,causal,bound", ((64, False, 0.907), (128, True, 0.868), (128, False, 0.916), (256, True, 0.588))
)
def test_flash4_rows_ceilings(head_dim, causal, bound):
    # Head dim 256's step (544 KiB through shared memory for 10.5 MFLOP) cannot keep the
    # tensor cores busy more than 59% of the time; 64 and 128 are closer to the tensor rate.
    module = _module()
    assert module.flash4_tile(head_dim, causal).tensor_share() == pytest.approx(bound, abs=1e-3)


def test_80_row_tile_moves_fewer_bytes_per_flop_than_64_rows():
    # Head dim 128 unmasked: the 80-row tile (flash-attn-4's, and flash4's since
    # dq_transposed) moves 5% fewer shared-memory bytes per FLOP than 64 rows; causal both
    # take 64.
    module = _module()
    rows_64, rows_80 = module.flash4_tile(128, True), module.flash4_tile(128, False)
    assert (rows_64.tile_m, rows_80.tile_m) == (64, 80)
    per_flop = [sum(t.smem_bytes().values()) / t.flops for t in (rows_64, rows_80)]
    assert per_flop[1] / per_flop[0] == pytest.approx(0.947, abs=1e-3)
    assert module.fa4_tile(128, False) == rows_80 and module.fa4_tile(128, True) == rows_64
    assert module.fa4_tile(256, False) is None
