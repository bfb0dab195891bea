"""The FP8 kernel with scores in f16 (Sm90ForwardConfig.scores_in_f16) against the
selector's kernel (fp32 scores), on the GPU: RMSE of each against float64 attention, on
FlashAttention-3's outlier inputs and on N(0, 1) inputs, with and without the Hadamard
rotation, at ragged and whole lengths, causal and not.

    python perf/f16_scores_probe.py [--out probe.json]

Both kernels read Q and K quantized with one descale per tile; the f16 kernel's codes are
those scaled down to its limits (perf/sweep_configs.py, bounded_codes), and the fp32
kernel runs on both quantizations, so the table separates the smaller codes' rounding
from the f16 scores'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from flash4 import reference  # noqa: E402
from flash4.compiler import compiled_forward, tile_counter  # noqa: E402
from flash4.devices import device_sms  # noqa: E402
from flash4.dispatch import select  # noqa: E402
from flash4.fp8 import OUT_DTYPE, tile_descales  # noqa: E402
from flash4.forward import LOG2_E  # noqa: E402
from flash4.quantize import fp8_value_layout, hadamard_rotate, quantize_fp8  # noqa: E402
from fp8_accuracy_model import outlier_inputs  # noqa: E402
from sweep_configs import bounded_codes  # noqa: E402


def run(entry, q8, k8, v8, causal: bool, scale: float) -> torch.Tensor:
    config = entry.config
    kernel = compiled_forward(entry, with_lse=False)
    batch, seqlen_q, heads, _ = q8.values.shape
    kv_heads, seqlen_k = k8.values.shape[2], k8.values.shape[1]
    blocks_q, blocks_k = -(-seqlen_q // config.tile_m), -(-seqlen_k // config.tile_n)
    out = torch.full(q8.values.shape, float("nan"), dtype=OUT_DTYPE, device=q8.values.device)
    kernel(
        q8.values, k8.values, fp8_value_layout(v8.values), out, None,
        tile_descales(q8, batch, heads, blocks_q), tile_descales(k8, batch, kv_heads, blocks_k),
        tile_descales(v8, batch, kv_heads, blocks_k), scale * LOG2_E, device_sms(0), tile_counter(config, q8.values.device),
    )
    torch.cuda.synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for seqlen_q, seqlen_k in ((2048, 2048), (1000, 1000), (17, 1000), (4096, 4096)):
                for inputs in ("outliers", "normal"):
                    for hadamard in (False, True):
                        if seqlen_q == 4096 and (hadamard or inputs == "normal"):
                            continue  # the rows from 4k: one case each
                        shape_q, shape_k = (2, seqlen_q, 8, head_dim), (2, seqlen_k, 8, head_dim)
                        draw = outlier_inputs if inputs == "outliers" else (lambda s, d: torch.randn(s, device=d))
                        q, k, v = (draw(s, "cuda").to(torch.bfloat16) for s in (shape_q, shape_k, shape_k))
                        exact, _ = reference.attention(q, k, v, causal=causal, compute_dtype=torch.float64)
                        qr, kr = (hadamard_rotate(q), hadamard_rotate(k)) if hadamard else (q, k)
                        entry = select("sm_90a", "float8_e4m3fn", head_dim, causal, seqlen_q)
                        f16_entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, scores_in_f16=True))
                        q8, k8 = quantize_fp8(qr, entry.config.tile_m), quantize_fp8(kr, entry.config.tile_n)
                        v8 = quantize_fp8(v, None)
                        qb, kb = bounded_codes(q8, k8, head_dim)
                        scale = head_dim**-0.5
                        outs = {
                            "fp32 scores": run(entry, q8, k8, v8, causal, scale),
                            "fp32 scores, bounded codes": run(entry, qb, kb, v8, causal, scale),
                            "f16 scores, bounded codes": run(f16_entry, qb, kb, v8, causal, scale),
                        }
                        row = dict(head_dim=head_dim, causal=causal, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                   inputs=inputs, hadamard=hadamard)
                        for name, out in outs.items():
                            row[name] = float((out.double() - exact).pow(2).mean().sqrt())
                        row["f16 - fp32 (bounded) max"] = float(
                            (outs["f16 scores, bounded codes"].float() - outs["fp32 scores, bounded codes"].float()).abs().max()
                        )
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"command": "python perf/f16_scores_probe.py", "gpu": torch.cuda.get_device_name(),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
