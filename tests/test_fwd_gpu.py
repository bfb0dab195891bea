"""The Hopper forward kernel against the float32 reference, on the GPU.

Rule (DESIGN.md), per output: max|out - ref| <= 2 * max|out_torch - ref| + 1e-5, where
out_torch is the same attention done by torch in the input dtype. Outputs are poisoned with
NaN before every launch, inputs are fresh random draws, sizes are ragged.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash4
from flash4 import dispatch, reference

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16)
# (seqlen_q, seqlen_k): ragged sizes, equal and unequal, both orders.
SEQLENS = (
    (1, 1), (17, 17), (128, 128), (1000, 1000), (4096, 4096),
    (1, 1000), (17, 1000), (1000, 17), (128, 4096), (4096, 128),
)
# (heads, kv_heads): multi-head, GQA 4:1, MQA.
HEADS = ((4, 4), (8, 2), (4, 1))
ABS_SLACK = 1e-5


def _inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _run_poisoned(q, k, v, causal, softmax_scale=None):
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, device=q.device)
    flash4.flash_attn_forward_into(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal)
    torch.cuda.synchronize()
    return out, lse


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _check_lse(lse, lse_ref, lse_torch):
    empty = lse_ref == -math.inf
    assert torch.equal(lse == -math.inf, empty), "rows without keys must have LSE = -inf, only those"
    if (~empty).any():
        err = _max_err(lse[~empty], lse_ref[~empty])
        bound = 2 * _max_err(lse_torch[~empty], lse_ref[~empty]) + ABS_SLACK
        assert err <= bound, f"LSE error {err:.3g} > bound {bound:.3g}"


def _check(q, k, v, causal, softmax_scale=None):
    out, lse = _run_poisoned(q, k, v, causal, softmax_scale)
    assert not out.isnan().any(), "NaN in out: some output was never written"
    assert not lse.isnan().any(), "NaN in LSE: some row was never written"
    out_ref, lse_ref = reference.attention(q, k, v, softmax_scale=softmax_scale, causal=causal)
    out_torch, lse_torch = reference.attention_in_dtype(q, k, v, softmax_scale=softmax_scale, causal=causal)
    err = _max_err(out, out_ref)
    bound = 2 * _max_err(out_torch, out_ref) + ABS_SLACK
    assert err <= bound, f"out error {err:.3g} > bound {bound:.3g}"
    _check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_forward_matches_reference(dtype, head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads):
    seed = hash((head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads, str(dtype))) % 2**31
    q, k, v = _inputs(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed)
    _check(q, k, v, causal)


# Every row of the selector's bf16 table, at a ragged length just past the row's first.
BF16_ROWS = [r for r in dispatch.TABLE if r.arch == "sm_90a" and r.dtype == "bfloat16"]
RAGGED_PAST_ROW_START = 17


@pytest.mark.parametrize(
    "row", BF16_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in BF16_ROWS]
)
def test_every_row_matches_reference(row):
    # Rows that start at long lengths (up to 16k) are reached by few of the shapes above or
    # none; each row runs here on the length it starts at plus a ragged tail, GQA 3:1 (an
    # odd group, which runs the row itself; an even one may pair heads, below).
    seqlen = row.min_seqlen_q + RAGGED_PAST_ROW_START
    assert dispatch.select("sm_90a", "bfloat16", row.head_dim, row.causal, seqlen, group=3) is row
    seed = hash(("every-row", row.head_dim, row.causal, seqlen)) % 2**31
    q, k, v = _inputs(1, seqlen, seqlen, 6, 2, row.head_dim, torch.bfloat16, seed)
    _check(q, k, v, row.causal)


# Each causal row as select() runs it with clusters of two query heads (even groups), from
# the first length that takes them.
HEAD_CLUSTER_STARTS = sorted({
    (r.head_dim, max(r.min_seqlen_q, dispatch.HEAD_CLUSTER_MIN_SEQLEN[r.head_dim]))
    for r in BF16_ROWS if r.causal
})


@pytest.mark.parametrize("head_dim,start", HEAD_CLUSTER_STARTS, ids=[f"d{d}-s{s}" for d, s in HEAD_CLUSTER_STARTS])
@pytest.mark.parametrize("heads,kv_heads", ((4, 2), (8, 1)), ids=("gqa2", "mqa8"))
def test_head_cluster_rows_match_reference(head_dim, start, heads, kv_heads):
    seqlen = start + RAGGED_PAST_ROW_START
    row = dispatch.select("sm_90a", "bfloat16", head_dim, True, seqlen, group=heads // kv_heads)
    assert row.config.cluster_heads
    seed = hash(("head-cluster-row", head_dim, seqlen, kv_heads)) % 2**31
    q, k, v = _inputs(1, seqlen, seqlen, heads, kv_heads, head_dim, torch.bfloat16, seed)
    _check(q, k, v, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((17, 1000), (1000, 17), (1000, 1000)))
def test_forward_without_lse_matches_reference(dtype, head_dim, causal, seqlen_q, seqlen_k):
    # The variant compiled without LSE stores (lse=None) must still write every output row.
    seed = hash(("no-lse", head_dim, causal, seqlen_q, seqlen_k, str(dtype))) % 2**31
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 8, 2, head_dim, dtype, seed)
    out = torch.full_like(q, math.nan)
    flash4.flash_attn_forward_into(q, k, v, out, None, causal=causal)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "NaN in out: some output was never written"
    out_ref, _ = reference.attention(q, k, v, causal=causal)
    out_torch, _ = reference.attention_in_dtype(q, k, v, causal=causal)
    assert _max_err(out, out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK


def _run_config_variant(q, k, v, causal, **changes):
    """The table's kernel for these inputs with ``changes`` to its config: (out, lse),
    poisoned beforehand, every row checked as written."""
    import dataclasses

    from flash4.compiler import compiled_forward, tile_counter
    from flash4.dispatch import select
    from flash4.devices import device_sms
    from flash4.forward import LOG2_E

    batch, seqlen_q, heads, head_dim = q.shape
    entry = select("sm_90a", str(q.dtype).removeprefix("torch."), head_dim, causal, seqlen_q)
    if "dynamic_tiles" not in changes and (changes.get("kv_multicast") or changes.get("persistent") is False):
        # Clusters share out tiles in turn (as select() runs them), and a one-tile grid has
        # no order to choose: no dynamic one.
        changes = dict(dynamic_tiles=False, **changes)
    entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, **changes))
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads, seqlen_q), math.nan, device="cuda")
    compiled_forward(entry)(q, k, v, out, lse, head_dim**-0.5 * LOG2_E, device_sms(0), tile_counter(entry.config, q.device))
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any(), "some output row was never written"
    return out, lse


def _check_same_bits(q, k, v, causal, before: dict, after: dict) -> None:
    """The table's kernel for these inputs with the ``before`` and the ``after`` changes to
    its config: the same output and LSE, bit for bit."""
    want, want_lse = _run_config_variant(q, k, v, causal, **before)
    out, lse = _run_config_variant(q, k, v, causal, **after)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def _check_config_variant(head_dim, causal, seqlen_q, seqlen_k, **changes):
    """The table's bf16 kernel for this case with ``changes`` to its config, against the
    reference, on 4 batch entries of 8 query heads and 2 kv heads."""
    seed = hash(("variant", head_dim, causal, seqlen_q, seqlen_k, tuple(sorted(changes.items())))) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    out, lse = _run_config_variant(q, k, v, causal, **changes)
    out_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    out_torch, lse_torch = reference.attention_in_dtype(q, k, v, causal=causal)
    assert _max_err(out, out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK
    _check_lse(lse, lse_ref, lse_torch)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("persistent", (False, True), ids=("one-tile", "persistent"))
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", ((1000, 1000), (1100, 1100), (1100, 700), (1000, 17), (17, 1000), (4096, 128))
)
def test_scheduler_variants_match_reference(head_dim, causal, persistent, seqlen_q, seqlen_k):
    # Both tile schedulers, whichever the selector picks: with 4 * 8 heads and up to 32 query
    # blocks there are more tiles than SMs, so persistent CTAs loop over several tiles,
    # including (causal, seqlen_q > seqlen_k) tiles that see no key at all; 1100 rows make an
    # odd number of query blocks, whose middle one has no causal pair. At head dim 256 a
    # persistent CTA stages O in Q's buffer, so each tile's Q load waits for the previous
    # tile's O store, empty tiles included. A one-tile CTA has one Q slot and stages O in
    # Q's buffer, so its warpgroups store O together.
    slots = {} if persistent else dict(q_stages=1, o_store_per_warpgroup=False)
    _check_config_variant(head_dim, causal, seqlen_q, seqlen_k, persistent=persistent, **slots)


def test_shapes_and_scales_never_recompile(monkeypatch):
    from flash4 import compiler, interface

    compiles = []
    real_compile = compiler._compile

    def counting_compile(entry, *options, **kwargs):
        compiles.append(entry)
        return real_compile(entry, *options, **kwargs)

    monkeypatch.setattr(compiler, "_compile", counting_compile)
    monkeypatch.setattr(interface, "_KERNELS", {})
    compiler.compiled_forward.cache_clear()
    # batch, seqlen_q, seqlen_k, heads, kv_heads, softmax_scale: everything but the kernel's
    # static properties (dtype, head dim, causal, LSE or not) changes from call to call.
    for i, (batch, seqlen_q, seqlen_k, heads, kv_heads, scale) in enumerate(
        ((1, 17, 17, 2, 2, None), (3, 1000, 64, 4, 1, 0.3), (2, 5, 4096, 8, 2, 1.7), (7, 128, 300, 6, 3, None))
    ):
        q, k, v = _inputs(batch, seqlen_q, seqlen_k, heads, kv_heads, 64, torch.bfloat16, 20 + i)
        flash4.flash_attn_func(q, k, v, softmax_scale=scale)
    assert len(compiles) == 1, f"{len(compiles)} compilations for one kernel over changing shapes"
    flash4.flash_attn_func(q, k, v, return_lse=True)
    assert len(compiles) == 2, "asking for LSE builds the one variant that writes it"


def test_public_function_returns_out_and_lse():
    q, k, v = _inputs(2, 300, 500, 4, 2, 128, torch.bfloat16, 1)
    out = flash4.flash_attn_func(q, k, v, causal=True)
    out2, lse = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, 4, 300) and lse.dtype == torch.float32
    assert torch.equal(out, out2), "the kernel must be deterministic"
    out_ref, _ = reference.attention(q, k, v, causal=True)
    out_torch, _ = reference.attention_in_dtype(q, k, v, causal=True)
    assert _max_err(out, out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK


def test_softmax_scale_is_honoured():
    q, k, v = _inputs(1, 200, 300, 2, 2, 64, torch.float16, 2)
    _check(q, k, v, causal=False, softmax_scale=0.37)


def test_strided_views_of_packed_qkv():
    # A (batch, seqlen, 3, heads, head_dim) projection output, sliced without copying.
    qkv = torch.randn(2, 333, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)


def test_rows_without_keys_give_zero_and_minus_inf():
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    q, k, v = _inputs(1, 300, 20, 2, 1, 64, torch.bfloat16, 3)
    out, lse = _run_poisoned(q, k, v, causal=True)
    assert torch.all(out[:, :280] == 0)
    assert torch.all(lse[:, :, :280] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, :, 280:]))


def test_long_keys_million_tokens():
    q, k, v = _inputs(1, 64, 1 << 20, 2, 1, 64, torch.bfloat16, 4)
    _check(q, k, v, causal=False)


def test_tensor_past_2_to_31_elements():
    # q and out hold 17 * 128 * 2^20 > 2^31 elements: offsets past 2^31 must be exact.
    seqlen_q, heads, head_dim = 1 << 20, 17, 128
    assert seqlen_q * heads * head_dim > 2**31
    q, k, v = _inputs(1, seqlen_q, 256, heads, 1, head_dim, torch.bfloat16, 5)
    out, lse = _run_poisoned(q, k, v, causal=False)
    assert not out.isnan().any()
    tail = slice(seqlen_q - 300, seqlen_q)  # rows whose offsets are past 2^31
    q_tail = q[:, tail]
    out_ref, lse_ref = reference.attention(q_tail, k, v)
    out_torch, lse_torch = reference.attention_in_dtype(q_tail, k, v)
    assert _max_err(out[:, tail], out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK
    _check_lse(lse[:, :, tail], lse_ref, lse_torch)


def test_many_heads_and_batches_grid():
    q, k, v = _inputs(64, 33, 70, 48, 16, 64, torch.float16, 6)
    _check(q, k, v, causal=True)


def test_runs_on_the_current_stream():
    q, k, v = _inputs(2, 1000, 1000, 4, 4, 128, torch.bfloat16, 7)
    expected = flash4.flash_attn_func(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = flash4.flash_attn_func(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def test_cuda_graph_capture_and_replay():
    q, k, v = _inputs(2, 500, 700, 4, 2, 128, torch.bfloat16, 8)
    flash4.flash_attn_func(q, k, v, causal=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash4.flash_attn_func(q, k, v, causal=True)
    fresh = _inputs(2, 500, 700, 4, 2, 128, torch.bfloat16, 9)
    for static, new in zip((q, k, v), fresh):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    out_ref, _ = reference.attention(q, k, v, causal=True)
    out_torch, _ = reference.attention_in_dtype(q, k, v, causal=True)
    assert _max_err(out, out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK


def test_unsupported_head_dim_raises_before_launch():
    q, k, v = _inputs(1, 16, 16, 2, 2, 72, torch.bfloat16, 10)
    with pytest.raises(ValueError, match="head_dim=72"):
        flash4.flash_attn_func(q, k, v)


def test_forward_into_refuses_inputs_requiring_grad_before_launch():
    q, k, v = _inputs(1, 64, 64, 2, 2, 64, torch.bfloat16, seed=7)
    q.requires_grad_(True)
    out = torch.full_like(q, math.nan)
    with pytest.raises(NotImplementedError, match="q requires grad"):
        flash4.flash_attn_forward_into(q, k, v, out, None)
    torch.cuda.synchronize()
    assert out.isnan().all(), "the refused call touched out"
    with torch.no_grad():
        flash4.flash_attn_forward_into(q, k, v, out, None)
    torch.cuda.synchronize()
    assert not out.isnan().any()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1000, 1000), (17, 1000), (4096, 4096)))
def test_other_rescale_setting_matches_reference(head_dim, causal, seqlen_q, seqlen_k):
    # The table skips O's rescale when no row of a warp raised its max at some head dims
    # (rescale_when_needed) and not at others; the other setting must be right too: with
    # 32 key blocks (4096) most blocks skip it, and a skip that should not happen leaves O
    # scaled wrong.
    from flash4.dispatch import select

    default = select("sm_90a", "bfloat16", head_dim, causal, seqlen_q).config.rescale_when_needed
    _check_config_variant(head_dim, causal, seqlen_q, seqlen_k, rescale_when_needed=not default)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1000, 1000), (1100, 700), (17, 1000), (4096, 4096), (1000, 17)))
def test_other_row_sum_order_matches_reference(head_dim, causal, seqlen_q, seqlen_k):
    # The table starts each key block's row sum from the old sum times O's factor at some
    # head dims (sum_from_rescaled) and not at others; the other order must be right too:
    # many blocks (4096), a single block (17 keys), causal tiles that see few keys.
    from flash4.dispatch import select

    default = select("sm_90a", "bfloat16", head_dim, causal, seqlen_q).config.sum_from_rescaled
    _check_config_variant(head_dim, causal, seqlen_q, seqlen_k, sum_from_rescaled=not default)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1000, 1000), (1100, 700), (3000, 3000)))
def test_other_p_order_changes_no_bit(head_dim, causal, seqlen_q, seqlen_k):
    # The 16-bit rows convert P after O's rescale (the FP8 head-dim-256 rows before it,
    # p_before_rescale): the same operations on the same values, so the other order gives
    # the same bits.
    from flash4.dispatch import select

    default = select("sm_90a", "bfloat16", head_dim, causal, seqlen_q).config.p_before_rescale
    seed = hash(("p-before-rescale", head_dim, causal, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(2, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    _check_same_bits(q, k, v, causal, {}, dict(p_before_rescale=not default))


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1000, 1000), (1100, 700), (17, 1000), (1000, 17), (3000, 3000)))
def test_q_in_registers_changes_no_bit(head_dim, causal, seqlen_q, seqlen_k):
    # The S GEMM with Q in registers (q_in_registers, loaded by ldmatrix) does the same
    # multiply-adds in the same order as with Q in shared memory: the same bits, for tiles
    # that see one key block, many, or none (causal, 1000 queries on 17 keys), and Q slots
    # released early then reused by later tiles of a persistent CTA. Two consumer
    # warpgroups at head dim 64, where three run out of registers with Q held; lazy_rescale
    # checked by the max, since the check by sums reads Q's slot again.
    seed = hash(("q-in-registers", head_dim, causal, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    tiles = dict(consumer_warpgroups=2) if head_dim == 64 else {}
    tiles.update(lazy_check_by_sums=False)
    _check_same_bits(q, k, v, causal, dict(q_in_registers=False, **tiles), dict(q_in_registers=True, **tiles))


@pytest.mark.parametrize("head_dim,warpgroups", ((64, 2), (64, 3), (128, 2), (256, 2)), ids=("64", "64-3wg", "128", "256"))
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", ((1000, 1000), (1100, 1100), (1100, 700), (17, 1000), (1000, 17), (4096, 128), (3000, 3000))
)
def test_candidate_dynamic_tiles_changes_no_bit(head_dim, warpgroups, seqlen_q, seqlen_k):
    # Causal persistent grids taking their tiles from a counter at run time (dynamic_tiles)
    # instead of dealing pairs: each tile's work is the same, only its CTA differs, so the
    # same bits; with 4 * 8 heads every CTA takes several tiles, including tiles that see
    # no key (1000 queries on 17 keys, 4096 on 128; at head dim 256 they still store O
    # through Q's buffer) and an odd number of query blocks (1100). Run twice: the counter
    # starts from 0 in each launch.
    seed = hash(("dynamic", head_dim, warpgroups, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    tiles = dict(consumer_warpgroups=warpgroups, persistent=True)
    if head_dim == 256:
        tiles.update(q_stages=1)
    want, want_lse = _run_config_variant(q, k, v, True, **tiles)
    for _ in range(2):
        out, lse = _run_config_variant(q, k, v, True, dynamic_tiles=True, **tiles)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim,warpgroups", ((64, 2), (64, 3), (128, 2)), ids=("64", "64-3wg", "128"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", ((1, 1), (17, 17), (512, 512), (1000, 1000), (1100, 700), (17, 1000), (1000, 17), (3000, 3000))
)
def test_first_block_turn_changes_no_bit(head_dim, warpgroups, causal, seqlen_q, seqlen_k):
    # The tile's first S GEMM issued in the ping-pong turn (first_block_turn): only when
    # each warpgroup issues changes, not what it computes, so the same bits. The turn
    # carries from tile to tile of a persistent CTA, so an unbalanced wait would hang or
    # reorder a later tile: 4 * 8 heads give every CTA several tiles, one-block tiles (17,
    # 512 causal's first), tiles that see no key and skip the loop (1000 queries on 17
    # keys, causal), and at 3000 causal the dynamic grid at head dim 64.
    seed = hash(("first-block-turn", head_dim, warpgroups, causal, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    tiles = dict(consumer_warpgroups=warpgroups)
    _check_same_bits(q, k, v, causal, dict(first_block_turn=False, **tiles), dict(first_block_turn=True, **tiles))


@pytest.mark.parametrize("head_dim,warpgroups", ((64, 2), (64, 3), (128, 2), (256, 2)), ids=("64", "64-3wg", "128", "256"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", ((1, 1), (17, 17), (1000, 1000), (1100, 700), (700, 1100), (17, 1000), (1000, 17), (512, 512))
)
def test_masked_column_slices_change_no_bit(head_dim, warpgroups, causal, seqlen_q, seqlen_k):
    # The first key block's softmax over only the column slices some row of each warp sees
    # (masked_column_slices): P is 0 in the others, as exp2(-inf) is, and the row sums add
    # the same values in the same order, so the same bits. Diagonals at every offset
    # (seqlen_q != seqlen_k, either way), whole key blocks past a warp's rows (17 queries on
    # 1000 keys), seqlen_k's ragged tail alone (unmasked), rows that see no key (1000 on 17).
    seed = hash(("masked-column-slices", head_dim, warpgroups, causal, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    tiles = dict(consumer_warpgroups=warpgroups)
    if head_dim == 256:
        # Its 80-key blocks do not cut into 8-column-group slices; 64-key ones do.
        tiles.update(tile_n=64)
    _check_same_bits(q, k, v, causal, dict(masked_column_slices=0, **tiles), dict(masked_column_slices=4, **tiles))


@pytest.mark.parametrize("slices", (2, 8))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1100, 700), (700, 1100), (17, 1000)))
def test_other_slice_counts_change_no_bit(slices, seqlen_q, seqlen_k):
    # The first block cut into halves or eighths (16 keys, one warp's rows on the diagonal)
    # instead of the rows' quarters: the same bits as uncut.
    head_dim = 64
    seed = hash(("slice-counts", head_dim, slices, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    _check_same_bits(
        q, k, v, True,
        dict(masked_column_slices=0, consumer_warpgroups=2),
        dict(masked_column_slices=slices, consumer_warpgroups=2),
    )


@pytest.mark.parametrize(
    "head_dim,tiles",
    ((64, {}), (128, {}), (256, dict(tile_n=64)), (256, dict(tile_n=80)), (256, dict(tile_n=80, persistent=False)),
     (256, dict(tile_n=80, persistent=False, kv_multicast=True))),
    ids=("64", "128", "256-n64", "256-n80", "256-one-tile", "256-multicast"),
)
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k", ((1, 1), (17, 17), (1000, 1000), (1100, 700), (700, 1100), (17, 1000), (1000, 17), (512, 512))
)
def test_skip_unseen_first_block_changes_no_bit(head_dim, tiles, seqlen_q, seqlen_k):
    # Causal: a warpgroup that sees no key of its tile's first block skips that block's S
    # GEMM (skip_unseen_first_block) and takes -inf scores, which the masked GEMM's would
    # have been: the same bits. 64- and 80-key blocks under 128-row tiles (the first
    # warpgroup misses the diagonal's top block), persistent or not, clusters whose first
    # CTA masks whole blocks, diagonals at every offset, rows that see no key at all.
    seed = hash(("skip-unseen", head_dim, tuple(tiles.items()), seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    if tiles.get("persistent") is False:
        tiles = dict(tiles, q_stages=1, o_store_per_warpgroup=False)
    _check_same_bits(
        q, k, v, True,
        dict(skip_unseen_first_block=False, **tiles),
        dict(skip_unseen_first_block=True, **tiles),
    )


# Key rows scaled up towards key 0 by up to this factor: the key loop walks down from the
# last block, so each block's scores pass the last ones' max by several powers of two.
RISING_SCORES_SCALE = 30.0


# Key 0 scaled by this much: its scores reach tens to hundreds of octaves above the max a
# row keeps by then (key 0 is in the last block the loop walks), past fp32's exponentials.
SPIKE_KEY_SCALE = 200.0


def _shaped_score_inputs(scores, seqlen_q, seqlen_k, head_dim, seed):
    """Inputs whose scores are "random", "rising" (keys scaled up towards key 0 by up to
    RISING_SCORES_SCALE) or "spike" (key 0 scaled by SPIKE_KEY_SCALE)."""
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    if scores == "rising":
        ramp = torch.linspace(RISING_SCORES_SCALE, 1.0, seqlen_k, device="cuda")
        k = (k.float() * ramp[None, :, None, None]).to(k.dtype)
    elif scores == "spike":
        k[:, 0] = (k[:, 0].float() * SPIKE_KEY_SCALE).to(k.dtype)
    return q, k, v


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("check", ("max", "sums"))
@pytest.mark.parametrize("scores", ("random", "rising", "spike"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1000, 1000), (1100, 700), (17, 1000), (1000, 1127), (3000, 3000)))
def test_lazy_rescale_matches_reference(head_dim, causal, check, scores, seqlen_q, seqlen_k):
    # Unmasked blocks keeping the row max while the scores stay within its headroom
    # (lazy_rescale, here forced on every row at these lengths), the branch chosen by each
    # thread's max over its scores or by the row sums of P (lazy_check_by_sums): not the
    # same bits as rebasing every block, so against the reference. Random scores rarely
    # pass the kept max by 2^8; rising ones pass it by a few octaves a block, so warps
    # rebase (by the sums: P divided by its largest value), each at its own blocks. The
    # spike key's scores lie tens of octaves above the rest (rows then one-hot: the
    # output is V's row to the bit in the reference) or past fp32's exponentials, where
    # the sums' warps compute their scores again. Causal 1000 queries on 1127 keys: a
    # tile's first row sees exactly the keys up to the end of a block, so it reaches that
    # block, unmasked, with max -inf.
    seed = hash(("lazy-rescale", head_dim, causal, check, scores, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _shaped_score_inputs(scores, seqlen_q, seqlen_k, head_dim, seed)
    out, lse = _run_config_variant(q, k, v, causal, lazy_rescale=True, lazy_check_by_sums=check == "sums")
    out_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    out_torch, lse_torch = reference.attention_in_dtype(q, k, v, causal=causal)
    assert _max_err(out, out_ref) <= 2 * _max_err(out_torch, out_ref) + ABS_SLACK
    _check_lse(lse, lse_ref, lse_torch)


KV_MULTICAST_SEQLENS = ((1000, 1000), (1100, 700), (17, 1000), (1000, 17), (3000, 3000))


def _check_kv_multicast_changes_no_bit(head_dim, causal, persistent, seqlen_q, seqlen_k):
    # Clusters of two CTAs sharing each K and V block by multicast (kv_multicast) load the
    # same bytes into the same places, so the same bits as the CTAs loading alone. 1100 and
    # 17 queries give an odd number of query blocks: the last cluster's second block lies
    # past seqlen_q. With 4 * 8 heads a persistent cluster loops over several tiles. Causal,
    # a cluster walks the key blocks of its later query block, which the earlier one masks
    # whole: a row's first blocks then leave it at max -inf, and with 1100 queries on 700
    # keys some query blocks see no key at all while their partner does.
    slots = {} if persistent else dict(q_stages=1, o_store_per_warpgroup=False)
    seed = hash(("kv-multicast", head_dim, causal, persistent, seqlen_q, seqlen_k)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, 8, 2, head_dim, torch.bfloat16, seed)
    _check_same_bits(
        q, k, v, causal,
        dict(persistent=persistent, **slots),
        dict(persistent=persistent, kv_multicast=True, **slots),
    )


# (seqlen_q, seqlen_k, query heads, kv heads): groups of 2, 4 and 8 (MQA) query heads.
HEAD_CLUSTER_CASES = ((1100, 700, 8, 4), (17, 1000, 8, 2), (1000, 17, 8, 1), (3000, 3000, 8, 2))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize(
    "causal,persistent", ((False, False), (False, True), (True, False), (True, True)),
    ids=("full-one-tile", "full-persistent", "causal-one-tile", "causal-persistent"),
)
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,kv_heads", HEAD_CLUSTER_CASES)
def test_kv_multicast_head_clusters_changes_no_bit(head_dim, causal, persistent, seqlen_q, seqlen_k, heads, kv_heads):
    # Clusters of two query heads of one K/V head on the same query block (cluster_heads)
    # load the same K and V bytes as the CTAs alone: the same bits. A one-tile grid
    # clusters along its head axis, a persistent one hands out pairs of heads; causal, both
    # CTAs see the same keys, so no block is masked whole. With 4 batch entries a
    # persistent cluster loops over several tiles; 1000 queries on 17 keys leave causal
    # tiles that see no key at all.
    slots = {} if persistent else dict(q_stages=1, o_store_per_warpgroup=False)
    seed = hash(("head-clusters", head_dim, causal, persistent, seqlen_q, seqlen_k, kv_heads)) % 2**31
    q, k, v = _inputs(4, seqlen_q, seqlen_k, heads, kv_heads, head_dim, torch.bfloat16, seed)
    _check_same_bits(
        q, k, v, causal,
        dict(persistent=persistent, kv_multicast=False, **slots),
        dict(persistent=persistent, kv_multicast=True, cluster_heads=True, **slots),
    )


@pytest.mark.parametrize("head_dim", (128, 256))
@pytest.mark.parametrize(
    "causal,persistent", ((False, False), (False, True), (True, False)),
    ids=("full-one-tile", "full-persistent", "causal-one-tile"),
)
@pytest.mark.parametrize("seqlen_q,seqlen_k", KV_MULTICAST_SEQLENS)
def test_kv_multicast_changes_no_bit(head_dim, causal, persistent, seqlen_q, seqlen_k):
    _check_kv_multicast_changes_no_bit(head_dim, causal, persistent, seqlen_q, seqlen_k)


@pytest.mark.parametrize("head_dim", (128, 256))
@pytest.mark.parametrize("seqlen_q,seqlen_k", KV_MULTICAST_SEQLENS)
def test_kv_multicast_causal_persistent_changes_no_bit(head_dim, seqlen_q, seqlen_k):
    # Causal persistent clusters run in balanced pairs of units (two query blocks each);
    # 1100 queries give an odd number of units, the middle one paired with itself.
    _check_kv_multicast_changes_no_bit(head_dim, True, True, seqlen_q, seqlen_k)
