"""Kernel configurations: their shared-memory plan and what they refuse."""

from __future__ import annotations

import dataclasses

import pytest

from flash4.kernels.configs import SM90_SMEM_BYTES, Sm90ForwardConfig


def test_persistent_o_gets_its_own_buffer_only_where_it_fits():
    # Head dim 128: Q, O and a two-stage K/V ring of 128-key blocks fit (160 KiB).
    d128 = Sm90ForwardConfig(head_dim=128, tile_n=128, persistent=True)
    assert not d128.o_in_q_buffer
    assert d128.smem_bytes() == 2 * 128 * 128 * 2 + 4 * 128 * 128 * 2 + 1024
    # Head dim 256: a second 64 KiB tile next to Q and the 80-key ring would need 288 KiB.
    d256 = Sm90ForwardConfig(head_dim=256, tile_n=80, persistent=True, pingpong=False)
    assert d256.o_in_q_buffer
    assert d256.smem_bytes() == 128 * 256 * 2 + 4 * 80 * 256 * 2 + 1024 <= SM90_SMEM_BYTES
    # One tile per CTA: Q is dead by the epilogue, so O always reuses its buffer.
    assert Sm90ForwardConfig(head_dim=128, tile_n=128).o_in_q_buffer
    # A second Q slot (the next tile's Q) still fits at head dim 128: 224 KiB.
    two_slots = Sm90ForwardConfig(head_dim=128, tile_n=128, persistent=True, q_stages=2)
    assert two_slots.smem_bytes() == 3 * 128 * 128 * 2 + 4 * 128 * 128 * 2 + 1024 <= SM90_SMEM_BYTES


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(head_dim=128, tile_n=128, consumer_warpgroups=5), "consumer_warpgroups=5"),
        (dict(head_dim=128, tile_n=128, kv_stages=0), "kv_stages=0"),
        (dict(head_dim=72, tile_n=120), "tile_n=120"),
        (dict(head_dim=264, tile_n=64), "head_dim=264"),
        (dict(head_dim=256, tile_n=128), "bytes of shared memory"),
        (dict(head_dim=128, tile_n=128, persistent=True, q_stages=0), "q_stages=0"),
        # Two Q slots need a persistent CTA whose O has its own buffer.
        (dict(head_dim=128, tile_n=128, q_stages=2), "q_stages=2: .*persistent"),
        (dict(head_dim=256, tile_n=80, persistent=True, pingpong=False, q_stages=2), "q_stages=2: .*own buffer"),
        # The FP8 softmax keeps its own row sum.
        (dict(head_dim=128, tile_n=128, fp8=True, sum_from_rescaled=True), "sum_from_rescaled=True"),
        (dict(head_dim=128, tile_n=128, fp8=True, lazy_rescale=True), "lazy_rescale=True: the 16-bit softmax only"),
        # The first block's turn is a ping-pong turn.
        (dict(head_dim=128, tile_n=128, pingpong=False, first_block_turn=True), "first_block_turn=True: only with pingpong"),
        # The check by sums recomputes overflowed scores from Q's and K's slots.
        (dict(head_dim=64, tile_n=128, lazy_check_by_sums=True), "lazy_check_by_sums=True: only with lazy_rescale"),
        (dict(head_dim=64, tile_n=128, lazy_rescale=True, lazy_check_by_sums=True, q_in_registers=True),
         "lazy_check_by_sums=True: not with q_in_registers"),
        # A warpgroup's own O store needs O's own buffer: one tile per CTA, or head dim 256.
        (dict(head_dim=128, tile_n=128, o_store_per_warpgroup=True), "o_store_per_warpgroup=True: .*own"),
        (dict(head_dim=256, tile_n=80, persistent=True, pingpong=False, o_store_per_warpgroup=True),
         "o_store_per_warpgroup=True: .*own"),
        # Q in registers stops where Q and O's accumulator no longer fit together.
        (dict(head_dim=256, tile_n=64, q_in_registers=True), "q_in_registers=True: head_dim up to 128"),
        (dict(head_dim=256, tile_n=128, fp8=True, q_in_registers=True), "q_in_registers=True: head_dim up to 128"),
        # Column slices of the first block are whole 8-column groups, in the 16-bit softmax.
        (dict(head_dim=256, tile_n=80, masked_column_slices=4), "masked_column_slices=4: .*tile_n a multiple of 32"),
        (dict(head_dim=128, tile_n=128, fp8=True, masked_column_slices=4), "masked_column_slices=4: 16-bit only"),
        (dict(head_dim=128, tile_n=128, masked_column_slices=3), r"masked_column_slices=3: one of \(0, 2, 4, 8\)"),
        (dict(head_dim=256, tile_n=64, skip_unseen_first_block=True), "skip_unseen_first_block=True: only causal"),
        # A dynamic order hands out causal tiles of a persistent grid, one CTA's at a time.
        (dict(head_dim=128, tile_n=128, persistent=True, dynamic_tiles=True), "dynamic_tiles=True: only causal"),
        (dict(head_dim=128, tile_n=128, causal=True, dynamic_tiles=True), "dynamic_tiles=True: .*persistent"),
        (dict(head_dim=128, tile_n=128, causal=True, persistent=True, kv_multicast=True, dynamic_tiles=True),
         "dynamic_tiles=True: .*kv_multicast"),
    ],
)
def test_invalid_configs_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Sm90ForwardConfig(**fields)


