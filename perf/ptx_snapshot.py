"""Compile every kernel variant the selectors can pick for sm_90a, without a GPU, and write
each one's PTX to a folder: a refactor that is meant to change no generated code is
checked by comparing two snapshots (before and after) file by file.

    python perf/ptx_snapshot.py /tmp/before [--pass fwd|bwd|quantize|all] [--jobs 2]
    ... edit ...
    python perf/ptx_snapshot.py /tmp/after --against /tmp/before

Lines that name source positions (``.loc``, ``.file``) and comments are dropped, so that
moving code between lines is not a difference. Each file starts with the variant's
configuration and ptxas's registers, spills and serialised wgmma groups. The variants:
the forward selector's rows (16-bit and FP8, with and without LSE), the rows with head
clusters, the FP8 rows on int8 Q and K, and the backward's configurations over head dims, masks, the GQA schemes,
deterministic mode and both dQ schemes (first stores below ZEROED_DQ_MIN_SEQLEN_K, the
zeroed accumulator from it); the quantization kernels (rows to e4m3 or int8, per block or
per tensor, rotated or not; V's layout; the partial maxima) over input dtypes and head dims.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

# Source positions and comments: they move when code moves, and are no instruction.
_NOT_CODE = re.compile(r"\s*(\.loc|\.file|//)")
# Two query lengths on either side of flash4.backward.ZEROED_DQ_MIN_SEQLEN_K.
BACKWARD_SEQLENS_K = (1024, 16384)


def forward_variants() -> list[tuple[str, Any]]:
    """(name, (selector row, with_lse)) of every forward kernel the selectors can pick."""
    from flash4.dispatch import (
        FP8_DTYPE, FP8_HEAD_CLUSTER_MIN_SEQLEN, HEAD_CLUSTER_MIN_SEQLEN, TABLE, select, select_fp8,
    )

    rows = [row for row in TABLE if row.arch == "sm_90a"]
    clusters = {
        select("sm_90a", r.dtype, r.head_dim, True, max(r.min_seqlen_q, HEAD_CLUSTER_MIN_SEQLEN[r.head_dim]), group=2)
        for r in rows if r.causal and r.dtype == "bfloat16"
    } | {
        select_fp8("sm_90a", head_dim, True, start, v_per_tensor=True, group=2)
        for head_dim, start in FP8_HEAD_CLUSTER_MIN_SEQLEN.items()
    }
    variants = []
    for index, row in enumerate(rows + sorted(clusters, key=repr)):
        mask = "causal" if row.causal else "full"
        name = f"fwd-{index:02d}-{row.dtype}-d{row.head_dim}-{mask}-s{row.min_seqlen_q}"
        variants.append((name, (row, True)))
        # The FP8 rows without LSE are their own kernels (P's codes rounded, sums on the
        # tensor cores); a 16-bit row without LSE only drops its stores.
        if row.config.fp8:
            variants.append((name + "-no-lse", (row, False)))
    # The FP8 rows' kernels on int8 Q and K (the accurate mode, the shift folded into the
    # softmax), with and without LSE, and with the exact shift.
    for index, row in enumerate(r for r in rows if r.dtype == FP8_DTYPE):
        int8 = select_fp8("sm_90a", row.head_dim, row.causal, row.min_seqlen_q, v_per_tensor=True, qk_int8=True)
        exact = dataclasses.replace(int8, config=dataclasses.replace(int8.config, fp8_int8_shift_in_softmax=False))
        name = f"fwd-int8-{index:02d}-d{row.head_dim}-{'causal' if row.causal else 'full'}-s{row.min_seqlen_q}"
        variants += [(name, (int8, True)), (name + "-no-lse", (int8, False))]
        variants += [(name + "-exact", (exact, True)), (name + "-exact-no-lse", (exact, False))]
    return variants


def backward_variants() -> list[tuple[str, Any]]:
    """(name, config) of every backward configuration over head dims, masks, GQA schemes,
    deterministic mode and the two dQ schemes, each once."""
    from flash4.backward import SUPPORTED_HEAD_DIMS, backward_config

    configs: dict[str, Any] = {}
    for head_dim in SUPPORTED_HEAD_DIMS:
        for causal in (False, True):
            for scheme in ("mha", "gqa", "gqa-in-cta"):
                for deterministic in (False, True):
                    for seqlen_k in BACKWARD_SEQLENS_K:
                        config = backward_config(head_dim, causal, scheme != "mha", deterministic, seqlen_k=seqlen_k)
                        if scheme != "mha":
                            # Each scheme, whatever the selector would pick for the grid.
                            in_cta = scheme == "gqa-in-cta" and not deterministic
                            config = dataclasses.replace(
                                config, kv_accumulate=not in_cta, kv_group_in_cta=in_cta,
                                mirror_pairs=in_cta and config.mirror_pairs,
                            )
                        configs.setdefault(repr(config), config)
    return [(f"bwd-{index:02d}-d{c.head_dim}", c) for index, c in enumerate(configs.values())]


def quantize_variants() -> list[tuple[str, Any]]:
    """(name, keyword arguments of compile_quantize_report) of the quantization kernels: the
    rows kernel over 16- and 32-bit inputs, head dims, blocks (192 rows of float32 at head
    dim 256 are read twice, not held), rotation and codes; V's layout; the partial maxima."""
    variants = []
    for dtype in ("bfloat16", "float32"):
        for head_dim in (64, 128, 256):
            for block in (None, 128, 192):
                for hadamard in (False, True):
                    for int8 in (False, True):
                        name = f"quant-rows-{dtype}-d{head_dim}-b{block}-h{int(hadamard)}-{'int8' if int8 else 'e4m3'}"
                        variants.append((name, dict(dtype_name=dtype, head_dim=head_dim, block_rows=block,
                                                    hadamard=hadamard, int8=int8)))
            for hadamard in (False, True):
                variants.append((f"quant-amax-{dtype}-d{head_dim}-h{int(hadamard)}",
                                 dict(dtype_name=dtype, head_dim=head_dim, block_rows=None, amax=True, hadamard=hadamard)))
    for dtype in ("bfloat16", "float32", "float8_e4m3fn"):
        for head_dim in (64, 128, 256):
            variants.append((f"quant-vlayout-{dtype}-d{head_dim}",
                             dict(dtype_name=dtype, head_dim=head_dim, block_rows=None, transposed_v=True)))
    return variants


