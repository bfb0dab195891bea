"""FP8 accuracy in the model (flash4.reference.fp8_attention), on FlashAttention-3's inputs.

    python perf/fp8_accuracy_model.py [--seqlen 2048] [--heads 8] [--batch 2] [--device cpu]

Inputs N(0, 1) plus N(0, 100) on 0.1% of the entries; RMSE of the output against float64
attention on the unquantized inputs, for: per-tensor scales, per-tensor with the output
rounded to e4m3 too (cuDNN's FP8 mode on Hopper), blockwise scales (128 rows), blockwise
with the Hadamard rotation of Q and K, and torch in bf16; the kernel's tiled algorithm
(flash4.reference.fp8_blockwise_attention) with P from exp2 and with P's codes rounded from
the scores; then blockwise + Hadamard with one rounding at a time (Q and K, V, V rotated as
well, P), the others exact. What the FP8 kernel is built to reproduce; a development tool,
the tests decide.
"""

from __future__ import annotations

import argparse

import torch

from flash4 import reference
from flash4.quantize import Fp8Tensor, hadamard_rotate, hadamard_unrotate, quantize_fp8

OUTLIER_FRACTION = 0.001
OUTLIER_STD = 10.0
BLOCK = 128


def outlier_inputs(shape: tuple[int, ...], device: str) -> torch.Tensor:
    x = torch.randn(shape, device=device)
    return x + (torch.rand(shape, device=device) < OUTLIER_FRACTION) * torch.randn(shape, device=device) * OUTLIER_STD


def experiment_parser() -> argparse.ArgumentParser:
    """The experiment's sizes as options (defaults: FlashAttention-3's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    return parser


def main() -> None:
    parser = experiment_parser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    for head_dim in args.hdim:
        q, k, v = (outlier_inputs((args.batch, args.seqlen, args.heads, head_dim), args.device) for _ in range(3))
        exact, _ = reference.attention(q, k, v, compute_dtype=torch.float64)

        def rmse(out: torch.Tensor) -> float:
            return float(((out.double() - exact) ** 2).mean().sqrt())

        per_tensor = reference.fp8_attention(*(quantize_fp8(t, None) for t in (q, k, v)))
        rows = {
            "per-tensor": rmse(per_tensor),
            "per-tensor, fp8 out": rmse(quantize_fp8(per_tensor.float(), None).dequantize()),
            "blockwise": rmse(reference.fp8_attention(*(quantize_fp8(t, BLOCK) for t in (q, k, v)))),
            "blockwise + hadamard": rmse(reference.fp8_attention(
                quantize_fp8(q, BLOCK, hadamard=True), quantize_fp8(k, BLOCK, hadamard=True), quantize_fp8(v, BLOCK)
            )),
            "bf16 (torch)": rmse(reference.attention_in_dtype(*(t.bfloat16() for t in (q, k, v)))[0]),
        }
        # The kernel's own algorithm (tiles of 128, V per tensor, row sums of the rounded P),
        # with P from exp2 and with P's codes rounded from the scores (fp8_p_by_rounding).
        kernel_inputs = (quantize_fp8(q, BLOCK, hadamard=True), quantize_fp8(k, BLOCK, hadamard=True),
                         quantize_fp8(v, None))
        for label, by_rounding in (("exp2 P", False), ("P codes by rounding", True)):
            out = reference.fp8_blockwise_attention(*kernel_inputs, sum_rounded_p=True, p_by_rounding=by_rounding)[0]
            rows[f"blockwise + hadamard, kernel model, {label}"] = rmse(out)
        rows.update({f"{name} alone": rmse(out) for name, out in rounding_alone(q, k, v).items()})
        rows.update({name: rmse(out) for name, out in int8_qk(q, k, v).items()})
        print(f"hdim {head_dim}: " + " | ".join(f"{name} {value:.2e}" for name, value in rows.items()), flush=True)


def unrounded(x: torch.Tensor, rotated: bool) -> Fp8Tensor:
    """``x`` as it is behind the Fp8Tensor interface (descale 1), for the model to take
    values rounded elsewhere, or not at all."""
    return Fp8Tensor(x.float(), torch.ones((), device=x.device), None, rotated)


def rounding_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Blockwise + Hadamard FP8 with one rounding at a time, the rest exact: which one sets
    the error's floor. Q and K are rotated throughout (their scores unchanged)."""
    qr, kr = hadamard_rotate(q), hadamard_rotate(k)
    qh, kh = (quantize_fp8(t, BLOCK, hadamard=True).dequantize() for t in (q, k))

    def attention(qx: torch.Tensor, kx: torch.Tensor, vx: torch.Tensor) -> torch.Tensor:
        return reference.attention(qx, kx, vx, compute_dtype=torch.float64)[0]

    return {
        "Q, K rounding": attention(qh, kh, v),
        "V rounding": attention(qr, kr, quantize_fp8(v, None).dequantize()),
        # V rotated too (O rotated back after P V): e4m3's error is relative to each value,
        # so spreading V's outliers over the head dim leaves its share where it was.
        "V rounding, V rotated": hadamard_unrotate(
            attention(qr, kr, quantize_fp8(v, None, hadamard=True).dequantize()).float()
        ),
        "P rounding": reference.fp8_attention(unrounded(qr, True), unrounded(kr, True), unrounded(v, False)),
    }


