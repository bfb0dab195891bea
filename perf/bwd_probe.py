"""Diagnose the backward kernels on one small problem: every stage against the CPU model.

    python perf/bwd_probe.py [--hdim 128] [--seqlen-q 200] [--seqlen-k 300] [--causal] [--kv-heads 1]

Prints, for the preprocess outputs (D, lse_log2, and the dQ accumulator zeroed, as the
preprocess does for kernels without dq_first_stores) and for dq, dk,
dv, the largest error against flash4.reference (the exact gradients and the kernels'
blockwise model) and where it sits (batch, row, head, column), so a wrong stage and the
rows or columns it gets wrong show at a glance. A development tool; the tests decide.
"""

from __future__ import annotations

import argparse
import math

import torch

from flash4 import flash_attn_func, reference
from flash4.backward import attention_backward, backward_config
from flash4.compiler import compiled_backward_preprocess


def worst(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.double() - want.double()).abs()
    diff = torch.where(torch.isnan(diff), torch.inf, diff)
    index = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    print(f"{name:10s} max|err| {diff.max().item():10.3e} at {index}  (|ref| max {want.abs().max().item():.3e},"
          f" NaN {int(torch.isnan(got).sum())})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen-q", type=int, default=200)
    parser.add_argument("--seqlen-k", type=int, default=300)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    q = torch.randn(1, args.seqlen_q, args.heads, args.hdim, device="cuda", dtype=dtype)
    k = torch.randn(1, args.seqlen_k, args.kv_heads, args.hdim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=args.causal, return_lse=True)

    config = backward_config(args.hdim, args.causal, args.kv_heads != args.heads, seqlen_k=args.seqlen_k)
    padded = -(-args.seqlen_q // config.tile_m) * config.tile_m
    delta = torch.full((1, args.heads, padded), math.nan, device="cuda")
    lse_log2 = torch.full_like(delta, math.nan)
    accum = torch.full((1, args.heads, padded * args.hdim), math.nan, device="cuda")
    ready = torch.full((1, args.heads), -1, dtype=torch.int32, device="cuda")
    compiled_backward_preprocess("bfloat16", args.hdim, config.tile_m)(out, dout, lse, delta, lse_log2, accum, ready, None)
    torch.cuda.synchronize()
    want_delta = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    worst("D", delta[:, :, : args.seqlen_q], want_delta)
    worst("lse_log2", lse_log2[:, :, : args.seqlen_q], torch.where(lse == -math.inf, 0.0, lse * math.log2(math.e)))
    print(f"padding    D==0 {bool((delta[:, :, args.seqlen_q:] == 0).all())}  lse_log2==+inf "
          f"{bool((lse_log2[:, :, args.seqlen_q:] == math.inf).all())}  accumulator==0 {bool((accum == 0).all())}  "
          f"head counters==0 {bool((ready == 0).all())}")

    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=args.causal, grads=grads)
    torch.cuda.synchronize()
    cpu = [t.cpu() for t in (q, k, v, out, dout, lse)]
    exact = reference.attention_backward(*cpu, causal=args.causal)
    model = reference.blockwise_attention_backward(
        *cpu, causal=args.causal, block_m=config.tile_m, block_n=config.tile_n
    )
    baseline = reference.attention_backward_in_dtype(*(t.cpu() for t in (q, k, v, dout)), causal=args.causal)
    for name, got, want, m, b in zip(("dq", "dk", "dv"), (dq, dk, dv), exact, model, baseline):
        worst(name, got.cpu(), want)
        worst(f"{name} model", m, want)
        worst(f"{name} torch", b, want)


if __name__ == "__main__":
    main()
