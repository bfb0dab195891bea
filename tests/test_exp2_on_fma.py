"""kernels/exp2_on_fma.py's sequence replayed in numpy float32 on CPU: its constants and its
exponent-field arithmetic give 2^x to the stated relative error (the GPU tests run the PTX)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flash4.kernels import exp2_on_fma as m  # noqa: E402

STATED_RELATIVE_ERROR = 8.6e-5


def _f32(ptx_hex: str) -> np.float32:
    return np.array([int(ptx_hex[2:], 16)], dtype=np.uint32).view(np.float32)[0]


def _replay(x: np.ndarray) -> np.ndarray:
    x = np.maximum(x.astype(np.float32), _f32(m.EXP2_MIN_ARG))
    shifter = _f32(m.ROUND_SHIFTER)
    # add.rm: the sum rounded down; near 1.5 * 2^23 floats are the integers, so that is
    # shifter + floor(x), exactly.
    t = (shifter + np.floor(x)).astype(np.float32)
    j = (t - shifter).astype(np.float32)
    f = (x - j).astype(np.float32)
    p = np.float32(1) + f * (_f32(m.C1) + f * (_f32(m.C2) + f * _f32(m.C3)))
    p = p.astype(np.float32)
    bits = p.view(np.int32) + (t.view(np.int32) << np.int32(m.EXPONENT_SHIFT))
    return bits.view(np.float32)


def test_the_sequence_is_two_to_the_x_over_the_softmax_range():
    # Softmax arguments: scores minus the row max (<= 0), plus up to log2(448) for P's scale.
    x = np.linspace(-125.9, 8.8, 2_000_001, dtype=np.float32)
    got = _replay(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.all(np.abs(got / want - 1) < STATED_RELATIVE_ERROR)


def test_below_the_clamp_it_is_the_smallest_normal_power():
    assert np.all(_replay(np.array([-126.0, -300.0, -np.inf], dtype=np.float32)) == np.float32(2.0**-126))