INT8_MAX = 127


def int8_rounded(x: torch.Tensor, per_head: bool = False) -> torch.Tensor:
    """``x`` rounded to int8 codes (symmetric, to ±127) and scaled back: one scale per
    BLOCK rows of each head, or with ``per_head`` one per (batch, head)."""
    batch, seqlen, heads, head_dim = x.shape
    if per_head:
        amax = x.abs().amax(dim=(1, 3), keepdim=True)
    else:
        rows = x.abs().amax(dim=-1).reshape(batch, seqlen // BLOCK, BLOCK, heads).amax(dim=2)
        amax = rows.repeat_interleave(BLOCK, dim=1).unsqueeze(-1)
    step = amax / INT8_MAX
    return torch.round(x / step).clamp(-INT8_MAX, INT8_MAX) * step


def int8_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Q and K rotated, then rounded to int8 for an s8 S GEMM (accumulating in s32), P and
    V e4m3 as in the kernel (P per row onto 448, V per tensor). After the rotation the
    values are near-Gaussian, and int8's 255 even steps over a block's range round them
    about 3x finer than e4m3's three mantissa bits do. With K per head (one scale for
    every key block), raw s32 scores compare across key blocks, as a kernel's running
    max in integers would need."""
    if q.shape[1] % BLOCK or k.shape[1] % BLOCK:
        raise ValueError(f"int8_qk: seqlens must be multiples of {BLOCK}")
    qr, kr = hadamard_rotate(q), hadamard_rotate(k)
    v_e4m3 = quantize_fp8(v, None).dequantize()
    q8, k8 = int8_rounded(qr), int8_rounded(kr)
    return {
        "Q, K int8 rounding alone": reference.attention(q8, k8, v, compute_dtype=torch.float64)[0],
        "Q, K int8, P and V e4m3": reference.fp8_attention(
            unrounded(q8, True), unrounded(k8, True), unrounded(v_e4m3, False)
        ),
        "Q int8, K int8 per head, P and V e4m3": reference.fp8_attention(
            unrounded(q8, True), unrounded(int8_rounded(kr, per_head=True), True), unrounded(v_e4m3, False)
        ),
        # The FP8 kernel's own algorithm (tiles of 128, V per tensor, row sums of the
        # rounded P, P's codes rounded from fp32 scores) on int8 Q and K: what an s8 S GEMM
        # feeding the fp32-score softmax would give.
        "Q, K int8, kernel model, P codes by rounding": reference.fp8_blockwise_attention(
            unrounded(q8, True), unrounded(k8, True), quantize_fp8(v, None), sum_rounded_p=True, p_by_rounding=True
        )[0],
    }


if __name__ == "__main__":
    main()
