"""Read a kernel's SASS without a GPU: compile a selector row for sm_90a, disassemble it.

    pip install nvidia-cuda-nvdisasm          # once: the disassembler, from NVIDIA's wheel
    pip install nvidia-cutlass-dsl-libs-cu13  # the GPU machine's toolkit: with only the cu12
                                              # libs, ptxas schedules differently (2600
                                              # instructions against the GPU's 2560 at d128)
    python perf/sass_local.py --hdim 256 [--causal] [--seqlen 1] [--change '{"persistent": true}']
                              [--dump kernel.sass]

Prints the kernel's static instruction mix; the instructions before the first wgmma that
read a global load's result (the GEMM's issue waits for that load); and, for every run of
wgmma (HGMMA, or QGMMA for FP8) instructions, the uniform-datapath instructions issued
among them: the operand descriptors of each wgmma are built there, and they compete with
the wgmmas for issue slots. On the H200 (ncu, d256 s8k) flash4 issued 5.4 of them per
wgmma in its hot loop and flash-attn-4 2.3, 15% more instructions in all. These are static
counts; which run is hot (the mask-free loop) is for the reader to see in the dump.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from flash4.compiler import compile_entry
from flash4.dispatch import select

# Instructions closer than this (in the listing) belong to one run of wgmmas.
RUN_GAP = 12
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def nvdisasm() -> str:
    """The nvdisasm binary: $NVDISASM, or the one installed by the nvidia-cuda-nvdisasm wheel."""
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    for root in sys.path:
        found = glob.glob(os.path.join(root, "nvidia", "*", "bin", "nvdisasm"))
        if found:
            return found[0]
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm, or set NVDISASM")


def disassemble(cubin: bytes) -> list[str]:
    """The kernel's instructions, one 'OPCODE operands' string each, in address order."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([nvdisasm(), "-c", str(path)], check=True, capture_output=True, text=True).stdout
    return [f"{m.group(1)}{m.group(2)}".strip() for m in map(_INSTRUCTION.match, listing.splitlines()) if m]


# wgmma in SASS: HGMMA for 16-bit operands, QGMMA for FP8 ones.
WGMMA_OPCODES = ("HGMMA", "QGMMA")


def opcode(instruction: str) -> str:
    return instruction.split()[0].split(".")[0]


def wgmma_runs(instructions: list[str]) -> list[tuple[int, int]]:
    """(first, last) indices of each run of wgmma instructions."""
    at = [i for i, ins in enumerate(instructions) if opcode(ins) in WGMMA_OPCODES]
    runs: list[tuple[int, int]] = []
    for i in at:
        if runs and i - runs[-1][1] <= RUN_GAP:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


_REGISTER = re.compile(r"\bR(\d+)\b")
# Opcodes whose first operand is read, not written.
_NO_DESTINATION = ("ST", "STG", "STS", "STSM", "RED", "BRA", "BAR", "SYNCS", "CCTL", "EXIT")


def operand_registers(instruction: str) -> tuple[set[int], set[int]]:
    """(written, read) general registers of one instruction; a 64- or 128-bit load writes
    two or four."""
    parts = instruction.split(None, 1)
    if len(parts) < 2:
        return set(), set()
    operands = [o.strip() for o in parts[1].split(",")]
    if opcode(instruction) in _NO_DESTINATION or not _REGISTER.fullmatch(operands[0]):
        return set(), {int(r) for o in operands for r in _REGISTER.findall(o)}
    first = int(operands[0][1:])
    width = 4 if ".128" in parts[0] else 2 if ".64" in parts[0] else 1
    written = set(range(first, first + width))
    return written, {int(r) for o in operands[1:] for r in _REGISTER.findall(o)}


def first_wgmma_waits(instructions: list[str]) -> list[str]:
    """The instructions before the first wgmma that read what a global load (LDG) wrote:
    the wgmma's issue waits for that load (a load from L2 takes hundreds of cycles). The
    FP8 forward's tile start had ptxas put one there in 6 of its 9 rows
    (perf/h200-findings.md). Text order, so a path the first wgmma's warps never take can
    show up too: read the dump at the lines given."""
    first = next((i for i, ins in enumerate(instructions) if opcode(ins) in WGMMA_OPCODES), len(instructions))
    waits = []
    for i, ins in enumerate(instructions[:first]):
        if opcode(ins) != "LDG":
            continue
        pending, _ = operand_registers(ins)
        for j in range(i + 1, first):
            written, read = operand_registers(instructions[j])
            if pending & read:
                waits.append(f"{j}: {instructions[j]} (the LDG at {i})")
                break
            pending -= written
            if not pending:
                break
    return waits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", help="the selector's dtype: bfloat16, float16, float8_e4m3fn")
    parser.add_argument("--seqlen", type=int, default=1, help="seqlen_q that picks the selector row")
    parser.add_argument("--change", default="{}", help="JSON of config fields to change")
    parser.add_argument("--dump", type=Path, help="write the instruction listing here")
    args = parser.parse_args()
    entry = select("sm_90a", args.dtype, args.hdim, args.causal, args.seqlen)
    entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, **json.loads(args.change)))
    report = compile_entry(entry, keep_cubin=True, with_lse=False)
    instructions = disassemble(report.cubin)
    if args.dump:
        args.dump.write_text("\n".join(instructions) + "\n")
    mix = collections.Counter(map(opcode, instructions))
    print(f"{entry.config}: {len(instructions)} instructions, {report.registers} registers, "
          f"{report.spill_bytes} bytes spilled")
    print("  " + "  ".join(f"{name}={count}" for name, count in mix.most_common(16)))
    for first, last in wgmma_runs(instructions):
        run = [opcode(ins) for ins in instructions[first:last + 1]]
        wgmmas = sum(op in WGMMA_OPCODES for op in run)
        uniform = sum(op.startswith("U") and op != "UTMALDG" for op in run)
        shape = instructions[first].split()[0].split(".")[1]
        print(f"  run at {first:5d}: {wgmmas:2d} x {shape:10s} {uniform:3d} uniform ({uniform / wgmmas:.1f} per wgmma)")
    waits = first_wgmma_waits(instructions)
    print("  before the first wgmma, reads of global loads: " + ("; ".join(waits) if waits else "none"))


if __name__ == "__main__":
    main()
