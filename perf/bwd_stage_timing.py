"""Where the backward's time goes: its three launches timed alone on protocol shapes.

    python perf/bwd_stage_timing.py [--hdim 64 128 256] [--seqlen 1024 4096 16384] [--causal]
                                    [--change dq_register_order=True ...] [--out x.json]

Stages: the preprocess (D, lse_log2, and the dQ accumulator zeroed unless the selector's
kernel stores each part's first contribution, ``dq_first_stores``), the main kernel, the
postprocess (dQ out of its fp32 accumulator), and the whole ``attention_backward``; beside
the two memory passes the bandwidth they reach (bytes read once and written once over
their time). The memory passes cost the same at every seqlen of the protocol (16k tokens),
the main kernel grows with it: their share is what short sequences lose. ``--change``
times a candidate instead of the selector's configuration (Sm90BackwardConfig fields).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
from pathlib import Path

import torch

from flash4 import bench, flash_attn_func
from flash4.backward import attention_backward, backward_config
from flash4.compiler import compiled_backward, compiled_backward_postprocess, compiled_backward_preprocess

FP32_BYTES = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--change", nargs="+", default=[], metavar="FIELD=VALUE",
                        help="Sm90BackwardConfig fields replaced in the selector's configuration")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the timings, written after every shape")
    args = parser.parse_args()
    change = {field: ast.literal_eval(value) for field, value in (item.split("=", 1) for item in args.change)}
    timer = bench.make_timer(quick=False)
    records: list[dict] = []
    for head_dim in args.hdim:
        for seqlen in args.seqlen:
            batch, heads = bench.TOKENS // seqlen, bench.HIDDEN // head_dim
            q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            out, lse = flash_attn_func(q, k, v, causal=args.causal, return_lse=True)
            dout = torch.randn_like(out)
            scale = head_dim ** -0.5
            # The stages alone: the main kernel without the postprocess's overlap.
            selected = dataclasses.replace(backward_config(head_dim, args.causal, seqlen_k=seqlen), **change)
            config = dataclasses.replace(selected, overlap_postprocess=False)
            padded = -(-seqlen // config.tile_m) * config.tile_m
            f32 = dict(dtype=torch.float32, device="cuda")
            delta, lse_log2 = (torch.empty(batch, heads, padded, **f32) for _ in range(2))
            dq_accum = torch.empty(batch, heads, padded * head_dim, **f32)
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            ready = torch.zeros(batch, heads, dtype=torch.int32, device="cuda")
            # dq_first_stores: a ticket counter per query block, zeroed instead of the accumulator.
            tickets = 1 if config.dq_first_stores else 0
            counters = torch.empty(batch, heads, padded // config.tile_m * tickets, dtype=torch.int32, device="cuda")
            counters = counters if tickets else None
            pre = compiled_backward_preprocess("bfloat16", head_dim, config.tile_m, dq_counters_per_block=tickets)
            main_kernel = compiled_backward(config, "bfloat16")
            post = compiled_backward_postprocess("bfloat16", config.dq_tile_geometry)
            accum_bytes = dq_accum.numel() * FP32_BYTES
            zeroed_bytes = 0 if tickets else accum_bytes
            def main_alone() -> None:
                if counters is not None:
                    # Tickets start at zero in every call (the preprocess's job): a memset
                    # of a few KB, timed with the kernel.
                    counters.zero_()
                main_kernel(q, k, v, dout, lse_log2, delta, dq_accum.view(batch, heads, padded, head_dim), dk, dv,
                            counters, None, None, scale)

            stages = {
                "preprocess": (lambda: pre(out, dout, lse, delta, lse_log2, dq_accum, ready, counters),
                               out.numel() * 4 + zeroed_bytes),
                "main": (main_alone, None),
                "postprocess": (lambda: post(dq_accum, dq, ready, 0, scale), accum_bytes + dq.numel() * 2),
                "attention_backward": (lambda: attention_backward(q, k, v, out, dout, lse, scale, args.causal,
                                                                  grads=(dq, dk, dv), config=selected), None),
            }
            cells = []
            record = dict(head_dim=head_dim, seqlen=seqlen, batch=batch, heads=heads, causal=args.causal,
                          change=change, us={})
            for name, (fn, moved_bytes) in stages.items():
                fn()
                torch.cuda.synchronize()
                ms = timer.milliseconds(fn)
                record["us"][name] = round(ms * 1e3, 1)
                rate = f", {moved_bytes / ms / 1e9:.2f} TB/s" if moved_bytes else ""
                cells.append(f"{name} {ms * 1e3:.0f} us{rate}")
            mask = "causal" if args.causal else "full"
            print(f"d{head_dim} s{seqlen} {mask}: " + " | ".join(cells), flush=True)
            records.append(record)
            if args.out:
                payload = {**bench.environment(), "command": "python3 " + " ".join(sys.argv), "timer": timer.description,
                           "records": records}
                bench.write_json(args.out, payload, quiet=True)


if __name__ == "__main__":
    main()
