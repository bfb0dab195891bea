"""The FP8 forward kernel on the GPU, against the float64 attention of its dequantized inputs.

FP8 is judged by RMSE (DESIGN.md). What the kernel cannot avoid is rounding P to e4m3 for
its second GEMM, and its output to bf16: reference.fp8_blockwise_attention is the kernel's
algorithm in float64 (its tiles, running max, P scales and e4m3 rounding), rounded to bf16.
The kernel's RMSE may exceed that model's by a quarter (fp32 arithmetic and exp2's
approximation move some P across an e4m3 rounding boundary), plus half a bf16 step of the
output's size; a wrong key order, descale or mask errs far more. The LSE does not see P's
rounding, but it sees S's: Hopper's FP8 wgmma keeps about 14 bits of its running sum
(DeepSeek-V3 report, section 3.3.2; the reason CUTLASS's FP8 GEMMs promote to fp32 every few
k-blocks), so each of S's head_dim / 32 accumulation steps may lose up to 2^-13 of the sum
of |q_i k_i| (scaled): a row's LSE, 1-Lipschitz in its scores, may move by that much over
the row's largest such sum, plus the 1e-3 that the bf16 kernels' LSE must match to. A wrong
descale or mask moves it by far more. Without an LSE, kernels whose row sums run on the
tensor cores sum the rounded P (Sm90ForwardConfig.row_sum_on_tensor_cores); the model then
does too. Outputs come from a NaN-poisoned allocator.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_helpers import poison_allocator

import flash4
from flash4 import dispatch, reference
from flash4.fp8 import fp8_blocks

pytestmark = pytest.mark.gpu

# Slack on the model's RMSE (see the module docstring).
RMSE_SLACK = 1.25
# Half a step of bf16 (8 significant bits), relative to the output's RMS.
BF16_HALF_STEP = 2.0**-9
LSE_TOLERANCE = 1e-3
# Hopper's FP8 accumulator keeps about 14 bits: each k32 step may truncate 2^-13 of the sum.
ACCUMULATOR_STEP_ERROR = 2.0**-13
WGMMA_K_FP8 = 32
SEQLENS = ((1, 1), (17, 17), (1000, 1000), (1, 1000), (17, 1000), (1000, 17), (333, 777), (4096, 4096))


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def _check(q8, k8, v8, causal, out, lse, config=None):
    """``lse``: None for the kernel variant compiled without one; ``config``: the kernel's,
    if not the selected row's (its tiles, row sums and P's codes decide the model)."""
    qd, kd, vd = (t.dequantize().double() for t in (q8, k8, v8))
    exact, lse_exact = reference.attention(qd, kd, vd, causal=causal, compute_dtype=torch.float64)
    head_dim, seqlen_q = qd.shape[-1], qd.shape[1]
    blocks = fp8_blocks(head_dim, causal, seqlen_q)
    if config is not None:
        blocks = blocks._replace(q=config.tile_m, kv=config.tile_n)
    if config is None:
        config = dispatch.select_fp8(
            "sm_90a", head_dim, causal, seqlen_q, v8.block is None, group=qd.shape[2] // kd.shape[2]
        ).config
    model = reference.fp8_blockwise_attention(
        q8, k8, v8, causal=causal, block_m=blocks.q, block_n=blocks.kv,
        sum_rounded_p=lse is None and config.row_sum_on_tensor_cores,
        p_by_rounding=lse is None and config.fp8_p_by_rounding,
    )[0]
    model = model.to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and not out.isnan().any(), "some output element was never written"
    bound = RMSE_SLACK * _rms(model - exact) + BF16_HALF_STEP * _rms(exact)
    assert _rms(out - exact) <= bound, f"RMSE {_rms(out - exact):.3g} > {bound:.3g} (model {_rms(model - exact):.3g})"
    if lse is None:
        return
    empty = lse_exact == -math.inf
    assert torch.equal(lse == -math.inf, empty), "rows without keys must have LSE = -inf, only those"
    if (~empty).any():
        err = (lse.double() - lse_exact).abs()[~empty]
        bound = (LSE_TOLERANCE + _accumulation_bound(qd, kd))[~empty]
        worst = (err / bound).max().item()
        assert worst <= 1, f"LSE error {err.max().item():.3g}: {worst:.2f} of its bound"


def _accumulation_bound(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per (batch, head, query row): how far S's FP8 accumulation may move the row's LSE."""
    head_dim, groups = q.shape[-1], q.shape[2] // k.shape[2]
    magnitude = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k.abs().repeat_interleave(groups, dim=2))
    steps = head_dim // WGMMA_K_FP8
    return steps * ACCUMULATOR_STEP_ERROR * magnitude.amax(-1) / math.sqrt(head_dim)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (8, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
def test_fp8_forward_matches_its_model(head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads, hadamard):
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 31 + seqlen_k + head_dim)
    q, k, v = (
        torch.randn(2, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for s, h in ((seqlen_q, heads), (seqlen_k, kv_heads), (seqlen_k, kv_heads))
    )
    blocks = fp8_blocks(head_dim, causal, seqlen_q)
    q8, k8 = flash4.quantize_fp8(q, blocks.q, hadamard), flash4.quantize_fp8(k, blocks.kv, hadamard)
    v8 = flash4.quantize_fp8(v, blocks.kv)
    poison_allocator()
    out, lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    _check(q8, k8, v8, causal, out, lse)


FP8_ROWS = [r for r in dispatch.TABLE if r.dtype == dispatch.FP8_DTYPE]
RAGGED_PAST_ROW_START = 17


@pytest.mark.parametrize(
    "row", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in FP8_ROWS]
)
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_every_row_matches_its_model(row, return_lse):
    # Each row of the FP8 table (the shapes above reach only some of them) on the length
    # it starts at plus a ragged tail, GQA 4:1; with an LSE and without.
    seqlen = row.min_seqlen_q + RAGGED_PAST_ROW_START
    assert dispatch.select("sm_90a", dispatch.FP8_DTYPE, row.head_dim, row.causal, seqlen) is row
    _check_per_tensor_v(1, seqlen, seqlen, 8, 2, row.head_dim, row.causal, return_lse,
                        seed=seqlen * 7 + row.head_dim + row.causal)