def test_backward_configs_of_the_selector_fit_and_split_only_head_dim_256():
    from flash4.backward import SUPPORTED_HEAD_DIMS, backward_config
    from flash4.kernels.configs import SM90_SMEM_BYTES

    assert SUPPORTED_HEAD_DIMS == (64, 128, 256)
    for head_dim in SUPPORTED_HEAD_DIMS:
        config = backward_config(head_dim, causal=False, seqlen_k=1024)
        assert config.smem_bytes() <= SM90_SMEM_BYTES
        assert config.head_dim_split == (head_dim == 256)
        assert config.tile_n == (64 if head_dim == 256 else 128)


def test_backward_selector_takes_80_row_blocks_with_dq_transposed_at_head_dim_128_unmasked_only():
    from flash4.backward import TRANSPOSED_DQ_TILE_M, backward_config

    for seqlen_k in (1, 1000, 16384):
        config = backward_config(128, False, seqlen_k=seqlen_k)
        assert (config.tile_m, config.dq_transposed) == (TRANSPOSED_DQ_TILE_M, True) == (80, True)
        others = (
            backward_config(128, True, seqlen_k=seqlen_k), backward_config(128, False, True, seqlen_k=seqlen_k),
            backward_config(128, False, deterministic=True, seqlen_k=seqlen_k),
            backward_config(64, False, seqlen_k=seqlen_k), backward_config(256, False, seqlen_k=seqlen_k),
        )
        for other in others:
            assert not other.dq_transposed and other.tile_m != TRANSPOSED_DQ_TILE_M


def test_transposed_dq_geometry_is_one_warpgroup_accumulator_a_part():
    from flash4.kernels.configs import DQTileGeometry

    DQTileGeometry(128, 80, 80, 64, transposed=True)
    with pytest.raises(ValueError, match="transposed=True: .*got part_rows=40, part_cols=128"):
        DQTileGeometry(128, 80, 40, 128, transposed=True)


def test_backward_selector_zeroes_the_accumulator_from_long_rows_on_unless_deterministic():
    from flash4.backward import SUPPORTED_HEAD_DIMS, ZEROED_DQ_MIN_SEQLEN_K, backward_config

    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            short = backward_config(head_dim, causal, seqlen_k=ZEROED_DQ_MIN_SEQLEN_K - 1)
            long = backward_config(head_dim, causal, seqlen_k=ZEROED_DQ_MIN_SEQLEN_K)
            assert short.dq_first_stores and not long.dq_first_stores
            assert long == dataclasses.replace(short, dq_first_stores=False)
            assert backward_config(head_dim, causal, deterministic=True, seqlen_k=ZEROED_DQ_MIN_SEQLEN_K).dq_first_stores


