"""The Hopper backward (flash4/backward.py) against the float32 reference, on the GPU.

Rule of DESIGN.md for every gradient: max|g - ref| <= 2 * max|g_torch - ref| + 1e-5, where
ref is flash4.reference.attention_backward in float32 and g_torch is torch's autograd in
the input dtype. Gradients are poisoned with NaN before the launch; inputs are fresh draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash4 import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def poisoned_dq_accumulator(monkeypatch):
    """dQ's fp32 accumulator filled with NaN, not left as allocated: with
    ``dq_first_stores`` nothing zeroes it, so a part that no key block stores shows as NaN
    in dq instead of passing on memory that happened to hold zeros."""
    from flash4 import backward

    monkeypatch.setattr(
        backward, "dq_accumulator", lambda shape, device: torch.full(shape, math.nan, device=device)
    )

ABS_SLACK = 1e-5
# The forward tests' grid (ragged, equal and unequal both ways, up to 4096), plus two
# lengths that are no multiple of any tile.
SEQLEN_PAIRS = (
    (1, 1), (17, 17), (128, 128), (1000, 1000), (4096, 4096),
    (1, 1000), (17, 1000), (1000, 17), (128, 4096), (4096, 128), (333, 777), (777, 333),
)


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _check_against_reference(q, k, v, dout, causal, grads) -> None:
    """DESIGN.md's rule for each of dq, dk, dv, and no element left unwritten (NaN)."""
    out_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    expected = reference.attention_backward(q, k, v, out_ref, dout, lse_ref, causal=causal)
    baseline = reference.attention_backward_in_dtype(q, k, v, dout, causal=causal)
    for name, got, want, torch_grad in zip(("dq", "dk", "dv"), grads, expected, baseline):
        assert not got.isnan().any(), f"{name}: some element was never written"
        bound = 2 * _max_err(torch_grad, want) + ABS_SLACK
        assert _max_err(got, want) <= bound, f"{name}: error {_max_err(got, want):.3g} > {bound:.3g}"


def _backward_matches_reference(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype,
                                config=None) -> None:
    """Fresh inputs, flash4's forward for out and LSE, the gradients poisoned with NaN,
    the backward (``config``: a candidate's kernel instead of the selector's), the rule."""
    from flash4 import flash_attn_func
    from flash4.backward import attention_backward

    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads, config=config)
    torch.cuda.synchronize()

    _check_against_reference(q, k, v, dout, causal, (dq, dk, dv))


