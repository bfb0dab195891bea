"""Run flash4's forward and its peers' (flash-attn-4, and torch SDPA's cuDNN backend) once
each on one protocol shape, for a profiler; with ``--pass bwd``, their backward passes (the
forward runs once beforehand, outside the profiled range); with ``--pass fp8``, flash4's FP8
kernel and cuDNN's FP8 attention on inputs quantized beforehand (the bench's providers); with
``--pass quantize``, flash_attn_fp8's quantization kernels (Q blockwise, V into the FP8
kernel's layout) beside a plain copy of as many bytes, the bandwidth they could reach.

    ncu --clock-control none -k regex:Forward --section SpeedOfLight python perf/profile_once.py --hdim 128 --seqlen 1024
    ncu --clock-control none -k regex:Backward --section SpeedOfLight python perf/profile_once.py --pass bwd
    ncu --clock-control none -k regex:'Sm90ForwardKernel|cudnn' --set full python perf/profile_once.py --hdim 64 --seqlen 512
    ncu --clock-control none -k regex:'Sm90Fp8|cudnn' --set full python perf/profile_once.py --pass fp8 --seqlen 1024
    ncu --clock-control none -k regex:'Quantize|copy' --set full python perf/profile_once.py --pass quantize

Autograd runs the backward on a thread of its own, so NVTX ranges do not reach its kernels:
pick kernels by name (``-k``).

``perf/ncu_compare.py`` reads such a report's exported pages and sets the two kernels side by
side.

Each provider is warmed up (compiled) first, so the profiler sees steady-state launches.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

import flash4

TOKENS, HIDDEN = 16384, 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--pass", dest="which", choices=("fwd", "bwd", "fp8", "quantize"), default="fwd")
    parser.add_argument("--group", type=int, default=1, help="query heads per kv head (GQA/MQA)")
    args = parser.parse_args()
    if args.which == "fp8":
        profile(fp8_providers(args.hdim, args.seqlen, args.causal))
        return
    if args.which == "quantize":
        profile(quantize_providers(args.hdim, args.seqlen, args.causal))
        return
    batch, heads = TOKENS // args.seqlen, HIDDEN // args.hdim
    q, k, v = (torch.randn(batch, args.seqlen, heads // (args.group if i else 1), args.hdim, device="cuda",
                           dtype=torch.bfloat16, requires_grad=args.which == "bwd") for i in range(3))
    forwards = {"flash4": lambda: flash4.flash_attn_func(q, k, v, causal=args.causal)}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        forwards["fa4"] = lambda: fa4(q, k, v, causal=args.causal)
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa_cudnn():
        # SDPA takes (batch, heads, seqlen, head_dim).
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=args.causal,
                enable_gqa=args.group > 1,
            )
        return out.transpose(1, 2)

    forwards["sdpa-cudnn"] = sdpa_cudnn
    providers = forwards
    if args.which == "bwd":
        dout = torch.randn(batch, args.seqlen, heads, args.hdim, device="cuda", dtype=torch.bfloat16)

        def backward_of(forward):
            out = forward()
            out = out[0] if isinstance(out, tuple) else out
            return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

        providers = {name: backward_of(forward) for name, forward in forwards.items()}
    profile(providers)


def fp8_providers(head_dim: int, seqlen: int, causal: bool) -> dict[str, Callable[[], object]]:
    """flash4's FP8 kernel and cuDNN's FP8 attention, as ``python -m flash4 bench --pass
    fp8`` times them, on one protocol shape."""
    from flash4 import bench

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return {
        name: bench.FP8_PROVIDERS[name](q, k, v, causal, head_dim**-0.5)[0] for name in (bench.FLASH4, "cudnn-fp8")
    }


def quantize_providers(head_dim: int, seqlen: int, causal: bool) -> dict[str, Callable[[], object]]:
    """Q quantized blockwise and V into the FP8 kernel's layout, as flash_attn_fp8 does them,
    and a copy of Q into a tensor like it: the same bytes read, twice the bytes written."""
    from flash4.fp8 import fp8_blocks
    from flash4.quantize import quantize_fp8, quantize_fp8_transposed_v

    batch, heads = TOKENS // seqlen, HIDDEN // head_dim
    q, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    copy = torch.empty_like(q)
    rows = fp8_blocks(head_dim, causal, seqlen).q
    return {
        "quantize Q": lambda: quantize_fp8(q, rows),
        "quantize V into layout": lambda: quantize_fp8_transposed_v(v),
        "copy": lambda: copy.copy_(q),
    }


def profile(providers: dict[str, Callable[[], object]]) -> None:
    """Each provider warmed up, then run once inside an NVTX range of its name."""
    for name, run in providers.items():
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
