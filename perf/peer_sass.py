"""flash4's Hopper kernels beside flash-attn-4's, as machine code, without a GPU.

    pip install nvidia-cuda-nvdisasm triton einops        # once: the disassembler, and what
                                                          # flash-attn-4 and quack import
    mkdir -p /tmp/peers && tar -xJf .gpu/peers/flash-attn-4-*.tar.xz -C /tmp/peers
    python perf/peer_sass.py --peer-site /tmp/peers [--pass fwd | fp8] --hdim 128 [--causal]
                             [--seqlen 16384] [--change '{...}']

Both kernels of the pass (the backward's main kernel, or the 16-bit forward; with ``--pass
fp8`` flash4's FP8 forward alone, without an LSE, as flash-attn-4 has none on sm_90) are compiled
for sm_90a here: flash4's with the configuration its selector picks (``--change`` edits
it; the forward's row depends on ``--seqlen``), flash-attn-4's with the tiles its own
interface picks for the head dim, on fake tensors. For each kernel's
consumer loop (a loop of at least one query block's wgmmas holding no smaller such loop;
flash4 has a masked and a mask-free one) it prints the instruction count and, for each
stretch between two wgmma waits (WARPGROUP.DEPBAR), what runs there: wgmmas,
exponentials (MUFU), FFMA / FMUL / FADD, conversions, shared-memory loads and stores.
Where the waits sit decides what overlaps the tensor cores. On 2026-11-30 (cutlass-dsl
4.8.1, flash-attn-4 4.0.0b36), causal head dim 128, same tile (64 x 128): flash-attn-4's
one loop, which masks every block, ran 16 of a thread's 32 exponentials between the Sᵀ
and the dPᵀ waits, flash4's masked loop 16 and its mask-free loop 5, ptxas having hoisted
the dPᵀ wait over the rest; in instructions the loops are alike (440 against 494 and 418).
``--timeline`` adds the order of the loop's instructions, runs of one kind folded.

flash-attn-4 is read here, never imported by flash4 itself.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sass_local import WGMMA_OPCODES, nvdisasm

# The instruction kinds the stretches count, and those the timeline keeps.
COUNTED = ("HGMMA", "QGMMA", "MUFU", "FFMA", "FMUL", "FADD", "F2FP", "LDS", "STS", "STSM", "BAR", "SYNCS")
TIMELINE = ("HGMMA", "QGMMA", "WARPGROUP", "MUFU", "LDS", "STS", "STSM", "BAR", "SYNCS", "F2FP", "FFMA", "FADD", "FMUL",
            "FSEL", "MEMBAR", "FENCE")
# One query block's worth: the fewest wgmmas of a consumer loop (head dim 256, split: 8).
MIN_LOOP_WGMMAS = 8
_LABEL = re.compile(r"^\s*\.?(L_x_\d+):")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_BRANCH_TARGET = re.compile(r"\(\.?(L_x_\d+)\)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with its modifiers: WARPGROUP.DEPBAR.LE

    @property
    def kind(self) -> str:
        return self.opcode.split(".")[0]


def listing(cubin: bytes) -> tuple[list[Instruction], dict[str, int], list[tuple[int, str]]]:
    """The instructions, the labels' addresses, and each branch as (address, target label)."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([nvdisasm(), "-c", str(path)], check=True, capture_output=True, text=True).stdout
    instructions, labels, branches, pending = [], {}, [], []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        address = int(m.group(1), 16)
        for name in pending:
            labels[name] = address
        pending = []
        instructions.append(Instruction(address, m.group(2)))
        target = _BRANCH_TARGET.search(m.group(3))
        if m.group(2).startswith("BRA") and target:
            branches.append((address, target.group(1)))
    return instructions, labels, branches


