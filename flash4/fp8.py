"""FP8 (e4m3) attention on Hopper: blockwise-quantized Q, K, V through the FP8 forward kernel
(kernels/sm90_fwd_fp8.py), bf16 out. Forward only.

``flash_attn_fp8(q, k, v)`` takes 16-bit tensors, quantizes them (Q and K with one descale
per 128 rows of each head, optionally after the Hadamard rotation; V with one per tensor)
and runs the kernel.
``flash_attn_fp8_quantized`` takes what ``flash4.quantize_fp8`` returned, blockwise
(``block=FP8_BLOCK``) or per tensor (``block=None``).
"""

from __future__ import annotations

import contextlib

import torch

from flash4.checks import AttentionProblem, check_devices, check_shapes, resolve_softmax_scale
from flash4.compiler import compiled_forward
from flash4.dispatch import FP8_DTYPE, FP8_OUT_DTYPE, FP8_TILE_N, select
from flash4.interface import LOG2_E, device_arch, device_sms
from flash4.quantize import FP8_DTYPE as TORCH_FP8_DTYPE
from flash4.quantize import Fp8Tensor, fp8_value_layout, quantize_fp8

# Rows per descale: the FP8 kernel's query tile and key tile, so each tile reads one.
FP8_BLOCK = FP8_TILE_N
OUT_DTYPE = getattr(torch, FP8_OUT_DTYPE)


def flash_attn_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    hadamard: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of bf16/fp16 q, k, v (as ``flash_attn_func`` takes them) computed in FP8:
    Q and K are quantized to e4m3 with one descale per 128 rows of a head (rotated first
    when ``hadamard``), V with one descale for the tensor, then the FP8 kernel runs. Returns
    bf16 ``out`` (and float32 ``lse``). Not differentiable.

    V per tensor: the kernel folds a V block's descale into P's scale relative to the
    largest so far, so blocks with smaller descales round P more coarsely; on
    FlashAttention-3's outlier inputs the kernel's algorithm (reference.fp8_blockwise_
    attention) erred 7-18% more with V per block than per tensor."""
    from flash4.checks import check_attention_args

    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {type(hadamard).__name__}")
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise NotImplementedError(
            "flash_attn_fp8 is forward only: call it under torch.no_grad() or with tensors that do not require grad"
        )
    return flash_attn_fp8_quantized(
        quantize_fp8(q, FP8_BLOCK, hadamard),
        quantize_fp8(k, FP8_BLOCK, hadamard),
        quantize_fp8(v, None),
        problem.softmax_scale,
        causal,
        return_lse,
    )


def flash_attn_fp8_quantized(
    q: Fp8Tensor,
    k: Fp8Tensor,
    v: Fp8Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The FP8 kernel on ``quantize_fp8``'s outputs: descales per ``FP8_BLOCK`` rows or per
    tensor, each of q, k, v on its own; q and k both rotated or neither, v never."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    problem = check_fp8_args(q, k, v, softmax_scale, causal)
    device = q.values.device
    entry = select(device_arch(device.index), FP8_DTYPE, problem.head_dim, causal, problem.seqlen_q)
    kernel = compiled_forward(entry, return_lse)
    batch, heads = problem.batch, problem.heads
    q_blocks = -(-problem.seqlen_q // entry.config.tile_m)
    kv_blocks = -(-problem.seqlen_k // entry.config.tile_n)
    out = torch.empty(q.values.shape, dtype=OUT_DTYPE, device=device)
    lse = torch.empty(batch, heads, problem.seqlen_q, dtype=torch.float32, device=device) if return_lse else None
    # Switching devices costs microseconds: only when the tensors live elsewhere.
    same = device.index == torch.cuda.current_device()
    with contextlib.nullcontext() if same else torch.cuda.device(device):
        kernel(
            q.values, k.values, fp8_value_layout(v.values), out, lse,
            tile_descales(q, batch, heads, q_blocks),
            tile_descales(k, batch, problem.kv_heads, kv_blocks),
            tile_descales(v, batch, problem.kv_heads, kv_blocks),
            problem.softmax_scale * LOG2_E, device_sms(device.index),
        )
    return (out, lse) if return_lse else out


def check_fp8_args(q: object, k: object, v: object, softmax_scale: object, causal: object) -> AttentionProblem:
    """Validate ``flash_attn_fp8_quantized``'s arguments before any launch, naming the culprit."""
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"{name} must be a flash4.Fp8Tensor (from flash4.quantize_fp8), got {type(t).__name__}")
        if not isinstance(t.values, torch.Tensor) or t.values.dtype != TORCH_FP8_DTYPE or t.values.dim() != 4:
            raise ValueError(f"{name}.values must be a 4-D {TORCH_FP8_DTYPE} tensor (batch, seqlen, heads, head_dim)")
        if not t.values.is_contiguous():
            raise ValueError(f"{name}.values must be contiguous, as quantize_fp8 returns it")
        if t.block not in (FP8_BLOCK, None):
            raise ValueError(
                f"{name}.block is {t.block}: the FP8 kernel reads one descale per {FP8_BLOCK} rows "
                f"(quantize_fp8(x, block={FP8_BLOCK})) or one per tensor (block=None)"
            )
        batch, seqlen, heads, _ = t.values.shape
        expected = () if t.block is None else (batch, heads, -(-seqlen // t.block))
        if tuple(t.descale.shape) != expected or t.descale.dtype != torch.float32 or not t.descale.is_contiguous():
            raise ValueError(
                f"{name}.descale must be a contiguous float32 tensor of shape {expected}, got "
                f"{t.descale.dtype} {tuple(t.descale.shape)}"
            )
    if q.hadamard != k.hadamard:
        raise ValueError("q and k must both be rotated (hadamard=True) or neither: QKᵀ is kept only then")
    if v.hadamard:
        raise ValueError("v must not be rotated (hadamard=False): rotating V would rotate the output")
    check_shapes(q.values, k.values, v.values)
    batch, seqlen_q, heads, head_dim = q.values.shape
    _, seqlen_k, kv_heads, _ = k.values.shape
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_devices({f"{name}.{part}": getattr(t, part).device for name, t in named for part in ("values", "descale")})
    return AttentionProblem(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, FP8_DTYPE, scale, causal)


def tile_descales(t: Fp8Tensor, batch: int, heads: int, blocks: int) -> torch.Tensor:
    """The kernel's float32 descales, one per (batch, head, tile): blockwise as given, or a
    per-tensor descale repeated."""
    if t.block is None:
        return t.descale.reshape(1, 1, 1).expand(batch, heads, blocks).contiguous()
    return t.descale
