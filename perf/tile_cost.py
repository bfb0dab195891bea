"""Split a forward kernel's time into a fixed cost per query tile and a cost per key block.

One query tile per (batch, head) (seqlen_q at most the row's tile_m) and a growing
seqlen_k: the time per wave of CTAs grows linearly in the number of key blocks; the
intercept is what every tile pays once (the CTA's or the persistent loop's turn, the Q
load, the pipeline's fill and drain, the epilogue). Same tensors for flash4's bf16 kernel,
flash-attn-4 and flash4's FP8 kernel (quantized beforehand, as the bench times it), in one
process, the providers taking turns.

At the protocol's fixed token count the rows at 512 keys pay this intercept once per four
key blocks: it is what perf/short_row_ceiling.py calls the fixed cost, measured per tile.
But the regimes differ. Here every K and V byte feeds one tile (one query tile per head),
so the cost per block is K's and V's bytes streamed from DRAM: the rate printed beside
each fit (H100, 2026-12-05, against the 3.02 TB/s of a copy there: bf16 89% and FP8 76%
at head dim 64, 101% and 93% at 128). On the bench's rows a head's K and V serve three or
four tiles, the later ones from L2, so this probe's per-block ratios are byte ratios, not
the bench's, and its intercepts are fixed costs while streaming; perf/short_row_ceiling.py
fits the bench's own numbers.

    python perf/tile_cost.py [--hdim 128] [--seqlen-q 128] [--out tile-cost.json]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from flash4 import bench

sys.path.insert(0, str(Path(__file__).parent))
from short_row_ceiling import fit_line  # noqa: E402

SEQLEN_KS = (128, 256, 512, 1024, 2048, 4096)
# Key columns a block of the fit counts: the bf16 rows' tile_n at head dims 64 and 128.
BLOCK_KEYS = 128
PROVIDERS = (("flash4-bf16", "fwd", "flash4"), ("fa4", "fwd", "fa4"), ("flash4-fp8", "fp8", "flash4"))
# Bytes of a K or V element each pass's kernel reads.
ELEMENT_BYTES = {"fwd": 2, "fp8": 1}


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=66)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlen-q", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    waves = args.batch * args.heads / sms
    scale = 1.0 / math.sqrt(args.hdim)
    times: dict[str, list[float]] = {name: [] for name, _, _ in PROVIDERS}
    errors: dict[str, str] = {}
    for seqlen_k in SEQLEN_KS:
        q = torch.randn(args.batch, args.seqlen_q, args.heads, args.hdim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(args.batch, seqlen_k, args.heads, args.hdim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        calls: dict[str, Callable[[], Any]] = {}
        for name, pass_, provider in PROVIDERS:
            if name in errors:
                continue
            try:
                calls[name] = bench.PASS_PROVIDERS[pass_][provider](q, k, v, args.causal, scale)[0]
                calls[name]()
            except Exception as exc:  # a peer missing or a shape it refuses: reported, not timed
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
                calls.pop(name, None)
        rounds: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                rounds[name].append(triton.testing.do_bench(call, return_mode="median") * 1e3)
        row = []
        for name, us in rounds.items():
            best = min(us)
            times[name].append(best / waves)
            row.append(f"{name} {best:8.1f} us")
        print(f"seqlen_k {seqlen_k:5d}: " + "  ".join(row), flush=True)
    blocks = [s / BLOCK_KEYS for s in SEQLEN_KS]
    fits = {}
    for name, ys in times.items():
        if len(ys) != len(blocks):
            continue
        a, b, worst = fit_line(blocks, ys)
        # A wave's tiles each read one block of K and one of V that no other tile reads.
        pass_ = next(p for n, p, _ in PROVIDERS if n == name)
        kv_gb_per_s = sms * 2 * BLOCK_KEYS * args.hdim * ELEMENT_BYTES[pass_] / (b * 1e3)
        fits[name] = {"fixed_us_per_wave": a, "us_per_block_per_wave": b, "largest_residual": worst,
                      "us_per_wave": ys, "kv_gb_per_s_per_block": kv_gb_per_s}
        print(f"{name}: per wave of tiles {a:.2f} us fixed + {b:.3f} us per {BLOCK_KEYS}-key block "
              f"(residuals within {worst:.1%}; K and V stream at {kv_gb_per_s:.0f} GB/s)")
    for name, error in errors.items():
        print(f"{name}: not timed ({error})")
    if args.out:
        bench.write_probe_json(args.out, [fits], args=vars(args) | {"out": str(args.out)}, waves=waves,
                               seqlen_ks=SEQLEN_KS, errors=errors)


if __name__ == "__main__":
    main()
