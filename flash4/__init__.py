"""flash4: exact attention for Hopper GPUs, written in CuTe-DSL."""

from flash4.fp8 import flash_attn_fp8, flash_attn_fp8_quantized
from flash4.interface import flash_attn_forward_into, flash_attn_func
from flash4.quantize import Fp8Tensor, Fp8TransposedV, quantize_fp8, quantize_int8, transpose_fp8_v

__all__ = [
    "Fp8Tensor",
    "Fp8TransposedV",
    "flash_attn_forward_into",
    "flash_attn_fp8",
    "flash_attn_fp8_quantized",
    "flash_attn_func",
    "quantize_fp8",
    "quantize_int8",
    "transpose_fp8_v",
]