def test_backward_selector_walks_a_kv_group_in_one_cta_on_a_full_grid_causal_only_short_and_mirrored():
    from flash4.backward import MIRRORED_KV_GROUP_MAX_SEQLEN_K, SUPPORTED_HEAD_DIMS, backward_config, wave_fill

    h200_sms = 132
    assert wave_fill(256, h200_sms) == 256 / 264 and wave_fill(132, h200_sms) == 1.0
    for head_dim in SUPPORTED_HEAD_DIMS:
        def scheme(causal=False, deterministic=False, grouped=True, seqlen_k=4096, kv_units=8):
            c = backward_config(head_dim, causal, grouped, deterministic, seqlen_k=seqlen_k, kv_units=kv_units,
                                sms=h200_sms)
            assert c.mirror_pairs == (c.kv_group_in_cta and causal)
            return (c.kv_accumulate, c.kv_group_in_cta)

        # The protocol's GQA-8 shapes: 16k tokens, 2 kv heads (head dim 128), a full last wave.
        tile_n = backward_config(head_dim, False, seqlen_k=1024).tile_n
        for seqlen in (1024, 4096, 16384):
            kv_units = 16384 // seqlen * 2048 // head_dim // 8
            assert wave_fill(-(-seqlen // tile_n) * kv_units, h200_sms) >= 0.95
            assert scheme(seqlen_k=seqlen, kv_units=kv_units) == (False, True)
        # Causal, mirrored pairs of key blocks: half the grid, only up to the head dim's
        # longest rows (none at 256).
        longest = MIRRORED_KV_GROUP_MAX_SEQLEN_K.get(head_dim, 0)
        if longest:
            kv_units = 16384 // longest * 2048 // head_dim // 8
            assert wave_fill(-(-longest // tile_n // 2) * kv_units, h200_sms) >= 0.95
            assert scheme(causal=True, seqlen_k=longest, kv_units=kv_units) == (False, True)
            assert scheme(causal=True, seqlen_k=longest + 1, kv_units=kv_units) == (True, False)
            # The grid counts pairs: 4 of 1024 keys on 33 kv units fill 132 SMs, on 34 they
            # leave most of a second wave idle.
            assert scheme(causal=True, seqlen_k=1024, kv_units=33) == (False, True)
            assert scheme(causal=True, seqlen_k=1024, kv_units=34) == (True, False)
        else:
            assert scheme(causal=True, seqlen_k=1024, kv_units=33) == (True, False)
        assert scheme(causal=True, seqlen_k=16384) == (True, False)
        assert scheme(causal=True, seqlen_k=1024, deterministic=True) == (True, False)
        assert scheme(deterministic=True) == (True, False)
        assert scheme(grouped=False) == (False, False)
        # MQA at batch 1: a CTA per key block of the one kv head leaves most SMs idle.
        assert scheme(seqlen_k=4096, kv_units=1) == (True, False)
        # Left out, the grid is taken as full.
        assert backward_config(head_dim, False, True, seqlen_k=64).kv_group_in_cta


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(head_dim=128, tile_m=64, tile_n=64), "tile_n=64: 128 keys"),
        (dict(head_dim=256, tile_m=64, tile_n=128, head_dim_split=True), "tile_n=128: 64 keys"),
        (dict(head_dim=256, tile_m=48, tile_n=64, head_dim_split=True), "tile_m=48"),
        (dict(head_dim=128, tile_m=64, q_stages=0), "q_stages=0"),
        (dict(head_dim=128, tile_m=64, dq_rows=True), "dq_rows=True: .*tile_m=128 \\(got 64\\)"),
        (dict(head_dim=128, tile_m=80), "tile_m=80: .*a multiple of 64"),
        (dict(head_dim=64, tile_m=80, dq_transposed=True), "dq_transposed=True: .*head_dim=128; got head_dim=64"),
        (dict(head_dim=128, tile_m=128, dq_rows=True, dq_transposed=True), "dq_transposed=True: .*dq_rows=True"),
        (dict(head_dim=128, tile_m=72, dq_transposed=True), "tile_m=72: a multiple of 16"),
        # Head dim 256 with two Q stages: the fp32 dQ tile leaves no room.
        (dict(head_dim=256, tile_m=64, tile_n=64, q_stages=2, do_stages=1, head_dim_split=True),
         "bytes of shared memory"),
    ],
)
def test_invalid_backward_configs_name_the_field(fields, message):
    from flash4.kernels.configs import Sm90BackwardConfig

    with pytest.raises(ValueError, match=message):
        Sm90BackwardConfig(**fields)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(fp8_v_per_tensor=True), "fp8_v_per_tensor=True: only with fp8=True"),
        (dict(row_sum_on_tensor_cores=True), "row_sum_on_tensor_cores=True: only with fp8_v_per_tensor=True"),
        (dict(fp8=True, row_sum_on_tensor_cores=True), "row_sum_on_tensor_cores=True: only with fp8_v_per_tensor"),
        (dict(fp8_qk_int8=True), "fp8_qk_int8=True: only with fp8=True"),
        (dict(fp8=True, fp8_v_per_tensor=True, row_sum_on_tensor_cores=True, fp8_p_by_rounding=True,
              scores_in_f16=True, fp8_qk_int8=True), "fp8_qk_int8=True: .*scores_in_f16=False"),
        (dict(fp8=True, causal=True, skip_unseen_first_block=True, fp8_qk_int8=True),
         "fp8_qk_int8=True: .*skip_unseen_first_block=False"),
        (dict(fp8=True, fp8_int8_shift_in_softmax=True), "fp8_int8_shift_in_softmax=True: only with fp8_qk_int8=True"),
    ],
)
def test_fp8_only_forward_fields_are_refused_elsewhere(fields, message):
    from flash4.kernels.configs import Sm90ForwardConfig

    with pytest.raises(ValueError, match=message):
        Sm90ForwardConfig(head_dim=128, tile_n=128, **fields)