@pytest.mark.parametrize(
    "row", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in FP8_ROWS]
)
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((0, 0), (1, 1000), (0, 1000)), ids=("square", "one-query", "more-keys"))
def test_every_row_with_f16_scores_matches_its_model(row, seqlen_q, seqlen_k):
    # The rows' f16-score kernels (kernels/f16_scores.py; Q's and K's codes within their
    # limits, no LSE) against the model of fp32 scores: a ragged tail past the row's start
    # (seqlen 0 stands for it), one query of many keys, more keys than queries; GQA 4:1.
    seqlen_q = seqlen_q or row.min_seqlen_q + RAGGED_PAST_ROW_START
    seqlen_k = max(seqlen_k, seqlen_q) if seqlen_k else seqlen_q
    entry = dispatch.select_fp8("sm_90a", row.head_dim, row.causal, seqlen_q, True, group=4, f16_scores=True)
    assert entry.config.scores_in_f16
    _check_per_tensor_v(1, seqlen_q, seqlen_k, 8, 2, row.head_dim, row.causal, False,
                        seed=seqlen_k * 5 + row.head_dim + row.causal, f16_codes=True)


def _check_per_tensor_v(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, return_lse, seed,
                        f16_codes=False, qk_int8=False):
    """Fresh inputs, Q and K in the selected row's blocks, V per tensor, through
    flash_attn_fp8_quantized onto a poisoned allocator; checked against the model.
    ``f16_codes``: Q and K quantized to flash_attn_fp8's code limits, with which the kernel
    without an LSE holds the scores in f16. ``qk_int8``: Q and K rotated and quantized to
    int8 (the accurate mode)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(batch, s, h, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
        for s, h in ((seqlen_q, heads), (seqlen_k, kv_heads), (seqlen_k, kv_heads))
    )
    blocks = fp8_blocks(head_dim, causal, seqlen_q)
    q_max, k_max = (blocks.q_max, blocks.k_max) if f16_codes else (448.0, 448.0)
    if qk_int8:
        q8, k8 = flash4.quantize_int8(q, blocks.q), flash4.quantize_int8(k, blocks.kv)
    else:
        q8, k8 = flash4.quantize_fp8(q, blocks.q, fp8_max=q_max), flash4.quantize_fp8(k, blocks.kv, fp8_max=k_max)
    v8 = flash4.quantize_fp8(v, None)
    poison_allocator()
    result = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=return_lse)
    torch.cuda.synchronize()
    out, lse = result if return_lse else (result, None)
    _check(q8, k8, v8, causal, out, lse)


# Where select_fp8 runs the causal row with clusters of two query heads of one K/V head
# (even groups, V per tensor): the first length that takes them, plus a ragged tail.
FP8_HEAD_CLUSTER_STARTS = sorted(dispatch.FP8_HEAD_CLUSTER_MIN_SEQLEN.items())


@pytest.mark.parametrize("head_dim,start", FP8_HEAD_CLUSTER_STARTS, ids=[f"d{d}-s{s}" for d, s in FP8_HEAD_CLUSTER_STARTS])
@pytest.mark.parametrize("extra_keys", (0, 1000), ids=("square", "more-keys"))
@pytest.mark.parametrize("heads,kv_heads", ((4, 2), (8, 1)), ids=("gqa2", "mqa8"))
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_head_cluster_rows_match_their_model(head_dim, start, extra_keys, heads, kv_heads, return_lse):
    seqlen_q = start + RAGGED_PAST_ROW_START
    seqlen_k = seqlen_q + extra_keys
    row = dispatch.select_fp8("sm_90a", head_dim, True, seqlen_q, v_per_tensor=True, group=heads // kv_heads)
    assert row.config.cluster_heads
    _check_per_tensor_v(1, seqlen_q, seqlen_k, heads, kv_heads, head_dim, True, return_lse,
                        seed=seqlen_k * 11 + head_dim + kv_heads)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("blocks", ("q", "k", "v", "none"))
def test_per_tensor_descales(head_dim, blocks):
    # One tensor per tensor-scaled at a time (or all of them): each descale path alone.
    q, k, v = (torch.randn(1, 700, 4, head_dim, device="cuda") * scale for scale in (1.0, 3.0, 0.2))
    rows = fp8_blocks(head_dim, False, 700)
    q8, k8, v8 = (
        flash4.quantize_fp8(t, None if blocks in (name, "none") else block)
        for name, t, block in (("q", q, rows.q), ("k", k, rows.kv), ("v", v, rows.kv))
    )
    poison_allocator()
    out, lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, return_lse=True)
    torch.cuda.synchronize()
    _check(q8, k8, v8, False, out, lse)


def test_flash_attn_fp8_quantizes_and_runs():
    # From bf16 inputs: quantized as documented (Q, K per tile of rows after the rotation, V
    # per tensor), the result errs against the exact attention of the unquantized inputs as the
    # kernel's algorithm on those quantized inputs does (about 5% of the output's RMS here,
    # mostly V's rounding in the first causal rows, which see few keys).
    q, k, v = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = flash4.flash_attn_fp8(q, k, v, causal=True, hadamard=True)
    exact, _ = reference.attention(q, k, v, causal=True, compute_dtype=torch.float64)
    blocks = fp8_blocks(128, True, 1000)
    q8, k8 = flash4.quantize_fp8(q, blocks.q, True), flash4.quantize_fp8(k, blocks.kv, True)
    # Without an LSE: the row sums of the kernel's variant (see the module docstring).
    rounded = dispatch.select_fp8("sm_90a", 128, True, 1000, True).config.row_sum_on_tensor_cores
    model = reference.fp8_blockwise_attention(
        q8, k8, flash4.quantize_fp8(v, None), causal=True, block_m=blocks.q, block_n=blocks.kv, sum_rounded_p=rounded
    )[0]
    bound = RMSE_SLACK * _rms(model.to(torch.bfloat16) - exact) + BF16_HALF_STEP * _rms(exact)
    assert out.dtype == torch.bfloat16 and _rms(out - exact) <= bound
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"^q requires grad, but flash_attn_fp8 is forward only"):
        flash4.flash_attn_fp8(q, k, v)


@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
@pytest.mark.parametrize("return_lse", (False, True), ids=("out", "lse"))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,kv_heads", [(1000, 1000, 4, 4), (17, 1000, 8, 2), (1000, 17, 4, 1)])
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_flash_attn_fp8_is_the_quantized_call_on_its_quantization(
    head_dim, seqlen_q, seqlen_k, heads, kv_heads, causal, return_lse, hadamard
):
    # flash_attn_fp8 skips quantize_fp8's and check_fp8_args's checks (its inputs passed
    # check_attention_args): the same bits out as the documented steps, quantize_fp8 of Q
    # and K per tile of the selected row onto its code limits (the f16-score kernels), V
    # per tensor into the kernel's layout, then flash_attn_fp8_quantized. Fresh inputs, a
    # poisoned allocator before each.
    from flash4.quantize import quantize_fp8_transposed_v

    q = torch.randn(2, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    blocks = fp8_blocks(head_dim, causal, seqlen_q)
    poison_allocator()
    want = flash4.flash_attn_fp8_quantized(
        flash4.quantize_fp8(q, blocks.q, hadamard, blocks.q_max), flash4.quantize_fp8(k, blocks.kv, hadamard, blocks.k_max),
        quantize_fp8_transposed_v(v), causal=causal, return_lse=return_lse,
    )
    poison_allocator()
    got = flash4.flash_attn_fp8(q, k, v, causal=causal, hadamard=hadamard, return_lse=return_lse)
    want, got = (want, got) if return_lse else ((want,), (got,))
    assert not want[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_flash_attn_func_and_transposed_v_run_the_same_kernel(head_dim):
    # e4m3 inputs with descales through flash_attn_func, and V laid out beforehand
    # (transpose_fp8_v): the same kernel on the same bytes, the same bits out.
    q, k, v = (torch.randn(2, 700, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    blocks = fp8_blocks(head_dim, True, 700)
    q8, k8, v8 = flash4.quantize_fp8(q, blocks.q), flash4.quantize_fp8(k, blocks.kv), flash4.quantize_fp8(v, None)
    want, want_lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=True, return_lse=True)
    vt = flash4.transpose_fp8_v(v8)
    poison_allocator()
    out, lse = flash4.flash_attn_func(
        q8.values, k8.values, v8.values, causal=True, return_lse=True,
        q_descale=q8.descale, k_descale=k8.descale, v_descale=v8.descale,
    )
    out_t, lse_t = flash4.flash_attn_fp8_quantized(q8, k8, vt, causal=True, return_lse=True)
    assert not want.isnan().any()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(out_t, want) and torch.equal(lse_t, want_lse)


def _strided_with_outliers(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A strided input (every other head-dim-sized slice of its rows) of a ragged length
    (1000 rows: a partial last block, a partial key group) with two outliers."""
    x = (torch.randn(2, 1000, 3, 2 * head_dim, dtype=dtype, device="cuda") * 5)[..., :head_dim]
    x[0, 7, 1, 3] = 300.0
    x[1, 999, 2, head_dim - 1] = -200.0
    return x


