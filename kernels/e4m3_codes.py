"""e4m3 facts shared by the kernels and the host: the codes of probabilities made without
an exponential, and the smallest descale of the quantization.

A positive e4m3 value 2^(E - 7) * (1 + M / 8) has the code 8 E + M (its 7 bits below the
sign): eight codes per power of two. So the code of 2^t is about 8 t + 56, exact at whole
t and linear in between, where 1 + f stands for 2^f and overestimates it by at most 6.1%
(Schraudolph's exponential, with a 3-bit mantissa). The FP8 forward rounds P to e4m3
anyway (up to 6.25% per value), so it can round P's codes straight from the log2-domain
scores: one FFMA per score gives 1536 + 8 t + 56 - bias, and one f16 conversion per pair
rounds that to an integer (an f16's step is 1 on [1024, 2048)), whose low byte is the
code. No MUFU exponential and no e4m3 conversion run; a max clamps underflow to code 0.
The packing is kernels/packed_convert.py's ``pack_quad_codes``; the model's rounding,
flash4/reference.py's.
"""

from __future__ import annotations

import math

# e4m3 has 3 mantissa bits: 8 codes per power of two.
CODES_PER_OCTAVE = 8
# The code of 1.0: e4m3's exponent bias (7) times CODES_PER_OCTAVE.
CODE_OF_ONE = 56
# The linear mantissa's mean overestimate of log2, 8 * mean over f in [0, 1) of
# (log2(1 + f) - f), in codes: taken off so that P's errors centre on 0.
LINEAR_MANTISSA_BIAS = CODES_PER_OCTAVE * (1.5 - 1.0 / math.log(2.0))
# 1.5 * 2^10: on [1024, 2048) an f16 steps by 1, so rounding to f16 rounds to an integer n,
# held as the bits 0x6600 + n; below it, max() clamps to code 0.
F16_INTEGER_BASE = 1536.0
F16_INTEGER_BASE_X2_BITS = 0x66006600
# The largest e4m3 code (448); 127 is NaN.
LARGEST_CODE = 126
# The smallest descale quantize_fp8 gives a block (float32's smallest normal): values are
# multiplied by the descale's reciprocal, which must stay finite; a block whose largest
# magnitude is below 448 times it is scaled up by 2^126 instead, its values below 448.
SMALLEST_DESCALE = 2.0**-126


def code_base(p_log2: float) -> float:
    """What a score at the row's max maps to, before the f16 rounding: the code of
    2^p_log2 (P's scale onto e4m3's range) plus F16_INTEGER_BASE, less the bias."""
    top = CODES_PER_OCTAVE * p_log2 + CODE_OF_ONE - LINEAR_MANTISSA_BIAS
    if round(top) > LARGEST_CODE:
        raise ValueError(f"p_log2={p_log2}: the largest probability's code {top:.3f} rounds past {LARGEST_CODE}")
    return F16_INTEGER_BASE + top
