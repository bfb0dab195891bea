"""The per-architecture selector: a table from problem features to a kernel and its tiles.

Each row says which kernel serves one (architecture, dtype, head dim, causal) case and with
which tile configuration. Anything the table lacks is an error that names the architecture
and what it supports; there is no fall-back to a slower path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flash4.kernels.configs import Sm90ForwardConfig

SUPPORTED_DTYPES = ("bfloat16", "float16")

# Keys per KV block by head dim on sm_90: the widest block whose Q tile plus two-stage K/V
# ring fits the 227 KiB of shared memory, and whose S accumulator fits the register budget.
_SM90_TILE_N = {64: 128, 128: 128, 256: 80}
# Ping-pong of the consumer warpgroups pays where softmax is a large share of the time;
# at head dim 256 the GEMMs dominate and the O accumulator leaves few spare registers.
_SM90_PINGPONG_HEAD_DIMS = (64, 128)


def _sm90_consumer_warpgroups(head_dim: int, causal: bool) -> int:
    """Three 64-row warpgroups (192-row tiles) where the S and O accumulators are small
    enough for 160 registers a thread: at head dim 64, 4-15% faster than 128-row tiles
    without a mask on the H200 (perf/sweep_configs.py, 2026-11-29). Causal keeps two: its
    short sequences lost 6-8% with three."""
    return 3 if head_dim == 64 and not causal else 2


def _sm90_persistent(head_dim: int, causal: bool) -> bool:
    """One CTA per SM looping over tiles where it pays: without a mask at head dims 64 and 128
    it gained 2-21% at seqlen 512-4096 on the H200 (d128 s512: 418 -> 506 TFLOP/s) and
    stayed within 2% at 16k (perf/sweep_configs.py, 2026-11-29). Causal tiles differ in
    length and the static round-robin order unbalances them (-3 to -30%); head dim 256 has
    no shared memory left for the separate O buffer."""
    return head_dim in (64, 128) and not causal


@dataclass(frozen=True)
class KernelEntry:
    """One row of the selector's table."""

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    kernel: str
    config: Sm90ForwardConfig


def _sm90_rows() -> Iterable[KernelEntry]:
    for dtype in SUPPORTED_DTYPES:
        for head_dim, tile_n in _SM90_TILE_N.items():
            for causal in (False, True):
                yield KernelEntry(
                    arch="sm_90a",
                    dtype=dtype,
                    head_dim=head_dim,
                    causal=causal,
                    kernel="kernels.sm90_fwd.Sm90ForwardKernel",
                    config=Sm90ForwardConfig(
                        head_dim=head_dim, tile_n=tile_n, causal=causal,
                        consumer_warpgroups=_sm90_consumer_warpgroups(head_dim, causal),
                        pingpong=head_dim in _SM90_PINGPONG_HEAD_DIMS,
                        persistent=_sm90_persistent(head_dim, causal),
                    ),
                )


TABLE: tuple[KernelEntry, ...] = tuple(_sm90_rows())

SUPPORTED_ARCHS: tuple[str, ...] = tuple(sorted({row.arch for row in TABLE}))


class UnsupportedProblemError(ValueError):
    """Raised when no kernel in the table serves the request."""


def arch_of_capability(major: int, minor: int) -> str:
    """The architecture name flash4 compiles for on a device of this compute capability."""
    # sm_90 and sm_100 kernels use the architecture-specific ("a") instruction sets
    # (wgmma, setmaxnreg, tcgen05), so they are built for sm_90a / sm_100a.
    suffix = "a" if (major, minor) in ((9, 0), (10, 0)) else ""
    return f"sm_{major}{minor}{suffix}"


def select(arch: str, dtype: str, head_dim: int, causal: bool) -> KernelEntry:
    """The table's row for this problem, or an error naming what is supported."""
    rows = [row for row in TABLE if row.arch == arch]
    if not rows:
        raise UnsupportedProblemError(
            f"flash4 has no kernels for architecture {arch}; supported: "
            f"{', '.join(SUPPORTED_ARCHS)} (Hopper: H100/H200)"
        )
    for row in rows:
        if (row.dtype, row.head_dim, row.causal) == (dtype, head_dim, causal):
            return row
    dims = sorted({row.head_dim for row in rows if row.dtype == dtype})
    if not dims:
        dtypes = sorted({row.dtype for row in rows})
        raise UnsupportedProblemError(f"dtype {dtype} is not supported on {arch}; supported: {dtypes}")
    raise UnsupportedProblemError(
        f"head_dim={head_dim} is not supported on {arch} for {dtype}; supported head dims: {dims}"
    )


def format_table(arch: str | None = None) -> str:
    """The table as aligned text, for ``python -m flash4 info``."""
    rows = [row for row in TABLE if arch is None or row.arch == arch]
    if not rows:
        return f"no kernels for {arch}; supported: {', '.join(SUPPORTED_ARCHS)}"
    header = ("arch", "dtype", "head_dim", "causal", "kernel", "tile_m x tile_n", "kv_stages", "persistent")
    lines = [header]
    for row in rows:
        c = row.config
        lines.append(
            (row.arch, row.dtype, str(row.head_dim), str(row.causal), row.kernel,
             f"{c.tile_m} x {c.tile_n}", str(c.kv_stages), str(c.persistent))
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
