"""Host cost per call at a tiny shape, where the GPU work is negligible (issue 3's protocol).

    python perf/host_overhead.py [--calls 1000] [--breakdown]

Wall time of ``calls`` back-to-back calls followed by one synchronize, divided by calls:
what a framework pays per attention call when the kernel itself takes a few microseconds.
Shape: batch 1, seqlen 128, 16 heads, head dim 64, bf16. ``--breakdown`` times each step
of ``flash_attn_func`` on its own instead.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

import flash4
from flash4 import interface
from flash4.checks import check_attention_args
from flash4.interface import _KERNELS, LOG2_E

BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 128, 16, 64


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def breakdown(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: int) -> None:
    """Microseconds of each step of ``flash_attn_func``, timed alone."""
    problem = check_attention_args(q, k, v, None, False)
    kernel, _ = interface._kernel(q.device.index, problem, False)
    out = torch.empty_like(q)
    sms = interface.device_sms(q.device.index)
    steps: dict[str, Callable[[], object]] = {
        "flash_attn_func": lambda: flash4.flash_attn_func(q, k, v),
        "check_attention_args": lambda: check_attention_args(q, k, v, None, False),
        "torch.empty_like(q) for out": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "torch.empty(q.shape, ...)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "interface._kernel lookup": lambda: interface._kernel(q.device.index, problem, False),
        "kernel call (same out)": lambda: kernel(q, k, v, out, None, 0.18, sms, None),
        "kernel call (fresh out)": lambda: kernel(q, k, v, torch.empty_like(q), None, 0.18, sms, None),
    }
    for name, fn in steps.items():
        print(f"{name:32s} {per_call_us(fn, calls):7.2f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    q, k, v = (torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flash4.flash_attn_func(q, k, v)
    if args.breakdown:
        breakdown(q, k, v, args.calls)
        return
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.empty_like(q)
    kernel, _ = next(iter(_KERNELS.values()))
    scale_log2 = HEAD_DIM**-0.5 * LOG2_E
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    providers: dict[str, Callable[[], object]] = {
        "flash4": lambda: flash4.flash_attn_func(q, k, v),
        # The compiled kernel alone (TVM FFI call and launch): the floor under flash4's checks.
        "flash4 compiled kernel only": lambda: kernel(q, k, v, out, None, scale_log2, sms, None),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
    }
    try:
        from flash_attn.cute import flash_attn_func as fa4

        providers["fa4"] = lambda: fa4(q, k, v)
    except ImportError:
        pass
    for name, fn in providers.items():
        print(f"{name:28s} {per_call_us(fn, args.calls):7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