def _many_adders_inputs(heads, kv_heads, head_dim, causal):
    """Fresh bf16 q, k, v, dout for 777 queries on 1000 keys (batch 2), with flash4's out
    and LSE: eight key blocks add into each query block's dQ, and under GQA several query
    heads into each dK, dV."""
    from flash4 import flash_attn_func

    dtype = torch.bfloat16
    q = torch.randn(2, 777, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, 1000, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(2, 1000, kv_heads, head_dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    return q, k, v, out, dout, lse


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("heads,kv_heads", ((3, 3), (4, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
def test_backward_matches_reference(head_dim, causal, dtype, seqlen_q, seqlen_k, heads, kv_heads):
    _backward_matches_reference(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, dtype)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((17, 17), (1000, 1000), (4096, 128), (128, 4096), (333, 777)))
@pytest.mark.parametrize(
    "change",
    (dict(dq_first_stores=False), dict(rotate_query_blocks=False)),
    ids=("accumulator-zeroed", "walks-in-order"),
)
def test_backward_variants_match_reference(head_dim, causal, seqlen_q, seqlen_k, change):
    # Below ZEROED_DQ_MIN_SEQLEN_K keys the selector's kernels store dQ's first
    # contributions, and they rotate unmasked walks; the variants a sweep compares them
    # with (the preprocess zeroing the accumulator, as the selector does for long rows, or
    # the walks in order) must stay right too.
    import dataclasses

    from flash4.backward import backward_config

    config = dataclasses.replace(backward_config(head_dim, causal, seqlen_k=seqlen_k), **change)
    _backward_matches_reference(2, seqlen_q, seqlen_k, 4, 4, head_dim, causal, torch.bfloat16, config)


def test_backward_variants_refuse_a_grouped_config_without_a_kv_scheme():
    # Under GQA a configuration that neither adds dK and dV across the group nor walks the
    # group in one CTA would let each query head's CTA overwrite them: refused before any
    # launch, the gradients untouched.
    import dataclasses

    from flash4 import flash_attn_func
    from flash4.backward import attention_backward, backward_config

    q = torch.randn(1, 64, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    config = dataclasses.replace(backward_config(64, False, True, seqlen_k=64), kv_accumulate=False,
                                 kv_group_in_cta=False)
    with pytest.raises(ValueError, match="kv_accumulate=True or kv_group_in_cta=True"):
        attention_backward(q, k, v, out, torch.randn_like(out), lse, grads=grads, config=config)
    assert all(g.isnan().all() for g in grads)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((17, 17), (1000, 1000), (4096, 128), (128, 4096), (333, 777)))
@pytest.mark.parametrize("heads,kv_heads", ((4, 2), (8, 1), (6, 2), (3, 3)), ids=("gqa2", "mqa8", "gqa3", "mha"))
def test_backward_kv_group_variants_match_reference(head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads):
    # A CTA per kv head walking each query head of its group in turn, dK and dV in its
    # registers across the walks (kv_group_in_cta), against the reference, masked or not
    # whatever the selector picks: odd and even groups, MQA, and multi-head (a group of
    # one); short walks (17 queries) and walks whose query blocks see no key (causal, 4096
    # queries on 128 keys). 4 batch entries at the short lengths keep several CTAs per kv
    # head in flight.
    import dataclasses

    from flash4.backward import backward_config

    config = dataclasses.replace(
        backward_config(head_dim, causal, kv_heads != heads, seqlen_k=seqlen_k), kv_accumulate=False,
        kv_group_in_cta=True,
    )
    batch = 4 if seqlen_q * seqlen_k < 1000 * 1000 else 2
    _backward_matches_reference(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, torch.bfloat16, config)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((17, 17), (1000, 1000), (4096, 128), (128, 4096), (333, 777)))
@pytest.mark.parametrize(
    "heads,kv_heads,kv_scheme",
    ((3, 3, None), (4, 2, "kv_accumulate"), (6, 2, "kv_group_in_cta"), (8, 1, "kv_group_in_cta")),
    ids=("mha", "gqa2-accumulate", "gqa3-in-cta", "mqa8-in-cta"),
)
def test_backward_mirror_pairs_variants_match_reference(head_dim, seqlen_q, seqlen_k, heads, kv_heads, kv_scheme):
    # Causal, a CTA walking key block n and then its mirror (mirror_pairs): even and odd
    # key-block counts (1000 keys: 8 at tile_n 128; 777: 7, whose middle block walks
    # alone; 17: one), query blocks that see no key (4096 queries on 128 keys: all but the
    # last 128 rows) and many key blocks on few queries (128 on 4096), under each way of
    # writing dK and dV.
    import dataclasses

    from flash4.backward import backward_config

    config = backward_config(head_dim, True, kv_heads != heads, seqlen_k=seqlen_k)
    if kv_scheme is not None:
        config = dataclasses.replace(config, kv_accumulate=kv_scheme == "kv_accumulate",
                                     kv_group_in_cta=kv_scheme == "kv_group_in_cta")
    config = dataclasses.replace(config, mirror_pairs=True)
    _backward_matches_reference(3, seqlen_q, seqlen_k, heads, kv_heads, head_dim, True, torch.bfloat16, config)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (17, 17), (1000, 1000), (4096, 128), (128, 4096), (333, 777)))
@pytest.mark.parametrize(
    "heads,kv_heads,change",
    (
        (3, 3, dict()),
        (3, 3, dict(dq_first_stores=False)),
        (4, 2, dict(kv_accumulate=True, kv_group_in_cta=False)),
        (6, 2, dict(kv_accumulate=False, kv_group_in_cta=True)),
        (6, 2, dict(kv_accumulate=False, kv_group_in_cta=True, mirror_pairs=True)),
    ),
    ids=("mha", "mha-zeroed", "gqa2-accumulate", "gqa3-in-cta", "gqa3-in-cta-mirrored"),
)
def test_backward_staggered_variants_match_reference(head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads, change):
    # The key split's warpgroups half a step apart (staggered_warpgroups): warpgroup 0's dQ
    # one step late and the walk's last after it, under every way of walking and writing
    # dK and dV; walks of one step (one query, or 17), walks whose blocks see no key
    # (causal, 4096 queries on 128 keys), several walks per CTA (groups, mirrored pairs).
    import dataclasses

    from flash4.backward import backward_config

    if change.get("mirror_pairs") and not causal:
        pytest.skip("mirror_pairs pairs causal key blocks only")
    config = dataclasses.replace(
        backward_config(head_dim, causal, kv_heads != heads, seqlen_k=seqlen_k), staggered_warpgroups=True, **change
    )
    _backward_matches_reference(3, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, torch.bfloat16, config)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (8, 2)), ids=("mha", "gqa"))
