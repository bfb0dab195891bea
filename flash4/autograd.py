"""flash4's attention as a ``torch.autograd.Function``.

The forward keeps what the backward needs: q, k, v, the output and the LSE (always
computed here, returned only when asked for). The backward runs the kernels of
flash4/backward.py; the LSE output is not differentiable.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from flash4.backward import attention_backward
from flash4.checks import AttentionProblem, tma_misaligned

# Runs the forward kernel: launch(q, k, v, out, lse, problem).
ForwardLaunch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionProblem], None]


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
        launch: ForwardLaunch,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((problem.batch, problem.heads, problem.seqlen_q), dtype=torch.float32, device=q.device)
        launch(q, k, v, out, lse, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return (out, lse) if return_lse else out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, *_lse_grad: Any) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        # The kernels read dO by TMA: the upstream gradient may be any view (an expanded
        # scalar's gradient has stride 0), so anything but a dense aligned tensor is copied.
        if not dout.is_contiguous() or tma_misaligned(dout):
            dout = dout.clone(memory_format=torch.contiguous_format)
        problem = ctx.problem
        dq, dk, dv = attention_backward(
            q, k, v, out, dout, lse, problem.softmax_scale, problem.causal, deterministic=ctx.deterministic
        )
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None, None, None)