def _compile(item: tuple[str, Any]) -> tuple[str, str]:
    name, what = item
    from flash4.compiler import compile_backward_report, compile_entry, compile_quantize_report

    if name.startswith("fwd"):
        row, with_lse = what
        report, described = compile_entry(row, arch="sm_90a", with_lse=with_lse), f"{row!r} with_lse={with_lse}"
    elif name.startswith("quant"):
        report, described = compile_quantize_report(**what), repr(what)
    else:
        report, described = compile_backward_report(what), repr(what)
    code = "\n".join(line for line in report.ptx.splitlines() if not _NOT_CODE.match(line))
    header = (f"// {described}\n// registers {report.registers}, spill bytes {report.spill_bytes}, "
              f"serialised wgmma groups {report.serialized_wgmma}\n")
    return name, header + code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="where to write one .ptx file per variant")
    parser.add_argument("--pass", dest="which", choices=("fwd", "bwd", "quantize", "all"), default="all")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles run side by side")
    parser.add_argument("--against", type=Path, help="an earlier snapshot: list the variants whose PTX differs")
    args = parser.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    variants = (
        (forward_variants() if args.which in ("fwd", "all") else [])
        + (backward_variants() if args.which in ("bwd", "all") else [])
        + (quantize_variants() if args.which in ("quantize", "all") else [])
    )
    args.folder.mkdir(parents=True, exist_ok=True)
    changed = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, text in pool.map(_compile, variants):
            (args.folder / f"{name}.ptx").write_text(text)
            if args.against is not None:
                before = args.against / f"{name}.ptx"
                if not before.exists() or before.read_text() != text:
                    changed.append(name)
            print(name, "differs" if name in changed else "", flush=True)
    print(f"{len(variants)} variants written to {args.folder}")
    if args.against is not None:
        print(f"{len(changed)} differ from {args.against}: {' '.join(changed) or 'none'}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
