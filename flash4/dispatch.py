"""The per-architecture selector: a table from problem features to a kernel and its tiles.

Each row says which kernel serves one (architecture, dtype, head dim, causal) case and with
which tile configuration. Anything the table lacks is an error that names the architecture
and what it supports; there is no fall-back to a slower path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Iterable

from flash4.kernels.configs import KV_MULTICAST_CTAS, Sm90ForwardConfig

SUPPORTED_DTYPES = ("bfloat16", "float16")

# Keys per KV block by head dim on sm_90: the widest block whose Q tile plus two-stage K/V
# ring fits the 227 KiB of shared memory, and whose S accumulator fits the register budget.
_SM90_TILE_N = {64: 128, 128: 128, 256: 80}
# Head dim 256 below 1-2k: 64 divides the protocol's short sequences, 80 leaves part of the
# last key block empty (512 keys in 560).
SHORT_TILE_N_256 = 64
# From these query lengths on, clusters of two query blocks share each K and V block by
# multicast (kv_multicast), by (head dim, causal).
KV_MULTICAST_MIN_SEQLEN = {(128, False): 16384, (256, False): 4096, (128, True): 8192, (256, True): 8192}
# Causal with clusters, from this query length on one tile per CTA beats a persistent grid.
CAUSAL_ONE_TILE_MIN_SEQLEN = 16384
# Causal persistent grids, from these query lengths on (by head dim), take their tiles at
# run time, longest first within sections of heads (dynamic_tiles), instead of long-short
# pairs dealt out in turn. H200, three rounds, --control, medians, the table's two copies
# against it (-fwd-sweep-dynamic{,-confirm}.json): head dim 64 at 2k / 4k / 8k / 16k 374/375
# and 377/377 -> 377 and 385, 433/428 and 433/431 -> 440 and 445, 468/466 and 472/469 -> 488
# and 487, 489/487 -> 506 (flash-attn-4 368, 425, 477-481, 499); 128 at 4k 560/568 and
# 571/566 -> 574 and 578, at 2k 504/513 and 518/520 -> 518 and 519. Lost at 1k (d64 tied,
# d128 451/442 -> 439: the counter's zeroing and a ticket a tile weigh on short calls) and
# at head dim 256 (1k 445/441 -> 436, 4k 599/595 -> 593: a section's K and V, 1 MiB an
# entry at 1k, outgrow L2). Head dim 128 from 8k keeps its clusters.
DYNAMIC_TILES_MIN_SEQLEN = {64: 2048, 128: 4096}
# Head dim 64 causal on the sliced 128-row tiles: lazy_rescale from this query length on
# (at 512 it lost 1.5%, at 1k and 2k it gained 2%).
LAZY_SLICED_MIN_SEQLEN = 1024
# Head dim 64 causal below 4k: the first key block's softmax in this many column slices of
# 32 keys, two 16-row warps' worth (masked_column_slices).
FIRST_BLOCK_SLICES = 4
# Causal under grouped-query attention with an even number of query heads per K/V head:
# from these query lengths on (by head dim), every 16-bit row runs with clusters of two
# query heads of one K/V head sharing K and V by multicast (cluster_heads; see select).
HEAD_CLUSTER_MIN_SEQLEN = {64: 4096, 128: 4096, 256: 2048}
# The FP8 kernel's inputs: e4m3 Q, K, V with one descale per tile; its O is bf16.
FP8_DTYPE = "float8_e4m3fn"
# The same for the FP8 rows with V per tensor (flash_attn_fp8's), at head dim 128 only.
# H200, groups of 8, causal, three rounds, --control, medians, the table's two copies
# against it (-fp8-sweep-head-clusters-gqa8.json), 4k / 16k: head dim 128 923/915 -> 957,
# 1016/1006 -> 1042; 256 1125/1115 -> 1113, 1260/1260 -> 1264; 64 636/635 -> 622,
# 761/763 -> 745. V per key block keeps the row (its kernel was not measured with them).
FP8_HEAD_CLUSTER_MIN_SEQLEN = {128: 4096}
FP8_OUT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class KernelEntry:
    """One row of the selector's table. A (dtype, head dim, causal) case may have several
    rows for different query lengths: the row with the largest ``min_seqlen_q`` not above
    the call's seqlen_q serves it. Each row is one compiled kernel, so shapes still never
    recompile; they only choose between kernels."""

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    kernel: str
    config: Sm90ForwardConfig
    min_seqlen_q: int = 1


def _sm90_configs(head_dim: int, causal: bool) -> Iterable[tuple[int, Sm90ForwardConfig]]:
    """(min_seqlen_q, config) rows per case. Each choice was measured on the H200 against
    the row before it (perf/sweep_configs.py: interleaved rounds, the row itself run twice
    as the control, the peers in the same process); the numbers, and the changes that did
    not pay, are in perf/h200-findings.md ("The selector's rows"). What the rows take:

    - A persistent grid with two Q slots, so that the next tile's Q loads while this one
      runs (causal: balanced pairs of query blocks, or from DYNAMIC_TILES_MIN_SEQLEN tiles
      taken at run time, longest first). Head dim 256, whose O is staged in Q's buffer,
      runs one tile per CTA unmasked from 1k, where a persistent grid only tied.
    - Ping-pong between the consumer warpgroups where the softmax is a large share of the
      time, so not at head dim 256, where the GEMMs dominate; at head dim 128 the tile's
      first S GEMM waits for its warpgroup's turn too (first_block_turn).
    - Head dim 64: 192-row tiles (three consumer warpgroups) unmasked, and causal from 4k;
      causal below that 128-row tiles, whose first key block's softmax runs only over the
      32-key slices each warp can see (masked_column_slices). Its row sums start from the
      old sum times O's factor (sum_from_rescaled), which puts O's rescale among the
      exponentials that bind there.
    - Unmasked blocks keep the row's max while its scores stay within 2^8 of it
      (lazy_rescale), the branch chosen by the row sums of P (lazy_check_by_sums) except
      at head dim 256 causal; head dim 64 causal below LAZY_SLICED_MIN_SEQLEN keeps the
      plain softmax.
    - Head dim 256: O's rescale skipped by a warp vote (rescale_when_needed); 64-key
      blocks below 1k unmasked and 2k causal (80-key blocks load 560 keys for 512);
      causal below 16k, the first warpgroup skips its S GEMM on a first key block it sees
      none of (skip_unseen_first_block).
    - Each consumer warpgroup stores its own 64 rows of O at head dim 64 and 128 causal.
    - From KV_MULTICAST_MIN_SEQLEN, clusters of two CTAs on adjacent query blocks share
      each K and V block by multicast (kv_multicast); causal from
      CAUSAL_ONE_TILE_MIN_SEQLEN, one tile per CTA.
    """
    tile_n = _SM90_TILE_N[head_dim]
    base = Sm90ForwardConfig(
        head_dim=head_dim, tile_n=tile_n, causal=causal,
        pingpong=head_dim != 256, persistent=head_dim != 256, rescale_when_needed=head_dim == 256,
        q_stages=1 if head_dim == 256 else 2, sum_from_rescaled=head_dim == 64,
        o_store_per_warpgroup=head_dim == 64 or (head_dim == 128 and causal),
        lazy_rescale=True, lazy_check_by_sums=not (head_dim == 256 and causal),
        first_block_turn=head_dim == 128,
    )
    if head_dim == 256 and causal:
        skipping = replace(base, skip_unseen_first_block=True)
        yield 1, replace(skipping, persistent=True, tile_n=SHORT_TILE_N_256)
        yield 2048, replace(skipping, persistent=True)
        yield KV_MULTICAST_MIN_SEQLEN[256, True], replace(skipping, persistent=True, kv_multicast=True)
        yield CAUSAL_ONE_TILE_MIN_SEQLEN, replace(base, kv_multicast=True)
    elif head_dim == 256:
        yield 1, replace(base, persistent=True, tile_n=SHORT_TILE_N_256)
        yield 1024, base
        yield KV_MULTICAST_MIN_SEQLEN[256, False], replace(base, kv_multicast=True)
    elif head_dim == 128 and not causal:
        yield 1, base
        yield KV_MULTICAST_MIN_SEQLEN[128, False], replace(base, kv_multicast=True)
    elif head_dim == 128:
        yield 1, base
        yield DYNAMIC_TILES_MIN_SEQLEN[128], replace(base, dynamic_tiles=True)
        yield KV_MULTICAST_MIN_SEQLEN[128, True], replace(base, kv_multicast=True)
        # One tile per CTA (one Q slot, O staged in Q's buffer), which clusters allow.
        one_tile = replace(base, persistent=False, q_stages=1, o_store_per_warpgroup=False)
        yield CAUSAL_ONE_TILE_MIN_SEQLEN, replace(one_tile, kv_multicast=True)
    elif not causal:
        yield 1, replace(base, consumer_warpgroups=3)
    else:
        sliced = replace(base, masked_column_slices=FIRST_BLOCK_SLICES)
        yield 1, replace(sliced, lazy_rescale=False, lazy_check_by_sums=False)
        yield LAZY_SLICED_MIN_SEQLEN, sliced
        yield DYNAMIC_TILES_MIN_SEQLEN[64], replace(sliced, dynamic_tiles=True)
        yield 4096, replace(base, consumer_warpgroups=3, dynamic_tiles=True)


def _sm90_rows() -> Iterable[KernelEntry]:
    for dtype in SUPPORTED_DTYPES:
        for head_dim in _SM90_TILE_N:
            for causal in (False, True):
                for min_seqlen_q, config in _sm90_configs(head_dim, causal):
                    yield KernelEntry(
                        arch="sm_90a", dtype=dtype, head_dim=head_dim, causal=causal,
                        kernel="kernels.sm90_fwd.Sm90ForwardKernel", config=config,
                        min_seqlen_q=min_seqlen_q,
                    )


# The FP8 kernel's rows, chosen by sweeps on the H200 and, since the descales travel with
# the stages, the H100 (perf/sweep_configs.py --pass fp8, each change against the row
# before it; the numbers, and the changes that did not pay, are in perf/h200-findings.md,
# "The selector's rows"). Q's descale blocks are the query tile, K's and V's the key tile
# (multiples of the FP8 wgmma's 32-deep k-step): flash4.fp8.fp8_blocks reads them off the
# row a problem selects. Every row: a persistent grid, V per tensor (a blockwise V gets
# the row's kernel built for it, select_fp8), O's rescale skipped by a warp vote; compiled
# without an LSE, row sums on the tensor cores and P's e4m3 codes rounded from the scores,
# with no exponential. Short rows stream their bytes through deeper K/V rings (at 512
# keys the kernel moves Q, K, V and O near DRAM's rate; perf/short_row_ceiling.py). Head
# dim 64 unmasked: two warpgroups on 256-key blocks, three K/V stages, below 8k; from 8k
# three warpgroups on 192-row tiles; both with two Q slots and O stored per warpgroup.
# Head dim 64 causal: Q in registers, below 4k on 128-row tiles with six K/V stages and
# two Q slots, from 4k on three warpgroups with tiles taken at run time, three K/V stages
# and O stored per warpgroup. Head dim 128: two warpgroups on 128-key blocks with Q in
# registers, four K/V stages below 2k unmasked and below 4k causal; causal below 1k with
# two Q slots (the next tile's Q lands while a short causal tile runs; at 1k they cost
# 3%). Head dim 256: 128-key blocks, no ping-pong, P converted before O's rescale.
_SM90_FP8_BASE = dict(fp8=True, fp8_v_per_tensor=True, rescale_when_needed=True, persistent=True)
_DYNAMIC_TILES = dict(dynamic_tiles=True)
# Row sums on the tensor cores, and with them (they sum the same P) P's codes by rounding.
_SUMS_ON_TENSOR_CORES = dict(row_sum_on_tensor_cores=True, fp8_p_by_rounding=True)
_O_PER_WARPGROUP = dict(o_store_per_warpgroup=True)
_Q_IN_REGISTERS = dict(q_in_registers=True)
# The tile scheduler's divisions on the uniform datapath: with the fast divisions, the CUDA 12
# ptxas of the default install spills 8 bytes of head dim 256 causal's tile prologue, and a
# kernel of the table must not spill (tests/test_fp8_cpu.py).
_DIVIDER = dict(fast_tile_divmod=False)
# Head dim 128 on two warpgroups, 128-key blocks, Q in registers (three run out of registers).
_D128_Q_IN_REGISTERS = dict(tile_n=128, **_Q_IN_REGISTERS, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP)
# (head dim, causal) -> (min_seqlen_q, the row's choices) per row.
_SM90_FP8_ROWS: dict[tuple[int, bool], tuple[tuple[int, dict], ...]] = {
    (64, False): (
        (1, dict(tile_n=256, kv_stages=3, q_stages=2, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP)),
        (8192, dict(tile_n=128, consumer_warpgroups=3, q_stages=2, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP)),
    ),
    (64, True): (
        (1, dict(tile_n=128, kv_stages=6, q_stages=2, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP, **_Q_IN_REGISTERS)),
        (4096, dict(tile_n=128, consumer_warpgroups=3, kv_stages=3, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP,
                    **_Q_IN_REGISTERS, **_DYNAMIC_TILES)),
    ),
    (128, False): ((1, dict(kv_stages=4, **_D128_Q_IN_REGISTERS)), (2048, _D128_Q_IN_REGISTERS)),
    (128, True): (
        (1, dict(kv_stages=4, q_stages=2, **_D128_Q_IN_REGISTERS)),
        (1024, dict(kv_stages=4, **_D128_Q_IN_REGISTERS)),
        (4096, dict(**_D128_Q_IN_REGISTERS, **_DYNAMIC_TILES)),
    ),
    (256, False): ((1, dict(tile_n=128, pingpong=False, p_before_rescale=True, **_SUMS_ON_TENSOR_CORES)),),
    (256, True): ((1, dict(tile_n=128, pingpong=False, p_before_rescale=True, **_SUMS_ON_TENSOR_CORES, **_DIVIDER)),),
}


def _sm90_fp8_rows() -> Iterable[KernelEntry]:
    for (head_dim, causal), rows in _SM90_FP8_ROWS.items():
        for min_seqlen_q, choices in rows:
            config = Sm90ForwardConfig(head_dim=head_dim, causal=causal, **_SM90_FP8_BASE, **choices)
            yield KernelEntry(
                arch="sm_90a", dtype=FP8_DTYPE, head_dim=head_dim, causal=causal,
                kernel="kernels.sm90_fwd_fp8.Sm90Fp8ForwardKernel", config=config, min_seqlen_q=min_seqlen_q,
            )


TABLE: tuple[KernelEntry, ...] = (*_sm90_rows(), *_sm90_fp8_rows())

# (arch, dtype, head dim, causal) -> its rows, longest min_seqlen_q first: select() runs on
# every call, so it is one dict lookup and a short scan.
_CASES: dict[tuple[str, str, int, bool], tuple[KernelEntry, ...]] = {}
for _row in sorted(TABLE, key=lambda row: -row.min_seqlen_q):
    _key = (_row.arch, _row.dtype, _row.head_dim, _row.causal)
    _CASES[_key] = _CASES.get(_key, ()) + (_row,)

SUPPORTED_ARCHS: tuple[str, ...] = tuple(sorted({row.arch for row in TABLE}))


class UnsupportedProblemError(ValueError):
    """Raised when no kernel in the table serves the request."""


def arch_of_capability(major: int, minor: int) -> str:
    """The architecture name flash4 compiles for on a device of this compute capability."""
    # sm_90 and sm_100 kernels use the architecture-specific ("a") instruction sets
    # (wgmma, setmaxnreg, tcgen05), so they are built for sm_90a / sm_100a.
    suffix = "a" if (major, minor) in ((9, 0), (10, 0)) else ""
    return f"sm_{major}{minor}{suffix}"


def select(
    arch: str, dtype: str, head_dim: int, causal: bool, seqlen_q: int = 1, group: int = 1
) -> KernelEntry:
    """The table's row for this problem (``group``: query heads per K/V head), or an error
    naming what is supported."""
    cluster_starts = FP8_HEAD_CLUSTER_MIN_SEQLEN if dtype == FP8_DTYPE else HEAD_CLUSTER_MIN_SEQLEN
    for row in _CASES.get((arch, dtype, head_dim, causal), ()):
        if seqlen_q >= row.min_seqlen_q:
            if causal and group % 2 == 0 and seqlen_q >= cluster_starts.get(head_dim, seqlen_q + 1):
                # Plain values as the key: select() runs on every call, and hashing a row's
                # nested dataclasses is not cheap.
                return _HEAD_CLUSTER_VARIANTS.get((arch, dtype, head_dim, row.min_seqlen_q), row)
            return row
    rows = [row for row in TABLE if row.arch == arch]
    if not rows:
        raise UnsupportedProblemError(
            f"flash4 has no kernels for architecture {arch}; supported: "
            f"{', '.join(SUPPORTED_ARCHS)} (Hopper: H100/H200)"
        )
    dims = sorted({row.head_dim for row in rows if row.dtype == dtype})
    if not dims:
        dtypes = sorted({row.dtype for row in rows})
        raise UnsupportedProblemError(f"dtype {dtype} is not supported on {arch}; supported: {dtypes}")
    raise UnsupportedProblemError(
        f"head_dim={head_dim} is not supported on {arch} for {dtype}; supported head dims: {dims}"
    )


def select_fp8(
    arch: str, head_dim: int, causal: bool, seqlen_q: int, v_per_tensor: bool, group: int = 1,
    f16_scores: bool = False, qk_int8: bool = False,
) -> KernelEntry:
    """The FP8 row for this problem (``group``: query heads per K/V head); for a V with one
    descale per key block (``v_per_tensor=False``), the row's kernel built for blockwise V
    descales. ``f16_scores``: Q's and K's codes keep Q Kᵀ inside f16 (kernels/f16_scores.py),
    so a row that rounds P's codes takes its scores in f16. ``qk_int8``: Q and K are int8
    (the accurate mode), whose s32 scores the fp32 softmax takes (``f16_scores`` is then
    moot)."""
    if not v_per_tensor:
        entry = _with_blockwise_v(select(arch, FP8_DTYPE, head_dim, causal, seqlen_q))
    else:
        entry = select(arch, FP8_DTYPE, head_dim, causal, seqlen_q, group)
        if f16_scores and entry.config.fp8_p_by_rounding and not qk_int8:
            entry = _with_f16_scores(entry)
    return _with_int8_qk(entry) if qk_int8 else entry


@functools.lru_cache(maxsize=None)
def _with_int8_qk(entry: KernelEntry) -> KernelEntry:
    """The row's kernel on int8 Q and K (Sm90ForwardConfig.fp8_qk_int8), the shift taken off
    in the softmax (fp8_int8_shift_in_softmax). H100, two rounds, the kernel alone, 1k / 16k
    TFLOP/s, exact shift -> folded (the e4m3 row's fp32 scores beside): head dim 64 full
    508 -> 551, 664 -> 782 (578, 824), causal 412 -> 440, 643 -> 761; 128 full 832 -> 843,
    945 -> 1033 (871, 1050), causal 616 -> 629, 939 -> 991; 256 full 997 -> 1045, 1203 ->
    1302 (1048, 1281), causal 706 -> 719, 1199 -> 1236 (perf/results/h100/2026-12-05-fp8-
    sweep-int8-shift.json). The rows' tiles are the e4m3 rows'; none was swept for int8."""
    return replace(
        entry, config=replace(entry.config, fp8_qk_int8=True, scores_in_f16=False, fp8_int8_shift_in_softmax=True)
    )


@functools.lru_cache(maxsize=None)
def _with_f16_scores(entry: KernelEntry) -> KernelEntry:
    """The row's kernel with its S GEMM accumulating in f16. H200, three rounds, the kernel
    alone (perf/results/h200/2026-12-02-fp8-sweep-f16-scores.json), 1k / 16k TFLOP/s, the
    row -> f16: head dim 64 full 584 -> 726, 806 -> 1007, causal 475 -> 556, 784 -> 973;
    128 full 876 -> 1007, 1049 -> 1184, causal 678 -> 770, 1016 -> 1162; 256 full 1025 ->
    1125, 1295 -> 1352, causal 771 -> 827, 1218 -> 1285. Q's and K's codes then come with
    kernels.f16_scores.code_limits: on FlashAttention-3's inputs the outputs erred within
    0.2-3% of the fp32 scores' on the same codes (-fp8-f16-scores-probe.json)."""
    return replace(entry, config=replace(entry.config, scores_in_f16=True))


def _with_head_clusters(entry: KernelEntry) -> KernelEntry:
    """The row's kernel with clusters of two query heads of one K/V head instead of adjacent
    query blocks (or of none). Causal, a pair of query blocks walks the keys of its later
    block, the earlier one masking the extra blocks whole; a pair of heads walks the same
    keys. Under GQA with groups of 8 (2026-11-30, three rounds, --control; medians, the
    table's two copies against it; -fwd-sweep-head-clusters-gqa8*.json): head dim 256 at 2k
    / 4k / 8k / 16k 578/572 -> 595, 639/639 -> 664, 689/696 -> 704, 731/732 -> 735; head
    dim 128 at 4k / 8k / 16k 595/597 -> 615, 630/631 -> 643, 650/651 -> 656; head dim 64 at
    4k / 16k 453/455 -> 459, 505/500 -> 514. Tied at 1k (all three), at 2k at head dim 128
    (560/567 -> 567) and unmasked (d128 4k 651/648 -> 651, d256 16k 746/745 -> 751, d64 4k
    513/511 -> 518), where the table keeps its rows."""
    # A persistent grid shares out whole clusters' tiles in turn: no dynamic order there.
    return replace(entry, config=replace(entry.config, kv_multicast=True, cluster_heads=True, dynamic_tiles=False))


# (arch, dtype, head dim, row's min_seqlen_q) -> the causal row with head clusters.
_HEAD_CLUSTER_VARIANTS: dict[tuple[str, str, int, int], KernelEntry] = {
    (row.arch, row.dtype, row.head_dim, row.min_seqlen_q): _with_head_clusters(row) for row in TABLE if row.causal
}


@functools.lru_cache(maxsize=None)
def _with_blockwise_v(entry: KernelEntry) -> KernelEntry:
    # P's scale then changes from block to block: the row sums stay on the CUDA cores.
    return replace(
        entry,
        config=replace(entry.config, fp8_v_per_tensor=False, row_sum_on_tensor_cores=False, fp8_p_by_rounding=False),
    )


def format_table(arch: str | None = None) -> str:
    """The table as aligned text, for ``python -m flash4 info``."""
    rows = [row for row in TABLE if arch is None or row.arch == arch]
    if not rows:
        return f"no kernels for {arch}; supported: {', '.join(SUPPORTED_ARCHS)}"
    header = ("arch", "dtype", "head_dim", "causal", "seqlen_q >=", "kernel", "tile_m x tile_n",
              "kv_stages", "persistent", "K/V shared by")
    lines = [header]
    for row in rows:
        c = row.config
        shared_by = f"{c.cluster_ctas} query blocks" if c.kv_multicast else "-"
        lines.append(
            (row.arch, row.dtype, str(row.head_dim), str(row.causal), str(row.min_seqlen_q), row.kernel,
             f"{c.tile_m} x {c.tile_n}", str(c.kv_stages), str(c.persistent), shared_by)
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)

    def starts(by_head_dim: dict[int, int]) -> str:
        return ", ".join(f"{seqlen} at head dim {dim}" for dim, seqlen in by_head_dim.items())

    return (
        f"{table}\n\nCausal with an even number of query heads per K/V head: K/V shared by "
        f"{KV_MULTICAST_CTAS} query heads instead, {'/'.join(SUPPORTED_DTYPES)} from seqlen_q "
        f"{starts(HEAD_CLUSTER_MIN_SEQLEN)}; {FP8_DTYPE} with V per tensor from seqlen_q "
        f"{starts(FP8_HEAD_CLUSTER_MIN_SEQLEN)}.\n{FP8_DTYPE} rows on the same tiles (select_fp8): the scores "
        f"in f16 where Q's and K's codes keep them there (flash_attn_fp8's default), int8 Q and K in the "
        f"accurate mode (qk_int8), a V with one descale per key block on a kernel built for it."
    )
