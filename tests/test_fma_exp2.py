"""The FMA-pipe exp2's arithmetic, replayed in numpy float32 bit for bit (the kernel's
instructions: round-down add, two adds, three FMAs, shift and integer add)."""

from __future__ import annotations

import numpy as np

from flash4.kernels.fma_exp2 import EXP2_CUBIC, MANTISSA_BITS, ROUNDING_MAGIC, SMALLEST_EXPONENT


def _replay(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    clamped = np.maximum(x.astype(f32), f32(SMALLEST_EXPONENT))
    # add.rm: the float64 sum is exact here, so flooring it is rounding toward -inf.
    rounded = (np.floor(clamped.astype(np.float64)) + ROUNDING_MAGIC).astype(f32)
    fraction = clamped - (rounded - f32(ROUNDING_MAGIC))
    poly = f32(EXP2_CUBIC[3])
    for c in (EXP2_CUBIC[2], EXP2_CUBIC[1], EXP2_CUBIC[0]):
        poly = (poly.astype(np.float64) * fraction + c).astype(f32)  # one rounding, as FFMA
    bits = (rounded.view(np.uint32) << np.uint32(MANTISSA_BITS)) + poly.view(np.uint32)
    return bits.view(f32)


def test_relative_error_over_the_softmax_range():
    # Softmax exponents are (s - max) * scale * log2(e) <= 0; the kernel's floor trick holds
    # for any |x| < 2^22, and large ones clamp.
    rng = np.random.default_rng()
    x = np.concatenate([
        -rng.exponential(3.0, 200_000),
        -rng.uniform(0, 125, 200_000),
        np.arange(-125, 1, dtype=np.float64),  # integers: fraction exactly 0
        -np.arange(1, 200_000) * 2.0**-17,  # just below 0 and just below integers
    ]).astype(np.float32)
    got = _replay(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() < 1e-4, f"worst relative error {rel.max():.2e} at x={x[rel.argmax()]}"


def test_clamps_below_the_normal_range_and_never_returns_zero():
    out = _replay(np.array([-125.5, -127.0, -200.0, -1e6], dtype=np.float32))
    assert np.all(out > 2.0**-126) and np.all(out < 2.0**-124)