def _per_row(descale: torch.Tensor, block: int | None, seqlen: int) -> torch.Tensor:
    """Descales (batch, heads, blocks), or one per tensor, broadcast to (batch, seqlen, heads, 1)."""
    if block is None:
        return descale
    return descale.repeat_interleave(block, dim=2)[:, :, :seqlen].transpose(1, 2).unsqueeze(-1)


# Every descale block the FP8 selector's rows use: their query tiles (128, 192) and key
# tiles (96 at head dim 128 unmasked from 4k, 128), and one per tensor.
@pytest.mark.parametrize("block", (None, 96, 128, 192), ids=("tensor", "b96", "b128", "b192"))
@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=("bf16", "fp16", "fp32"))
# e4m3's largest value, and a code limit of flash_attn_fp8 (kernels/f16_scores.code_limits).
@pytest.mark.parametrize("fp8_max", (448.0, 16.0), ids=("e4m3-max", "max16"))
def test_quantization_and_v_layout_on_the_gpu(block, hadamard, head_dim, dtype, fp8_max):
    # The GPU kernels (kernels/quantize_fp8.py, rotating in registers with hadamard) on a
    # strided input (every other head-dim-sized slice of its rows) of a ragged length (a
    # partial last block, a partial key group): each descale is its block's largest
    # magnitude over fp8_max (to an ulp: torch divides by a scalar through its reciprocal), each
    # value the rotated input (torch's rotation, bit for bit) times its descale's
    # reciprocal in float32, rounded to e4m3, exactly; V's layout is the CPU's, byte for
    # byte. float32 at head dim 256 in blocks of 192 rows is read twice (not held).
    from flash4.quantize import FP8_DTYPE, FP8_MAX, hadamard_rotate

    x = _strided_with_outliers(head_dim, dtype)
    got = flash4.quantize_fp8(x, block, hadamard, fp8_max)
    rotated = (hadamard_rotate(x) if hadamard else x).float().cpu()
    want_descale = flash4.quantize_fp8(rotated, block, fp8_max=fp8_max).descale
    want = (rotated * (1.0 / _per_row(got.descale.cpu(), block, x.shape[1]))).to(FP8_DTYPE)
    assert torch.allclose(got.descale.cpu(), want_descale, rtol=2.0**-22, atol=0)
    assert torch.equal(got.values.cpu().view(torch.uint8), want.view(torch.uint8))
    if not hadamard:
        on_cpu = flash4.Fp8Tensor(got.values.cpu(), got.descale.cpu(), block, False)
        got_t, want_t = flash4.transpose_fp8_v(got), flash4.transpose_fp8_v(on_cpu)
        assert torch.equal(got_t.values.cpu().view(torch.uint8), want_t.values.view(torch.uint8))
    # The fused V kernel quantizes to e4m3's largest value only: V's codes have no limit.
    if block is None and not hadamard and fp8_max == FP8_MAX:
        from flash4.quantize import quantize_fp8_transposed_v

        fused = quantize_fp8_transposed_v(x)
        assert torch.equal(fused.values.view(torch.uint8), flash4.transpose_fp8_v(got).values.view(torch.uint8))
        assert torch.equal(fused.descale, got.descale)


