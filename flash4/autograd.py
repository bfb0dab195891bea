"""flash4's attention as a ``torch.autograd.Function`` (eager calls; torch.compile traces
the custom ops of flash4/custom_ops.py instead).

The forward keeps what the backward needs: q, k, v, the output and the LSE (always
computed here, returned only when asked for). The backward runs the kernels of
flash4/backward.py; the LSE output is not differentiable.
"""

from __future__ import annotations

from typing import Any

import torch

from flash4.backward import attention_backward
from flash4.checks import AttentionProblem, tma_misaligned
from flash4.forward import run_forward


def upstream_gradient(dout: torch.Tensor) -> torch.Tensor:
    """dO as the kernels read it, by TMA: the upstream gradient may be any view (an expanded
    scalar's gradient has stride 0), so anything but a dense aligned tensor is copied."""
    if not dout.is_contiguous() or tma_misaligned(dout):
        return dout.clone(memory_format=torch.contiguous_format)
    return dout


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        problem: AttentionProblem,
        return_lse: bool,
        deterministic: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, lse = run_forward(q, k, v, problem, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return (out, lse) if return_lse else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, *_lse_grad: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        problem = ctx.problem
        dq, dk, dv = attention_backward(
            q, k, v, out, upstream_gradient(dout), lse, problem.softmax_scale, problem.causal,
            deterministic=ctx.deterministic,
        )
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None, None)
