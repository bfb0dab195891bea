"""Benchmark adapters for peers outside torch, kept out of the flash4 package.

``flash4.bench`` loads this module when it runs from a checkout; each provider turns
(q, k, v, causal, scale) in (batch, seqlen, heads, head_dim) layout into a no-argument call
to time and a function that brings its result back to that layout.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    # Imported when measured, and only if installed: an absent peer is a recorded error.
    from flash_attn.cute import flash_attn_func

    # 4.0.0b36 returns (out, lse); other versions may return out alone.
    return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)), (
        lambda out: out[0] if isinstance(out, tuple) else out
    )


def _fa4_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    from flash_attn.cute import flash_attn_func

    from flash4.bench import autograd_backward

    def forward(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
        out = flash_attn_func(q_, k_, v_, softmax_scale=scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out

    return autograd_backward(forward, q, k, v)


def _cudnn_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN's FP8 attention through nvidia-cudnn-frontend (`import cudnn`): e4m3 Q, K, V
    with one descale per tensor, P scaled onto e4m3's range, and an e4m3 O (the only output
    type it offers on Hopper), scaled onto that range by the largest |V| (|O| cannot exceed
    it). The timed call is the graph's execution; its O comes back dequantized."""
    import cudnn

    from flash4.quantize import FP8_MAX, quantize_fp8

    q8, k8, v8 = (quantize_fp8(t, None) for t in (q, k, v))
    # cuDNN's tensors are (batch, heads, seqlen, head_dim): transposed views of the same memory.
    qt, kt, vt = (t.values.transpose(1, 2) for t in (q8, k8, v8))
    out = torch.empty_like(q8.values).transpose(1, 2)
    scale_o = float(FP8_MAX / (v8.values.float().abs().amax() * v8.descale).clamp_min(1e-30))
    scalars = {
        "descale_q": q8.descale, "descale_k": k8.descale, "descale_v": v8.descale,
        "descale_s": torch.tensor(1.0 / FP8_MAX), "scale_s": torch.tensor(FP8_MAX), "scale_o": torch.tensor(scale_o),
    }
    scalars = {name: value.reshape(1, 1, 1, 1).float().to(q.device) for name, value in scalars.items()}
    amax_s, amax_o = (torch.empty(1, 1, 1, 1, device=q.device) for _ in range(2))

    def build(stats_kwargs: dict[str, Any]):
        graph = cudnn.pygraph(
            io_data_type=cudnn.data_type.FP8_E4M3,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
        )
        inputs = {name: graph.tensor_like(data) for name, data in (("q", qt), ("k", kt), ("v", vt), *scalars.items())}
        o, _, amax_s_t, amax_o_t = graph.sdpa_fp8(
            **inputs, attn_scale=scale, use_causal_mask=causal, **stats_kwargs
        )
        o.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(cudnn.data_type.FP8_E4M3)
        for amax in (amax_s_t, amax_o_t):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
        graph.build()
        tensors = {inputs[name]: data for name, data in (("q", qt), ("k", kt), ("v", vt), *scalars.items())}
        tensors.update({o: out, amax_s_t: amax_s, amax_o_t: amax_o})
        return graph, tensors

    # Frontend versions name the "no softmax statistics" switch differently.
    try:
        graph, tensors = build({"generate_stats": False})
    except Exception:
        graph, tensors = build({"is_inference": True})
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)

    def run() -> torch.Tensor:
        graph.execute(tensors, workspace)
        return out

    return run, (lambda o: o.transpose(1, 2).float() / scale_o)


PROVIDERS: dict[str, Callable[..., Any]] = {"fa4": _fa4}
BACKWARD_PROVIDERS: dict[str, Callable[..., Any]] = {"fa4": _fa4_backward}
FP8_PROVIDERS: dict[str, Callable[..., Any]] = {"cudnn-fp8": _cudnn_fp8}
