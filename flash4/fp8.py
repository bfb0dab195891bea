"""FP8 (e4m3) attention on Hopper: blockwise-quantized Q, K, V through the FP8 forward kernel
(kernels/sm90_fwd_fp8.py), bf16 out. Forward only.

``flash_attn_fp8(q, k, v)`` takes 16-bit tensors, quantizes them (Q and K with one descale
per tile of rows of each head, optionally after the Hadamard rotation; V with one per
tensor) and runs the kernel. With ``qk_int8=True`` (the accurate mode) Q and K are int8
instead of e4m3 (``flash4.quantize_int8``), V still e4m3.
``flash_attn_fp8_quantized`` takes what ``flash4.quantize_fp8`` returned, blockwise (Q per
``fp8_blocks(head_dim, causal, seqlen_q).q`` rows, K and V per ``.kv`` rows: the query and
key tiles of the kernel that serves the problem) or per tensor (``block=None``); V may come
laid out beforehand (``transpose_fp8_v``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flash4.checks import (
    AttentionProblem, check_attention_args, check_devices, check_shapes, refuse_grad, resolve_softmax_scale,
)
from flash4.compiler import compiled_forward, tile_counter
from flash4.dispatch import FP8_DTYPE, FP8_OUT_DTYPE, TABLE, UnsupportedProblemError, select, select_fp8
from flash4.devices import device_arch, device_sms, on_device
from flash4.forward import LOG2_E
from flash4.kernels.f16_scores import code_limits, scores_fit_f16
from flash4.quantize import FP8_DTYPE as TORCH_FP8_DTYPE
from flash4.quantize import FP8_MAX as TORCH_FP8_MAX
from flash4.quantize import (
    FP8_KEY_GROUP,
    Fp8Tensor,
    Fp8TransposedV,
    fp8_value_layout,
    quantize_fp8_transposed_v,
    quantize_on_gpu,
)

OUT_DTYPE = getattr(torch, FP8_OUT_DTYPE)
# The architecture of flash4's FP8 kernels (wgmma with e4m3 operands).
FP8_ARCH = "sm_90a"


class Fp8Blocks(NamedTuple):
    """Rows per blockwise descale: ``q`` for Q (the FP8 kernel's query tile), ``kv`` for K
    and V (its key tile), so that each tile reads one descale; and the ``fp8_max`` of Q
    (``q_max``) and of K (``k_max``) with which ``flash_attn_fp8_quantized`` runs the
    kernel that holds Q Kᵀ in f16 (kernels/f16_scores.py)."""

    q: int
    kv: int
    q_max: float
    k_max: float


def fp8_blocks(head_dim: int, causal: bool, seqlen_q: int) -> Fp8Blocks:
    """The descale block sizes of the FP8 kernel that serves this problem: the tiles of its
    selector row (short causal sequences take shorter query tiles, as the 16-bit rows do)."""
    try:
        config = select(FP8_ARCH, FP8_DTYPE, head_dim, causal, seqlen_q).config
    except UnsupportedProblemError:
        heads = sorted({row.head_dim for row in TABLE if row.dtype == FP8_DTYPE})
        raise ValueError(f"head_dim={head_dim}: the FP8 kernel supports head dims {heads}") from None
    return Fp8Blocks(config.tile_m, config.tile_n, *code_limits(head_dim))


def flash_attn_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    hadamard: bool = False,
    return_lse: bool = False,
    qk_int8: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of bf16/fp16 q, k, v (as ``flash_attn_func`` takes them) computed in FP8:
    Q and K are quantized to e4m3 with one descale per tile of rows of a head (``fp8_blocks``;
    rotated first when ``hadamard``) onto its code limits (``.q_max``, ``.k_max``: the
    kernel then holds the scores in f16), V with one descale for the tensor, then the FP8
    kernel runs. Returns bf16 ``out`` (and float32 ``lse``). Not differentiable.

    ``qk_int8`` (the accurate mode): Q and K quantized to int8 instead (``quantize_int8``,
    best with ``hadamard=True``), whose s32 scores the kernel converts to fp32. On
    FlashAttention-3's outlier inputs (H100, 2026-12-05) it errs 0.28-0.36x as much as
    cuDNN's per-tensor FP8 (e4m3 blockwise + Hadamard: 0.45-0.52x), at 1.03-1.66x cuDNN's
    speed and below the e4m3 kernels' (README, FP8).

    V per tensor: the kernel folds a V block's descale into P's scale relative to the
    largest so far, so blocks with smaller descales round P more coarsely; on
    FlashAttention-3's outlier inputs the kernel's algorithm (reference.fp8_blockwise_
    attention) erred 7-18% more with V per block than per tensor."""
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {type(hadamard).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(qk_int8, bool):
        raise TypeError(f"qk_int8 must be a bool, got {type(qk_int8).__name__}")
    if torch.compiler.is_compiling():
        return _traced_fp8(q, k, v, softmax_scale, causal, hadamard, return_lse, qk_int8)
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    _refuse_grad(q, k, v)
    # Q's and K's codes within code_limits keep Q Kᵀ inside f16, so the kernel holds its
    # scores there (without an LSE); e4m3 keeps its relative precision at any scale, and
    # on FlashAttention-3's inputs the outputs erred as with codes to 448 (README, FP8).
    q_max, k_max = code_limits(problem.head_dim)
    # The device's kernel for the problem before any launch: its tiles are the blocks, and a
    # GPU without FP8 kernels is refused before anything is quantized.
    entry = select_fp8(
        device_arch(q.device.index), problem.head_dim, causal, problem.seqlen_q, v_per_tensor=True,
        group=problem.group_size, f16_scores=True, qk_int8=qk_int8,
    )
    # The inputs passed check_attention_args, so the quantization kernels take them and what
    # they return is what the FP8 kernel reads: neither quantize_fp8's checks nor
    # check_fp8_args (a quarter of the call's host time) run again.
    with on_device(q.device):
        return _launch(
            quantize_on_gpu(q, entry.config.tile_m, hadamard, q_max, int8=qk_int8),
            quantize_on_gpu(k, entry.config.tile_n, hadamard, k_max, int8=qk_int8),
            quantize_fp8_transposed_v(v),
            problem,
            entry,
            return_lse,
        )


def _refuse_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    refuse_grad("flash_attn_fp8", "call it under torch.no_grad() or with tensors that do not require grad", q, k, v)


def _traced_fp8(q, k, v, softmax_scale, causal, hadamard, return_lse, qk_int8):
    """flash_attn_fp8 as torch.compile traces it: one node of the graph (flash4/custom_ops.py,
    which runs the eager call); the tensors' checks run there, before the launch."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _refuse_grad(q, k, v)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    out, lse = torch.ops.flash4.fp8_attention(q, k, v, scale, causal, hadamard, return_lse, qk_int8)
    return (out, lse) if return_lse else out


def _traced_fp8_quantized(q, k, v, softmax_scale, causal, return_lse):
    """flash_attn_fp8_quantized as torch.compile traces it: one node of the graph
    (flash4/custom_ops.py) taking each quantized tensor's parts, which it reassembles for
    the eager call; every check of the parts runs there, before the launch."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    parts = []
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, (Fp8Tensor, Fp8TransposedV)):
            raise TypeError(f"{name} must be a flash4.Fp8Tensor or flash4.Fp8TransposedV, got {type(t).__name__}")
        transposed = isinstance(t, Fp8TransposedV)
        parts += [
            t.values, t.descale, t.block or 0, False if transposed else t.hadamard,
            TORCH_FP8_MAX if transposed else t.fp8_max, t.seqlen if transposed else -1,
        ]
    head_dim = q.values.shape[-1]
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    out, lse = torch.ops.flash4.fp8_attention_quantized(*parts, scale, causal, return_lse)
    return (out, lse) if return_lse else out


def flash_attn_fp8_quantized(
    q: Fp8Tensor,
    k: Fp8Tensor,
    v: Fp8Tensor | Fp8TransposedV,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The FP8 kernel on ``quantize_fp8``'s outputs: descales per tile of rows
    (``fp8_blocks``) or per tensor, each of q, k, v on its own; q and k both rotated or
    neither, v never. V given as an Fp8Tensor is laid out for the kernel on every call (a
    pass over V); ``transpose_fp8_v`` does that once, for V read by many calls.

    With V per tensor and without ``return_lse``, the kernels sum each row's P on the
    tensor cores: the e4m3-rounded P that multiplied V, so O is normalised by the weights
    it was built from; and they round P's e4m3 codes straight from the scores, linear in
    the mantissa between powers of two (kernels/e4m3_codes.py; each P within about 6% of
    exp, as e4m3's own rounding), with no exponential. With ``return_lse`` they take
    exp2 and sum the unrounded P, whose log is the true LSE; ``out`` then differs slightly
    from the call without (by P's rounding in the sum, largest on rows of few keys)."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if torch.compiler.is_compiling():
        return _traced_fp8_quantized(q, k, v, softmax_scale, causal, return_lse)
    problem = check_fp8_args(q, k, v, softmax_scale, causal)
    device = q.values.device
    entry = select_fp8(
        device_arch(device.index), problem.head_dim, causal, problem.seqlen_q, v_per_tensor=v.block is None,
        group=problem.group_size, f16_scores=scores_fit_f16(problem.head_dim, q.fp8_max, k.fp8_max),
        qk_int8=q.values.dtype == torch.int8,
    )
    with on_device(device):
        return _launch(q, k, v, problem, entry, return_lse)


def _launch(
    q: Fp8Tensor, k: Fp8Tensor, v: Fp8Tensor | Fp8TransposedV, problem: AttentionProblem, entry, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The FP8 kernel of ``entry`` on checked inputs, on the current device."""
    kernel = compiled_forward(entry, return_lse)
    device = q.values.device
    batch, heads = problem.batch, problem.heads
    q_blocks = -(-problem.seqlen_q // entry.config.tile_m)
    kv_blocks = -(-problem.seqlen_k // entry.config.tile_n)
    out = torch.empty_like(q.values, dtype=OUT_DTYPE, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads, problem.seqlen_q, dtype=torch.float32, device=device) if return_lse else None
    kernel(
        q.values, k.values, v.values if isinstance(v, Fp8TransposedV) else fp8_value_layout(v.values), out, lse,
        *kernel_descales(q, k, v, batch, heads, problem.kv_heads, q_blocks, kv_blocks),
        problem.softmax_scale * LOG2_E, device_sms(device.index), tile_counter(entry.config, device),
    )
    return (out, lse) if return_lse else out


def check_fp8_args(q: object, k: object, v: object, softmax_scale: object, causal: object) -> AttentionProblem:
    """Validate ``flash_attn_fp8_quantized``'s arguments before any launch, naming the culprit."""
    named = (("q", q), ("k", k), ("v", v))
    for name, t in named:
        allowed = (Fp8Tensor, Fp8TransposedV) if name == "v" else (Fp8Tensor,)
        if not isinstance(t, allowed):
            what = " or flash4.Fp8TransposedV (from transpose_fp8_v)" if name == "v" else ""
            raise TypeError(
                f"{name} must be a flash4.Fp8Tensor (from flash4.quantize_fp8){what}, got {type(t).__name__}"
            )
        # Q and K: e4m3, or int8 (quantize_int8, the accurate mode); V e4m3.
        dtypes = (TORCH_FP8_DTYPE,) if name == "v" else (TORCH_FP8_DTYPE, torch.int8)
        if not isinstance(t.values, torch.Tensor) or t.values.dtype not in dtypes or t.values.dim() != 4:
            layout = "(batch, kv_heads, head_dim, keys)" if isinstance(t, Fp8TransposedV) else "(batch, seqlen, heads, head_dim)"
            allowed_dtypes = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{name}.values must be a 4-D {allowed_dtypes} tensor {layout}")
        if not t.values.is_contiguous():
            raise ValueError(f"{name}.values must be contiguous, as quantize_fp8 returns it")
    if q.values.dtype != k.values.dtype:
        raise ValueError(
            f"q.values is {q.values.dtype} but k.values is {k.values.dtype}: Q and K must both be e4m3 "
            f"(quantize_fp8) or both int8 (quantize_int8)"
        )
    if q.hadamard != k.hadamard:
        raise ValueError("q and k must both be rotated (hadamard=True) or neither: QKᵀ is kept only then")
    if isinstance(v, Fp8TransposedV):
        batch, seqlen_k, kv_heads, head_dim = k.values.shape
        padded = -(-seqlen_k // FP8_KEY_GROUP) * FP8_KEY_GROUP
        if tuple(v.values.shape) != (batch, kv_heads, head_dim, padded) or v.seqlen != seqlen_k:
            raise ValueError(
                f"v (transposed) must hold k's keys: values of shape {(batch, kv_heads, head_dim, padded)} and "
                f"seqlen {seqlen_k}, got {tuple(v.values.shape)} and seqlen {v.seqlen}"
            )
        check_shapes(q.values, k.values, k.values)
    else:
        if v.hadamard:
            raise ValueError("v must not be rotated (hadamard=False): rotating V would rotate the output")
        check_shapes(q.values, k.values, v.values)
    batch, seqlen_q, heads, head_dim = q.values.shape
    _, seqlen_k, kv_heads, _ = k.values.shape
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    blocks = fp8_blocks(head_dim, causal, seqlen_q)
    for name, t, rows, nheads, seqlen in (
        ("q", q, blocks.q, heads, seqlen_q), ("k", k, blocks.kv, kv_heads, seqlen_k), ("v", v, blocks.kv, kv_heads, seqlen_k)
    ):
        if t.block not in (rows, None):
            raise ValueError(
                f"{name}.block is {t.block}: at head_dim={head_dim}, causal={causal}, seqlen_q={seqlen_q} the FP8 "
                f"kernel reads one descale per {rows} rows (quantize_fp8(x, block={rows}), see "
                f"flash4.fp8.fp8_blocks) or one per tensor (block=None)"
            )
        expected = () if t.block is None else (batch, nheads, -(-seqlen // t.block))
        if tuple(t.descale.shape) != expected or t.descale.dtype != torch.float32 or not t.descale.is_contiguous():
            raise ValueError(
                f"{name}.descale must be a contiguous float32 tensor of shape {expected}, got "
                f"{t.descale.dtype} {tuple(t.descale.shape)}"
            )
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    # The common case in one expression; the named walk only to name a culprit.
    device = q.values.device
    if not (device.type == "cuda" and device == q.descale.device == k.values.device == k.descale.device
            == v.values.device == v.descale.device):
        check_devices({f"{name}.{part}": getattr(t, part).device for name, t in named for part in ("values", "descale")})
    return AttentionProblem(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, FP8_DTYPE, scale, causal)


def kernel_descales(
    q: Fp8Tensor, k: Fp8Tensor, v: Fp8Tensor | Fp8TransposedV, batch: int, heads: int, kv_heads: int,
    q_blocks: int, kv_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The descales the kernel that ``select_fp8`` picks for these inputs reads: Q's and K's
    per tile, and a per-tensor V's as it is (that kernel reads one float, so it takes a view:
    repeating it per tile was a copy launched on every call: on the H200's host about 11 µs,
    a quarter of the call's host time, and 2-3 µs of GPU time)."""
    return (
        tile_descales(q, batch, heads, q_blocks),
        tile_descales(k, batch, kv_heads, kv_blocks),
        v.descale.view(1, 1, 1) if v.block is None else v.descale,
    )


def tile_descales(t: Fp8Tensor, batch: int, heads: int, blocks: int) -> torch.Tensor:
    """The kernel's float32 descales, one per (batch, head, tile): blockwise as given, or a
    per-tensor descale repeated."""
    if t.block is None:
        return t.descale.reshape(1, 1, 1).expand(batch, heads, blocks).contiguous()
    return t.descale