def test_staggered_backward_has_the_bits_of_in_step(head_dim, causal, heads, kv_heads):
    # Staggered warpgroups change when each dQ GEMM runs, not what it adds: deterministic,
    # so the additions go in the same order, the two kernels' gradients are bit-identical.
    import dataclasses

    from flash4.backward import attention_backward, backward_config

    q, k, v, out, dout, lse = _many_adders_inputs(heads, kv_heads, head_dim, causal)
    # The selector staggers some of these configurations itself: in step is asked for.
    selected = backward_config(head_dim, causal, kv_heads != heads, True, seqlen_k=1000)
    in_step = dataclasses.replace(selected, staggered_warpgroups=False)
    runs = []
    for config in (in_step, dataclasses.replace(in_step, staggered_warpgroups=True)):
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        runs.append(attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads, deterministic=True,
                                       config=config))
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert not a.isnan().any(), f"{name}: some element was never written"
        assert torch.equal(a, b), f"{name}: staggered differs from in step"


def _deterministic_runs_agree(heads, kv_heads, head_dim, causal, config=None) -> None:
    """Two deterministic backward runs (``config``: a candidate's kernel instead of the
    selector's) on the many-adders inputs: the same bits, and the rule of DESIGN.md."""
    from flash4.backward import attention_backward

    q, k, v, out, dout, lse = _many_adders_inputs(heads, kv_heads, head_dim, causal)
    runs = []
    for _ in range(2):
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        runs.append(attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads, deterministic=True,
                                       config=config))
    torch.cuda.synchronize()
    for name, first, second in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{name} differs between two deterministic runs"
    _check_against_reference(q, k, v, dout, causal, runs[0])


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q", (17, 1000))
def test_long_rows_zeroed_accumulator_matches_reference(head_dim, causal, seqlen_q):
    # From ZEROED_DQ_MIN_SEQLEN_K keys on, the selector's kernel adds every contribution
    # into an accumulator the preprocess zeroed (poisoned with NaN here before that), under
    # GQA as well; the last key block is ragged.
    from flash4.backward import ZEROED_DQ_MIN_SEQLEN_K, backward_config

    seqlen_k = ZEROED_DQ_MIN_SEQLEN_K + 17
    assert not backward_config(head_dim, causal, True, seqlen_k=seqlen_k).dq_first_stores
    _backward_matches_reference(1, seqlen_q, seqlen_k, 4, 2, head_dim, causal, torch.bfloat16)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (8, 2)), ids=("mha", "gqa"))
def test_deterministic_backward_is_bit_identical(head_dim, causal, heads, kv_heads):
    # Many key blocks add into each query block's dQ (1000 keys), and under GQA four query
    # heads into each dK, dV: the orders that deterministic mode fixes.
    _deterministic_runs_agree(heads, kv_heads, head_dim, causal)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (17, 17), (1000, 1000), (4096, 128), (128, 4096), (333, 777)))
