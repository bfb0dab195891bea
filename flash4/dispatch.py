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
# multicast (kv_multicast; see _sm90_configs), by (head dim, causal).
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
# (at 512 it lost 1.5%, at 1k and 2k it gained 2%; see _sm90_configs).
LAZY_SLICED_MIN_SEQLEN = 1024
# Head dim 64 causal below 4k: the first key block's softmax in this many column slices of
# 32 keys, two 16-row warps' worth (masked_column_slices; see _sm90_configs).
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
    """(min_seqlen_q, config) rows per case, chosen with perf/sweep_configs.py on the H200
    (2026-11-29; TFLOP/s at seqlen 512 / 1k / 2k / 4k / 16k, 16k tokens):

    - Persistent (one CTA per SM looping over tiles; causal in balanced pairs of query
      blocks) at head dims 64 and 128: d128 full 421/502/574/620/634 -> 495/549/591/616/
      631, d128 causal 267/392/471/545/624 -> 335/436/522/561/610. At head dim 256, where
      O must be staged in Q's buffer, only causal below 16k pays (median of 3 interleaved
      rounds at 2k/4k/8k/16k: 503/561/613/671 -> 542/608/631/669); full does not
      (488/610/662/680/717 -> 503/590/644/679/712, one round at 512/1k/2k/4k/16k).
    - Three 64-row consumer warpgroups (192-row tiles) at head dim 64, where the S and O
      accumulators fit 160 registers a thread: full 340/380/410/422/434 -> 349/400/462/482/
      525 (persistent). Causal short sequences prefer 128-row tiles (less diagonal waste,
      more tiles to share out): 233/309/363 against 157/270/345, long ones 192 rows:
      397/429 -> 422/475 at 4k/16k.
    - Ping-pong of the consumer warpgroups where softmax is a large share of the time (not
      at head dim 256, where the GEMMs dominate; it lost 5-9% there).
    - O's rescale skipped when no row of a warp raised its max (rescale_when_needed) at
      head dim 256, where O is 128 registers a thread: full 592/711 -> 582/720, causal
      439/684 -> 437/706 at 1k/16k (two rounds); at 64 and 128 it lost up to 3%.
    - Two Q slots wherever O has a buffer of its own (persistent, head dims 64 and 128), so
      the next tile's Q loads while this one runs (three rounds, 512 / 1k / 4k): d64 full
      346/403/492 -> 355/406/495, causal 234/311/432 -> 244/320/428; d128 full
      507/573/638 -> 520/580/645, causal 335/440/577 -> 336/439/576.
    - At head dim 64, each block's row sum started from the old sum times O's factor
      (sum_from_rescaled), so O's rescale runs among the exponentials, which bind there
      (three rounds, 512 / 1k / 4k / 16k): full 356/400/488/525 -> 361/408/496/535,
      causal 244/316/431/492 -> 244/321/437/502. At 128 it lost 2-3% (587/646/658 ->
      568/624/640 full), at 256 it tied.
    - At head dim 256, 64-key blocks below 1k (full) and 2k (causal) queries: 80-key
      blocks load 560 keys for 512 (three rounds, 512 / 1k): full 481/594 -> 497/592,
      causal 316/446 -> 333/466. At head dim 64, 128-row tiles at 512 tied (360 -> 359).
    - Each consumer warpgroup storing its own 64 rows of O (o_store_per_warpgroup; two
      rounds, 512 / 1k / 4k, 2026-11-30-fwd-sweep-o-store-per-warpgroup.json) at head dim
      64: full 360/411/499 -> 387/429/500, causal 244/320/435 -> 256/324/441; 128 causal
      336/435/571 -> 353/452/578. Not at 128 full: 510/577/673 -> 523/589/633 (the table's
      4k rounds spread 643-707), nor there at 4k / 8k / 16k (632/636/636 -> 631/633/631).
    - Head dim 256 full below 1k queries persistent (2026-11-30, three rounds,
      -fwd-sweep-d256-short.json): 473 -> 493 at 512 (cuDNN 495), as one round had shown
      (488 -> 503); at 1k it ties (572 -> 575), and ping-pong ties at 512 and 1k.
    - Unmasked at head dims 128 and 256, clusters of two CTAs on adjacent query blocks
      sharing each K and V block by multicast, so L2 serves it once per pair (kv_multicast;
      2026-11-30, three rounds, --control, -fwd-sweep-kv-multicast*.json; medians, the
      selector's two copies against the candidate): head dim 256 at 2k / 4k / 8k / 16k
      646/646 -> 648, 662 -> 682/686, 691 -> 722/720, 714 -> 739/736 (flash-attn-4 654 /
      682 / 718 / 724; a first sweep 677/666 -> 683 at 4k, 718/713 -> 738 at 16k, tied at
      1k); head dim 128 at 16k 662/651 -> 668 and 645/644 -> 660 in two sweeps, but tied
      at 1k / 4k / 8k (571/580 -> 574, 647/639 -> 644, 656/649 -> 655). Not causal, where
      the pair's query blocks see different key blocks. Not at head dim 64 (its three
      warpgroups spill 12 bytes with it, stored once a tile): 2k / 8k / 16k 490/489 -> 457,
      529/523 -> 516, 536/536 -> 542 (-kv-multicast-d64.json).
      Causal (-kv-multicast-causal.json, three rounds, medians), a cluster walking the key
      blocks of its later query block, which the earlier one masks whole; one tile per CTA
      only (persistent causal CTAs run balanced pairs of far-apart blocks): head dim 256
      at 16k (one tile per CTA there already) 689/688 -> 711, at 8k one-tile 649/645 ->
      623; head dim 128 one-tile at 16k 613/617 -> 632, at 8k 601/596 -> 582 (flash-attn-4
      690, 660, 618, 595). Unmasked head dim 128 on one tile per CTA with clusters lost
      (8k / 16k 663/654 -> 646, 661/673 -> 659; -kv-multicast-d128-one-tile.json).
      Causal persistent grids with clusters, which share out balanced pairs of units
      (a unit: one cluster's two query blocks), at 8k, in two sweeps (three rounds,
      --control, -kv-multicast-causal-persistent{,-confirm}.json): head dim 256 646/651 ->
      668 and 653/647 -> 669, 128 606/610 -> 616 and 610/606 -> 616 (flash-attn-4 658-659,
      599-604). Lost or tied at 2k (d256 546/544 -> 534, d128 535/532 -> 525) and 4k (d256
      611/612 -> 624, then 609/617 -> 615; d128 577/586 -> 573, 582/584 -> 576), and tied
      at 16k against the one-tile clusters (d256 708/704 -> 704, d128 639/639 -> 637).
    - Causal, the tile's first key block (the diagonal's top) cut where rows cannot see it
      (2026-11-30, three rounds, --control; -fwd-sweep-masked-column-slices.json,
      -fwd-sweep-first-block.json; medians, the table's two copies against the candidate).
      Head dim 64, its softmax over only the 32-key slices each warp sees
      (masked_column_slices), at 512 / 1k / 2k in two sweeps: 253/255 -> 260 and 255/255 ->
      260, 328/326 -> 338 and 323/318 -> 334, 387/382 -> 397 and 391/384 -> 398 (cuDNN
      259/328/374); tied on the 192-row tiles from 4k (450/449 -> 449, 497/496 -> 496,
      511/511 -> 512). Head dim 128 lost at 512 (363/363 -> 349) and tied at 1k / 2k. Head
      dim 256, whose 64- and 80-key blocks leave the first warpgroup none of that block's
      keys in most tiles, skipping its S GEMM there (skip_unseen_first_block), 512 / 1k /
      2k / 4k / 8k: 330/324 -> 337, 444/449 -> 456, 546/538 -> 553, 607/610 -> 622, 679/675
      -> 689 (cuDNN 331/435/508/545/579); the one-tile clusters at 16k tied (718/719 ->
      719). With the column slices as well at 512 / 1k: 335, 459 (not taken).
    - Unmasked blocks keeping the row max within 2^8 of their scores (lazy_rescale: no
      quad shuffles, no O rescale, no factor exponential while the max holds; 2026-11-30,
      three rounds, --control, -fwd-sweep-lazy-rescale-{d64,d256,short,d256-4k}.json;
      medians, the table's two copies against the candidate). Head dim 64 full, 512 / 1k /
      2k / 4k / 8k / 16k: 382/381 -> 388, 421/421 -> 436, 488/486 -> 496, 501/503 -> 516,
      529/522 -> 551, 530/527 -> 545 (flash-attn-4 539 at 16k); causal on the 192-row
      tiles, 4k / 8k / 16k: 446/446 -> 456, 493/493 -> 513, 519/512 -> 528; the sliced
      128-row causal rows lost (512 / 1k / 2k 258/258 -> 256, 333/331 -> 330, 397/392 ->
      390). Head dim 256 full, 512 / 1k / 2k / 4k / 8k / 16k: 497/500 -> 517, 580/580 ->
      593, 641/628 -> 643, 677/682 -> 701, 721/714 -> 733, 738/744 -> 751; causal 338/336 ->
      343, 453/454 -> 471, 555/549 -> 557, 628/625 -> 631, 678/686 -> 684, 718/718 -> 731.
      Head dim 128 lost or tied (two rounds, -fwd-sweep-lazy-rescale.json, fastest rounds:
      full 1k / 4k / 16k 582/583 -> 580, 637/646 -> 639, 662/661 -> 662; causal 464/451 ->
      455, 601/589 -> 590, 649/645 -> 632).
    - lazy_rescale's branch chosen by the row sums of P under the kept max instead of
      each thread's max over its scores (lazy_check_by_sums: the common branch takes no
      max at all, a sixth of its instructions at head dim 64; 2026-11-30, three rounds,
      --control, -fwd-sweep-lazy-check-by-sums{,-2}.json; medians, the table's row again
      -> with lazy_rescale and the check by sums). Head dim 64 full, 512 / 1k / 2k / 4k /
      8k / 16k: 398 -> 396, 432 -> 444, 508 -> 528, 506 -> 534, 549 -> 579, 539 -> 569;
      causal 261 -> 257, 334 -> 340, 396 -> 403, 449 -> 472, 513 -> 536, 518 -> 539. Head
      dim 128 full 516 -> 520, 564 -> 583, 627 -> 653, 625 -> 668, 649 -> 714, 652 -> 690;
      causal 368 -> 368, 444 -> 451, 533 -> 550, 572 -> 591, 624 -> 632, 629 -> 637. Head
      dim 256 (against its max check) full 528 -> 539, 578 -> 578, 663 -> 681, 688 -> 701,
      744 -> 747, 736 -> 737; causal 347 -> 342, 464 -> 462, 575 -> 570, 625 -> 627, 702
      -> 704, 714 -> 715, so causal keeps the max check (its diagonal rows, whose max
      comes from a few keys, pass the sums more often and pay the rebasing). Head dim 64
      causal at 512 keeps no lazy_rescale. A probe with no check at all ran d64 full 16k
      at 583 (-fwd-probe-kept-max-check*.json).
    - Not taken: a share of head dim 64's exponentials on the FMA pipe (a cubic, 8
      instructions for one MUFU.EX2): every 16th lost 1-5% from 4k, more lost more, and
      on top of the check by sums every 16th still lost 1-6% (perf/sweep_configs.py).
      A third time after the fast tile divisions (2026-12-01, -fwd-sweep-fma-exp2.json,
      1 / 2 / 3 of every 8 columns): 1-8% slower at every length, more with every column.
      Head dim 64 causal 512, which tied cuDNN (261 against 260): no change to its row
      ran faster (lazy_rescale with the sums 255, dynamic tiles 250, a third K/V stage 259;
      -fwd-sweep-d64-causal-512.json); the tile scheduler's fast divisions, a change to
      every row, took it to 274 against 259 (2026-12-01-fwd-sweep-fast-tile-divmod.json).
      Head dim 128 unmasked 16k without its clusters: 712 against 710, a tie
      (-fwd-sweep-d128-no-multicast.json).
    - Head dim 256 unmasked from 4k (2026-12-01, --control, the selector's row against
      each; -fwd-sweep-d256-{persistent,knobs,pingpong}.json, -kv-multicast-four.json):
      a persistent grid, ping-pong (with or without the first block's turn), 64-key
      blocks, P before O's rescale, the max check instead of the sums all stayed within
      the rounds' spread, which at the GPU's power limit is itself 2-10% (8k: 731-745
      for the selector's row across the session's sweeps). Clusters of four CTAs sharing
      K and V lost 4-9% at head dims 128 and 256, and 37% on head dim 128 unmasked 16k's
      persistent grid (33 clusters of four: likely not all resident at once, a GPC's 16-18
      SMs holding four such clusters at most).
    - The tile's first S GEMM in the ping-pong turn (first_block_turn; three rounds,
      --control, -fwd-sweep-first-block-turn.json; table again -> with it), taken at head
      dim 128: full 512 / 1k / 4k / 16k 519 -> 533, 596 -> 601, 684 -> 694, 714 -> 717;
      causal 360 -> 363, 464 -> 470, 604 -> 606, 657 -> 658 (the fastest rounds the same
      way: 522 -> 544, 599 -> 658, 687 -> 717, 717 -> 717). Not at 64: full 396 -> 401,
      451 -> 456, 547 -> 549, 581 -> 579; causal 260 -> 258, 343 -> 343, 479 -> 479,
      564 -> 561 (at causal 512, where the warpgroups' first softmaxes were thought to
      leave the tensor cores idle, no gain).
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


# The FP8 kernel's tiles, chosen with perf/sweep_configs.py --pass fp8 on the H200
# (2026-11-29, the kernel alone, TFLOP/s at seqlen 1k / 16k, full then causal). Q's descale
# blocks are the query tile, K's and V's the key tile (multiples of the FP8 wgmma's 32-deep
# k-step): ``flash4.fp8.fp8_blocks`` reads them off the row a problem selects.
#
# First sweep (full, against 128x128 tiles with ping-pong, persistent below head dim 256):
# head dim 64 three 64-row consumer warpgroups (383/449 -> 416/580; 256 keys per block gave
# 407/529); head dim 256 persistent (895/1150 -> 981/1153).
#
# Then (two interleaved rounds) the rows take V per tensor, as flash_attn_fp8 quantizes it
# (fp8_v_per_tensor; a V with blockwise descales gets the row's kernel built for them,
# select_fp8), and skip O's rescale when no row of a warp raised its max
# (rescale_when_needed):
#   d64:  416/578, 262/485 -> 463/696, 281/609;
#   d256: 994/1171, 726/1124 -> 975/1223, 730/1096 (within the rounds' spread but 16k full).
#
# Third sweep (two rounds): head dim 128 on three warpgroups and 96-key blocks (the widest
# that compiles clean with 192 rows; 128 keys spill), against two on 192 keys: 667/898,
# 471/824 -> 693/947, 484/852 (no ping-pong gave 685/954, 466/839); but causal at 512
# 330 -> 266 (three rounds), so causal below 1k keeps two on 192 keys (1k: 484 against 486).
# Head dim 64 causal below 4k on 128-row tiles, as the 16-bit rows: 281 -> 321 at 1k (with
# one Q descale per warpgroup; 192-row tiles keep 16k, 608 against 540).
#
# Not taken: every 8th exponential on the FMA pipe instead of MUFU (lost 1-5% at head dims
# 64 and 128); one Q descale per 64-row warpgroup on 192-row tiles (lost 7% at head dim 64
# full, 464/696 -> 431/643); 160-key blocks at head dim 128.
#
# Fourth sweep (three rounds, 512 / 1k / 4k / 16k; -fp8-sweep-p-before-rescale.json): P
# converted before O's rescale (p_before_rescale) at head dim 256, full 994/1134/1217 ->
# 993/1158/1246 from 1k, causal 515/719/1000/1111 -> 519/739/1051/1178; it lost at 64 (full
# 4k 619 -> 549) and 128 (full 1k 700 -> 668). Two Q slots at head dim 128 full below 1k:
# 536 -> 557 at 512 (1k and up within 1%: 700/884/952 -> 697/879/948).
#
# Fifth (three rounds, 1k / 2k / 16k; -fp8-sweep-d128-tiles.json): head dim 128 causal from
# 1k to 2k on two warpgroups, 128-key blocks and two Q slots, 484 -> 515 at 1k (2k: 641 ->
# 632; without ping-pong 517 / 626). Full, that tile lost (698/830/939 -> 674/755/851), as
# did 160-key blocks (658/779/872) and 64-key ones on three warpgroups (621/733/832).
#
# Sixth (2026-11-30, two rounds, 512 / 1k / 4k / 16k, the kernels without an LSE;
# perf/results/h200/2026-11-30-fp8-sweep-row-sum-on-tensor-cores.json): row sums on the
# tensor cores (row_sum_on_tensor_cores), against the FADD sums: head dim 64 full
# 363/464/620/692 -> 385/486/648/727, causal 232/320/498/604 -> 236/328/512/620; 128 full
# 559/707/888/961 -> 566/722/913/982, causal from 2k 739/866 -> 752/895 at 4k/16k, below
# it 326/518 -> 317/513 at 512/1k (not taken there); 256 within 2% either way (full
# 818/1019/1194/1246 -> 815/1028/1216/1236; not taken: there the tensor cores bind).
#
# Seventh (2026-11-30, two rounds, 512 / 1k / 4k; 2026-11-30-fp8-sweep-o-store-per-warpgroup.json):
# each consumer warpgroup storing its own 64 rows of O (o_store_per_warpgroup): head dim
# 128 causal 328/516/751 -> 344/535/757, full 570 -> 586 at 512 (716/905 -> 719/906 at
# 1k/4k), 64 causal 238/330 -> 241/345 at 512/1k (509 -> 507 at 4k); 64 full lost
# (385/488/649 -> 370/455/608) although its key loop's SASS is the same instructions: the
# loss comes from how the three warpgroups then meet at tile boundaries, not the loop.
#
# Eighth (2026-11-30; -fp8-sweep-q-in-registers-{probe,d64,d128,d128-confirm}.json): Q held
# in registers for the S GEMM (q_in_registers; the SS wgmma reads up to 107 bytes a clock
# of shared memory's 128). Head dim 64 (two rounds, 512 / 1k / 2k / 4k / 16k): causal
# 243/344/425/512/620 -> 252/351/432/543/660, full tied (386/486/599/646/717 ->
# 384/487/600/648/716; not taken). Head dim 128 on three warpgroups runs out of registers
# (ptxas serialises the wgmmas), so on two with 128-key blocks, one Q slot (freed once
# loaded) and the row sums on the tensor cores (three rounds, 1k / 2k / 8k / 16k): causal
# 535/645/824/876 -> 596/728/865/894, at 512 345 -> 431 (two rounds); full 709/830 ->
# 753/840 at 1k / 2k, 586 -> 618 at 512, but 889 -> 872 at 4k and 923/970 -> 907/930 at
# 8k / 16k, where three warpgroups on 96-key blocks keep the rows. The 16-bit kernel lost
# with it (bf16 d128 full 514/580/642/647 -> 502/562/628/620 at 512 / 1k / 4k / 16k;
# perf/sweep_configs.py).
#
# Ninth (2026-11-30, three rounds, 1k / 4k / 16k, the kernels without an LSE;
# perf/results/h200/2026-11-30-fp8-sweep-p-by-rounding.json): wherever the row sums run
# on the tensor cores, P's e4m3 codes rounded from the scores (fp8_p_by_rounding, no MUFU
# exponential; kernels/e4m3_codes.py), faster rounds: head dim 128 full 763/920/977 ->
# 850/979/1033, causal 601/822/902 -> 651/888/979; 64 full 491/651/723 -> 578/749/813,
# causal 354/548/665 -> 420/630/740 (cuDNN 739/884/897, 469/732/849, 445/545/563,
# 281/420/539). Then head dim 256 with both (three rounds, 512 / 1k / 2k;
# -fp8-sweep-d256-p-by-rounding.json): full 826/1027/1141 -> 868/1034/1144, causal
# 522/756/945 -> 552/785/950 (cuDNN 724/861/945, 435/602/773); at 4k / 16k within the
# rounds' spread (two rounds, -fp8-sweep-after-p-by-rounding.json: full 1211/1268 ->
# 1209/1296, causal 1080/1242 -> 1095/1246). Not taken there: head dim 128's short-row tile
# at every length (full 1000/1058 -> 983/1023 at 4k / 16k), Q in registers at 64 (within
# 1%).
#
# Tenth (2026-11-30, three rounds, --control, 1k / 4k / 16k, the kernels without an LSE;
# -fp8-sweep-dynamic.json): causal tiles taken at run time (dynamic_tiles, as the 16-bit
# rows above), medians, the table's two copies against it: head dim 64 4k 629/624 -> 636,
# 16k 745/736 -> 762; 128 4k 868/875 -> 883, 16k 974/944 -> 992; lost at 1k (64 418/418 ->
# 401, 128 648/647 -> 614) and at head dim 256 (1k 781/771 -> 725, 16k 1214/1204 -> 1196).
#
# Eleventh (2026-12-01, three rounds, --control, 1k / 16k; -fp8-sweep-fast-tile-divmod.json):
# the tile scheduler's divisions by the divider instead of multiply and shift
# (fast_tile_divmod=False; the fast ones, taken on 2026-12-01 from bf16 sweeps, had cost
# head dim 64 unmasked 8%: A/B against the tree before them, 571/814 -> 527/750), medians,
# the table's two copies against it: head dim 64 full 528/534 -> 549, 750/751 -> 776; 256
# causal 750/775 -> 789, 1210/1219 -> 1245. Lost at 64 causal 1k (433/440 -> 416) and 128
# causal 1k (661/674 -> 656); tied elsewhere (256 full 1007/1025 -> 1025, 1286/1279 -> 1296).
#
# Twelfth (2026-12-01, three rounds, --control, 1k / 16k; -fp8-sweep-rebuilt-divisors.json):
# the divider's divisors rebuilt in the kernel from the scheduler's sizes, not carried as
# kernel-argument values (what fast_tile_divmod=False now does), the rows carrying them
# twice against it: head dim 64 full 551/548 -> 570, 783/779 -> 811; 256 causal 781/776 ->
# 778, 1248/1246 -> 1264.
#
# Thirteenth (2026-12-01, three rounds, --control, 1k / 16k;
# -fp8-sweep-fast-divisions-after-cursor.json): after K's descales were read through a
# carried cursor (kernels.online_softmax.DescaleCursor; ptxas had rebuilt their row
# address, divisions included, in every key block: what the divider rows had saved), the
# fast divisions on those two rows again, the divider rows twice against them: head dim 64
# full 582/581 -> 589, 810/809 -> 808; 256 causal 774/771 -> 797, 1209/1228 -> 1219. Head
# dim 64 unmasked took them; 256 causal keeps the divider: with the fast divisions, the
# CUDA 12 ptxas that the default install brings (nvidia-cutlass-dsl-libs-cu12; the H200
# runs CUDA 13's) holds the cursor in a vector register and spills 8 bytes of the tile's
# prologue (none with the divider, whose batch and head, and so the cursor, stay on the
# uniform datapath), and a kernel of the table must not spill (tests/test_fp8_cpu.py).
_SM90_FP8_BASE = dict(fp8=True, fp8_v_per_tensor=True, rescale_when_needed=True, persistent=True)
_DYNAMIC_TILES = dict(dynamic_tiles=True)
# Row sums on the tensor cores, and with them (they sum the same P) P's codes by rounding.
_SUMS_ON_TENSOR_CORES = dict(row_sum_on_tensor_cores=True, fp8_p_by_rounding=True)
_O_PER_WARPGROUP = dict(o_store_per_warpgroup=True)
_Q_IN_REGISTERS = dict(q_in_registers=True)
# The tile scheduler's divisions on the uniform datapath (see the thirteenth sweep).
_DIVIDER = dict(fast_tile_divmod=False)
# Head dim 128 on two warpgroups, 128-key blocks, Q in registers (see the eighth sweep).
_D128_Q_IN_REGISTERS = dict(tile_n=128, **_Q_IN_REGISTERS, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP)
# (head dim, causal) -> (min_seqlen_q, the row's choices) per row.
_SM90_FP8_ROWS: dict[tuple[int, bool], tuple[tuple[int, dict], ...]] = {
    (64, False): ((1, dict(tile_n=128, consumer_warpgroups=3, **_SUMS_ON_TENSOR_CORES)),),
    (64, True): (
        (1, dict(tile_n=128, **_SUMS_ON_TENSOR_CORES, **_O_PER_WARPGROUP, **_Q_IN_REGISTERS)),
        (4096, dict(tile_n=128, consumer_warpgroups=3, **_SUMS_ON_TENSOR_CORES, **_Q_IN_REGISTERS, **_DYNAMIC_TILES)),
    ),
    (128, False): (
        (1, _D128_Q_IN_REGISTERS),
        (4096, dict(tile_n=96, consumer_warpgroups=3, **_SUMS_ON_TENSOR_CORES)),
    ),
    (128, True): ((1, _D128_Q_IN_REGISTERS), (4096, dict(**_D128_Q_IN_REGISTERS, **_DYNAMIC_TILES))),
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
    arch: str, head_dim: int, causal: bool, seqlen_q: int, v_per_tensor: bool, group: int = 1
) -> KernelEntry:
    """The FP8 row for this problem (``group``: query heads per K/V head); for a V with one
    descale per key block (``v_per_tensor=False``), the row's kernel built for blockwise V
    descales."""
    if not v_per_tensor:
        return _with_blockwise_v(select(arch, FP8_DTYPE, head_dim, causal, seqlen_q))
    return select(arch, FP8_DTYPE, head_dim, causal, seqlen_q, group)


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
        f"{starts(FP8_HEAD_CLUSTER_MIN_SEQLEN)}."
    )