@pytest.mark.parametrize("seqlen", (1, 17, 32, 33, 129, 1000))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
def test_v_layout_kernel_on_ragged_lengths(seqlen, head_dim, dtype):
    # V's layout kernel transposes 128 keys per CTA through shared memory: a last tile with
    # fewer keys, a last key group padded with zeros, a tile that ends past the padded
    # length. Quantizing (its descale from the partial maxima, written by one CTA) and
    # moving e4m3 bytes as they are, byte for byte the CPU's layout, into a poisoned output.
    from flash4.quantize import FP8_DTYPE, fp8_value_layout, quantize_fp8_transposed_v

    v = torch.randn(3, seqlen, 2, head_dim, device="cuda", dtype=dtype) * 3
    v[2, seqlen - 1, 1, head_dim - 1] = -700.0  # the largest magnitude, in the tensor's last partial
    poison_allocator()
    got = quantize_fp8_transposed_v(v)
    want = quantize_fp8_transposed_v(v.cpu())
    assert got.descale.shape == () and torch.equal(got.descale.cpu(), want.descale)
    assert torch.equal(got.values.cpu().view(torch.uint8), want.values.view(torch.uint8))
    values = (v.cpu() * 40).clamp(-448, 448).to(FP8_DTYPE)
    poison_allocator()
    moved = fp8_value_layout(values.cuda())
    assert torch.equal(moved.cpu().view(torch.uint8), fp8_value_layout(values).view(torch.uint8))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=("bf16", "fp32"))
