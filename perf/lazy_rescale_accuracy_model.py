"""What lazy_rescale costs the 16-bit forward's accuracy, in a model of its softmax (CPU).

    python perf/lazy_rescale_accuracy_model.py [--inputs outlier normal peaked] [--seqlen 2048] [--heads 2]

The online softmax over 128-key blocks, scores in float32 (log2 domain), P rounded to bf16
before P V, O and the row sums in float32, as the kernel does; the row max either the
block's true running max or kept until a block's scores pass it by more than
LAZY_THRESHOLD octaves (the kernel's lazy_rescale). Row sums from the unrounded P (the
kernel's) or from the bf16 P that multiplied V. RMSE of the bf16 output against float64
attention, beside torch SDPA in float32 rounded to bf16. Inputs: FlashAttention-3's
outliers (perf/fp8_accuracy_model.py), N(0, 1), and N(0, 4) (peaked rows).

Why it matters: at the true max each row's largest P is exactly 1 and carries no rounding;
under a kept max it is rounded like the rest, and on rows that one key dominates the
output moves by P's rounding while the row sum (unrounded) does not.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from flash4 import reference  # noqa: E402
from fp8_accuracy_model import outlier_inputs  # noqa: E402

BLOCK = 128
# kernels/sm90_fwd.py keeps the row max while no score passes it by more than 2^8.
LAZY_THRESHOLD = 8.0


def online_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lazy: bool, sum_rounded: bool) -> torch.Tensor:
    """Attention of one head's (seqlen, head_dim) float32 q, k, v by the kernel's algorithm."""
    scores = (q.double() @ k.double().T).float() * (q.shape[-1] ** -0.5 * math.log2(math.e))
    rows = q.shape[0]
    row_max = torch.full((rows,), -math.inf)
    row_sum = torch.zeros(rows)
    out = torch.zeros(rows, v.shape[-1])
    for start in range(0, k.shape[0], BLOCK):
        block = scores[:, start : start + BLOCK]
        block_max = block.max(1).values
        new_max = torch.maximum(row_max, block_max)
        if lazy:
            kept = (block_max - row_max <= LAZY_THRESHOLD) & torch.isfinite(row_max)
            new_max = torch.where(kept, row_max, new_max)
        rescale = torch.where(torch.isfinite(row_max), torch.exp2(row_max - new_max), torch.zeros(rows))
        p = torch.exp2(block - new_max[:, None])
        p16 = p.bfloat16().float()
        row_sum = row_sum * rescale + (p16 if sum_rounded else p).sum(1)
        out = out * rescale[:, None] + (p16.double() @ v[start : start + BLOCK].double()).float()
        row_max = new_max
    return out / row_sum[:, None]


def inputs(kind: str, shape: tuple[int, ...]) -> torch.Tensor:
    if kind == "outlier":
        return outlier_inputs(shape, "cpu")
    return torch.randn(shape) * (2.0 if kind == "peaked" else 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", nargs="+", default=["outlier", "normal", "peaked"])
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    variants = {
        "true max": dict(lazy=False, sum_rounded=False),
        "kept max": dict(lazy=True, sum_rounded=False),
        "kept max, sums of rounded P": dict(lazy=True, sum_rounded=True),
    }
    for kind in args.inputs:
        torch.manual_seed(0)
        for head_dim in args.hdim:
            q, k, v = (inputs(kind, (1, args.seqlen, args.heads, head_dim)).bfloat16() for _ in range(3))
            exact, _ = reference.attention(q, k, v, compute_dtype=torch.float64)

            def rmse(out: torch.Tensor) -> float:
                return float((out.bfloat16().double() - exact).pow(2).mean().sqrt())

            row = {}
            for name, options in variants.items():
                heads = [online_softmax(*(t[0, :, h].float() for t in (q, k, v)), **options) for h in range(args.heads)]
                row[name] = rmse(torch.stack(heads, 1)[None])
            sdpa = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
            row["sdpa float32"] = rmse(sdpa.transpose(1, 2))
            print(f"{kind:8s} d{head_dim:<4d}" + " | ".join(f"{name} {value:.3e}" for name, value in row.items()))


if __name__ == "__main__":
    main()
