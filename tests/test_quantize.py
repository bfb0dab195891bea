"""flash4.quantize on CPU: e4m3 round trips within the format's rounding, descales per
(batch, head, block of rows), the Hadamard rotation's identities, and the FP8 model of
flash4.reference against the exact maths."""

from __future__ import annotations

import math

import pytest
import torch

from flash4 import reference
from flash4.quantize import (
    FP8_MAX, INT8_MAX, hadamard_rotate, hadamard_signs, hadamard_unrotate, quantize_fp8, quantize_int8,
)

# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2^-4 of a normal value's
# magnitude; below the smallest normal (2^-6) the step is 2^-9 (of the scaled value).
E4M3_RELATIVE = 2.0**-4
E4M3_SUBNORMAL_STEP = 2.0**-9


def _with_outliers(*shape: int) -> torch.Tensor:
    """FlashAttention-3's accuracy inputs: N(0, 1), plus N(0, 100) on 0.1% of the entries."""
    x = torch.randn(shape)
    return x + (torch.rand(shape) < 0.001) * torch.randn(shape) * 10


@pytest.mark.parametrize("block", (None, 1, 64, 128, 1000))
@pytest.mark.parametrize("seqlen", (1, 17, 300))
def test_round_trip_is_within_e4m3_rounding(block, seqlen):
    x = _with_outliers(2, seqlen, 3, 64) * 3
    q = quantize_fp8(x, block)
    assert q.values.dtype == torch.float8_e4m3fn and q.values.shape == x.shape
    blocks = None if block is None else -(-seqlen // block)
    assert q.descale.shape == (() if block is None else (2, 3, blocks)) and q.descale.dtype == torch.float32
    # Each block's largest magnitude lands on e4m3's largest value.
    scaled = q.values.float().abs()
    if block is None:
        assert scaled.max() == FP8_MAX
    else:
        per_block = torch.nn.functional.pad(scaled, (0, 0, 0, 0, 0, blocks * block - seqlen))
        assert torch.all(per_block.view(2, blocks, block, 3, 64).amax(dim=(2, 4)) == FP8_MAX)
    back = q.dequantize()
    step = torch.maximum(x.abs() * E4M3_RELATIVE, _per_row_descale(q, seqlen) * E4M3_SUBNORMAL_STEP)
    assert torch.all((back - x).abs() <= step * (1 + 1e-6))


def _per_row_descale(q, seqlen):
    if q.block is None:
        return q.descale
    return q.descale.repeat_interleave(q.block, dim=2)[:, :, :seqlen].transpose(1, 2).unsqueeze(-1)


def test_zero_block_gets_unit_descale():
    x = torch.zeros(1, 256, 2, 64)
    x[:, 128:] = 1.0
    q = quantize_fp8(x, 128)
    assert torch.equal(q.descale[:, :, 0], torch.ones(1, 2))
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_tiny_block_gets_the_smallest_descale(dtype):
    # A block whose largest magnitude is below 448 * 2^-126 would get a subnormal descale,
    # whose reciprocal overflows to inf (and 0 * inf = NaN): it gets SMALLEST_DESCALE, its
    # values scaled up by exactly 2^126, the zeros among them staying 0.
    from flash4.kernels.e4m3_codes import SMALLEST_DESCALE

    x = torch.zeros(1, 256, 2, 64, dtype=dtype)
    x[:, :128, :, ::2] = 3.0 * 2.0**-130
    x[:, 128:] = 1.0
    q = quantize_fp8(x, 128)
    assert torch.equal(q.descale[:, :, 0], torch.full((1, 2), SMALLEST_DESCALE))
    assert not q.values.float().isnan().any()
    assert torch.equal(q.values[:, :128].float(), x[:, :128].float() * 2.0**126)
    assert torch.equal(q.dequantize(), x.float())


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_hadamard_rotation_is_orthogonal_and_keeps_scores(head_dim):
    q, k = torch.randn(2, 33, 4, head_dim), torch.randn(2, 45, 4, head_dim)
    rq, rk = hadamard_rotate(q), hadamard_rotate(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    assert torch.allclose(torch.einsum("bqhd,bkhd->bhqk", rq, rk), scores, atol=1e-4)
    assert torch.allclose(hadamard_unrotate(rq), q, atol=1e-5)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5)
    signs = hadamard_signs(head_dim)
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(signs, hadamard_signs(head_dim))


def test_hadamard_rotation_matches_the_dense_matrix():
    d = 8
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    x = torch.randn(3, d)
    signs = hadamard_signs(d)
    assert torch.allclose(hadamard_rotate(x, signs), (x * signs) @ h / math.sqrt(d), atol=1e-6)


@pytest.mark.parametrize("head_dim,vector", [(16, 8), (32, 8), (64, 8), (128, 8), (256, 8), (512, 8), (128, 4)])
def test_the_kernels_rotation_plan_gives_the_torch_rotation_bit_for_bit(head_dim, vector):
    # kernels/hadamard_rotation.py's plan played in torch: each lane's piece (its columns,
    # its word of minus signs), the stages in the plan's order (in a lane a + b and a - b,
    # across lanes the partner's value plus or minus the lane's own), the float32 scale
    # last. Its bits must be hadamard_rotate's, or the GPU kernels' cannot be.
    from flash4.compiler import _kernel_hadamard
    from flash4.kernels.hadamard_rotation import RowRotation

    rotation = RowRotation(head_dim, vector, _kernel_hadamard(head_dim, True))
    x = _with_outliers(200, head_dim) * 3
    columns = [[rotation.index(lane, p) for p in range(rotation.piece)] for lane in range(rotation.lanes)]
    assert sorted(sum(columns, [])) == list(range(head_dim))
    pieces = [x[:, lane_columns].clone() for lane_columns in columns]
    for lane, piece in enumerate(pieces):
        word = rotation.negative_words[lane] & 0xFFFFFFFF
        piece[:, [p for p in range(rotation.piece) if word >> p & 1]] *= -1
    for across_lanes, step in rotation.stages:
        if across_lanes:
            pieces = [pieces[lane ^ step] - own if lane & step else pieces[lane ^ step] + own
                      for lane, own in enumerate(pieces)]
            continue
        for piece in pieces:
            low = [p for p in range(rotation.piece) if not p & step]
            a, b = piece[:, low], piece[:, [p + step for p in low]]
            piece[:, low], piece[:, [p + step for p in low]] = a + b, a - b
    got = torch.empty_like(x)
    for lane_columns, piece in zip(columns, pieces):
        got[:, lane_columns] = piece * torch.tensor(rotation.scale, dtype=torch.float32)
    assert torch.equal(got, hadamard_rotate(x))


def test_hadamard_spreads_an_outlier():
    # One large entry per row: its block's scale is set by it, the rest quantize coarsely.
    # Rotated, the row's energy is spread over all coordinates.
    x = torch.randn(1, 128, 1, 128)
    x[..., 5] = 200.0
    plain, rotated = x.abs().amax(dim=-1), hadamard_rotate(x).abs().amax(dim=-1)
    assert torch.all(rotated < plain / 4)


def test_invalid_arguments_name_themselves():
    x = torch.randn(1, 4, 1, 64)
    with pytest.raises(ValueError, match=r"^block must be a positive int or None"):
        quantize_fp8(x, 0)
    with pytest.raises(ValueError, match=r"^x must be \(batch, seqlen, heads, head_dim\)"):
        quantize_fp8(x[0], 64)
    with pytest.raises(TypeError, match=r"^hadamard must be a bool"):
        quantize_fp8(x, 64, hadamard=1)
    with pytest.raises(ValueError, match=r"^head_dim=48: .*power of two"):
        hadamard_rotate(torch.randn(2, 48))
    q8 = quantize_fp8(x, 64, hadamard=True)
    with pytest.raises(ValueError, match=r"^q and k must both be rotated"):
        reference.fp8_attention(q8, quantize_fp8(x, 64), quantize_fp8(x, 64))
    with pytest.raises(ValueError, match=r"^v must not be rotated"):
        reference.fp8_attention(q8, q8, q8)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_fp8_model_is_exact_attention_on_representable_inputs(causal):
    # Inputs whose largest magnitude is 3.5 get the descale 3.5 / 448 = 2^-7, exact in
    # float32, and values from {0, ±1/4, ±1/2, ±1, ±2, ±3.5} then scale onto e4m3 values
    # exactly: quantization adds no error, and the model differs from exact attention only
    # by P's rounding, 2^-4 relative at most.
    levels = torch.tensor([0.0, 0.25, 0.5, 1.0, 2.0, 3.5, -0.25, -0.5, -1.0, -2.0, -3.5])

    def grid(*shape):
        x = levels[torch.randint(len(levels), shape)]
        x.view(-1)[0] = 3.5
        return x

    q, k, v = grid(1, 40, 2, 64), grid(1, 50, 2, 64), grid(1, 50, 2, 64)
    q8, k8, v8 = (quantize_fp8(t, None) for t in (q, k, v))
    assert all(torch.equal(t8.dequantize(), t) for t8, t in ((q8, q), (k8, k), (v8, v)))
    out = reference.fp8_attention(q8, k8, v8, causal=causal)
    exact, _ = reference.attention(q, k, v, causal=causal, compute_dtype=torch.float64)
    assert (out - exact).abs().max() <= E4M3_RELATIVE * v.abs().max()


def test_blockwise_hadamard_beats_per_tensor_on_outlier_inputs():
    # FlashAttention-3's experiment in the model: the error of the QKᵀ product is set by
    # e4m3's 3 mantissa bits on each element, and the Hadamard rotation spreads the
    # outliers that dominate it. Here (seed 0): per-tensor 1.39e-2, blockwise 1.38e-2,
    # blockwise + Hadamard 8.7e-3. Blockwise scales alone barely help: e4m3 is a float
    # format, its relative rounding does not depend on the scale.
    torch.manual_seed(0)
    q, k, v = (_with_outliers(1, 512, 4, 128) for _ in range(3))
    exact, _ = reference.attention(q, k, v, compute_dtype=torch.float64)

    def rmse(block, hadamard):
        out = reference.fp8_attention(quantize_fp8(q, block, hadamard), quantize_fp8(k, block, hadamard),
                                      quantize_fp8(v, block))
        return float(((out - exact) ** 2).mean().sqrt())

    per_tensor, rotated = rmse(None, False), rmse(128, True)
    assert rotated < per_tensor / 1.5, (per_tensor, rotated)


@pytest.mark.parametrize("block", (None, 1, 64, 128, 1000))
@pytest.mark.parametrize("seqlen", (1, 17, 300))
@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
def test_int8_round_trip_is_within_half_a_step(block, seqlen, hadamard):
    # int8 codes: integers within ±127, each block's largest magnitude on 127, every value
    # within half a step (its block's descale) of the (rotated) input.
    x = _with_outliers(2, seqlen, 3, 64) * 3
    t = quantize_int8(x.bfloat16(), block, hadamard)
    target = hadamard_rotate(x.bfloat16()) if hadamard else x.bfloat16().float()
    assert t.values.dtype == torch.int8 and t.fp8_max == INT8_MAX and t.hadamard == hadamard and t.block == block
    assert int(t.values.abs().max()) <= INT8_MAX and int(t.values.min()) >= -INT8_MAX
    blocks = 1 if block is None else -(-seqlen // block)
    assert tuple(t.descale.shape) == (() if block is None else (2, 3, blocks))
    rows = t.descale if block is None else t.descale.repeat_interleave(block, dim=2)[:, :, :seqlen].transpose(1, 2)
    step = rows.unsqueeze(-1) if block is not None else rows
    # Half a step, plus the float32 rounding of the product with the reciprocal (a value up
    # to 127 steps, 2^-24 of it) and of the dequantization.
    assert ((t.dequantize() - target).abs() <= (0.5 + INT8_MAX * 2.0**-22) * step).all()
    # The largest code of each block (or of the tensor) is 127.
    if block is None:
        assert int(t.values.abs().max()) == INT8_MAX
    else:
        padded = torch.nn.functional.pad(t.values.abs().amax(dim=-1).int(), (0, 0, 0, blocks * block - seqlen))
        assert (padded.view(2, blocks, block, 3).amax(dim=2) == INT8_MAX).all()


def test_int8_keeps_scores_three_times_closer_than_e4m3_after_the_rotation():
    # What the accurate mode rests on: on FlashAttention-3's inputs, rotated, int8's even
    # steps round Q Kᵀ about 3x finer than e4m3's mantissa (perf/fp8_accuracy_model.py).
    torch.manual_seed(0)
    q, k = _with_outliers(1, 256, 2, 64), _with_outliers(1, 256, 2, 64)
    exact = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())

    def error(quantize):
        qd, kd = (quantize(t, 128, True).dequantize().double() for t in (q, k))
        return float((torch.einsum("bqhd,bkhd->bhqk", qd, kd) - exact).pow(2).mean().sqrt())

    e4m3, int8 = error(quantize_fp8), error(quantize_int8)
    assert int8 < e4m3 / 2.5, (e4m3, int8)


def test_int8_arguments_name_themselves():
    x = torch.randn(1, 4, 2, 64)
    with pytest.raises(ValueError, match=r"^x must be \(batch, seqlen, heads, head_dim\)"):
        quantize_int8(x[0])
    with pytest.raises(ValueError, match=r"^block must be a positive int or None"):
        quantize_int8(x, 0)
    with pytest.raises(TypeError, match=r"^hadamard must be a bool"):
        quantize_int8(x, 128, 1)
