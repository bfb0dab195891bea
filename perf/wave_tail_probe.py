"""What the backward's last, partial wave of CTAs costs: each protocol shape beside one of
about the same size whose grid of key-block CTAs fills whole waves of the GPU's SMs (one
CTA per SM: the main kernel's shared memory allows no second). Unmasked, every CTA walks
every query block, so a grid of W waves and a fraction takes as long as W + 1 full ones;
the TFLOP/s of the two shapes differ by what the idle SMs of the last wave cost.

    python3 perf/wave_tail_probe.py [--hdim 64 128 256] [--rounds 3] [--out probe.json]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from flash4 import bench
from flash4.backward import backward_config
from flash4.devices import device_sms


def whole_waves_shape(shape: bench.Shape, sms: int) -> bench.Shape:
    """``shape`` with heads and seqlen changed (batch 1, about as many tokens per head
    times heads) so that heads x key blocks is a multiple of ``sms``."""
    tile_n = backward_config(shape.head_dim, shape.causal, seqlen_k=shape.seqlen).tile_n
    ctas = shape.batch * shape.heads * -(-shape.seqlen // tile_n)
    waves = ctas // sms
    for heads in range(shape.heads, 0, -1):
        if (waves * sms) % heads == 0:
            return bench.Shape(batch=1, seqlen=waves * sms // heads * tile_n, heads=heads, head_dim=shape.head_dim,
                               causal=shape.causal, pass_="bwd")
    raise ValueError(f"no whole-wave shape for {shape}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sms = device_sms(torch.cuda.current_device())
    providers = {name: bench.BACKWARD_PROVIDERS[name] for name in (bench.FLASH4, "fa4")}
    timer = bench.make_timer(quick=False)
    records = []
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, (False,), passes=("bwd",)):
        for probe in (shape, whole_waves_shape(shape, sms)):
            tile_n = backward_config(probe.head_dim, False, seqlen_k=probe.seqlen).tile_n
            ctas = probe.batch * probe.heads * -(-probe.seqlen // tile_n)
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
