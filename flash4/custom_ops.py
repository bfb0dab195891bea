"""flash4's attention as torch.library custom ops: what torch.compile sees of a call.

Dynamo cannot trace a kernel launch, so while it compiles, ``flash_attn_func`` calls
these ops, and the graph holds each call as one node: the fake implementations give the
compiler the outputs' shapes and strides (the real ones allocate exactly those), and the
registered autograd formula puts the backward op into AOTAutograd's backward graph, so a
compiled training step runs flash4's backward kernels with no graph break. The FP8 calls
(forward only) are one op each: ``flash_attn_fp8``, its quantization inside, and
``flash_attn_fp8_quantized``, on the parts of its quantized inputs; so is
``flash_attn_forward_into``, an op that declares the buffers it writes.

Eager calls do not come here: through the dispatcher's custom-op path a call with a
(1, 128, 16, 64) tensor cost 17 µs against 4 µs for the same Python function called
directly (2-core CPU, torch 2.13), where a whole flash4 call costs its host 18 µs (H200).
Eager and compiled calls differ only in how they reach ``flash4.forward`` and
``flash4.backward``, which both share.
"""

from __future__ import annotations

import torch

from flash4.autograd import upstream_gradient
from flash4.backward import attention_backward as backward_kernels
from flash4.backward import check_backward_supported
from flash4.checks import check_attention_args, check_out_buffers, resolve_softmax_scale
from flash4.forward import launch_forward, run_forward
from flash4.fp8 import OUT_DTYPE as FP8_OUT_DTYPE
from flash4.fp8 import flash_attn_fp8, flash_attn_fp8_quantized
from flash4.quantize import Fp8Tensor, Fp8TransposedV

# An op's outputs are tensors, never None: the forward op's LSE when it was not asked for.
_NO_LSE_SHAPE = (0,)


@torch.library.custom_op("flash4::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, with_lse: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, LSE) of ``flash_attn_func``; without ``with_lse`` the LSE is empty and the
    kernel that writes none runs. ``deterministic`` is the backward's (see
    ``flash_attn_func``)."""
    return forward_outputs(q, k, v, softmax_scale, causal, with_lse)


def forward_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward op's work: every check of an eager call, before the launch. A module
    function so that CPU tests can put the reference maths in the kernels' place."""
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    out, lse = run_forward(q, k, v, problem, with_lse)
    return out, lse if lse is not None else q.new_empty(_NO_LSE_SHAPE, dtype=torch.float32)


@attention_forward.register_fake
def _attention_forward_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, with_lse: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse_shape = (batch, heads, seqlen_q) if with_lse else _NO_LSE_SHAPE
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flash4::attention_backward", mutates_args=())
def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    softmax_scale: float, causal: bool, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the forward's saved tensors and the upstream gradient ``dout``."""
    return backward_outputs(dout, q, k, v, out, lse, softmax_scale, causal, deterministic)


def backward_outputs(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    softmax_scale: float, causal: bool, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's work (a module function for the same reason as ``forward_outputs``)."""
    return backward_kernels(
        q, k, v, out, upstream_gradient(dout), lse, softmax_scale, causal, deterministic=deterministic
    )


@attention_backward.register_fake
def _attention_backward_fake(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    softmax_scale: float, causal: bool, deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # flash4.backward.attention_backward allocates its gradients with empty_like.
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, softmax_scale, causal, _with_lse, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.mark_non_differentiable(lse)


def _backward_formula(ctx, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


attention_forward.register_autograd(_backward_formula, setup_context=_save_for_backward)


@torch.library.custom_op("flash4::attention_forward_into", mutates_args=("out", "lse"))
def attention_forward_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float, causal: bool,
) -> None:
    """``flash_attn_forward_into``: attention written into the caller's ``out`` and ``lse``
    (None: the kernel that writes none), which the op declares it mutates."""
    forward_into(q, k, v, out, lse, softmax_scale, causal)


def forward_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float, causal: bool,
) -> None:
    """The op's work: every check of an eager call, before the launch (a module function,
    as ``forward_outputs``)."""
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    check_out_buffers(q, problem, out, lse)
    launch_forward(q, k, v, out, lse, problem)


@attention_forward_into.register_fake
def _attention_forward_into_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float, causal: bool,
) -> None:
    return None


