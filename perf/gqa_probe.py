"""Where the forward's time goes under GQA: flash4 and flash-attn-4 on grouped k and v,
each also on the same k and v expanded to every query head (multi-head, same FLOPs), and
flash-attn-4 with its query-head packing off. One process, interleaved rounds.

    python3 perf/gqa_probe.py --group 8 --out probe.json
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Callable

import torch

from flash4 import bench

Provider = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], bench.Prepared]


def expanded(prepare: Provider, group: int) -> Provider:
    """``prepare`` on k and v repeated to every query head: multi-head, the same FLOPs."""

    def run_on_expanded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        return prepare(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2), causal, scale)

    return run_on_expanded


def fa4_unpacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
    from flash_attn.cute import flash_attn_func

    return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, pack_gqa=False)), (
        lambda out: out[0] if isinstance(out, tuple) else out
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fa4 = bench.PROVIDERS["fa4"]
    providers = {
        "flash4": bench.PROVIDERS["flash4"],
        "flash4-mha": expanded(bench.PROVIDERS["flash4"], args.group),
        "fa4": fa4,
        "fa4-unpacked": fa4_unpacked,
        "fa4-mha": expanded(fa4, args.group),
    }
    timer = bench.make_timer(quick=False)
    records = []
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, (False, True), group=args.group):
        record = bench.measure_shape(shape, timer, providers=providers, rounds=args.rounds)
        cells = " | ".join(
            f"{name} {m.tflops:.0f}" if m.tflops else f"{name} {m.error}" for name, m in record.results.items()
        )
        print(f"{shape.label()}: {cells}", flush=True)
        records.append(dataclasses.asdict(record))
        if args.out:
            bench.write_probe_json(args.out, records)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