@pytest.mark.parametrize("tile_m", (80, 64))
@pytest.mark.parametrize(
    "heads,kv_heads,change",
    (
        (3, 3, dict()),
        (3, 3, dict(dq_first_stores=False)),
        (3, 3, dict(staggered_warpgroups=False)),
        (4, 2, dict(kv_accumulate=True, kv_group_in_cta=False)),
        (6, 2, dict(kv_accumulate=False, kv_group_in_cta=True)),
    ),
    ids=("mha", "mha-zeroed", "mha-in-step", "gqa2-accumulate", "gqa3-in-cta"),
)
def test_backward_transposed_dq_variants_match_reference(causal, seqlen_q, seqlen_k, tile_m, heads, kv_heads, change):
    # dQᵀ = Kᵀ dSᵀ at head dim 128 (dq_transposed), on 80-row query blocks (flash-attn-4's
    # unmasked tile, no multiple of 64) and 64: each warpgroup's accumulator leaves in its
    # registers' order and the postprocess puts every value back in place. Ragged last
    # blocks (17, 333, 777 and 1000 rows are no multiple of 80), first stores and the zeroed
    # accumulator, in step and staggered, both GQA schemes.
    import dataclasses

    from flash4.backward import backward_config

    config = dataclasses.replace(
        backward_config(128, causal, kv_heads != heads, seqlen_k=seqlen_k), dq_transposed=True, tile_m=tile_m,
        **change,
    )
    _backward_matches_reference(3, seqlen_q, seqlen_k, heads, kv_heads, 128, causal, torch.bfloat16, config)


@pytest.mark.parametrize("tile_m", (80, 64))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_transposed_dq_deterministic_backward_is_bit_identical(tile_m, causal):
    # Deterministic turns over the transposed parts: two runs, the same bits, and the rule.
    import dataclasses

    from flash4.backward import backward_config

    config = dataclasses.replace(
        backward_config(128, causal, False, True, seqlen_k=1000), dq_transposed=True, tile_m=tile_m
    )
    _deterministic_runs_agree(4, 4, 128, causal, config)


@pytest.mark.parametrize(
    "head_dim,transposed", ((64, False), (128, False), (256, False), (128, True)),
    ids=("d64", "d128", "d256", "d128-transposed-80"),
)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seqlen", (1, 17, 1000))
@pytest.mark.parametrize("overlap", (False, True), ids=("alone", "overlap"))
def test_dq_postprocess_rounds_like_torch(head_dim, transposed, dtype, seqlen, overlap):
    # dQ out of its fp32 accumulator (kernels/sm90_bwd_postprocess.py), which holds each
    # query block as the main kernel's tile geometry says: every value read from its
    # place, the product with the softmax scale rounded once to nearest even, as torch's
    # multiply does, so the same bits; the padded rows are never read (NaN there would
    # show), every output element is written (NaN poison).
    from flash4.backward import backward_config
    from flash4.compiler import compiled_backward_postprocess

    import dataclasses

    config = backward_config(head_dim, False, seqlen_k=1024)
    if transposed:
        # The dQᵀ parts in register order, staged through shared memory a query block at a time.
        config = dataclasses.replace(config, dq_transposed=True, tile_m=80)
    geometry = config.dq_tile_geometry
    # Rows padded to whole query blocks, as attention_backward allocates them.
    batch, heads, scale, padded = 2, 3, 0.0883883, -(-seqlen // geometry.tile_m) * geometry.tile_m
    rows_major = torch.randn(batch, heads, padded, head_dim, device="cuda") * 3
    rows_major[:, :, seqlen:] = math.nan
    row = torch.arange(padded, device="cuda").view(-1, 1)
    col = torch.arange(head_dim, device="cuda").view(1, -1)
    place = geometry.offset(row, col).flatten()
    accum = torch.full((batch, heads, padded * head_dim), math.nan, device="cuda")
    accum[:, :, place] = rows_major.flatten(2)
    dq = torch.full((batch, seqlen, heads, head_dim), math.nan, device="cuda", dtype=dtype)
    # The overlapping variant, launched alone: its head counters already at the key blocks.
    key_blocks = 3
    ready = torch.full((batch, heads), key_blocks, dtype=torch.int32, device="cuda")
    compiled_backward_postprocess(str(dtype).removeprefix("torch."), geometry, overlap=overlap)(
        accum, dq, ready, key_blocks, scale
    )
    torch.cuda.synchronize()
    want = torch.mul(rows_major[:, :, :seqlen].transpose(1, 2), scale).to(dtype)
    assert torch.equal(dq, want)
