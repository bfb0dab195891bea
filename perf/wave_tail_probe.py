"""What the last, partial wave of tiles costs: each protocol shape beside one of about the
same size whose tiles fill whole waves of the GPU's SMs (one CTA per SM: the kernels' shared
memory allows no second). Unmasked, every tile is as long as the others, so W waves and a
fraction take as long as W + 1 full ones; the TFLOP/s of the two shapes differ by what the
idle SMs of the last wave cost. The backward's tiles are its key-block CTAs; the forward's
its query blocks, shared out by a persistent grid or launched one per CTA.

    python3 perf/wave_tail_probe.py [--pass bwd] [--hdim 64 128 256] [--rounds 3] [--out probe.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from flash4 import bench
from flash4.backward import backward_config
from flash4.dispatch import select
from flash4.devices import device_sms


def tile_rows(shape: bench.Shape) -> int:
    """The rows of the sequence one tile covers: the backward's keys per CTA, the forward's
    queries per tile (the selector's bf16 row for this shape)."""
    if shape.backward:
        return backward_config(shape.head_dim, shape.causal, seqlen_k=shape.seqlen).tile_n
    return select("sm_90a", "bfloat16", shape.head_dim, shape.causal, shape.seqlen).config.tile_m


def tiles(shape: bench.Shape) -> int:
    return shape.batch * shape.heads * -(-shape.seqlen // tile_rows(shape))


def whole_waves_shape(shape: bench.Shape, sms: int) -> bench.Shape:
    """``shape`` with heads and seqlen changed (batch 1, about as many tokens per head
    times heads) so that heads x tiles per head is a multiple of ``sms``."""
    rows = tile_rows(shape)
    waves = tiles(shape) // sms
    for heads in range(shape.heads, 0, -1):
        if (waves * sms) % heads == 0:
            return dataclasses.replace(shape, batch=1, seqlen=waves * sms // heads * rows, heads=heads)
    raise ValueError(f"no whole-wave shape for {shape}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sms = device_sms(torch.cuda.current_device())
    providers = {name: bench.PASS_PROVIDERS[args.pass_][name] for name in (bench.FLASH4, "fa4")}
    timer = bench.make_timer(quick=False)
    records = []
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, (False,), passes=(args.pass_,)):
        for probe in (shape, whole_waves_shape(shape, sms)):
            ctas = tiles(probe)
            record = bench.measure_shape(probe, timer, providers=providers, rounds=args.rounds)
            fastest = {
                name: probe.flops / min(m.ms_rounds) / 1e9 for name, m in record.results.items() if m.ms_rounds
            }
            cells = " | ".join(f"{name} {tflops:.0f}" for name, tflops in fastest.items())
            print(f"{probe.label()} ctas {ctas} = {ctas / sms:.2f} waves (fastest rounds): {cells}", flush=True)
            records.append({**dataclasses.asdict(record), "ctas": ctas, "waves": ctas / sms})
            if args.out:
                bench.write_probe_json(args.out, records)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