def consumer_loops(cubin: bytes) -> list[list[Instruction]]:
    """The innermost loops (backward branches) with at least MIN_LOOP_WGMMAS wgmmas, in
    address order."""
    instructions, labels, branches = listing(cubin)
    spans = []
    for address, target in branches:
        start = labels.get(target)
        if start is None or start >= address:
            continue
        body = [i for i in instructions if start <= i.address <= address]
        if sum(i.kind in WGMMA_OPCODES for i in body) >= MIN_LOOP_WGMMAS:
            spans.append((start, address, body))
    # A loop ptxas rotated may only overlap the one it holds: keep the spans that overlap
    # no shorter one.
    inner = [s for s in spans if not any(len(o[2]) < len(s[2]) and o[0] <= s[1] and s[0] <= o[1] for o in spans)]
    return [body for _, _, body in sorted(inner, key=lambda s: s[0])]


def stretches(body: list[Instruction]) -> list[collections.Counter]:
    """What runs between consecutive wgmma waits (the waits themselves left out)."""
    counts = [collections.Counter()]
    for i in body:
        if i.opcode.startswith("WARPGROUP.DEPBAR"):
            counts.append(collections.Counter())
        else:
            counts[-1][i.kind] += 1
    return counts


def timeline(body: list[Instruction]) -> str:
    """The loop's instructions of the TIMELINE kinds in order, a run of one kind as KINDxN."""
    folded: list[list] = []
    for i in body:
        if i.kind not in TIMELINE:
            continue
        tag = i.opcode if i.kind in ("WARPGROUP", "BAR", "SYNCS", "LDS", "STS", "STSM") else i.kind
        if folded and folded[-1][0] == tag:
            folded[-1][1] += 1
        else:
            folded.append([tag, 1])
    return " ".join(tag if n == 1 else f"{tag}x{n}" for tag, n in folded)


def flash4_cubin(pass_: str, head_dim: int, causal: bool, seqlen: int, change: dict) -> tuple[str, bytes]:
    from flash4.compiler import compile_backward_report, compile_entry

    if pass_ == "bwd":
        from flash4.backward import backward_config

        config = dataclasses.replace(backward_config(head_dim, causal, seqlen_k=seqlen), **change)
        return f"flash4 {config}", compile_backward_report(config, keep_cubin=True).cubin
    from flash4.dispatch import FP8_DTYPE, select

    entry = select("sm_90a", FP8_DTYPE if pass_ == "fp8" else "bfloat16", head_dim, causal, seqlen)
    entry = dataclasses.replace(entry, config=dataclasses.replace(entry.config, **change))
    # FP8 as flash_attn_fp8 runs it by default: without an LSE.
    return f"flash4 {entry.config}", compile_entry(entry, keep_cubin=True, with_lse=pass_ != "fp8").cubin


def flash_attn_4_forward_cubin(peer_site: Path, head_dim: int, causal: bool) -> tuple[str, bytes]:
    """flash-attn-4's sm90 forward (with LSE) as its interface configures it, on fake tensors."""
    sys.path.insert(0, str(peer_site))
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.interface import _tile_size_fwd_sm90
    from flash_attn.cute.utils import AuxData
    from quack.compile_utils import make_fake_tensor

    tiles = _tile_size_fwd_sm90(head_dim, head_dim, causal, False)
    dtype = cutlass.BFloat16
    # One producer warpgroup, and a consumer warpgroup per 64 query rows.
    threads = 128 * (1 + tiles.m_block_size // 64)
    kernel = FlashAttentionForwardSm90(
        dtype, head_dim, head_dim, 1, is_causal=causal, is_local=False, pack_gqa=False,
        tile_m=tiles.m_block_size, tile_n=tiles.n_block_size, num_stages=2, num_threads=threads,
        Q_in_regs=False, intra_wg_overlap=tiles.intra_wg_overlap, mma_pv_is_rs=tiles.mma_pv_is_rs,
    )
    batch, seqlen_q, seqlen_k, heads = (cute.sym_int() for _ in range(4))
    q, o = (make_fake_tensor(dtype, (batch, seqlen_q, heads, head_dim), divisibility=8) for _ in range(2))
    k, v = (make_fake_tensor(dtype, (batch, seqlen_k, heads, head_dim), divisibility=8) for _ in range(2))
    lse = make_fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), divisibility=1)
    with tempfile.TemporaryDirectory() as scratch:
        cute.compile(
            kernel, q, k, v, o, lse, cutlass.Float32(1.0), None, None, None, None, None, None, None, None, None,
            AuxData(), None, None, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=f"--enable-tvm-ffi --gpu-arch=sm_90a --keep-cubin --dump-dir={scratch}",
        )
        cubin = Path(sorted(glob.glob(f"{scratch}/*.cubin"))[0]).read_bytes()
    return f"flash-attn-4 {tiles}, {threads} threads", cubin


