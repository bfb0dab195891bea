"""flash4: exact attention for Hopper GPUs, written in CuTe-DSL."""

from flash4.interface import flash_attn_forward_into, flash_attn_func

__all__ = ["flash_attn_func", "flash_attn_forward_into"]
