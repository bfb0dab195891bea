"""How many bytes one step of the Hopper backward moves through shared memory, and the
ceiling on TFLOP/s that this sets beside the tensor cores' own.

    python perf/bwd_smem_bound.py [perf/results/h100/2026-12-06-bench-bwd.json]

A step is one query block against a CTA's key block: tile_m queries, tile_n keys, five
GEMMs (Sᵀ, dPᵀ, dV, dK, dQ; 10 · tile_m · tile_n · head_dim FLOPs, the bench's count).
Its shared-memory traffic, counted as the kernels are built (kernels/sm90_bwd.py):

- each wgmma reads its operands from shared memory, A (64 rows) unless it comes from
  registers, and B; a warpgroup's wgmma reads all of B, so two warpgroups on the same B
  read it twice;
- TMA writes each Q and dO tile, with their rows' LSE and D;
- the consumers write dSᵀ (and, with the head dim split, Pᵀ) for the GEMMs that read it;
- dQ's fp32 tile is written by the consumers and read by the bulk reduction.

An SM's shared memory serves 128 bytes a clock and its tensor cores 4096 dense 16-bit
FLOPs a clock, so a step takes at least max(bytes / 128, FLOPs / 4096) clocks, and the
kernel reaches at most FLOPs / 4096 over that: its share of the tensor peak. Given a
backward bench JSON (``python -m flash4 bench --pass bwd``), each provider's TFLOP/s is
set against that share of the bf16 matmul ceiling measured in the same run. At the
GPU's power limit each kernel runs at its own clock (the matmul's is the lowest, so these
fractions run high: H200, 16k, backward head dim 128 at 1665 MHz for flash4 and 1620 for
flash-attn-4, the matmul at 1455; perf/h200-findings.md), so compare providers within a
shape rather than read a fraction as an efficiency.

flash-attn-4's rows (its ``_tile_size_bwd_sm90``) are modelled where its layout is
flash4's key split (head dims 64 and 128): Sᵀ and dPᵀ with keys as rows, dV and dK from
registers. At head dim 128 unmasked both take 80-row query blocks with dQ transposed
(flash4 since 2026-12-06, ``dq_transposed``), which reads the same bytes per GEMM as dQ
split by columns; causal, both take 64 rows.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

# An SM's shared memory: 32 banks of 4 bytes, one wavefront a clock.
SMEM_BYTES_PER_CLOCK = 128
# Dense 16-bit wgmma on an SM: 4 tensor cores of 1024 FLOPs a clock.
TENSOR_FLOPS_PER_CLOCK = 4096
# A wgmma's M: one warpgroup's rows.
WGMMA_M = 64
WARPGROUPS = 2
IN_BYTES, FP32_BYTES = 2, 4


@dataclass(frozen=True)
class BackwardTile:
    """One backward row's step. ``head_dim_split``: both warpgroups own the same tile_n
    keys and split queries (Sᵀ, dPᵀ) and head-dim columns (dV, dK, dQ), Pᵀ and dSᵀ through
    shared memory; otherwise each owns 64 keys and keeps Pᵀ and dSᵀ in registers.
    ``dq_rows``: the dQ GEMM's warpgroups split its query rows instead of its columns."""

    head_dim: int
    tile_m: int
    tile_n: int
    head_dim_split: bool = False
    dq_rows: bool = False

    @property
    def flops(self) -> int:
        return 10 * self.tile_m * self.tile_n * self.head_dim

    def smem_bytes(self) -> dict[str, int]:
        """Shared-memory bytes of one step, by what moves them."""
        d, m, n, wgs = self.head_dim, self.tile_m, self.tile_n, WARPGROUPS
        parts: dict[str, int] = {}
        if self.head_dim_split:
            # Sᵀ, dPᵀ: M = the n keys (A: K or V), N = m / wgs queries (B: Q or dO).
            parts["S, dP"] = 2 * wgs * (n * d + m // wgs * d) * IN_BYTES
            # dV, dK: M = n keys, N = d / wgs columns, K = m queries; A (Pᵀ, dSᵀ) whole.
            parts["dV, dK"] = 2 * wgs * (n * m + m * d // wgs) * IN_BYTES
            parts["P, dS stores"] = 2 * n * m * IN_BYTES
        else:
            # Sᵀ, dPᵀ: M = 64 own keys (A: K or V), N = m queries (B: Q or dO).
            parts["S, dP"] = 2 * wgs * (WGMMA_M * d + m * d) * IN_BYTES
            # dV, dK: A (Pᵀ, dSᵀ) from registers, B (dO, Q) = m queries x d.
            parts["dV, dK"] = 2 * wgs * m * d * IN_BYTES
            parts["P, dS stores"] = n * m * IN_BYTES
        if self.dq_rows:
            # M = m / wgs own queries (A: their dS rows), N = d, K = n keys (B: K).
            parts["dQ"] = wgs * (m // wgs * n + n * d) * IN_BYTES
        else:
            # M = m queries (A: all of dS), N = d / wgs columns (B: their part of K); the
            # transposed GEMM (M = d / wgs, N = m) reads the same two operands.
            parts["dQ"] = wgs * (m * n + n * d // wgs) * IN_BYTES
        parts["TMA Q, dO"] = 2 * m * d * IN_BYTES + 2 * m * FP32_BYTES
        parts["dQ tile"] = 2 * m * d * FP32_BYTES
        return parts

    def tensor_share(self) -> float:
        """The most of the tensor peak a step can reach with shared memory its only other bound."""
        smem = sum(self.smem_bytes().values()) / SMEM_BYTES_PER_CLOCK
        tensor = self.flops / TENSOR_FLOPS_PER_CLOCK
        return tensor / max(tensor, smem)


def flash4_tile(head_dim: int, causal: bool) -> BackwardTile:
    """flash4's row for a multi-head shape (flash4/backward.py)."""
    from flash4.backward import backward_config

    config = backward_config(head_dim, causal, seqlen_k=16384)
    return BackwardTile(head_dim, config.tile_m, config.tile_n, config.head_dim_split, config.dq_rows)


def fa4_tile(head_dim: int, causal: bool) -> BackwardTile | None:
    """flash-attn-4 4.0's sm_90 row where its layout is the key split (None elsewhere)."""
    if head_dim == 64:
        return BackwardTile(64, 128, 128, dq_rows=True)
    if head_dim == 128:
        return BackwardTile(128, 64 if causal else 80, 128)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", nargs="?", type=Path, help="a backward bench JSON to set against the model")
    args = parser.parse_args()

    print("| tile (head dim, queries x keys) | KiB a step | bytes / FLOP | tensor share |")
    print("|---|---|---|---|")
    tiles = {"flash4 64": flash4_tile(64, False), "flash4 128 causal": flash4_tile(128, True),
             "flash4 128 unmasked": flash4_tile(128, False), "flash4 256": flash4_tile(256, False),
             "fa4 128 unmasked": fa4_tile(128, False)}
    for name, tile in tiles.items():
        total = sum(tile.smem_bytes().values())
        print(f"| {name} ({tile.tile_m} x {tile.tile_n}) | {total / 1024:.0f} | "
              f"{total / tile.flops:.4f} | {tile.tensor_share():.3f} |")
    if args.bench is None:
        return
    report = json.loads(args.bench.read_text())
    ceiling = report["ceilings"]["bf16_matmul_tflops"]
    print(f"\n{report['gpu']}, bf16 matmul ceiling {ceiling:.0f} TFLOP/s; each cell: TFLOP/s, "
          "and its fraction of the ceiling times the tile's tensor share\n")
    print("| head dim | mask | seqlen | flash4 | fa4 |")
    print("|---|---|---|---|---|")
    for record in report["records"]:
        shape, results = record["shape"], record["results"]
        if shape.get("pass_") != "bwd" or shape.get("group", 1) != 1:
            continue
        cells = []
        for provider, tile in (("flash4", flash4_tile(shape["head_dim"], shape["causal"])),
                               ("fa4", fa4_tile(shape["head_dim"], shape["causal"]))):
            tflops = (results.get(provider) or {}).get("tflops")
            if tflops is None or tile is None:
                cells.append("-")
                continue
            # Causal steps on the diagonal do the same work masked; the share is per step.
            cells.append(f"{tflops:.0f} ({tflops / (ceiling * tile.tensor_share()):.2f})")
        mask = "causal" if shape["causal"] else "full"
        print(f"| {shape['head_dim']} | {mask} | {shape['seqlen']} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