def test_per_tensor_descale_folds_every_partial_maximum(dtype):
    # A per-tensor descale is the largest of the partial maxima, more of them than a CTA
    # has threads: the largest magnitude placed in each corner of the tensor in turn.
    from flash4.kernels.quantize_fp8 import ROW_THREADS, amax_block_rows

    seqlen = 16384
    x = torch.randn(3, seqlen, 8, 64, device="cuda", dtype=dtype)
    rows = amax_block_rows(64, x.element_size())
    assert 3 * 8 * -(-seqlen // rows) > ROW_THREADS
    for corner in ((0, 0, 0, 0), (2, seqlen - 1, 7, 63), (1, rows, 3, 5), (2, seqlen - 1 - rows, 0, 0)):
        y = x.clone()
        y[corner] = -1000.0
        poison_allocator()
        got = flash4.quantize_fp8(y, None)
        want = flash4.quantize_fp8(y.cpu(), None)
        assert got.descale.item() == want.descale.item() == pytest.approx(1000.0 / 448, rel=1e-6)
        assert torch.equal(got.values.cpu().view(torch.uint8), want.values.view(torch.uint8))


@pytest.mark.parametrize("block", (None, 128), ids=("tensor", "b128"))
def test_tiny_block_quantizes_as_on_the_cpu(block):
    # A block (or tensor) whose largest magnitude over 448 is below float32's smallest
    # normal: the kernel gives it SMALLEST_DESCALE, as the CPU does, and the same bytes.
    from flash4.kernels.e4m3_codes import SMALLEST_DESCALE

    x = torch.randn(2, 300, 3, 128, device="cuda", dtype=torch.bfloat16)
    x[:, :128] *= 2.0**-120
    if block is None:
        x *= 2.0**-120
    poison_allocator()
    got = flash4.quantize_fp8(x, block)
    want = flash4.quantize_fp8(x.cpu(), block)
    first = got.descale if block is None else got.descale[:, :, 0]
    assert (first == SMALLEST_DESCALE).all()
    assert torch.equal(got.descale.cpu(), want.descale)
    assert torch.equal(got.values.cpu().view(torch.uint8), want.values.view(torch.uint8))
    assert not got.values.float().isnan().any()


def _run_variant(q8, k8, v8, causal: bool, with_lse: bool = True, **changes):
    """The selector's FP8 kernel for these inputs with ``changes`` to its config: (out, lse),
    lse None ``with_lse=False``."""
    import dataclasses

    from flash4.compiler import compiled_forward, tile_counter
    from flash4.dispatch import FP8_DTYPE, select
    from flash4.fp8 import OUT_DTYPE, tile_descales
    from flash4.devices import device_sms
    from flash4.forward import LOG2_E

    batch, seqlen_q, heads, head_dim = q8.values.shape
    seqlen_k, kv_heads = k8.values.shape[1:3]
    entry = select("sm_90a", FP8_DTYPE, head_dim, causal, seqlen_q)
    if "dynamic_tiles" not in changes and (changes.get("kv_multicast") or changes.get("persistent") is False):
        # Clusters share out tiles in turn (as select() runs them), and a one-tile grid has
        # no order to choose: no dynamic one.
        changes = dict(dynamic_tiles=False, **changes)
    entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, **changes))
    n_q, n_k = -(-seqlen_q // entry.config.tile_m), -(-seqlen_k // entry.config.tile_n)
    poison_allocator()
    out = torch.empty(q8.values.shape, dtype=OUT_DTYPE, device="cuda")
    lse = torch.empty(batch, heads, seqlen_q, device="cuda") if with_lse else None
    compiled_forward(entry, with_lse)(
        q8.values, k8.values, flash4.transpose_fp8_v(v8).values, out, lse,
        tile_descales(q8, batch, heads, n_q), tile_descales(k8, batch, kv_heads, n_k),
        tile_descales(v8, batch, kv_heads, n_k), head_dim**-0.5 * LOG2_E, device_sms(0),
        tile_counter(entry.config, q8.values.device),
    )
    torch.cuda.synchronize()
    return out, lse


def _variant_config(head_dim: int, causal: bool, seqlen: int, **changes):
    """The selected FP8 row's configuration with ``changes``."""
    import dataclasses

    return dataclasses.replace(dispatch.select("sm_90a", dispatch.FP8_DTYPE, head_dim, causal, seqlen).config, **changes)


def _variant_inputs(head_dim: int, causal: bool, seqlen: int):
    blocks = fp8_blocks(head_dim, causal, seqlen)
    q, k, v = (torch.randn(2, seqlen, h, head_dim, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    return flash4.quantize_fp8(q, blocks.q), flash4.quantize_fp8(k, blocks.kv), flash4.quantize_fp8(v, None)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("with_lse", (False, True), ids=("no-lse", "lse"))
@pytest.mark.parametrize("seqlen", (1100, 4113))
def test_head_clusters_change_no_bit(head_dim, causal, with_lse, seqlen):
    # Clusters of two query heads of one K/V head (cluster_heads; 8 query heads on 2 K/V
    # heads here) load the same K and V bytes and descales as the CTAs alone: the table's
    # bits, causal or not, on one-tile and persistent rows.
    q8, k8, v8 = _variant_inputs(head_dim, causal, seqlen)
    want, want_lse = _run_variant(q8, k8, v8, causal, with_lse)
    out, lse = _run_variant(q8, k8, v8, causal, with_lse, kv_multicast=True, cluster_heads=True)
    assert not want.isnan().any() and torch.equal(out, want)
    assert lse is None or torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("with_lse", (False, True), ids=("no-lse", "lse"))
@pytest.mark.parametrize("seqlen", (1100, 4113))
def test_candidate_dynamic_tiles_changes_no_bit(head_dim, with_lse, seqlen):
    # Causal persistent FP8 grids taking their tiles from a counter at run time
    # (dynamic_tiles): each tile runs as in the pairs' order, on another CTA, so the
    # table's bits.
    q8, k8, v8 = _variant_inputs(head_dim, True, seqlen)
    want, want_lse = _run_variant(q8, k8, v8, True, with_lse)
    out, lse = _run_variant(q8, k8, v8, True, with_lse, dynamic_tiles=True)
    assert not want.isnan().any() and torch.equal(out, want)
    assert lse is None or torch.equal(lse, want_lse)


# Four consumer warpgroups at head dim 64: (causal, tile_n, scores in f16, with an LSE),
# the blocks that fit their registers (tests/test_compile_sm90.py).
FOUR_WARPGROUP_CASES = [(False, 64, False, True), (False, 64, True, False), (True, 64, False, True),
                        (True, 64, True, False), (True, 96, True, False)]


@pytest.mark.parametrize("causal,tile_n,f16_scores,with_lse", FOUR_WARPGROUP_CASES,
                         ids=[f"{'causal' if c else 'full'}-{n}-{'f16' if f else 'fp32-lse'}" for c, n, f, _ in FOUR_WARPGROUP_CASES])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_candidate_four_warpgroups_match_their_model(causal, tile_n, f16_scores, with_lse, seqlen_q, seqlen_k):
    # Head dim 64 on four consumer warpgroups (256-row tiles: half the tiles of 128 rows,
    # each with its fixed cost): the four-way turn and four O slabs, on one-block tiles,
    # ragged tails, rows that see no key, and several tiles a CTA (4096; causal: the
    # dynamic order); Q in 256-row blocks and K in the variant's, V per tensor; f16
    # scores on codes within their limits, as flash_attn_fp8 quantizes them.
    changes = dict(consumer_warpgroups=4, tile_n=tile_n, scores_in_f16=f16_scores)
    config = _variant_config(64, causal, seqlen_q, **changes)
    g = torch.Generator(device="cuda").manual_seed(seqlen_q * 13 + seqlen_k + tile_n + causal + 2 * f16_scores)
    q, k, v = (
        torch.randn(2, s, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        for s, h in ((seqlen_q, 8), (seqlen_k, 2), (seqlen_k, 2))
    )
    blocks = fp8_blocks(64, causal, seqlen_q)
    q_max, k_max = (blocks.q_max, blocks.k_max) if f16_scores else (448.0, 448.0)
    q8, k8 = flash4.quantize_fp8(q, config.tile_m, fp8_max=q_max), flash4.quantize_fp8(k, tile_n, fp8_max=k_max)
    v8 = flash4.quantize_fp8(v, None)
    out, lse = _run_variant(q8, k8, v8, causal, with_lse, **changes)
    _check(q8, k8, v8, causal, out, lse, config)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_skipped_rescale_changes_no_bit(head_dim, causal, return_lse):
    # The table's kernels skip O's rescale when no row of a warp raised its max; where they
    # skip, the factor is exactly 1, so the kernel that always rescales gives the same bits
    # (with an LSE and without, whose row sums take the same factors).
    q8, k8, v8 = _variant_inputs(head_dim, causal, 3000)
    want = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=return_lse)
    want, want_lse = want if return_lse else (want, None)
    out, lse = _run_variant(q8, k8, v8, causal, return_lse, rescale_when_needed=False)
    assert not want.isnan().any() and torch.equal(out, want)
    assert lse is None if not return_lse else torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen", (1000, 3000))
def test_other_p_order_changes_no_bit(head_dim, causal, seqlen):
    # The head-dim-256 rows convert P before O's rescale (p_before_rescale), the others
    # after it: the same operations on the same values, so the other order gives the
    # table kernel's bits.
    from flash4.dispatch import FP8_DTYPE, select

    default = select("sm_90a", FP8_DTYPE, head_dim, causal, seqlen).config.p_before_rescale
    q8, k8, v8 = _variant_inputs(head_dim, causal, seqlen)
    want, want_lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=True)
    out, lse = _run_variant(q8, k8, v8, causal, p_before_rescale=not default)
    assert not want.isnan().any() and torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (17, 17), (17, 1000), (1000, 17), (1000, 1000), (3000, 3000)))
