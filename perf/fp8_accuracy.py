"""FP8 accuracy on the GPU: FlashAttention-3's experiment with the kernels themselves.

    python perf/fp8_accuracy.py [--seqlen 2048] [--heads 8] [--batch 2] [--out acc.json]

Inputs N(0, 1) plus N(0, 100) on 0.1% of the entries (perf/fp8_accuracy_model.py), in
bf16; RMSE of each output against float64 attention of those bf16 inputs, for flash4's
FP8 kernel with per-tensor scales, blockwise scales, blockwise scales with the Hadamard
rotation (flash_attn_fp8(hadamard=True)), the same with Q's and K's codes to
fp8_blocks' q_max and k_max (the kernel then holds its scores in f16), the accurate mode
(int8 Q and K, rotated: flash_attn_fp8(hadamard=True, qk_int8=True)), cuDNN's FP8 attention (per-tensor, e4m3 output;
perf/peer_providers.py) and the bf16 kernels (flash4, torch SDPA). The model's prediction
for the same inputs is perf/fp8_accuracy_model.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))

import flash4  # noqa: E402
from flash4 import reference  # noqa: E402
from flash4.fp8 import fp8_blocks  # noqa: E402
from fp8_accuracy_model import experiment_parser, outlier_inputs  # noqa: E402


def outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each way of computing attention(q, k, v), as a call returning its output."""
    from peer_providers import _cudnn_fp8

    blocks = fp8_blocks(q.shape[-1], False, q.shape[1])
    scale = q.shape[-1] ** -0.5
    per_tensor = [flash4.quantize_fp8(t, None) for t in (q, k, v)]
    blockwise = [flash4.quantize_fp8(q, blocks.q), flash4.quantize_fp8(k, blocks.kv), per_tensor[2]]
    # Rotated, codes within the limits with which the kernel holds the scores in f16.
    f16_codes = [flash4.quantize_fp8(q, blocks.q, True, blocks.q_max),
                 flash4.quantize_fp8(k, blocks.kv, True, blocks.k_max), per_tensor[2]]
    cudnn_run, cudnn_out = _cudnn_fp8(q, k, v, False, scale)
    return {
        "flash4 fp8 per-tensor": lambda: flash4.flash_attn_fp8_quantized(*per_tensor),
        "flash4 fp8 blockwise": lambda: flash4.flash_attn_fp8_quantized(*blockwise),
        "flash4 fp8 blockwise + hadamard": lambda: flash4.flash_attn_fp8(q, k, v, hadamard=True),
        "flash4 fp8 blockwise + hadamard, f16 scores": lambda: flash4.flash_attn_fp8_quantized(*f16_codes),
        "flash4 int8 qk + hadamard": lambda: flash4.flash_attn_fp8(q, k, v, hadamard=True, qk_int8=True),
        "cudnn fp8 per-tensor (fp8 out)": lambda: cudnn_out(cudnn_run()),
        "flash4 bf16": lambda: flash4.flash_attn_func(q, k, v),
        "torch sdpa bf16": lambda: torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v))
        ).transpose(1, 2),
    }


def main() -> None:
    parser = experiment_parser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for head_dim in args.hdim:
        shape = (args.batch, args.seqlen, args.heads, head_dim)
        q, k, v = (outlier_inputs(shape, "cuda").to(torch.bfloat16) for _ in range(3))
        exact, _ = reference.attention(q, k, v, compute_dtype=torch.float64)
        row = {}
        for name, call in outputs(q, k, v).items():
            try:
                row[name] = (call().double() - exact).pow(2).mean().sqrt().item()
            except Exception as exc:  # an absent peer is data, not a reason to stop
                row[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        best, cudnn, own = (row.get(n) for n in (
            "flash4 fp8 blockwise + hadamard", "cudnn fp8 per-tensor (fp8 out)", "flash4 fp8 per-tensor"))
        if all(isinstance(x, float) for x in (best, cudnn, own)):
            row["blockwise + hadamard / cudnn"] = best / cudnn
            row["per-tensor / (blockwise + hadamard)"] = own / best
        accurate = row.get("flash4 int8 qk + hadamard")
        if all(isinstance(x, float) for x in (accurate, cudnn, own)):
            row["int8 qk + hadamard / cudnn"] = accurate / cudnn
            row["per-tensor / (int8 qk + hadamard)"] = own / accurate
        results[head_dim] = row
        print(f"d{head_dim}: " + " | ".join(f"{n} {x:.3g}" if isinstance(x, float) else f"{n} {x}"
                                            for n, x in row.items()), flush=True)
    if args.out:
        record = {
            "command": "python3 perf/fp8_accuracy.py " + " ".join(sys.argv[1:]),
            "inputs": f"bf16 N(0,1) + N(0,100) on 0.1% of entries, batch {args.batch}, seqlen {args.seqlen}, "
                      f"heads {args.heads}; RMSE against float64 attention of the bf16 inputs",
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "rmse": results,
        }
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