def compiled_forward_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
    softmax_scale: float | None, causal: bool,
) -> None:
    """``flash_attn_forward_into`` as torch.compile traces it (checks as ``compiled_attention``)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    attention_forward_into(q, k, v, out, lse, resolve_softmax_scale(softmax_scale, q.shape[-1]), causal)


@torch.library.custom_op("flash4::fp8_attention", mutates_args=())
def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, hadamard: bool,
    return_lse: bool, qk_int8: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, LSE) of ``flash_attn_fp8`` (quantization included); without ``return_lse`` the
    LSE is empty. Forward only: flash_attn_fp8 refuses inputs that require grad while it is
    traced."""
    return fp8_outputs(q, k, v, softmax_scale, causal, hadamard, return_lse, qk_int8)


def fp8_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, hadamard: bool,
    return_lse: bool, qk_int8: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 op's work: the eager call (a module function, as ``forward_outputs``)."""
    result = flash_attn_fp8(q, k, v, softmax_scale, causal, hadamard, return_lse, qk_int8)
    if return_lse:
        return result
    return result, q.new_empty(_NO_LSE_SHAPE, dtype=torch.float32)


@fp8_attention.register_fake
def _fp8_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool, hadamard: bool,
    return_lse: bool, qk_int8: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, _ = q.shape
    out = torch.empty_like(q, dtype=FP8_OUT_DTYPE, memory_format=torch.contiguous_format)
    lse_shape = (batch, heads, seqlen_q) if return_lse else _NO_LSE_SHAPE
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("flash4::fp8_attention_quantized", mutates_args=())
def fp8_attention_quantized(
    q_values: torch.Tensor, q_descale: torch.Tensor, q_block: int, q_hadamard: bool, q_max: float, q_seqlen: int,
    k_values: torch.Tensor, k_descale: torch.Tensor, k_block: int, k_hadamard: bool, k_max: float, k_seqlen: int,
    v_values: torch.Tensor, v_descale: torch.Tensor, v_block: int, v_hadamard: bool, v_max: float, v_seqlen: int,
    softmax_scale: float, causal: bool, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, LSE) of ``flash_attn_fp8_quantized`` from each quantized tensor's parts (an op
    takes tensors and numbers, not NamedTuples): values, descale, block (0: per tensor),
    rotation, largest code and, for V laid out by ``transpose_fp8_v``, its keys (-1: an
    Fp8Tensor)."""
    tensors = [
        _quantized(*parts) for parts in (
            (q_values, q_descale, q_block, q_hadamard, q_max, q_seqlen),
            (k_values, k_descale, k_block, k_hadamard, k_max, k_seqlen),
            (v_values, v_descale, v_block, v_hadamard, v_max, v_seqlen),
        )
    ]
    return fp8_quantized_outputs(*tensors, softmax_scale, causal, return_lse)


def _quantized(values, descale, block: int, hadamard: bool, largest: float, seqlen: int):
    if seqlen >= 0:
        return Fp8TransposedV(values, descale, block or None, seqlen)
    return Fp8Tensor(values, descale, block or None, hadamard, largest)


def fp8_quantized_outputs(q, k, v, softmax_scale: float, causal: bool, return_lse: bool) -> tuple:
    """The quantized FP8 op's work: the eager call (a module function, as ``forward_outputs``)."""
    result = flash_attn_fp8_quantized(q, k, v, softmax_scale, causal, return_lse)
    if return_lse:
        return result
    return result, q.values.new_empty(_NO_LSE_SHAPE, dtype=torch.float32)


@fp8_attention_quantized.register_fake
def _fp8_attention_quantized_fake(
    q_values: torch.Tensor, q_descale: torch.Tensor, q_block: int, q_hadamard: bool, q_max: float, q_seqlen: int,
    k_values: torch.Tensor, k_descale: torch.Tensor, k_block: int, k_hadamard: bool, k_max: float, k_seqlen: int,
    v_values: torch.Tensor, v_descale: torch.Tensor, v_block: int, v_hadamard: bool, v_max: float, v_seqlen: int,
    softmax_scale: float, causal: bool, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, _ = q_values.shape
    out = torch.empty_like(q_values, dtype=FP8_OUT_DTYPE, memory_format=torch.contiguous_format)
    lse_shape = (batch, heads, seqlen_q) if return_lse else _NO_LSE_SHAPE
    return out, q_values.new_empty(lse_shape, dtype=torch.float32)


def compiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None, causal: bool,
    return_lse: bool, deterministic: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_func`` as torch.compile traces it. The checks of the flags and of the
    head dim of a backward run while tracing; those of the tensors (their addresses
    among them, which tracing does not know) in the op, before its launch."""
    for name, flag in (("causal", causal), ("return_lse", return_lse), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1])
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad:
        check_backward_supported(q.shape[-1])
    out, lse = attention_forward(q, k, v, scale, causal, return_lse or needs_grad, deterministic)
    return (out, lse) if return_lse else out
