"""How far the FP8 forward can outrun the 16-bit one on short sequences: a two-term fit.

    python perf/short_row_ceiling.py perf/results/h100/2026-12-05-issue5-bench-fp8-int8-qk.json
                                     [--fast flash4] [--slow flash4-bf16]

At the protocol's fixed token count (16k) every seqlen launches the same number of query
tiles, so a kernel's time is, to first order, a fixed cost per call (each tile's pipeline
fill and drain, its epilogue, the grid's tail: the same count at every seqlen) plus a cost
per FLOP: ``ms = fixed + per_flop * flops``. Fitted by least squares over a head dim's and
mask's short seqlens (``--fit-seqlens``; long rows run at the power limit's lower clocks) (an FP8 bench JSON, ``python -m flash4 bench --pass fp8``), for the FP8
kernel (``--fast``) and the 16-bit one (``--slow``, run in the same bench), it prints both
terms, how well the line fits, the measured ratio slow / fast per seqlen, and the ratio
the FP8 kernel would reach with its own fixed cost and a per-FLOP cost exactly half the
16-bit kernel's (the FP8 tensor cores' rate over the 16-bit ones'): its ceiling for this
design, where any cut to the fixed cost the two kernels share moves both.

Then the bytes: each kernel's least DRAM traffic (Q, K and V read once, O written once)
over its time, against the copy rate the bench measured. A kernel near that rate is bound
by DRAM, and where both are, the ratio of their times cannot pass the ratio of their bytes
(8 / 5 = 1.6 for e4m3 in and bf16 out against bf16 in and out).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# FP8 wgmma runs at twice the 16-bit rate on Hopper: the most an FP8 kernel's per-FLOP
# cost can shrink.
TENSOR_RATE_RATIO = 2.0


# Bytes per element of Q (and of K, V, O) that must cross DRAM at least: each tensor once,
# since the other query tiles of a head find its K and V in L2.
FAST_IN_BYTES, SLOW_IN_BYTES, OUT_BYTES = 1, 2, 2


def least_bytes(shape: dict, in_bytes: int) -> float:
    """Q, K and V read once and O (16-bit) written once, for one bench shape."""
    q_elements = shape["batch"] * shape["seqlen"] * shape["heads"] * shape["head_dim"]
    kv_elements = q_elements / shape.get("group", 1)
    return q_elements * (in_bytes + OUT_BYTES) + 2 * kv_elements * in_bytes


def dram_rates(report: dict, fast: str, slow: str) -> list[tuple[dict, float, float]]:
    """(shape, fast's bytes per second, slow's) for every record timing both."""
    rates = []
    for record in report["records"]:
        shape, results = record["shape"], record["results"]
        if fast in results and slow in results and results[fast].get("ms") and results[slow].get("ms"):
            rates.append((shape, least_bytes(shape, FAST_IN_BYTES) / (results[fast]["ms"] * 1e-3),
                          least_bytes(shape, SLOW_IN_BYTES) / (results[slow]["ms"] * 1e-3)))
    return rates


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares intercept and slope of ys over xs, and the largest relative residual."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    intercept = mean_y - slope * mean_x
    worst = max(abs(intercept + slope * x - y) / y for x, y in zip(xs, ys))
    return intercept, slope, worst


@dataclass(frozen=True)
class Fit:
    """One head dim and mask: each kernel's fitted line and, per seqlen, the measured ratio
    slow / fast and the ceiling."""

    head_dim: int
    causal: bool
    slow: tuple[float, float, float]  # fixed ms, ms per GFLOP, largest relative residual
    fast: tuple[float, float, float]
    ratios: tuple[tuple[int, float, float], ...]  # (seqlen, measured, ceiling)


def fit_report(report: dict, fast: str, slow: str, fit_seqlens: list[int]) -> list[Fit]:
    """The fits of a bench report's records, by head dim and mask."""
    groups: dict[tuple[int, bool], list[tuple[int, float, float, float]]] = defaultdict(list)
    for record in report["records"]:
        shape, results = record["shape"], record["results"]
        if fast not in results or slow not in results:
            continue
        groups[(shape["head_dim"], shape["causal"])].append(
            (shape["seqlen"], record["flops"] / 1e9, results[fast]["ms"], results[slow]["ms"])
        )
    fits = []
    for (head_dim, causal), rows in sorted(groups.items()):
        rows.sort()
        fitted = [r for r in rows if r[0] in fit_seqlens]
        gflops = [r[1] for r in fitted]
        fast_line = fit_line(gflops, [r[2] for r in fitted])
        slow_line = fit_line(gflops, [r[3] for r in fitted])
        slow_fixed, slow_slope, _ = slow_line
        ratios = tuple(
            (seqlen, slow_ms / fast_ms,
             (slow_fixed + slow_slope * gflop) / (fast_line[0] + slow_slope / TENSOR_RATE_RATIO * gflop))
            for seqlen, gflop, fast_ms, slow_ms in rows
        )
        fits.append(Fit(head_dim, causal, slow_line, fast_line, ratios))
    return fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json", type=Path)
    parser.add_argument("--fast", default="flash4", help="the FP8 provider (default: flash4)")
    parser.add_argument("--slow", default="flash4-bf16", help="the 16-bit provider (default: flash4-bf16)")
    parser.add_argument("--fit-seqlens", type=int, nargs="+", default=[512, 1024, 2048],
                        help="the seqlens the lines are fitted on (default: the short ones, where the clock "
                             "holds; at the power limit long rows run at lower clocks, bf16 more than FP8)")
    args = parser.parse_args()
    report = json.loads(args.bench_json.read_text())
    print(f"{report.get('gpu')} {report.get('date')}: {args.slow} / {args.fast}, fitted ms = fixed + per_gflop * GFLOP")
    for fit in fit_report(report, args.fast, args.slow, args.fit_seqlens):
        (slow_fixed, slow_slope, slow_res), (fast_fixed, fast_slope, fast_res) = fit.slow, fit.fast
        mask = "causal" if fit.causal else "full"
        print(
            f"\nhead dim {fit.head_dim} {mask}: fixed {slow_fixed * 1e3:.0f} / {fast_fixed * 1e3:.0f} us, per GFLOP "
            f"{slow_slope * 1e3:.2f} / {fast_slope * 1e3:.2f} us (per-FLOP speed-up {slow_slope / fast_slope:.2f}); "
            f"largest residual {slow_res:.0%} / {fast_res:.0%}"
        )
        print("  seqlen  measured  ceiling")
        for seqlen, measured, ceiling in fit.ratios:
            print(f"  {seqlen:>6}  {measured:8.2f}  {ceiling:7.2f}")
    copy = report.get("ceilings", {}).get("copy_gb_per_s")
    print(f"\nLeast DRAM bytes over time, TB/s ({args.fast} / {args.slow})"
          + (f", and as a share of the copy's {copy / 1e3:.2f} TB/s" if copy else ""))
    for shape, fast_rate, slow_rate in dram_rates(report, args.fast, args.slow):
        share = f"  {fast_rate / (copy * 1e9):4.0%} / {slow_rate / (copy * 1e9):4.0%}" if copy else ""
        mask = "causal" if shape["causal"] else "full"
        print(f"  d{shape['head_dim']:<3} {mask:6} {shape['seqlen']:>6}  {fast_rate / 1e12:5.2f} / {slow_rate / 1e12:5.2f}{share}")


if __name__ == "__main__":
    main()