@pytest.mark.parametrize("kv_heads", (2, 1), ids=("gqa", "mqa"))
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_per_tensor_v_matches_its_model(head_dim, causal, seqlen_q, seqlen_k, kv_heads, return_lse):
    # V with one descale takes the kernel whose P scale is a constant and whose V descale
    # multiplies O once at the end (the blockwise V of the test above takes the other);
    # without an LSE, the variant whose row sums run on the tensor cores.
    _check_per_tensor_v(2, seqlen_q, seqlen_k, 8, kv_heads, head_dim, causal, return_lse,
                        seed=seqlen_q * 13 + seqlen_k + head_dim + kv_heads)


@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen", (1000, 3000))
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_q_in_registers_changes_no_bit(head_dim, causal, seqlen, return_lse):
    # Q's e4m3 tile loaded into registers by ldmatrix (16-bit units, two e4m3 each) feeds
    # the S GEMM the same values in the same order as from shared memory: the same bits,
    # whichever the table's row holds.
    q8, k8, v8 = _variant_inputs(head_dim, causal, seqlen)
    want, want_lse = _run_variant(q8, k8, v8, causal, return_lse, q_in_registers=False)
    out, lse = _run_variant(q8, k8, v8, causal, return_lse, q_in_registers=True)
    assert not want.isnan().any() and torch.equal(out, want)
    assert lse is None if not return_lse else torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen", (1, 17, 1000, 3000, 4113))
def test_exp2_p_without_lse_matches_its_model(head_dim, causal, seqlen):
    # The rows round P's codes from the scores where they write no LSE; with exp2 instead
    # (fp8_p_by_rounding off) that variant matches its own model, and the variant with an
    # LSE, which always takes exp2, gives the table's bits either way. 4113 queries: the
    # rows from 4k and a ragged block.
    q8, k8, v8 = _variant_inputs(head_dim, causal, seqlen)
    out, _ = _run_variant(q8, k8, v8, causal, False, fp8_p_by_rounding=False)
    assert not out.isnan().any()
    _check(q8, k8, v8, causal, out, None, _variant_config(head_dim, causal, seqlen, fp8_p_by_rounding=False))
    want, want_lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=True)
    out, lse = _run_variant(q8, k8, v8, causal, True, fp8_p_by_rounding=False)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (128, 256))