def flash_attn_4_cubin(peer_site: Path, head_dim: int, causal: bool) -> tuple[str, bytes]:
    """flash-attn-4's sm90 backward as its interface configures it, compiled on fake tensors."""
    sys.path.insert(0, str(peer_site))
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.interface import _tile_size_bwd_sm90, make_fake_bwd_tensors
    from flash_attn.cute.utils import AuxData

    tiles = _tile_size_bwd_sm90(head_dim, head_dim, causal, False)
    dtype = cutlass.BFloat16
    kernel = FlashAttentionBackwardSm90(
        dtype, head_dim, head_dim, 1, causal, is_local=False, deterministic=False,
        tile_m=tiles.m_block_size, tile_n=tiles.n_block_size, Q_stage=tiles.num_stages_Q,
        dO_stage=tiles.num_stages_dO, PdS_stage=tiles.num_stages_PdS, SdP_swapAB=tiles.SdP_swapAB,
        dKV_swapAB=tiles.dKV_swapAB, dQ_swapAB=tiles.dQ_swapAB, AtomLayoutMSdP=tiles.AtomLayoutMSdP,
        AtomLayoutNdKV=tiles.AtomLayoutNdKV, AtomLayoutMdQ=tiles.AtomLayoutMdQ,
        num_threads=(tiles.num_wg + 1) * 128, V_in_regs=False, dQ_single_wg=tiles.dQ_single_wg,
    )
    # (q, k, v, o, do, dq, dk, dv, lse, lse_log2, dpsum, dq_accum, dk_accum, dv_accum, scale_p)
    q, k, v, _, do, _, dk, dv, _, lse_log2, dpsum, dq_accum, *_ = make_fake_bwd_tensors(
        dtype, has_gqa=False, varlen_q=False, varlen_k=False
    )
    with tempfile.TemporaryDirectory() as scratch:
        cute.compile(
            kernel, q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, cutlass.Float32(1.0),
            None, None, None, None, None, None, None, None, None, AuxData(), None, None,
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=f"--enable-tvm-ffi --gpu-arch=sm_90a --keep-cubin --dump-dir={scratch}",
        )
        cubin = Path(sorted(glob.glob(f"{scratch}/*.cubin"))[0]).read_bytes()
    return f"flash-attn-4 {tiles}", cubin


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-site", type=Path, required=True, help="folder holding flash_attn/ and quack/")
    parser.add_argument("--pass", dest="pass_", choices=("bwd", "fwd", "fp8"), default="bwd",
                        help="fp8: flash4's FP8 forward alone (flash-attn-4 has none on sm_90)")
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=16384, help="the forward's selector row (seqlen_q)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--change", default="{}", help="JSON of flash4's configuration fields to change")
    parser.add_argument("--timeline", action="store_true")
    args = parser.parse_args()
    kernels = [flash4_cubin(args.pass_, args.hdim, args.causal, args.seqlen, json.loads(args.change))]
    if args.pass_ != "fp8":
        peer = flash_attn_4_cubin if args.pass_ == "bwd" else flash_attn_4_forward_cubin
        kernels.append(peer(args.peer_site, args.hdim, args.causal))
    for name, cubin in kernels:
        print(name)
        for body in consumer_loops(cubin):
            print(f"  loop at {body[0].address:#x}: {len(body)} instructions")
            for n, counts in enumerate(stretches(body)):
                cells = " ".join(f"{kind} {counts[kind]}" for kind in COUNTED if counts[kind])
                print(f"    after wait {n}: {cells}" if n else f"    before the first wait: {cells}")
            if args.timeline:
                print("    " + timeline(body))


if __name__ == "__main__":
    main()
