"""Argument checks for the attention functions, run on the host before any launch.

Every failure is a TypeError or ValueError (never an assert, which ``python -O`` strips)
whose message names the argument and what is allowed. The checks run in a fixed order, so
that CPU tests can reach each one: a CPU tensor passes every shape and dtype check and only
fails the device check at the end.

Whether a head dim or dtype has a compiled kernel on this GPU is the selector's question
(``flash4.dispatch.select``), not this module's. Large sizes need no check: the kernel
indexes with 64-bit offsets.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, NamedTuple

import torch

from flash4.reference import default_softmax_scale

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
# wgmma and TMA move 16-byte rows: 8 elements of a 2-byte dtype.
HEAD_DIM_MULTIPLE = 8
# The TMA engine moves 16-byte units: strides and start addresses must be 16-byte multiples.
TMA_ALIGN_BYTES = 16
TMA_ALIGN_ELEMENTS = TMA_ALIGN_BYTES // 2  # of a 2-byte dtype
# CUDA caps a grid's y and z dimensions at 65535; heads and batch entries are laid on them.
MAX_GRID_YZ = 65535
# The largest head dim whose Q tile and K/V ring fit Hopper's shared memory.
MAX_HEAD_DIM = 256
_LAYOUT = "(batch, seqlen, heads, head_dim)"


class AttentionProblem(NamedTuple):
    """The sizes and options of one attention call, after validation (immutable; a tuple
    because it is built on every call and a tuple is the cheapest record to build)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    softmax_scale: float
    causal: bool

    @property
    def group_size(self) -> int:
        """Query heads per kv head (1: multi-head, heads: multi-query)."""
        return self.heads // self.kv_heads


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES}


def _check_tensors(q: object, k: object, v: object) -> None:
    # Every check tests the common case in one expression and only walks the arguments to
    # name the culprit when it fails: this runs on every call, where microseconds count.
    tensors = (("q", q), ("k", k), ("v", v))
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        name, tensor = next(t for t in tensors if not isinstance(t[1], torch.Tensor))
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not q.dim() == k.dim() == v.dim() == 4:
        name, tensor = next(t for t in tensors if t[1].dim() != 4)
        raise ValueError(
            f"{name} must be 4-D {_LAYOUT}, got shape {tuple(tensor.shape)} ({tensor.dim()}-D)"
        )
    dtype = q.dtype
    if dtype not in SUPPORTED_DTYPES or k.dtype not in SUPPORTED_DTYPES or v.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(_dtype_name(d) for d in SUPPORTED_DTYPES)
        name, tensor = next(t for t in tensors if t[1].dtype not in SUPPORTED_DTYPES)
        hint = " (e4m3 inputs also take q_descale, k_descale and v_descale)" if tensor.dtype == torch.float8_e4m3fn else ""
        raise TypeError(f"{name} has dtype {_dtype_name(tensor.dtype)}; supported dtypes: {allowed}{hint}")
    if k.dtype != dtype or v.dtype != dtype:
        name, tensor = next(t for t in tensors[1:] if t[1].dtype != dtype)
        raise TypeError(
            f"{name} has dtype {_dtype_name(tensor.dtype)} but q has {_dtype_name(dtype)}; "
            "q, k and v must share one dtype"
        )


