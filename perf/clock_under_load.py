"""TFLOP/s per clock: each provider run back to back for a few seconds on one protocol shape
while nvidia-smi samples the SM clock and the power draw, beside a bf16 matmul (the
ceiling's GEMM) timed the same way.

    python3 perf/clock_under_load.py [--hdim 64 128 256] [--seqlen 16384] [--causal no]
                                     [--pass fwd bwd] [--seconds 3] [--out probe.json]

The H200 holds its 700 W limit by lowering the SM clock, so a kernel that spends more
energy per FLOP (the softmax's exponentials and conversions beside the tensor cores) runs
at a lower clock than a GEMM. TFLOP/s divided by the clock separates the kernel's work per
clock from the clock the power limit leaves it; the tensor cores' share, that rate over
TENSOR_FLOPS_PER_CLOCK_PER_SM x SMs, says how much of the GEMM's per-clock rate a kernel
reaches and so what TFLOP/s a target asks at the clock the kernel gets.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from flash4 import bench
from flash4.machine import gpu_state

# Dense bf16 wgmma on one Hopper SM: 1024 multiply-adds a clock (989 TFLOP/s on an H100
# SXM's 132 SMs at 1830 MHz).
TENSOR_FLOPS_PER_CLOCK_PER_SM = 4096
# nvidia-smi's sampling period; it reads the clock and power the driver last recorded.
SAMPLE_MS = 50
# Back-to-back calls before a window's clock samples count: the clock settles in well
# under a second at the power limit.
SETTLE_S = 1.0
GEMM_SIZE = bench.CEILING_GEMM_SIZE


class ClockSampler:
    """nvidia-smi streaming ``clocks.sm,power.draw`` every SAMPLE_MS while open."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._process = subprocess.Popen(
            ["nvidia-smi", "--id=0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             f"-lms={SAMPLE_MS}"],
            stdout=subprocess.PIPE, text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.counting = False

    def _read(self) -> None:
        for line in self._process.stdout:  # type: ignore[union-attr]
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:
                continue
            if self.counting:
                self.samples.append((clock, power))

    def close(self) -> None:
        self._process.terminate()
        self._process.wait()


def run_window(call: Callable[[], Any], seconds: float, sampler: ClockSampler) -> dict[str, float]:
    """``call`` back to back: SETTLE_S unsampled, then ``seconds`` sampled and timed."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        call()
        torch.cuda.synchronize()
    sampler.samples.clear()
    sampler.counting = True
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    started = time.monotonic()
    start.record()
    while time.monotonic() - started < seconds:
        for _ in range(4):  # a few calls per host check, so the queue never drains
            call()
        calls += 4
    stop.record()
    torch.cuda.synchronize()
    sampler.counting = False
    clocks = [c for c, _ in sampler.samples]
    powers = [p for _, p in sampler.samples]
    return {"ms_per_call": start.elapsed_time(stop) / calls, "calls": calls, "samples": len(clocks),
            "sm_clock_mhz": statistics.median(clocks) if clocks else math.nan,
            "power_w": statistics.median(powers) if powers else math.nan}


def describe(flops: float, window: dict[str, float], sms: int) -> dict[str, float]:
    tflops = flops / (window["ms_per_call"] * 1e-3) / 1e12
    per_ghz = tflops / (window["sm_clock_mhz"] / 1000)
    peak_per_ghz = TENSOR_FLOPS_PER_CLOCK_PER_SM * sms / 1e3
    return {**window, "tflops": round(tflops, 1), "tflops_per_ghz": round(per_ghz, 1),
            "tensor_share": round(per_ghz / peak_per_ghz, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    parser.add_argument("--pass", dest="passes", nargs="+", choices=("fwd", "bwd"), default=["fwd"])
    parser.add_argument("--peers", nargs="+", default=["sdpa-cudnn", "fa4"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    causal = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    before = gpu_state()
    sampler = ClockSampler()
    records: list[dict[str, Any]] = []

    def keep(record: dict[str, Any]) -> None:
        records.append(record)
        print({k: v for k, v in record.items() if k not in ("calls", "samples")}, flush=True)
        if args.out is not None:
            bench.write_probe_json(args.out, records, sms=sms, seconds=args.seconds, before=before)

    a = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_SIZE, GEMM_SIZE, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.matmul(a, b)  # noqa: E731
    # The GPU warms to its steady temperature first, so the first provider is not favoured.
    run_window(gemm, args.seconds, sampler)
    keep({"provider": "bf16 matmul", "shape": f"{GEMM_SIZE}^3",
          **describe(2 * GEMM_SIZE**3, run_window(gemm, args.seconds, sampler), sms)})
    try:
        for shape in bench.protocol_shapes(args.hdim, args.seqlen, causal, args.passes):
            q = torch.randn((shape.batch, shape.seqlen, shape.heads, shape.head_dim), dtype=torch.bfloat16,
                            device="cuda")
            k, v = (torch.randn_like(q) for _ in range(2))
            scale = 1.0 / math.sqrt(shape.head_dim)
            table = bench.PASS_PROVIDERS[shape.pass_]
            for name in (bench.FLASH4, *args.peers):
                try:
                    call, _ = table[name](q, k, v, shape.causal, scale)
                    call()
                    torch.cuda.synchronize()
                    window = run_window(call, args.seconds, sampler)
                except Exception as exc:  # a peer that cannot run is data
                    keep({"provider": name, "shape": shape.label(), "error": f"{type(exc).__name__}: {exc}"[:300]})
                    continue
                keep({"provider": name, "shape": shape.label(), **describe(shape.flops, window, sms)})
            keep({"provider": "bf16 matmul", "shape": f"{GEMM_SIZE}^3 after {shape.label()}",
                  **describe(2 * GEMM_SIZE**3, run_window(gemm, args.seconds, sampler), sms)})
            del q, k, v
            torch.cuda.empty_cache()
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
