"""Time candidate tile configurations of the Hopper forward kernel on protocol shapes.

A development tool for choosing the selector's rows (flash4/dispatch.py): each candidate is
compiled and timed in one process on the same tensors, next to flash-attn-4 when it imports.

    python perf/sweep_configs.py [--seqlen 2048 8192]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from flash4.bench import attention_flops
from flash4.compiler import compiled_forward
from flash4.dispatch import select
from flash4.interface import LOG2_E

TOKENS, HIDDEN = 16384, 2048

CANDIDATES: dict[int, list[dict]] = {
    64: [dict(), dict(consumer_warpgroups=2), dict(rescale_o_before_pv=True)],
    128: [dict(), dict(rescale_o_before_pv=True)],
    256: [dict(), dict(tile_n=64), dict(persistent=True)],
}


def main() -> None:
    import triton.testing

    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hdim", type=int, nargs="+", default=sorted(CANDIDATES))
    args = parser.parse_args()
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        fa4 = None
    for head_dim in args.hdim:
        for causal in (False, True):
            for seqlen in args.seqlen:
                batch, heads = TOKENS // seqlen, HIDDEN // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                out = torch.empty_like(q)
                lse = torch.empty(batch, heads, seqlen, device="cuda")
                expected = torch.nn.functional.scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal
                ).transpose(1, 2)
                flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal)
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                base = select("sm_90a", "bfloat16", head_dim, causal, seqlen)
                cells = []
                for change in CANDIDATES[head_dim]:
                    try:
                        config = dataclasses.replace(base.config, **change)
                        kernel = compiled_forward(dataclasses.replace(base, config=config))
                        scale = head_dim**-0.5 * LOG2_E
                        ms = triton.testing.do_bench(lambda: kernel(q, k, v, out, lse, scale, sms), return_mode="median")
                        # A fast wrong kernel is no candidate: show its distance to SDPA.
                        diff = (out - expected).abs().max().item()
                        cells.append(f"{change or 'base'}: {flops / ms / 1e9:.0f} (diff {diff:.1e})")
                    except Exception as exc:  # a candidate that does not fit is reported, not fatal
                        cells.append(f"{change}: {type(exc).__name__}: {str(exc)[:80]}")
                if fa4 is not None:
                    ms = triton.testing.do_bench(lambda: fa4(q, k, v, causal=causal), return_mode="median")
                    cells.append(f"fa4: {flops / ms / 1e9:.0f}")
                print(f"d{head_dim} {'causal' if causal else 'full'} s{seqlen}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