@pytest.mark.parametrize("with_lse", (False, True), ids=("no-lse", "lse"))
@pytest.mark.parametrize("seqlen", (1000, 1100, 4113))
def test_kv_multicast_changes_no_bit(head_dim, with_lse, seqlen):
    # Clusters of two CTAs sharing each K and V block by multicast (kv_multicast, which the
    # 16-bit rows take and the FP8 rows do not; perf/h200-findings.md): the same bytes in
    # the same places, so the table's bits. 1100 and 4113 queries give an odd
    # number of query blocks at some rows' tiles (a cluster's second block past seqlen_q).
    q8, k8, v8 = _variant_inputs(head_dim, False, seqlen)
    want, want_lse = _run_variant(q8, k8, v8, False, with_lse)
    out, lse = _run_variant(q8, k8, v8, False, with_lse, kv_multicast=True)
    assert torch.equal(out, want)
    assert lse is None or torch.equal(lse, want_lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("with_lse", (False, True), ids=("no-lse", "lse"))
@pytest.mark.parametrize("seqlen", (17, 1100, 4113))
def test_divider_changes_no_bit(head_dim, causal, with_lse, seqlen):
    # The tile scheduler's divisions by the divider (fast_tile_divmod=False, its divisors
    # rebuilt in the kernel from its sizes) find the same tiles as the fast divisors made on
    # the host: the same bits (a tile missed is NaN from the poisoned output, one found
    # twice or wrong differs). Both sides are asked for explicitly: the table's rows take
    # one or the other.
    q8, k8, v8 = _variant_inputs(head_dim, causal, seqlen)
    want, want_lse = _run_variant(q8, k8, v8, causal, with_lse, fast_tile_divmod=True)
    out, lse = _run_variant(q8, k8, v8, causal, with_lse, fast_tile_divmod=False, dynamic_tiles=False)
    assert not want.isnan().any() and not out.isnan().any() and torch.equal(out, want)
    assert lse is None or torch.equal(lse, want_lse)


# ---------------------------------------------------------------------------- int8 Q and K
# The accurate mode: int8 Q and K (s8 S GEMM, s32 scores shifted into fp32), e4m3 V and P.
# Its model is the FP8 kernel's algorithm on the dequantized int8 inputs, with the same
# bounds; the s32 accumulation is exact, so the LSE bound of the e4m3 accumulator is loose.
@pytest.mark.parametrize(
    "row", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in FP8_ROWS]
)
@pytest.mark.parametrize("return_lse", (True, False), ids=("lse", "no-lse"))
def test_every_row_with_int8_qk_matches_its_model(row, return_lse):
    seqlen = row.min_seqlen_q + RAGGED_PAST_ROW_START
    entry = dispatch.select_fp8("sm_90a", row.head_dim, row.causal, seqlen, True, group=4, qk_int8=True)
    assert entry.config.fp8_qk_int8 and entry.config.fp8_int8_shift_in_softmax
    _check_per_tensor_v(1, seqlen, seqlen, 8, 2, row.head_dim, row.causal, return_lse,
                        seed=seqlen * 3 + row.head_dim + row.causal, qk_int8=True)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (4, 1)), ids=("mha", "mqa"))
def test_int8_qk_matches_its_model(head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads):
    _check_per_tensor_v(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, True,
                        seed=seqlen_q * 13 + seqlen_k + head_dim, qk_int8=True)


