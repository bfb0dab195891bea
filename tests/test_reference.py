"""flash4.reference against a naive softmax written out row by row in float64.

Inputs are fresh N(0, 1) draws on every run (no fixed seed), so the tests check the maths,
not one lucky sample.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash4.reference import attention, attention_in_dtype, blockwise_attention

# float64 reference against float64 naive maths: only summation order differs.
FLOAT64_TOL = 1e-10
# float32 (or the blockwise order of sums) against float64, for O(1) scores and outputs.
FLOAT32_TOL = 1e-5
# One rounding of O(1) values in the input dtype: bf16 keeps 8 mantissa bits, fp16 11.
# The baseline rounds scores, probabilities and output; allow a few such roundings.
IN_DTYPE_TOL = {torch.bfloat16: 4e-2, torch.float16: 5e-3}


def random_qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=torch.float64):
    q = torch.randn(batch, seqlen_q, heads, head_dim, dtype=dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, dtype=dtype)
    return q, k, v


def naive_attention(q, k, v, softmax_scale, causal):
    """Row by row in float64, with the kv head of query head h spelled out as h // group."""
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q, k, v = q.double(), k.double(), v.double()
    out = torch.zeros(batch, seqlen_q, heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            kv_head = h // group
            for i in range(seqlen_q):
                last_key = i + seqlen_k - seqlen_q if causal else seqlen_k - 1
                if last_key < 0:
                    continue  # this row sees no key: out stays 0, lse stays -inf
                keys = k[b, : last_key + 1, kv_head]
                scores = softmax_scale * (keys @ q[b, i, h])
                top = scores.max()
                weights = torch.exp(scores - top)
                total = weights.sum()
                out[b, i, h] = (weights / total) @ v[b, : last_key + 1, kv_head]
                lse[b, h, i] = top + torch.log(total)
    return out, lse


def assert_close_with_inf(actual, expected, tol):
    """Equal within tol where finite; -inf exactly where expected is -inf; no NaN."""
    assert not torch.isnan(actual).any()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    if finite.any():
        error = (actual.double() - expected.double())[finite].abs().max().item()
        assert error <= tol, f"max error {error:.3g} > {tol:.3g}"


HEAD_LAYOUTS = [(4, 4), (6, 2), (4, 1)]  # (heads, kv_heads): MHA, GQA 3:1, MQA
SEQLEN_PAIRS = [(13, 13), (5, 19), (19, 5), (1, 7), (7, 1)]


@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_naive_softmax(heads, kv_heads, seqlen_q, seqlen_k, causal):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim=16)
    scale = 0.3  # not the default, so a scale that is ignored shows
    expected_out, expected_lse = naive_attention(q, k, v, scale, causal)

    out, lse = attention(q, k, v, softmax_scale=scale, causal=causal, compute_dtype=torch.float64)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == q.shape and lse.shape == (2, heads, seqlen_q)
    assert_close_with_inf(out, expected_out, FLOAT64_TOL)
    assert_close_with_inf(lse, expected_lse, FLOAT64_TOL)

    out32, lse32 = attention(q, k, v, softmax_scale=scale, causal=causal)
    assert out32.dtype == lse32.dtype == torch.float32
    assert_close_with_inf(out32, expected_out, FLOAT32_TOL)
    assert_close_with_inf(lse32, expected_lse, FLOAT32_TOL)


def test_default_scale_is_inverse_sqrt_head_dim():
    head_dim = 32
    q, k, v = random_qkv(1, 9, 11, 2, 2, head_dim)
    expected_out, expected_lse = naive_attention(q, k, v, 1 / math.sqrt(head_dim), causal=False)
    out, lse = attention(q, k, v, compute_dtype=torch.float64)
    assert_close_with_inf(out, expected_out, FLOAT64_TOL)
    assert_close_with_inf(lse, expected_lse, FLOAT64_TOL)


@pytest.mark.parametrize(
    "function",
    [
        lambda q, k, v: attention(q, k, v, causal=True),
        lambda q, k, v: blockwise_attention(q, k, v, causal=True, block_m=4, block_n=3),
        lambda q, k, v: attention_in_dtype(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True),
    ],
    ids=["attention", "blockwise_attention", "attention_in_dtype"],
)
def test_rows_without_keys_give_zero_and_minus_inf(function):
    # Causal with seqlen_q > seqlen_k: query i sees keys j <= i - (seqlen_q - seqlen_k), so
    # the first seqlen_q - seqlen_k rows see none.
    seqlen_q, seqlen_k = 12, 5
    empty_rows = seqlen_q - seqlen_k
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim=16)
    out, lse = function(q, k, v)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.all(out[:, :empty_rows] == 0)
    assert torch.all(lse[:, :, :empty_rows] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, :, empty_rows:]))
    assert torch.all(out[:, empty_rows:].abs().sum(dim=-1) > 0)


BLOCK_SHAPES = [(128, 128), (64, 80), (16, 32), (32, 16), (7, 5)]
RAGGED_SEQLEN_PAIRS = [(1, 1), (17, 17), (100, 100), (257, 257), (1, 257), (257, 17), (17, 100), (100, 257)]