def tma_misaligned(tensor: torch.Tensor) -> bool:
    """Whether TMA cannot address ``tensor``: a stride (of a dim longer than 1) or the start
    address is not a 16-byte multiple."""
    if tensor.data_ptr() % TMA_ALIGN_BYTES:
        return True
    # A dim of size 1 is never stepped over, so its stride does not matter.
    strides, shape = tensor.stride(), tensor.shape
    return any(strides[i] % TMA_ALIGN_ELEMENTS and shape[i] > 1 for i in range(3))


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k_shape = k.shape
    if k_shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k_shape)} and v {tuple(v.shape)}")
    batch, seqlen_q, heads, head_dim = q.shape
    k_batch, seqlen_k, kv_heads, kv_head_dim = k_shape
    if k_batch != batch:
        raise ValueError(f"k has batch {k_batch} but q has batch {batch}; they must match")
    if kv_head_dim != head_dim:
        raise ValueError(
            f"k and v have head_dim {kv_head_dim} but q has head_dim {head_dim}; they must match"
        )
    if seqlen_q < 1 or seqlen_k < 1:
        name, seqlen = ("seqlen_q (q.shape[1])", seqlen_q) if seqlen_q < 1 else ("seqlen_k (k.shape[1])", seqlen_k)
        raise ValueError(f"{name} is {seqlen}; seqlen must be >= 1")
    if batch < 1 or heads < 1 or kv_heads < 1:
        name, size = next(
            item for item in (("batch (q.shape[0])", batch), ("heads (q.shape[2])", heads),
                              ("kv_heads (k.shape[2])", kv_heads)) if item[1] < 1
        )
        raise ValueError(f"{name} is {size}; it must be >= 1")
    if batch > MAX_GRID_YZ or heads > MAX_GRID_YZ:
        name, size = ("batch (q.shape[0])", batch) if batch > MAX_GRID_YZ else ("heads (q.shape[2])", heads)
        raise ValueError(
            f"{name} is {size}; at most {MAX_GRID_YZ} (the kernels launch one grid row per "
            "head and per batch entry)"
        )
    if heads % kv_heads:
        raise ValueError(
            f"heads={heads} (q.shape[2]) is not divisible by kv_heads={kv_heads} (k.shape[2]); "
            "each kv head must serve the same number of query heads"
        )
    if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} (q.shape[3]) must be a multiple of {HEAD_DIM_MULTIPLE} "
            f"in [{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}]"
        )
    tensors = (("q", q), ("k", k), ("v", v))
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    if not qs[3] == ks[3] == vs[3] == 1:
        name, tensor = next(t for t in tensors if t[1].stride(-1) != 1)
        raise ValueError(
            f"{name} has stride {tensor.stride(-1)} in its last dim (head_dim); "
            f"it must be contiguous there (stride 1): call {name}.contiguous()"
        )
    # All aligned (the usual case) is one test; otherwise look closer, since a dim of
    # size 1 may have any stride.
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % TMA_ALIGN_BYTES or (
        qs[0] | qs[1] | qs[2] | ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]
    ) % TMA_ALIGN_ELEMENTS:
        for name, tensor in tensors:
            if tma_misaligned(tensor):
                raise ValueError(
                    f"{name} has strides {tuple(tensor.stride())} and address {tensor.data_ptr():#x}; "
                    f"TMA needs every stride but the last to be a multiple of {TMA_ALIGN_ELEMENTS} "
                    f"elements and a {TMA_ALIGN_BYTES}-byte aligned start: call {name}.contiguous()"
                )


def resolve_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    if softmax_scale is None:
        return default_softmax_scale(head_dim)
    # bool is a numbers.Real too, but True as a scale is surely a mistake.
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a positive finite float or None, got {type(softmax_scale).__name__}"
        )
    scale = float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"softmax_scale must be a positive finite float or None, got {scale}")
    return scale


def check_devices(devices: Mapping[str, torch.device]) -> None:
    """All named tensors' devices must be one and the same CUDA device.

    Takes devices rather than tensors so the mixed-GPU path can be tested without GPUs.
    """
    for name, device in devices.items():
        if device.type != "cuda":
            raise ValueError(f"{name} is on {device}; flash4 needs CUDA tensors")
    (first_name, first), *rest = devices.items()
    for name, device in rest:
        if device != first:
            raise ValueError(
                f"{name} is on {device} but {first_name} is on {first}; all tensors must be on one device"
            )


def describe_attention(
    q: object, k: object, v: object, softmax_scale: object, causal: object
) -> AttentionProblem:
    """Every check except the device one: the problem of these tensors, wherever they live.

    For compile-only paths, which build kernels from CPU tensors.
    """
    _check_tensors(q, k, v)
    check_shapes(q, k, v)
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    scale = resolve_softmax_scale(softmax_scale, head_dim)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return AttentionProblem(
        batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, _dtype_name(q.dtype), scale, causal
    )


def check_attention_args(
    q: object, k: object, v: object, softmax_scale: object, causal: object
) -> AttentionProblem:
    """Validate an attention call's arguments; returns the problem or raises naming the argument."""
    problem = describe_attention(q, k, v, softmax_scale, causal)
    device = q.device
    if not (device.type == "cuda" and device == k.device == v.device):
        check_devices({"q": device, "k": k.device, "v": v.device})
    return problem


def refuse_grad(function: str, advice: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A forward-only call outside autograd: an input that requires grad would silently get
    none through it, so the call is refused, naming the inputs (without grad mode, or on
    detached tensors, it runs)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        names = [name for name, t in (("q", q), ("k", k), ("v", v)) if t.requires_grad]
        raise NotImplementedError(f"{', '.join(names)} requires grad, but {function} is forward only: {advice}")


def check_out_buffers(q: torch.Tensor, problem: AttentionProblem, out: object, lse: object) -> None:
    """``flash_attn_forward_into``'s buffers: ``out`` like q (contiguous), ``lse`` float32
    (batch, heads, seqlen_q) contiguous or None, both on q's device."""
    buffers = [("out", out, tuple(q.shape), q.dtype)]
    if lse is not None:
        buffers.append(("lse", lse, (problem.batch, problem.heads, problem.seqlen_q), torch.float32))
    for name, tensor, shape, dtype in buffers:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous {dtype} tensor of shape {shape}, got "
                f"{tensor.dtype} {tuple(tensor.shape)} with strides {tuple(tensor.stride())}"
            )
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
