"""Where flash4's host time per call goes, at the tiny shape of perf/host_overhead.py.

    python perf/host_breakdown.py

Times each step of ``flash_attn_func`` on its own, 10000 times, and prints microseconds.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

import flash4
from flash4 import interface
from flash4.checks import check_attention_args

BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 128, 16, 64
CALLS = 10000


def per_call_us(fn: Callable[[], object]) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    q, k, v = (torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flash4.flash_attn_func(q, k, v)
    problem = check_attention_args(q, k, v, None, False)
    kernel = interface._kernel(0, problem, False)
    out = torch.empty_like(q)
    steps = {
        "flash_attn_func": lambda: flash4.flash_attn_func(q, k, v),
        "check_attention_args": lambda: check_attention_args(q, k, v, None, False),
        "torch.empty(out)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "q.device": lambda: q.device,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "interface._kernel lookup": lambda: interface._kernel(0, problem, False),
        "device_sms": lambda: interface.device_sms(0),
        "kernel call (same out)": lambda: kernel(q, k, v, out, None, 0.18, 132),
        "kernel call (fresh out)": lambda: kernel(q, k, v, torch.empty_like(q), None, 0.18, 132),
        "torch.empty_like alone": lambda: torch.empty_like(q),
        "torch.empty_like contiguous": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
    }
    for name, fn in steps.items():
        print(f"{name:32s} {per_call_us(fn):7.2f} us", flush=True)


if __name__ == "__main__":
    main()