@pytest.mark.parametrize(
    "row", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in FP8_ROWS]
)
@pytest.mark.parametrize("with_lse", (True, False), ids=("lse", "no-lse"))
def test_candidate_int8_exact_shift_matches_its_model(row, with_lse):
    # The int8 kernels that take the shift off every score by an FADD (fp8_int8_shift_in_softmax
    # off; the selector's fold it into the softmax): within the model's bounds as well.
    seqlen = row.min_seqlen_q + RAGGED_PAST_ROW_START
    blocks = fp8_blocks(row.head_dim, row.causal, seqlen)
    q, k, v = (torch.randn(2, seqlen, h, row.head_dim, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    q8, k8, v8 = flash4.quantize_int8(q, blocks.q), flash4.quantize_int8(k, blocks.kv), flash4.quantize_fp8(v, None)
    out, lse = _run_variant(q8, k8, v8, row.causal, with_lse, fp8_qk_int8=True, fp8_int8_shift_in_softmax=False)
    _check(q8, k8, v8, row.causal, out, lse)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_int8_qk_with_blockwise_v_matches_its_model(head_dim, causal):
    q, k, v = (torch.randn(2, 777, 4, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    blocks = fp8_blocks(head_dim, causal, 777)
    q8, k8 = flash4.quantize_int8(q, blocks.q), flash4.quantize_int8(k, blocks.kv)
    v8 = flash4.quantize_fp8(v, blocks.kv)
    poison_allocator()
    out, lse = flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    _check(q8, k8, v8, causal, out, lse)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_flash_attn_fp8_int8_is_the_quantized_call_on_its_quantization(head_dim, causal):
    from flash4.quantize import quantize_fp8_transposed_v

    q = torch.randn(2, 1000, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 700, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    blocks = fp8_blocks(head_dim, causal, 1000)
    poison_allocator()
    want = flash4.flash_attn_fp8_quantized(
        flash4.quantize_int8(q, blocks.q), flash4.quantize_int8(k, blocks.kv), quantize_fp8_transposed_v(v),
        causal=causal,
    )
    poison_allocator()
    got = flash4.flash_attn_fp8(q, k, v, causal=causal, hadamard=True, qk_int8=True)
    assert not want.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize("block", (None, 96, 128, 192), ids=("tensor", "b96", "b128", "b192"))
@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=("bf16", "fp16", "fp32"))
def test_int8_quantization_on_the_gpu_is_the_torch_definition(block, hadamard, head_dim, dtype):
    # quantize_int8's GPU kernel (the FP8 rows kernel with int8 codes, rounding by the shift)
    # on a strided input of a ragged length with two outliers: each descale its block's
    # largest magnitude over 127 (to an ulp, as quantize_fp8's), each code the torch
    # definition's, on the same descales, exactly.
    from flash4.quantize import INT8_MAX, hadamard_rotate

    x = _strided_with_outliers(head_dim, dtype)
    got = flash4.quantize_int8(x, block, hadamard)
    assert got.values.is_cuda and got.values.dtype == torch.int8 and got.fp8_max == INT8_MAX
    rotated = (hadamard_rotate(x) if hadamard else x).float().cpu()
    want_descale = flash4.quantize_int8(rotated, block, hadamard=False).descale
    assert torch.allclose(got.descale.cpu(), want_descale, rtol=2.0**-22, atol=0)
    quotient = rotated * (1.0 / _per_row(got.descale.cpu(), block, x.shape[1]))
    assert torch.equal(got.values.cpu(), torch.round(quotient).clamp(-INT8_MAX, INT8_MAX).to(torch.int8))


# FlashAttention-3's accuracy inputs (batch 2, seqlen 2048, 8 heads): N(0, 1) plus N(0, 100)
# on 0.1% of the entries. Issue 5 asks of blockwise + Hadamard at least 2.5x less error
# than flash4's own per-tensor mode (and at most 0.4x cuDNN's, perf/fp8_accuracy.py); the
# float64 model of the kernel gives 3.4 / 3.1 / 2.7x with int8 Q and K.
OWN_PER_TENSOR_RATIO = 2.5


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_int8_qk_errs_far_less_than_per_tensor_fp8_on_outliers(head_dim):
    g = torch.Generator(device="cuda").manual_seed(head_dim)

    def inputs():
        x = torch.randn(2, 2048, 8, head_dim, device="cuda", generator=g)
        outliers = torch.rand(x.shape, device="cuda", generator=g) < 0.001
        return (x + outliers * torch.randn(x.shape, device="cuda", generator=g) * 10).bfloat16()

    q, k, v = inputs(), inputs(), inputs()
    exact, _ = reference.attention(q, k, v, compute_dtype=torch.float64)
    per_tensor = flash4.flash_attn_fp8_quantized(*(flash4.quantize_fp8(t, None) for t in (q, k, v)))
    accurate = flash4.flash_attn_fp8(q, k, v, hadamard=True, qk_int8=True)
    rmse_per_tensor, rmse_accurate = _rms(per_tensor - exact), _rms(accurate - exact)
    print(f"\nhead dim {head_dim}: per-tensor {rmse_per_tensor:.3g}, int8 Q K + Hadamard {rmse_accurate:.3g} "
          f"({rmse_per_tensor / rmse_accurate:.2f}x)")
    assert rmse_accurate * OWN_PER_TENSOR_RATIO <= rmse_per_tensor


@pytest.mark.parametrize("qk_int8", (False, True), ids=("e4m3", "int8-qk"))
@pytest.mark.parametrize("return_lse", (False, True), ids=("out", "lse"))
def test_compiled_fp8_call_runs_the_same_kernels(return_lse, qk_int8):
    # Under torch.compile flash_attn_fp8 is one node (flash4/custom_ops.py) that runs the
    # eager call: the same quantization and kernels, the same bits.
    q, k, v = (torch.randn(2, 700, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))

    def call(q, k, v):
        return flash4.flash_attn_fp8(q, k, v, causal=True, hadamard=True, return_lse=return_lse, qk_int8=qk_int8)

    _check_compiled_is_eager(call, (q, k, v), return_lse)


def _check_compiled_is_eager(call, inputs: tuple, return_lse: bool) -> None:
    """``call`` compiled (one graph, from a poisoned allocator) and eager give the same bits."""
    torch._dynamo.reset()
    poison_allocator()
    got = torch.compile(call, fullgraph=True)(*inputs)
    want = call(*inputs)
    got, want = (got, want) if return_lse else ((got,), (want,))
    assert not want[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("qk_int8", (False, True), ids=("e4m3", "int8-qk"))
@pytest.mark.parametrize("return_lse", (False, True), ids=("out", "lse"))
def test_compiled_quantized_fp8_call_runs_the_same_kernel(return_lse, qk_int8):
    # Under torch.compile flash_attn_fp8_quantized is one node of its inputs' parts
    # (flash4/custom_ops.py), reassembled for the eager call: the same kernel, the same bits.
    q, k, v = (torch.randn(2, 900, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    blocks = fp8_blocks(128, True, 900)
    if qk_int8:
        q8, k8 = flash4.quantize_int8(q, blocks.q), flash4.quantize_int8(k, blocks.kv)
    else:
        q8 = flash4.quantize_fp8(q, blocks.q, True, blocks.q_max)
        k8 = flash4.quantize_fp8(k, blocks.kv, True, blocks.k_max)
    v8 = flash4.transpose_fp8_v(flash4.quantize_fp8(v, None))

    def call(q8, k8, v8):
        return flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=True, return_lse=return_lse)

    _check_compiled_is_eager(call, (q8, k8, v8), return_lse)
