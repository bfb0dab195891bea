"""perf/ptx_snapshot.py's variants: what a "PTX unchanged" check after a refactor covers
(listed without compiling)."""

from __future__ import annotations

from perf_tools import load

from flash4.dispatch import TABLE


def _snapshot_module():
    return load("ptx_snapshot")


def test_forward_variants_cover_every_selector_row_and_the_fp8_kernels_without_lse():
    variants = _snapshot_module().forward_variants()
    names = [name for name, _ in variants]
    assert len(names) == len(set(names)), "two variants would write one file"
    rows = [row for _, (row, _) in variants]
    for row in TABLE:
        if row.arch == "sm_90a":
            assert row in rows, f"{row} is not in the snapshot"
    assert any(row.config.cluster_heads for row in rows), "no head-cluster kernel"
    without_lse = {row for _, (row, with_lse) in variants if not with_lse}
    assert without_lse == {row for row in rows if row.config.fp8}
    int8 = [row for row in rows if row.config.fp8_qk_int8]
    assert len(int8) == sum(1 for row in TABLE if row.config.fp8) * 4
    assert sum(row.config.fp8_int8_shift_in_softmax for row in int8) == len(int8) // 2


def test_backward_variants_are_distinct_and_cover_every_scheme():
    variants = _snapshot_module().backward_variants()
    configs = [config for _, config in variants]
    assert len({repr(c) for c in configs}) == len(configs)
    assert {c.head_dim for c in configs} == {64, 128, 256}
    for field in ("causal", "kv_accumulate", "kv_group_in_cta", "mirror_pairs", "deterministic",
                  "dq_first_stores", "staggered_warpgroups", "head_dim_split"):
        assert {getattr(c, field) for c in configs} == {False, True}, f"{field} takes one value only"


def test_quantize_variants_cover_both_codes_and_every_kernel():
    variants = _snapshot_module().quantize_variants()
    names = [name for name, _ in variants]
    assert len(names) == len(set(names))
    kwargs = [what for _, what in variants]
    assert {w.get("int8", False) for w in kwargs} == {False, True}
    assert any(w.get("transposed_v") for w in kwargs) and any(w.get("amax") for w in kwargs)
    assert {w["block_rows"] for w in kwargs} >= {None, 128, 192}
