"""The user-facing attention functions: check, select, launch."""

from __future__ import annotations

import torch

from flash4.autograd import AttentionFunction
from flash4.backward import check_backward_supported
from flash4.checks import check_attention_args, check_out_buffers, refuse_grad
from flash4.custom_ops import compiled_attention, compiled_forward_into
from flash4.forward import launch_forward, run_forward


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
    deterministic: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention ``softmax(softmax_scale * q k^T + mask) v``.

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, kv_heads, head_dim) with
    kv_heads dividing heads (GQA/MQA). bf16 or fp16 CUDA tensors, last dim contiguous.
    ``softmax_scale`` defaults to 1/sqrt(head_dim). ``causal`` masks key j for query i when
    j > i + seqlen_k - seqlen_q (bottom-right aligned); a row that sees no key gives 0.

    Returns out, shaped and typed like q, and with ``return_lse`` also the float32
    log-sum-exp of each row's scaled scores, (batch, heads, seqlen_q), natural log
    (-inf for a row that sees no key).

    Differentiable with respect to q, k and v; the LSE is not. ``deterministic`` makes the
    gradients bit-identical run to run (the backward's fp32 additions into dq, and into dk
    and dv under GQA/MQA, take turns in a fixed order); the forward is deterministic either
    way.

    FP8: e4m3 q, k, v with their float32 descales (``x ≈ values * descale``), each either
    one per tensor (shape ()) or one per block of rows of each head ((batch, heads,
    ceil(seqlen / block)), what ``quantize_fp8(x, block)`` gives; the block is the FP8
    kernel's tile: ``flash4.fp8.fp8_blocks(head_dim, causal, seqlen_q)``, ``.q`` for q,
    ``.kv`` for k and v),
    run the FP8 kernel (see ``flash4.flash_attn_fp8_quantized``); out is bf16, forward only.

    Under torch.compile the call is one node of the graph (flash4/custom_ops.py): the
    16-bit one forward and backward, the one with descales forward only.
    """
    if q_descale is not None or k_descale is not None or v_descale is not None:
        return _fp8_attention(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, return_lse)
    if torch.compiler.is_compiling():
        return compiled_attention(q, k, v, softmax_scale, causal, return_lse, deterministic)
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        check_backward_supported(problem.head_dim)
        return AttentionFunction.apply(q, k, v, problem, return_lse, deterministic)
    # Without return_lse the kernel variant that never writes LSE runs: no buffer, no stores.
    out, lse = run_forward(q, k, v, problem, return_lse)
    return (out, lse) if return_lse else out


def _fp8_attention(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, return_lse):
    """flash_attn_func with descales: the FP8 kernel on e4m3 inputs."""
    from flash4.fp8 import fp8_blocks, flash_attn_fp8_quantized
    from flash4.quantize import Fp8Tensor

    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D e4m3 tensor (batch, seqlen, heads, head_dim) when descales are given")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    blocks = fp8_blocks(q.shape[-1], causal, q.shape[1])
    quantized = []
    for name, values, descale, rows in (("q", q, q_descale, blocks.q), ("k", k, k_descale, blocks.kv),
                                        ("v", v, v_descale, blocks.kv)):
        if not isinstance(descale, torch.Tensor):
            raise TypeError(
                f"{name}_descale must be a float32 tensor (one per tensor, or one per {rows} rows of each "
                f"head) when any descale is given, got {type(descale).__name__}"
            )
        quantized.append(Fp8Tensor(values, descale, None if descale.dim() == 0 else rows, False))
    return flash_attn_fp8_quantized(*quantized, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse)


def flash_attn_forward_into(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> None:
    """``flash_attn_func`` writing into preallocated ``out`` (like q, contiguous) and ``lse``
    (float32, contiguous (batch, heads, seqlen_q), or None to skip it): for CUDA graphs and
    buffer reuse. Under torch.compile the call is one node of the graph, an op declaring
    that it writes ``out`` and ``lse`` (flash4/custom_ops.py). Forward only."""
    if torch.compiler.is_compiling():
        # The tensors' checks (their addresses among them, which tracing does not know) run
        # in the op, before its launch.
        refuse_forward_into_grad(q, k, v)
        compiled_forward_into(q, k, v, out, lse, softmax_scale, causal)
        return
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    refuse_forward_into_grad(q, k, v)
    check_out_buffers(q, problem, out, lse)
    launch_forward(q, k, v, out, lse, problem)


def refuse_forward_into_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``flash_attn_forward_into`` writes into the caller's buffers, outside autograd."""
    refuse_grad(
        "flash_attn_forward_into",
        "use flash_attn_func for gradients, or call it under torch.no_grad() or with detached tensors",
        q, k, v,
    )
