"""perf/short_row_ceiling.py: the two-term fit and the ceiling it reads off, on synthetic
bench records whose times follow known lines."""

from __future__ import annotations

import pytest

from perf_tools import load


def _module():
    return load("short_row_ceiling")


def _report(fixed_slow, per_gflop_slow, fixed_fast, per_gflop_fast):
    records = []
    for seqlen in (512, 1024, 2048, 4096):
        gflop = 68.719476736 * seqlen / 512
        records.append({
            "shape": {"head_dim": 128, "causal": False, "seqlen": seqlen},
            "flops": gflop * 1e9,
            "results": {
                "flash4": {"ms": fixed_fast + per_gflop_fast * gflop},
                "flash4-bf16": {"ms": fixed_slow + per_gflop_slow * gflop},
            },
        })
    return {"records": records}


def test_fit_recovers_the_lines_and_a_kernel_at_the_tensor_rate_sits_at_its_ceiling():
    module = _module()
    # The fast kernel at exactly half the slow one's per-FLOP cost, with a fixed cost of its own.
    (fit,) = module.fit_report(_report(0.05, 0.0014, 0.03, 0.0007), "flash4", "flash4-bf16", [512, 1024, 2048])
    assert fit.slow[:2] == pytest.approx((0.05, 0.0014)) and fit.fast[:2] == pytest.approx((0.03, 0.0007))
    assert fit.slow[2] < 1e-9 and fit.fast[2] < 1e-9
    for _, measured, ceiling in fit.ratios:
        assert measured == pytest.approx(ceiling)


def test_a_slower_fast_kernel_stays_below_its_ceiling():
    module = _module()
    (fit,) = module.fit_report(_report(0.05, 0.0014, 0.05, 0.0009), "flash4", "flash4-bf16", [512, 1024, 2048])
    assert all(measured < ceiling for _, measured, ceiling in fit.ratios)
    # With equal fixed costs the ceiling climbs towards the tensor-rate ratio as the work grows.
    ceilings = [ceiling for _, _, ceiling in fit.ratios]
    assert ceilings == sorted(ceilings) and ceilings[-1] < module.TENSOR_RATE_RATIO


def test_dram_rates_count_q_k_v_once_and_o_once():
    module = _module()
    shape = {"batch": 2, "seqlen": 512, "heads": 8, "head_dim": 128, "causal": False, "group": 4}
    elements = 2 * 512 * 8 * 128
    # e4m3 Q (1 byte) and bf16 O (2), K and V a quarter of Q's elements under GQA 4.
    fast_bytes, slow_bytes = elements * (3 + 2 * 0.25), elements * (4 + 4 * 0.25)
    report = {"records": [{"shape": shape, "results": {"flash4": {"ms": 2.0}, "flash4-bf16": {"ms": 4.0}}}]}
    ((got, fast_rate, slow_rate),) = module.dram_rates(report, "flash4", "flash4-bf16")
    assert got is shape
    assert fast_rate == pytest.approx(fast_bytes / 2e-3) and slow_rate == pytest.approx(slow_bytes / 4e-3)