def test_each_kernels_named_barriers_differ_and_fit_the_hardware():
    # The forward at its most (four consumer warpgroups, each storing its own O) and the
    # backward (two warpgroups, dQ handed to its store warp, staggered or meeting on dSᵀ):
    # within each kernel no id twice, none 0 (__syncthreads') or past the hardware's.
    from flash4.pipelines.named_barriers import HARDWARE_BARRIERS, NamedBarrier as B

    forward = [B.EPILOGUE] + [B.WARPGROUP_TURN_0 + w for w in range(4)] + [B.EPILOGUE_WARPGROUP_0 + w for w in range(4)]
    backward = [B.EPILOGUE, B.DS_TILE] + [first + w for first in (B.DQ_FULL_0, B.DQ_EMPTY_0, B.DS_WRITTEN_0) for w in range(2)]
    for ids in (forward, backward):
        assert len(set(ids)) == len(ids) and 0 < min(ids) and max(ids) < HARDWARE_BARRIERS


def test_register_budgets_fit_the_pool_the_cta_launches_with():
    # setmaxnreg moves registers within the CTA's pool, what its threads got at launch; an
    # .inc past it waits forever. 640 threads launch with 96 each (61440 in all, not the
    # SM's 65536): four consumer warpgroups get 112, not 120.
    from flash4.pipelines.warp_roles import RegisterBudget, launch_registers, register_budget

    assert [launch_registers(t) for t in (384, 512, 640)] == [168, 128, 96]
    for warpgroups in (2, 3, 4):
        budget = register_budget(warpgroups)
        pool = budget.threads * launch_registers(budget.threads)
        assert 128 * (budget.producer + warpgroups * budget.consumer) <= pool
    with pytest.raises(ValueError, match="pool at launch holds 61440"):
        RegisterBudget(producer=24, consumer=120, consumer_warpgroups=4)
