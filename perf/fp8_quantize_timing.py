"""Where flash_attn_fp8's time goes: each stage of the call timed alone on protocol shapes.

    python perf/fp8_quantize_timing.py [--hdim 64 128 256] [--seqlen 1024 16384] [--causal] [--quantize-only]

Stages: Q and K quantized blockwise (kernels/quantize_fp8.py), Q also rotated first (the
Hadamard rotation in the same kernel), V quantized per tensor into the kernel's layout (its
partial maxima, then the layout kernel), the FP8 attention on those inputs, and the whole
call, without and with the rotation; beside them the bandwidth each quantization stage reaches (bytes
read once and written once over its time; V's stage reads V twice) and what a bf16 flash4
forward takes. A stage far below a copy's rate is where the call loses its time.
"""

from __future__ import annotations

import argparse

import torch

from flash4 import bench
from flash4.fp8 import flash_attn_fp8, flash_attn_fp8_quantized, fp8_blocks
from flash4.interface import flash_attn_func
from flash4.quantize import quantize_fp8, quantize_fp8_transposed_v


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--quantize-only", action="store_true",
                        help="only the quantization stages (no attention kernel to compile)")
    args = parser.parse_args()
    timer = bench.make_timer(quick=False)
    for head_dim in args.hdim:
        for seqlen in args.seqlen:
            batch, heads = bench.TOKENS // seqlen, bench.HIDDEN // head_dim
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            blocks = fp8_blocks(head_dim, args.causal, seqlen)
            q8, k8, vt = quantize_fp8(q, blocks.q), quantize_fp8(k, blocks.kv), quantize_fp8_transposed_v(v)
            stages = {
                "quantize Q": (lambda: quantize_fp8(q, blocks.q), q.numel() * 3),
                "quantize K": (lambda: quantize_fp8(k, blocks.kv), k.numel() * 3),
                "quantize Q rotated": (lambda: quantize_fp8(q, blocks.q, True), q.numel() * 3),
                "quantize V into layout": (lambda: quantize_fp8_transposed_v(v), v.numel() * 5),
                "FP8 attention": (lambda: flash_attn_fp8_quantized(q8, k8, vt, causal=args.causal), None),
                "flash_attn_fp8 (all)": (lambda: flash_attn_fp8(q, k, v, causal=args.causal), None),
                "flash_attn_fp8 hadamard": (lambda: flash_attn_fp8(q, k, v, causal=args.causal, hadamard=True), None),
                "bf16 forward": (lambda: flash_attn_func(q, k, v, causal=args.causal), None),
            }
            if args.quantize_only:
                stages = {name: stage for name, stage in stages.items() if stage[1] is not None}
            cells = []
            for name, (fn, moved_bytes) in stages.items():
                fn()
                torch.cuda.synchronize()
                ms = timer.milliseconds(fn)
                rate = f", {moved_bytes / ms / 1e9:.2f} TB/s" if moved_bytes else ""
                cells.append(f"{name} {ms * 1e3:.0f} us{rate}")
            mask = "causal" if args.causal else "full"
            print(f"d{head_dim} s{seqlen} {mask}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