@pytest.mark.parametrize("block_m,block_n", BLOCK_SHAPES)
@pytest.mark.parametrize("seqlen_q,seqlen_k", RAGGED_SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_matches_exact(block_m, block_n, seqlen_q, seqlen_k, causal):
    q, k, v = random_qkv(1, seqlen_q, seqlen_k, 4, 2, head_dim=32)
    exact_out, exact_lse = attention(q, k, v, causal=causal, compute_dtype=torch.float64)

    out, lse = blockwise_attention(
        q, k, v, causal=causal, block_m=block_m, block_n=block_n, compute_dtype=torch.float64
    )
    assert out.shape == q.shape and lse.shape == exact_lse.shape
    assert_close_with_inf(out, exact_out, FLOAT64_TOL)
    assert_close_with_inf(lse, exact_lse, FLOAT64_TOL)

    out32, lse32 = blockwise_attention(q.float(), k.float(), v.float(), causal=causal,
                                       block_m=block_m, block_n=block_n)
    assert out32.dtype == lse32.dtype == torch.float32
    assert_close_with_inf(out32, exact_out, FLOAT32_TOL)
    assert_close_with_inf(lse32, exact_lse, FLOAT32_TOL)


def test_blockwise_with_kernel_tiles_and_custom_scale():
    # The sm_90 kernel's tiles at head dim 128: 128 query rows, 128 keys per block.
    q, k, v = random_qkv(2, 300, 211, 4, 1, head_dim=128)
    exact = attention(q, k, v, softmax_scale=0.05, causal=True, compute_dtype=torch.float64)
    blockwise = blockwise_attention(q, k, v, softmax_scale=0.05, causal=True, compute_dtype=torch.float64)
    for actual, expected in zip(blockwise, exact):
        assert_close_with_inf(actual, expected, FLOAT64_TOL)


@pytest.mark.parametrize("block_m,block_n", [(0, 16), (16, 0), (-1, 16)])
def test_blockwise_rejects_empty_blocks(block_m, block_n):
    q, k, v = random_qkv(1, 4, 4, 1, 1, 8)
    with pytest.raises(ValueError, match="block_m"):
        blockwise_attention(q, k, v, block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(33, 33), (17, 100), (100, 17)])
def test_attention_in_dtype_close_to_float_reference(dtype, causal, seqlen_q, seqlen_k):
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim=64, dtype=dtype)
    # The float reference sees the same rounded inputs, so only the maths' rounding counts.
    ref_out, ref_lse = attention(q, k, v, causal=causal, compute_dtype=torch.float64)

    out, lse = attention_in_dtype(q, k, v, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert_close_with_inf(out, ref_out, IN_DTYPE_TOL[dtype])
    # lse is O(log seqlen_k + max score), a few units: its rounding is relative to that.
    assert_close_with_inf(lse, ref_lse, IN_DTYPE_TOL[dtype] * 2)


@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_matches_autograd(heads, kv_heads, seqlen_q, seqlen_k, causal):
    # The explicit gradients (from out and LSE, as the kernel has them) against torch's
    # autograd through the naive row-by-row maths, all in float64. Causal with
    # seqlen_q > seqlen_k leaves rows without keys: their dq must be 0, and they add
    # nothing to dk, dv.
    from flash4.reference import attention_backward

    q, k, v = (t.requires_grad_(True) for t in random_qkv(2, seqlen_q, seqlen_k, heads, kv_heads, 16))
    scale = 0.3
    out, lse = naive_attention(q, k, v, scale, causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    dq, dk, dv = attention_backward(
        q.detach(), k.detach(), v.detach(), out.detach(), dout, lse.detach(),
        softmax_scale=scale, causal=causal, compute_dtype=torch.float64,
    )
    for name, got, want in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert got.shape == want.shape, name
        error = (got - want).abs().max().item()
        assert error <= FLOAT64_TOL, f"{name}: max error {error:.3g}"
    if causal and seqlen_q > seqlen_k:
        assert torch.all(dq[:, : seqlen_q - seqlen_k] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_in_dtype_close_to_float_reference(dtype, causal):
    # The baseline of the accuracy rule: torch's own gradients in the input dtype, a few
    # roundings away from the float32 reference (relative to the gradients' size).
    from flash4.reference import attention, attention_backward, attention_backward_in_dtype

    q, k, v = random_qkv(2, 37, 53, 4, 2, 32, dtype=dtype)
    dout = torch.randn(2, 37, 4, 32, dtype=dtype)
    out, lse = attention(q, k, v, causal=causal)
    expected = attention_backward(q, k, v, out, dout, lse, causal=causal)
    baseline = attention_backward_in_dtype(q, k, v, dout, causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), baseline, expected):
        assert got.dtype == dtype, name
        scale = want.abs().max().item()
        error = (got.float() - want).abs().max().item()
        assert 0 < error <= IN_DTYPE_TOL[dtype] * scale, f"{name}: {error:.3g} vs size {scale:.3g}"


@pytest.mark.parametrize("heads,kv_heads", HEAD_LAYOUTS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS + [(70, 300), (300, 70), (129, 129)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m", [64, 128])
def test_blockwise_backward_matches_exact(heads, kv_heads, seqlen_q, seqlen_k, causal, block_m):
    # The backward kernels' algorithm (padding, +inf LSE rows, the kernel's own walk over
    # query blocks and which ones it masks) against the exact gradients, in float32.
    from flash4.reference import attention_backward, blockwise_attention_backward

    q, k, v = random_qkv(2, seqlen_q, seqlen_k, heads, kv_heads, 16, dtype=torch.float32)
    dout = torch.randn_like(q)
    out, lse = attention(q, k, v, causal=causal)
    expected = attention_backward(q, k, v, out, dout, lse, causal=causal)
    got = blockwise_attention_backward(q, k, v, out, dout, lse, causal=causal, block_m=block_m)
    for name, g, e in zip(("dq", "dk", "dv"), got, expected):
        assert g.shape == e.shape, name
        error = (g - e).abs().max().item()
        assert error <= 1e-4, f"{name}: max error {error:.3g}"
