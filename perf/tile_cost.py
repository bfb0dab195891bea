"""Split a forward kernel's time into a fixed cost per query tile and a cost per key block.

One query tile per (batch, head) (seqlen_q = 128) and a growing seqlen_k: the time per wave
of CTAs grows linearly in the number of key blocks; the intercept is what every tile pays
once (launch of the CTA, barrier setup, Q load, first block, epilogue). Same tensors for
flash4 and flash-attn-4, in one process.

    python perf/tile_cost.py [--hdim 128]
"""

from __future__ import annotations

import argparse

import torch

import flash4

SEQLEN_Q = 128
SEQLEN_KS = (128, 256, 512, 1024, 2048, 4096)


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=66)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    providers = {"flash4": flash4.flash_attn_func}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        providers["fa4"] = fa4
    except ImportError:
        pass
    waves = args.batch * args.heads / torch.cuda.get_device_properties(0).multi_processor_count
    times: dict[str, list[float]] = {name: [] for name in providers}
    for seqlen_k in SEQLEN_KS:
        q = torch.randn(args.batch, SEQLEN_Q, args.heads, args.hdim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(args.batch, seqlen_k, args.heads, args.hdim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        row = []
        for name, fn in providers.items():
            ms = triton.testing.do_bench(lambda: fn(q, k, v), return_mode="median")
            times[name].append(ms * 1e3 / waves)
            row.append(f"{name} {ms * 1e3:8.1f} us")
        print(f"seqlen_k {seqlen_k:5d}: " + "  ".join(row), flush=True)
    blocks = [s / 128 for s in SEQLEN_KS]
    for name, ys in times.items():
        a, b = fit(blocks, ys)
        print(f"{name}: per wave of tiles {a:.2f} us fixed + {b:.3f} us per 128-key block")


if __name__ == "__main__":
    main()
