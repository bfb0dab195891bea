"""Time candidate configurations of the Hopper kernels on protocol shapes.

A development tool for choosing the selector's rows (flash4/dispatch.py) and the backward's
configurations (flash4/backward.py): each candidate is a change to the configuration the
selector picks for the shape; the candidates, flash-attn-4 and cuDNN are timed on the same
tensors, taking turns over ``--rounds`` rounds (the bench's measure_shape), and each keeps
its median. Two rounds of one kernel differed by up to 10% on the H200, so a single round
decides nothing below that. Each candidate's largest distance to torch SDPA's output (dq
for the backward) is printed beside its time: a fast wrong kernel is no candidate.

    python perf/sweep_configs.py [--pass bwd] [--hdim 128] [--seqlen 2048 8192] [--rounds 5] [--group 8]
                                 [--candidates '[{"kv_stages": 3}]']
                                 [--out perf/results/h200/DATE-sweep.json]

With ``--out``, the records (each candidate's rounds and distance, the versions, the
command) go to that JSON after every shape, so a run cut short keeps what it measured.

``--control`` times the selector's configuration once more, after the candidates ("...
again"): the two copies differ only by their place in the turn, so their gap is the
smallest difference a candidate must beat. In every two-candidate backward sweep of
2026-11-30 at seqlen 16k, one provider's second round ran 10-20% slower than its first,
whichever configuration stood there: the first provider on unmasked shapes, the second on
causal ones (where each call takes half as long), i.e. at about the same time into the
shape. With two rounds the median is their mean and carries half of that; keep three,
and read each provider's fastest round (perf/read_rounds.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from flash4 import bench
from flash4.compiler import compiled_forward, tile_counter
from flash4.dispatch import KernelEntry, select
from flash4.devices import device_sms
from flash4.interface import LOG2_E

# Each list: the selector's row ({}) and changes to it; a change that does not apply to a
# shape is left out there. Add a candidate here with its GPU test, run the sweep, keep the
# winner as the row and delete the rest. Tried on the H200 and not taken (2026-11-29, 1k
# and 16k, 2-3 rounds; perf/results/h200/2026-11-29-fwd-sweep-candidates3.json and
# -fwd-d128-epilogue-arrive.json): 176- and 192-key blocks at head dim 128, O's rescale
# skipped at 64 and 128, one tile per CTA (lost 10-20% at 1k causal), the causal one-tile
# order across L2 groups of heads (as one tile per CTA), the epilogue's O barrier as a sync
# of the storing warp only (within noise, -2% at head dim 256), a third K/V stage at 64.
# The next tile's first S GEMM issued under this tile's epilogue (overlap_epilogue, 3 rounds
# at 512/1k/4k, -fwd-sweep-overlap-epilogue.json): d64 full 355/400/479 -> 349/401/475,
# causal 246/316/424 -> 238/313/424; d128 full 528/596/644 -> 512/579/632; FP8 d128 full
# 555/701/883 -> 533/691/872 (against two Q slots). Lost or tied everywhere.
# P converted before O's rescale (p_before_rescale; taken by the FP8 head-dim-256 rows),
# 3 rounds at 512/1k/4k/16k (-fwd-sweep-p-before-rescale.json): within 1-2% at 64 and
# 128 either way; d256 full 481/575/673/702 -> 483/569/644/694. One CTA per SM at d256 full
# on 64-key blocks: 481/575 -> 497/587 at 512/1k, but its slowest rounds 425/510 against the
# row's 469/575 (and the row had given 497 at 512 in the sweep before): not taken.
# Warpgroups whose 64 rows all lie past seqlen_q (the ragged last tile of 192-row tiles)
# keeping only the barriers and skipping their GEMMs and softmax (skip_idle_warpgroups, 3
# rounds at 512/1k/2k/4k; -fwd-sweep-idle-warpgroups.json, -fp8-sweep-idle-warpgroups.json):
# bf16 d64 full 358/420/479/497 -> 360/422/476/500, causal flat; FP8 d128 full
# 556/701/822/881 -> 566/698/832/892, causal 327/483/639/739 -> 317/482/644/751; FP8 d64
# full 370/465/574/617 -> 355/433/535/574. The warpgroup left alone runs its blocks
# unoverlapped, about as long as three in turn, so the tail tile hardly shortens.
# Lost (2026-11-30, three rounds, 512 / 1k / 4k / 16k; -fwd-sweep-rescale-skip-after-p.json):
# O's rescale skipped when no row of a warp raised its max, with P converted above that
# branch (rescale_when_needed + p_before_rescale), at head dims 64 and 128. d128 full
# 522/594/652/658 -> 512/568/637/658, causal 338/442/579/628 -> 334/439/564/625; d64 full
# 358/412/498/533 -> 362/412/501/546 but causal 244/321/437/498 -> 239/307/432/500.
# Lost (2026-11-30, three rounds, 512 / 1k / 4k / 16k; -fwd-sweep-deferred-pv-wait.json):
# each block's wait for its P V, O's rescale and P's conversion moved to the start of the
# next block's step (bit-identical). Within one block ptxas (cu13) hoists that wait above
# every exponential at head dims 64 and 128 (ncu, d128 full 8k: 7% of the loop's stall
# samples on it); behind the back edge the exponentials do overlap P V, yet d128 full
# 509/564/635/654 -> 485/542/595/601, causal 343/443/578/621 -> 327/423/551/596, d64 full
# 363/414/496/530 -> 336/388/476/513; d256 within 1%. Rebuilt and measured again
# (2026-11-30, three rounds, --control, 1k / 4k / 16k; -fwd-sweep-deferred-pv-wait-clean.json;
# 36 GPU tests bit-identical to the table's kernels) after ptxas's C7514 was counted as a
# serialised wgmma, which the first run might have hidden: it compiles clean (no C75xx
# remark, the same 168 registers, SASS: the wait at the step's top, all 66 MUFU.EX2 after
# the S wait) and still loses (medians): d128 full 587/639/658 -> 560/588/617, causal 473/582/631 ->
# 457/567/608; d64 full 433/507/536 -> 411/487/517, causal 330/444/499 -> 319/432/491.
# A reading, not shown: the exponentials running beside the RS P V GEMM slow it (that
# wgmma reads P from the warp's own registers while it runs); ptxas parks the warp on the
# wait instead. (The backward's dK from shared memory, below, did not bear it out there.)
# Probe, not a candidate (2026-11-30, three rounds, --control, 1k / 4k / 16k;
# -fwd-probe-exps-before-pv-wait.json): the same schedule got another way, both rows' max
# first and O's factor from the scaled max divided back (a MUFU.RCP on its path), after
# which ptxas runs 40 of the 66 exponentials before the P V wait instead of 6 (30 more
# instructions a block). Medians: d128 full 578/634/644 -> 554/598/620, causal 450/575/625 ->
# 440/554/606; d64 full 424/502/524 -> 370/421/497, causal 328/437/493 -> 314/363/464.
# flash-attn-4's loop (perf/peer_sass.py) runs 10 there.
# Not taken (2026-11-30, three rounds, --control, 1k / 4k / 16k;
# -fwd-sweep-rescale-o-before-pv.json; 42 GPU tests against the reference passed): O's
# rescale by a block's factors moved into the next step, between its S and P V issues (as
# flash-attn-4 does above head dim 128), so that its FMULs (64 a thread at 128) leave the
# step's tail; ptxas then puts them among the S wgmmas and waits for P V before every
# exponential. Faster rounds against the better of the table's two: d128 full
# 631/659/658 -> 591/642/661, causal 473/593/646 -> 469/583/629; d256 full 604/701/725
# -> 586/677/717, causal 473/639/706 -> 462/625/696; d64 within 1-2%, lower.
# Lost (2026-11-30, three rounds, 4k / 8k / 16k; -fwd-sweep-one-tile-long.json): one tile
# per CTA (one Q slot) at head dims 64 and 128 on long sequences, where ncu (d128 full 8k)
# showed the persistent grid idle at its end 1.7% of the time against flash-attn-4's 1.0%:
# d128 full 646/648/651 -> 617/630/635, causal 579/605/615 -> 534/574/618; d64 full
# 500/526/527 -> 484/519/528, causal 431/470/495 -> 413/470/496.
# Lost (2026-11-30, three rounds, 512 / 1k / 2k; -fwd-sweep-64-key-blocks.json): 64-key blocks
# at head dims 64 and 128 on short sequences (twice the steps a tile, so a shorter pipeline
# fill and drain): d64 full 360/414/476 -> 344/386/437, causal 242/320/380 -> 223/291/340;
# d128 full 527/584/616 -> 475/521/550, causal 337/441/517 -> 321/409/478.
# Lost or tied (2026-11-30, three rounds, 512 / 1k / 2k / 8k; -fwd-sweep-no-pingpong.json): no
# ping-pong at head dims 64 and 128, rechecked on today's persistent rows: d64 full
# 360/419/482/531 -> 360/391/448/515, causal 243/321/379/473 -> 239/306/353/442; d128 full
# 525/599/628/660 -> 523/583/613/639, causal 337/445/524/610 -> 334/440/520/609.
# The S GEMM issued from inline PTX with 32-bit descriptor arithmetic (the DSL adds each
# k-step's offset to the 64-bit descriptor with a carry: 5 uniform instructions per wgmma
# in the key loop, 3.5 this way; 2026-11-30, three rounds, 1k / 4k / 16k,
# -fwd-sweep-asm-s-gemm.json, same max distance to SDPA): d128 full 589/645/663 ->
# 582/640/649, causal 451/575/621 -> 445/571/620; FP8 d128 full 704/960 -> 705/960 at
# 1k / 16k (-fp8-sweep-asm-s-gemm.json). Fewer instructions do not pay: issue is not what
# binds in the 16-bit kernel.
# P in two register buffers taking turns, so that the softmax never waits for the P V GEMM
# reading the previous P (ptxas puts that wait before every exponential of the block; here
# none), O's rescale moved to the top of the next step, before its turn (2026-11-30, three
# rounds, 1k / 4k / 16k, -fwd-sweep-two-p-buffers.json; 53 GPU tests bit-identical to the
# table's kernels): d128 full 587/649/651 -> 559/629/644, causal 434/573/621 -> 429/572/623.
# With the wait pinned below the exponentials by a uniform branch instead, ptxas
# serialised the wgmmas. Not taken: the wait is not what the tensor cores idle on.
# Lost (2026-11-30, two rounds, 1k / 4k / 16k; -fwd-sweep-d128-three-warpgroups.json): head
# dim 128 on three consumer warpgroups and 80-key blocks (96 spill; one Q slot, as O's own
# buffer leaves no room for two), full 608/644/661 -> 524/621/641, causal 447/582/624 ->
# 368/531/595.
# Lost (2026-11-30, two rounds, 512 / 1k / 4k / 16k; -fwd-sweep-q-in-registers.json; 20 GPU
# tests bit-identical to the table's kernels): Q in registers for the S GEMM
# (q_in_registers, which the FP8 rows take): d128 full 514/580/642/647 -> 502/562/628/620,
# causal 358/454/576/618 -> 349/444/562/600; d64 on two warpgroups (three spill with Q
# held) full 386/423/497/525 -> 378/414/444/437, causal 255/329/440/493 ->
# 252/323/401/435. The 16-bit S GEMM reads 96 bytes a clock of shared memory, the FP8 one
# 107: only FP8 gains from the relief.
# Not taken (2026-11-30, three rounds, 4k / 8k / 16k; -fwd-sweep-d128-full-o-store-long.json):
# each warpgroup storing its own O at head dim 128 full, 632/636/636 -> 631/633/631.
# Lost (2026-11-30, three rounds, --control, 1k / 4k / 16k; -fwd-sweep-pv-wait-pinned.json;
# 42 GPU tests, bit-identical to the table): flash-attn-4's loop order rebuilt exactly. The
# P V wait pinned after every row's max and its 64 scaled-score FFMAs (a never-taken branch
# reading them ends the basic block, so ptxas neither hoists the wait nor sinks the FFMAs;
# same instruction count), and with sum_from_rescaled O's rescale among the exponentials:
# SASS d128 max + 64 FFMA + 1 MUFU beside P V, as flash-attn-4's max + 66 FFMA + 10 MUFU.
# Faster rounds, d128 full 632/659/664 -> 574/625/640 (pinned), 580/633/651 (and the sum
# from the rescaled one); causal 473/595/638 -> 463/577/622, 462/589/627; d64 (its row
# has that sum) full 446/507/540 -> 434/501/534, causal 330/449/502 -> 328/443/506. The
# order of the softmax around the P V wait is not what flash-attn-4 gains at d128 16k.
# Lost or tied (2026-11-30, three rounds, --control, 1k / 4k / 16k;
# -fwd-sweep-d128-three-kv-stages.json; 14 GPU tests passed): head dim 128 with three K/V
# stages and one Q slot (O staged in Q's buffer, so the shared O store), 224 KiB. Faster
# rounds, full 625/638/650 -> 518/612/645, causal 463/581/622 -> 403/556/623: the K/V
# loads are not late at 16k, and the lost Q slot costs the short sequences 4-17%.
# Taken (2026-11-30, --group 8; flash4/dispatch.py, _with_head_clusters): clusters of two
# query heads of one K/V head (cluster_heads), causal from 2k-4k.
# Not taken (2026-11-30, three rounds, --control; -fwd-sweep-kv-multicast-d64-causal.json; 5
# GPU tests bit-identical to the row): head dim 64 causal (three warpgroups, persistent)
# with clusters of two query blocks, which compile clean there (the unmasked row spills
# 12 bytes with them). Medians 8k 478/479 -> 467, 16k 492/493 -> 501; fastest rounds
# 518/479 -> 470, 500/494 -> 501 (flash-attn-4 485 / 502 median).
# Probe (2026-11-30, three rounds, perf/wave_tail_probe.py --pass fwd,
# -fwd-wave-tail-probe.json): beside shapes whose tiles fill whole rounds of the grid, head
# dim 128 unmasked at 16k ran 667 -> 685 (flash-attn-4 669 -> 688; 2048 tiles are 15.52
# rounds on 132 SMs at every protocol length), 64 529 -> 534, 256 (one tile per CTA) even.
# Lost (2026-11-30, three rounds, --control, -fwd-sweep-split-tail.json; 5 GPU tests of the
# variant and 52 scheduler variants passed; code on branch proto/split-tail): the persistent
# grid's last round cut into 2-4 pieces along the keys, each piece leaving its O, row max and
# sums in a workspace and the last to draw its unit's ticket merging the others
# (split_tail). Medians, table/again -> split: d128 2k / 4k / 16k 621/619 -> 574, 645/638 ->
# 610, 672/660 -> 667; d64 496/494 -> 483, 508/500 -> 509, 539/536 -> 531. Timed alone
# (triton do_bench, three rounds), the variant with nothing cut (one piece, placeholder
# buffers) already ran d128 2k 422 -> 450 us, 4k 817 -> 870, 16k 3215 -> 3310, d64 2k 542
# -> 566; cutting then saved 20 us at d128 16k and 6 us at d64 2k, and cost 18 us at d128
# 2k and 4k (pieces of 5-10 blocks, each paying its pipeline fill and a merge). Same
# registers (168) and no spills; what slows the uncut variant's loop was not found.
# Lost (2026-11-30, three rounds, --control, causal 1k-16k; -fwd-sweep-zigzag.json; 28 GPU
# tests bit-identical to the table): causal persistent grids dealing single tiles sorted
# longest first across all heads (every (head, batch) entry's last query block, then the one
# before), one per CTA a round, every other round reversed (zigzag_tiles), instead of
# long-short pairs. A model with equal blocks has the pairs' whole units leaving 3-6% of the
# SMs idle in a partial last round (d64 causal 16k: 1376 pairs on 132 SMs, 10.42 rounds run
# as 11) and the zig-zag 0.5%. Faster rounds, table -> zig-zag: d64 1k / 4k / 16k
# 332/438/492 -> 300/401/484; d128 1k / 2k / 4k 459/540/577 -> 374/443/507; d256 1k / 4k
# 464/622 -> 366/580. Its rounds spread every entry's tiles over the grid at once: at d128 1k
# 132 entries' K and V (66 MB) against the pairs' ~33 (17 MB) in 50 MB of L2. L2 locality
# outweighs the tail; a balanced order must keep each round's tiles within a few entries.
# Taken (2026-11-30, three rounds, --control; -fwd-sweep-dynamic{,-confirm}.json; 28 GPU
# tests bit-identical to the pairs, twice each): causal persistent grids taking their tiles
# at run time, longest first within sections of heads (dynamic_tiles), at head dim 64 from
# 2k and 128 at 4k (flash4/dispatch.py, DYNAMIC_TILES_MIN_SEQLEN, has the numbers).
# Taken (2026-11-30, three rounds, --control; -fwd-sweep-masked-column-slices.json,
# -fwd-sweep-first-block.json; 112 GPU tests bit-identical to the rows without): causal,
# the first key block's softmax over only the column slices each warp sees
# (masked_column_slices) at head dim 64 below 4k, and its S GEMM skipped by a warpgroup
# that sees none of it (skip_unseen_first_block) at head dim 256 below 16k
# (perf/h200-findings.md has the numbers). Not taken: the slices at head dim 128 (512
# 363/363 -> 349) and with the skip at 256.
# Lost (2026-11-30, three rounds, --control; -fwd-sweep-dynamic-short.json): dynamic_tiles
# on head dim 64's causal row below 2k, now with the column slices: 512 259/260 -> 249, 1k
# 339/338 -> 334 (cuDNN 259, 324): a ticket a tile and the counter's zeroing outweigh the
# balance where a tile is 1-8 blocks.
# Lost (2026-11-30, three rounds, --control; -fwd-sweep-slice-counts.json,
# -fwd-sweep-slice-branches.json; 32 and 48 GPU tests bit-identical to the block uncut):
# other cuts of that first block. Medians, table/again -> candidate, causal 512 / 1k / 2k.
# Halves (one copy of the softmax fewer): d64 261/260 -> 257, 340/339 -> 331, 405/395 ->
# 396; d128 362/356 -> 358, 463/458 -> 454, 534/525 -> 532. Eighths (16 keys, one warp's
# rows on the diagonal; eight copies, 5400 instructions against 3400): d64 170, 272, 353,
# so code size binds there. One copy with each slice's exponentials behind a warp-uniform
# branch instead of a copy per count (the whole block masked first, 2500 instructions):
# d64 259/259 -> 251, 340/337 -> 327, 403/392 -> 389, eighths 249 / 324 / 393; d128 quarters
# 365/367 -> 347, 468/462 -> 455, 535/545 -> 534.
# Taken (2026-11-30, three rounds, --control; -fwd-sweep-lazy-rescale*.json; 60 GPU tests
# against the reference, random and rising scores): unmasked blocks keeping the row max
# while the warp's scores stay within 2^8 of it (lazy_rescale) at head dim 64 (unmasked,
# causal from 4k) and 256, +1-4% (perf/h200-findings.md has the numbers). Not at head dim 128
# (lost or tied) nor on head dim 64's sliced causal rows below 4k (-1-2%).
# Lost (2026-11-30, three rounds, --control; -fwd-sweep-exp2-on-fma.json; 48 GPU tests
# against the reference passed): head dim 64, every 16th / 8th / 4th exponential of
# lazy_rescale's common branch by a cubic on the FMA pipe (x = round + fraction by adding
# 1.5 * 2^23, three FADD, three FFMA, a max against underflow and the exponent added as an
# integer: 8 instructions for one MUFU.EX2, 7.5e-5 relative). Medians, table again ->
# every 16 / 8 / 4: full 1k 429 -> 431 / 420 / 409, 4k 516 -> 492 / 487 / 475, 8k 536 ->
# 517 / 508 / 491, 16k 541 -> 524 / 517 / 500; causal 4k 454 -> 450 / 435 / 417, 8k 500 ->
# 495 / 489 / 466, 16k 521 -> 515 / 497 / 479. The more exponentials leave MUFU, the slower:
# MUFU does not bind there, and about 7% more instructions cost 1-5%.
# Probes (2026-11-30, -fwd-probe-kept-max-check*.json; output wrong on purpose where a
# warp would rebase): lazy_rescale's common branch without its max over the scores ran d64
# full 4k / 16k 515 -> 549, 553 -> 583, causal 456 -> 482, 527 -> 555; with the branch
# chosen by the row sums of P after the exponentials, 544 / 577; K released after the
# softmax instead of before, the same. Taken (three rounds, --control,
# -fwd-sweep-lazy-check-by-sums{,-2}.json; 90 GPU tests against the reference with random,
# rising and spike scores): that check (lazy_check_by_sums), with the rebasing of P by its
# largest value and the recomputed scores where P overflows, on every row but head dim
# 256 causal, +2-10% (perf/h200-findings.md has the numbers); lazy_rescale itself then at
# head dim 128 too. A first rebasing by whole octaves (P's largest value left in [1, 2))
# put one-hot rows one bf16 step off V's row (that P rounded in 16 bits, the sum not):
# the spike test caught it.
# Then (2026-11-30, three rounds, --control, medians, table again -> candidates): the FMA
# pipe's exponentials on top of the check by sums, every 16th / 8th
# (-fwd-sweep-exp2-on-fma-by-sums.json): d64 full 1k / 4k / 16k 450 -> 438 / 436, 541 ->
# 525 / 523, 589 -> 555 / 548; causal 341 -> 338 / 329, 478 -> 467 / 451, 552 -> 538 /
# 522. Lost again; removed. Head dim 128 unmasked 16k without its clusters 710 -> 712
# (-fwd-sweep-d128-no-multicast.json): a tie, not taken. Head dim 64 causal 512 (row 261,
# cuDNN 260; --candidates, -fwd-sweep-d64-causal-512.json): lazy_rescale with the sums
# 255, dynamic_tiles 250, masked_column_slices 2 / 0 255 / 254, kv_stages=3 259, tile_n=64
# 234, one tile per CTA 187. None taken.
# The tile's first S GEMM in the ping-pong turn (first_block_turn;
# -fwd-sweep-first-block-turn.json, 48 GPU tests of the same bits): taken at head dim 128
# (+0-3%), tied or lost at 64 (perf/h200-findings.md has the numbers).
CANDIDATES: dict[int, list[dict[str, Any]]] = {h: [dict()] for h in (64, 128, 256)}
# Tried on the H200 (2026-11-29, seqlen 512 and 16k, 2 rounds) and taken: dQ converted by a
# CuTe kernel (+13-21% at 512), dQ's TMA reductions from a store warp (+1-7%). Not taken:
# the preprocess's loads all issued first (within noise), K and V counted on the first Q
# and dO stages (lost 2-6% at 16k), dQ transposed on 80-row query blocks at head dim 128
# (flash-attn-4's non-causal choice; lost 6-13%, -bwd-d128-swap-ab.json), programmatic
# dependent launch after the preprocess (+1% at 512, -9% to +8% at 16k in rounds that
# spread as wide; -bwd-sweep-pdl.json), LSE and D read into registers while Sᵀ and dPᵀ run
# (stats_early; tried before and after the dQ tile fix, which left ncu's largest gap to
# flash-attn-4 on those loads: -2% to +3% at head dims 128 and 256, 2k and 16k, 3 rounds;
# -bwd-sweep-stats-early.json); dQ's shared-memory tile in the accumulator's register order
# (16-byte stores, ncu's mio_throttle at twice flash-attn-4's) and two CTAs of adjacent key
# blocks sharing Q and dO by multicast (L2 at 87-90% at head dim 256): at 16k within the
# rounds' spread (d128 full 587 -> 601 / 598, d256 full 448 -> 457 / 456, causal flat), at
# 1k 2-6% slower (d128 full 454 -> 440 / 441, d256 causal 290 -> 274; 3 rounds,
# -bwd-sweep-fragment-multicast.json). (Deterministic cost 0.59-0.74x; the README has it.)
# Lost (2026-11-30, three rounds, 1k / 4k / 16k; -bwd-sweep-kv-in-registers.json): K (or V)
# held in registers as the Sᵀ (dPᵀ) GEMM's A operand, so those wgmmas read only Q (dO) from
# shared memory. Head dim 64 full 406/492/526 -> 405/494/524 (K) and 401/488/518 (V),
# causal 301/455/521 -> 281/407/470 and 285/409/474: ptxas spills 20-60 bytes. At 128 and
# 256 it spills 76-204 bytes and serialises the wgmmas, so was not run. Shared memory's
# bandwidth is not what binds the 16-bit backward at 64.
# Taken (2026-11-30, three rounds, -bwd-sweep-overlap-postprocess.json): the postprocess
# overlapping the main kernel (overlap_postprocess), 1k unmasked 403/442/356 ->
# 404/468/363 at head dims 64/128/256, causal 301/334/285 -> 305/345/297; 4k and 16k
# within the spread. Not taken (2026-11-30, printed only, protocol 1k): the preprocess
# with its loads issued before its stores, in batches (load_batches), the accumulator's
# zeros first, between or last: 77-79 us -> 79-98 us at head dims 64/128/256, where a
# copy of as many bytes takes 68-69 us.
# Lost (2026-11-30, three rounds, -bwd-sweep-early-dv.json): at head dim 128, dV's GEMM
# issued right after P and before the wait for dPᵀ, which pins all 32 exponentials a
# thread computes ahead of that wait (ptxas otherwise hoists it over all but 5 of them in
# the mask-free loop; flash-attn-4's SASS keeps them ahead, and ncu at 16k,
# -ncu-bwd-d128-full-16k.json, has flash4 at 14.2M cycles to its 13.4M). Full 475/561/595
# -> 448/553/573, causal 352/507/588 -> 347/496/572 at 1k/4k/16k. At 64 it spills.
# Taken (2026-11-30, two rounds; -bwd-sweep-first-stores.json, -bwd-sweep-rotate.json): dQ's
# first contribution per query block stored, not added (dq_first_stores; the preprocess
# no longer zeroes 128 MB), with the key blocks' walks rotated unmasked
# (rotate_query_blocks). 512 full 326/370/292 -> 342/403/314 at head dims 64/128/256,
# causal 208/239/201 -> 218/264/228, causal 1k +3-6%. First stores without the rotation
# lost 4-7% unmasked at 16k (d128 586 -> 545, all key blocks reaching a query block at
# once and waiting for its first store); rotated, 4k and 16k are within the spread.
# Lost again (2026-11-30, two rounds, -bwd-sweep-row-stats-in-registers.json; stats_early
# above, rechecked after the store warp and first stores): each thread's LSE·log2(e) read
# from shared memory into registers right after the Sᵀ GEMM's issue and D before the dPᵀ
# wait (as flash-attn-4 does at head dim 128), where ncu had 104k short-scoreboard
# samples on the first FFMAs after the S wait. Head dim 128 full 496/558/546 ->
# 466/549/568 at 1k/4k/16k (the 16k baseline's rounds 514-583), causal 373/515/583 ->
# 368/511/539; head dim 256 within 1%. At 64 (32 columns a thread) it spills 60 bytes.
# Lost again (2026-11-30, two rounds, -bwd-sweep-dq-register-order.json; kernels alone:
# -bwd-stages-dq-register-order.json; the register order above, rechecked with the stages
# timed apart): dQ stored from each warpgroup's registers in their own order, 16 bytes a
# thread (half the shared-memory stores, flash-attn-4's way), with the postprocess putting
# each value in place. The main kernel alone gained 0.8% at head dim
# 128 (16k 9.51 -> 9.43 ms) and nothing at 64; the postprocess, storing 4 bytes to each of
# two rows per 16-byte load, went from 54 to 125-143 us, and 1k lost 5-10%. The stores
# are not what holds the head-dim-128 kernel back.
# Probes (2026-11-30, main kernel alone, two rounds; -bwd-stages-dq-probes.json; temporary
# fields, never committed). Head dim 128 full 16k, 9.34-9.47 ms: dQ's shared-memory stores
# skipped 8.62-8.77 (-7%), its bulk reductions too 8.55-8.63: the 32 KB of fp32 stores a
# block cost what shared memory's 256 wavefronts would. dQ added from registers instead,
# red.global.add.v2.f32 / .v4.f32 (register order): 12.4 / 11.0 ms, causal and head dim 64
# +14-32%. The stores deferred into the next block's step, once its Sᵀ and dPᵀ GEMMs are
# issued: +2.7% at 128 and 64, +30% at 256. 80-row blocks with dQ transposed
# (flash-attn-4's non-causal tile), dQ's stores skipped in both: 8.81/8.83 ms against the
# 64-row 8.80/8.84, so no gain left for a conflict-free dQᵀ tile to unlock. That variant
# waited for dV before issuing dQᵀ: without the wait ptxas serialises the wgmmas at 80
# rows (insufficient registers; at 64 rows it fits), where flash-attn-4 issues both
# (perf/peer_sass.py). dK's GEMM reading dSᵀ from its shared-memory tile (SS, so dSᵀ's
# 20 registers a thread are free once stored) does not lift it: still serialised.
# Lost (2026-11-30, two rounds, -bwd-sweep-row-stats-thread-order.json): the preprocess
# storing each block's LSE·log2(e) and D in the consumer threads' order, read four at a
# time (LDS.128, half the loads and wavefronts of LDS.64). Head dim 64 full 425/512 ->
# 346/425 at 1k/16k, causal 321/523 -> 274/428; 128 full 503/540 -> 465/564 (the
# selector's 16k rounds 502-585), causal 381/591 -> 366/517; 256 within 1% full, causal
# 16k 453 -> 427. GPU tests of the variant passed (78). That layout put all of a lane's
# values first, so the four lanes of a quad loaded 16-byte units tile_m floats apart: at
# 128 rows (head dim 64) all on the same four banks, 4 wavefronts a load instead of 1.
# Lost as well (2026-11-30, two rounds, -bwd-sweep-row-stats-thread-order-quads.json): the
# same loads with a quad's four units side by side (one wavefront a warp load; CPU test of
# CuTe's partition): head dim 64 full 424/511 -> 407/503 at 1k/16k, causal 321/524 ->
# 314/482; 128 full 498/534 -> 478/579 (the selector's 16k rounds 488-591), causal
# 381/591 -> 373/535; 256 full 384/445 -> 381/453, causal 315/441 -> 313/431. The 16k
# medians carry a slow second round (see --control); the faster rounds alone have the
# candidate 1% slower at head dim 128, 2-5% at 64, within 1% at 256. Not the wavefronts,
# then: four values a load lose where two a load do not.
# Reading the sweeps of 2026-11-30 by their faster rounds (the slow second rounds above
# left out), the accumulator zeroed by the preprocess (dq_first_stores=False) ran 1-4%
# faster than first stores at 4k and 16k at head dims 128 and 256 (128 full 16k 1.03x in
# both sweeps, 256 full 1.04x in both, causal 1.01-1.03x; 64 within 1%) while first
# stores won 1-12% at 512 and up to 6% in most 1k rows: the ticket protocol costs on long
# rows. Three candidates against it, swept together (2026-11-30, three rounds, --control,
# 1k / 4k / 16k; -bwd-sweep-tickets-mask-zeroed-d{64,128,256}.json; GPU tests of the first two passed,
# 120), by their faster rounds (selector: the better of its two copies):
# - Lost: tickets taken with acquire semantics, so that a later holder seeing LANDED
#   skipped its acquire load (dq_ticket_acquires). d128 full 509/569/587 ->
#   484/562/592, causal 379/520/591 -> 375/517/588; d256 full 390/441/456 ->
#   387/455/471 but causal 318/422/455 -> 326/427/443; d64 within 1%. The selector's
#   two copies differ by as much (d256 causal 16k 455 / 442).
# - Lost: every block through the masked step, so ptxas schedules one loop as
#   flash-attn-4's, 16 of a thread's 32 exponentials before the dPᵀ wait at head dim 128
#   (mask_every_block). d128 full 509/569/587 -> 468/559/575, causal 379/520/591 ->
#   373/513/581; d64 causal 16k 522 -> 517; d256 within 1-2%.
# - Taken from 8k keys on (flash4/backward.py, ZEROED_DQ_MIN_SEQLEN_K): the zeroed
#   accumulator. 16k: d128 full 587 -> 592, causal 591 -> 593; d256 full 456 -> 466,
#   causal 455 -> 469; d64 full 527 -> 533, causal 522 -> 530. 4k even (d128 569 -> 560,
#   d256 full 441 -> 451), 1k lost 2-8% (d128 full 509 -> 469).
# Probe, not a candidate (2026-11-30, three rounds, perf/wave_tail_probe.py,
# -bwd-wave-tail-probe.json): the unmasked 16k grids hold 15.52 waves of key-block CTAs
# (31.03 at head dim 64); beside shapes of whole waves (heads 15 / 31 / 6, seqlen 16896 /
# 16896 / 21120) flash4 runs 605 -> 616 at head dim 128, 539 -> 542 at 64, 470 -> 471 at
# 256 (flash-attn-4 626 -> 636, 540 -> 549, 384 -> 386). The last wave's CTAs finish
# early, alone on the memory system: splitting its walks (stream-K) could gain 2% at most.
# Lost (2026-11-30, three rounds, --control, -bwd-sweep-k-register-slices.json; GPU tests of
# the variant passed, 32): at head dim 128 the Sᵀ GEMM's first one or two 16-column slices
# of K held in registers (RS), the rest SS, so that 4-8 KiB fewer shared-memory bytes a
# query block are read (three slices spill). Faster rounds, full 1k/4k/16k 516/558/599 ->
# 481/558/589 (one slice) and 484/570/598 (two), causal 378/522/599 -> 370/515/590 and
# 372/516/591: within the selector's own spread, no gain.
# Not compiled clean, so not run (2026-11-30): each step issuing the next block's Sᵀ right
# after its dQ and dK GEMMs, before its wait for dK, so the tensor cores go from dK to the
# next Sᵀ without the loop's turn between (the last step peeled off, P in registers of its
# own). At head dims 64 and 128 ptxas serialises every wgmma: C7514 (the next Sᵀ in flight
# over the loop's back edge) and, with that Sᵀ waited for inside its step, C7512
# (insufficient registers: dV, dK, dSᵀ and the next Sᵀ live at once); with the exponentials
# written over the Sᵀ registers instead of P's own, C7514 and C7515. With the carried Sᵀ
# waited for at the top of each step (before dPᵀ is issued): C7512 and 8 bytes spilled (P
# in its own registers), C7515 (P over Sᵀ), 220 bytes spilled (Sᵀ copied out first). The
# exponentials reading Sᵀ are what ptxas objects to (without them it compiles clean).
# Lost (2026-11-30, three rounds, --control, 1k / 4k / 16k;
# -bwd-sweep-sdp-gemm-per-warpgroup.json; 104 GPU tests passed): at head dim 256, warpgroup 0
# computing Sᵀ and P of all 64 queries and warpgroup 1 dPᵀ and dS (from the 16-bit P read
# back from shared memory), instead of each both for 32 queries. Halved, Sᵀ and dPᵀ are
# 64x32x16 SS wgmmas, 3 KB of shared memory per 16 tensor clocks (192 bytes a clock, over
# the 128 it serves); whole, 64x64x16 at 128. By a count of bytes (wgmma operands, TMA
# writes, dQ's tile in and out) the kernel would be shared-memory bound and gain ~10%.
# Faster rounds, full 388/441/464 -> 380/446/471, causal 317/418/464 -> 312/419/475: 1-2%
# at 16k, a loss at 1k, and dq's largest distance to SDPA 2-3x larger (P rounded before
# dS). Shared memory's bandwidth does not bind at 256 either; the tensor pipe idles while
# both warpgroups compute P and dS and write dQ, in step.
# Lost (2026-11-30, three rounds, --control, 1k / 4k / 16k; -bwd-sweep-dk-from-smem.json;
# 208 GPU tests passed): the key split's dK GEMM reading dSᵀ from its shared-memory tile
# (SS) instead of the registers that computed it (RS), so that no RS wgmma runs beside the
# warp's dQ stores (the forward's reading above). Faster rounds, d128 full 513/574/604 ->
# 482/555/589, causal 385/523/604 -> 370/513/583; d64 full 433/512/544 -> 415/498/518,
# causal 323/469/539 -> 317/458/519. The 8 KB more of shared-memory reads a block cost
# more than any such contention.
# Tied (2026-11-30, three rounds, --control, 1k / 4k / 16k; -bwd-sweep-three-stages.json;
# 52 GPU tests passed): three Q and three dO stages at head dim 128 (226.5 of the 227 KiB),
# each query block's tiles loaded two blocks ahead. Faster rounds, full 514/570/604 ->
# 480/566/602, causal 392/519/600 -> 371/522/599: the loads are not late.
# Lost or tied (2026-11-30, three rounds, --control, 1k / 4k / 16k;
# -bwd-sweep-dv-issue.json; 104 GPU tests passed), head dim 128, the dV GEMM issued
# elsewhere (same bits): (a) right after Pᵀ is packed, before the dPᵀ wait, so that it runs
# under the dS math and ptxas keeps all 32 exponentials ahead of that wait (today 5 of 32 in
# the mask-free loop); (b) after dSᵀ's stmatrix, so that its four wgmmas issue in one run in
# the masked loop too. Faster rounds (selector: the better of its two copies), full
# 512/551/598 -> (a) 468/549/581, (b) 471/552/583; causal 378/514/587 -> (a) 367/498/578,
# (b) 370/507/577. More tensor work under the dS math does not pay; why was not shown.
# Tied or lost (2026-11-30, three rounds, --control; -bwd-sweep-mirror-pairs.json,
# -bwd-sweep-gqa8-mirror-pairs*.json; 60 GPU tests passed), a CTA per query head: causal,
# key block n and then its mirror, key_blocks - 1 - n, on half the grid (mirror_pairs).
# Medians, selector/again -> mirrored: MHA d128 4k 512/508 -> 504, 16k 582/588 -> 576; d64
# 457/454 -> 449, 517/522 -> 506; GQA-8 (kv_accumulate) 1k / 4k / 16k d128 307/319 -> 312,
# 487/459 -> 484, 572/570 -> 567; d64 276/283 -> 284, 435/437 -> 438, 514/514 -> 499;
# d256 265/270 -> 262, 388/373 -> 380, 451/454 -> 442. A CTA per query head already spreads
# a key block's long and short walks over many heads; taken under kv_group_in_cta (below).
# Lost (2026-11-30, three rounds, --control, 1k / 4k / 16k; -bwd-sweep-dq-turns.json; 42 GPU
# tests of the variant passed): head dim 128, a query block's whole dQ (64 x 128) from one
# warpgroup, the two taking turns by dSᵀ buffer (dq_turns), so that the dQ GEMM reads dS from
# shared memory once, not once per warpgroup (16 of the ~370 KB a step moves through shared
# memory, which ncu has at 80% of its throughput; flash-attn-4's 80-row tiles move ~5% fewer
# bytes a query row, the size of its lead), in 8 wgmmas, not 16. The warpgroup on turn waited
# for its dK before issuing dQ (its accumulator takes Pᵀ's and dSᵀ's registers). Faster rounds
# (selector: the better of its two copies), full 517/559/598 -> 475/547/577, causal
# 376/526/594 -> 362/500/578. Issuing dQ under dK instead puts a wgmma in a branch that
# keeps dK's accumulator in flight: ptxas serialises the wgmmas. What the warpgroup on turn
# adds to its step (the whole dQ GEMM and its store) outweighs the bytes saved.
# Probed (2026-12-01, head dim 128, the main kernel alone, full 16k / causal 8k, two rounds
# of trees taking turns; -bwd-probes-d128.json): each edit breaks the result on purpose, to
# price one part of a step. The selector's kernel 604 / 566; without the DS_TILE barrier
# 606 / 570 (the warpgroups' meeting at dSᵀ costs nothing, so decoupling them would not
# pay); without the exponentials 630 / 614; without the dQ GEMM 728 / 692, without it and
# its fp32 stores 746 / 718. Every 8th / 4th / 2nd column of Pᵀ by the FMA pipe's cubic
# (a34f4da^:kernels/fma_exp2.py), against 596 / 570 in that run: 596 / 566, 594 / 562,
# 586 / 551. The exponentials cost latency on the step's chain, not MUFU's rate. Also
# (CPU compile, 2026-12-01): the 80-row dQᵀ variant rebuilt on today's kernel still hits
# C7512 with P packed after dS, with flash-attn-4's order (dV waited for between dQᵀ and
# dK), with no masked loop, and with dQ's stores cut to one value; waiting for dV before
# dQᵀ compiles but spills 28 bytes.
# Taken (2026-12-01, the main kernel alone, paired rounds; -bwd-staggered.json; 116 GPU tests
# of the variant and the selector's 296 + 12 passed): the key split's warpgroups half a step
# apart (staggered_warpgroups; flash4/backward.py has the numbers). A probe first: without
# the DS_TILE barrier alone, nothing (606 / 570 against 604 / 566, in step still); without
# it and warpgroup 1 starting once warpgroup 0 had written its first dSᵀ (results wrong),
# causal +2-5% and unmasked -2% to +2%. Warpgroup 1's wait placed after its Sᵀ and dPᵀ
# issue, or right before its own dSᵀ write (the warpgroups then free to drift back into
# step), was no better than at the start of its step. A wgmma under the first step's branch
# (to skip warpgroup 0's dropped dQ GEMM) serialises every wgmma (C7512, 328 bytes spilled).
# Lost (2026-12-01, head dim 256, three rounds, --control; -bwd-sweep-d256-dq-register-adds.json;
# 54 GPU tests of the variant passed): each consumer thread adding its dQ into the zeroed fp32
# accumulator from registers (red.global.add of adjacent pairs, 32 a thread per block at the
# offsets the bulk reduction uses; no shared-memory tile, no store warp), to take the tile's
# 128 KB in and out of the ~544 KB a step moves through shared memory. Medians, selector /
# again -> register adds (-> with the freed 64 KB holding two Q and two dO stages): full
# 1k 378/378 -> 252 (258), 4k 438/439 -> 286 (296), 16k 454/454 -> 299 (309); causal 1k
# 302/311 -> 210 (215), 4k 408/411 -> 266 (278), 16k 439/468 -> 306 (314). A third slower:
# 8-byte reductions, 8192 a CTA per block, outrun the L2's atomic units by far where one
# bulk reduction moves whole lines. The second stages' +3% was the one gain.
# Lost (2026-12-01, head dim 256, three rounds, --control; -bwd-sweep-d256-late-dq-writes.json;
# 54 GPU tests of the variant passed): each block's dQ written to its shared-memory tile a
# block late, under the next block's Sᵀ GEMM (copied out of the dQ GEMM's registers with
# a + 0.0, else ptxas waits for the Sᵀ GEMM before the stores, C7517; issued under both Sᵀ
# and dPᵀ it spills 128 bytes). Selector / again -> late: full 1k 384/385 -> 338, 4k
# 443/427 -> 379, 8k 454/460 -> 408, 16k 463/469 -> 415; causal 1k 315/313 -> 288, 4k
# 418/415 -> 364, 8k 458/448 -> 411, 16k 459/472 -> 424. 10% slower, likely because the
# stores share shared memory with the GEMM whose result the step's softmax waits for (not profiled).
# Lost (2026-12-01, head dim 256, three rounds, --control; -bwd-sweep-d256-dq-under-dv.json;
# 54 GPU tests of the variant passed): the dQ GEMM issued between dK's and dV's and its tile
# written while dV's runs (dO freed last), not after all three. Selector / again -> variant:
# full 1k 380/380 -> 378, 4k 439/438 -> 435, 8k 454/449 -> 315, 16k 440/461 -> 315; causal
# 1k 315/311 -> 309, 4k 420/416 -> 414, 8k 451/450 -> 318, 16k 459/464 -> 328. Even below
# 8k, 30% slower from 8k, where dQ's accumulator is zeroed and every part adds (why the
# bulk additions, not the first stores, fall that far behind was not looked into).
BACKWARD_CANDIDATES: dict[int, list[dict[str, Any]]] = {
    hdim: [dict(), dict(dq_first_stores=True), dict(dq_first_stores=False)] for hdim in (64, 128, 256)
}
# With --group G > 1 (GQA/MQA) these join them: the two ways to write a group's dK and dV.
# Taken (2026-11-30, --group 8, three rounds, --control; -bwd-sweep-gqa8-kv-group-in-cta.json,
# -bwd-sweep-gqa8-d256-kv-group-in-cta.json; 120 GPU tests passed), for unmasked grids that
# fill their last wave (flash4/backward.py): a CTA per kv head walking each query head of
# its group, dK and dV in registers across the walks (kv_group_in_cta), against the fp32
# accumulators shared by the group (kv_accumulate). Medians, selector/again -> in CTA
# (fa4), 1k / 4k / 16k: d128 full 435/429 -> 517 (439), 540/549 -> 582 (568), 594/594 ->
# 601 (603); d64 full 396/394 -> 460 (405), 472/493 -> 516 (503), 525/502 -> 526 (528);
# d256 full 350/347 -> 406 (286), 422/421 -> 445 (361), 460/453 -> 459 (374). Causal lost:
# d128 327/323 -> 288, 495/487 -> 376, 581/581 -> 541; d64 290/289 -> 325, 443/437 -> 417,
# 516/523 -> 519; d256 269/269 -> 211, 389/393 -> 301, 457/448 -> 430. A CTA per kv head
# is 8x fewer, 8x longer CTAs whose walks shorten along the diagonal.
# Lost or tied (2026-11-30, same protocol; -bwd-sweep-causal-heaviest-first*.json,
# -bwd-sweep-gqa8-causal-heaviest-first*.json; 60 GPU tests passed): causal CTAs
# renumbered so that key block 0 of every (head, batch entry) launches first, then key
# block 1, and so on (the longest walks first). Across all heads: the default grid lost
# 5-27% (d64 causal 4k 459 -> 337; every CTA in flight streaming another head's Q and dO
# from DRAM); kv_group_in_cta gained at 1k (d128 312/319 -> 335, d64 282 -> 338) and d64
# 4k (431/437 -> 458), still lost d128 4k (475/481 -> 437) and 16k. In sections of heads
# whose Q, dO and dQ accumulator fit 32 MiB of L2: the default grid within noise (MHA d128
# 4k 524/521 -> 529, 16k 598/599 -> 592; d64 466/465 -> 462, 532/531 -> 526), in CTA d128
# 1k 317/321 -> 305, 4k 483/489 -> 380, d256 1k 269 -> 224. Not kept; pairing key block n
# with its mirror in one CTA (equal walks) balances causal in CTA instead:
# Taken (2026-11-30, --group 8, three rounds, --control; -bwd-sweep-gqa8-mirror-pairs*.json;
# 60 GPU tests passed), causal up to 4k keys at head dim 64 and 1k at 128
# (flash4/backward.py, MIRRORED_KV_GROUP_MAX_SEQLEN_K): kv_group_in_cta with mirror_pairs.
# Medians, selector/again -> in CTA unpaired -> paired (fa4), 1k / 2k / 4k / 16k: d64
# 276/283 -> 324 -> 340 (264), 365/372 -> 374 -> 401 (351), 435/437 -> 411 -> 449 (418),
# 514/514 -> 491 -> 489 (511); d128 307/319 -> 288 -> 333 (292), 403/410 -> 332 -> 391
# (392), 487/459 -> 371 -> 435 (482), 572/570 -> 499 -> 510 (581); d256 1k 265/270 -> 212
# -> 249, 4k 388/373 -> 307 -> 345, 16k 451/454 -> 424 -> 422. (With kv_accumulate,
# mirror_pairs spills 24 and 28 bytes at head dims 64 and 128.) With 4 query heads per kv
# head (two rounds, --control; -bwd-sweep-gqa4-kv-schemes.json), selector/again ->
# accumulated, in CTA unpaired (fa4), 1k / 4k: unmasked d128 522/514 -> 410 (422), 541/573
# -> 535 (546); d64 450/454 -> 377 (392), 466/510 -> 487 (483); causal d128 342/372 -> 303,
# 353 (307); d64 332/357 -> 275, 348 (280), 472/470 -> 440, 453 (391). The one miss: d128
# causal 4k, 474/478 accumulated against 502 paired (420 fa4), which group 8 lost.
GROUPED_BACKWARD_CANDIDATES: list[dict[str, Any]] = [
    dict(kv_accumulate=True, kv_group_in_cta=False, mirror_pairs=False),
    dict(kv_accumulate=False, kv_group_in_cta=True, mirror_pairs=False),
    dict(kv_accumulate=False, kv_group_in_cta=True, mirror_pairs=True),
]
# FP8: the kernel alone on inputs quantized (and V laid out) beforehand, Q in blocks of
# tile_m rows and K of tile_n, V per tensor as flash_attn_fp8 quantizes it; beside it
# flash4's FP8 call (the selector's tiles) and cuDNN's FP8 attention. The rows' history and
# what was not taken: perf/h200-findings.md; since then (-fp8-sweep-candidates3.json) a third
# K/V stage at head dims 64 and 128 (within 1% at 64, -5% at 128 16k) and 64-key blocks at
# 128 (-15%).
# Two Q slots (as the 16-bit rows; -fwd-sweep-q-slots.json, -fp8-sweep-q-slots.json, three
# rounds at 512/1k/4k): d64 full 370/465/621 -> 375/466/621, causal 233/320/496 ->
# 227/319/492 (not taken); d128 full 535/699/895 -> 555/704/893, causal 326/485/739 ->
# 331/479/732. Taken at d128 full below 1k after a fourth sweep (perf/h200-findings.md).
# Lost (2026-11-30, three rounds, 512 / 1k / 4k / 16k; -fp8-sweep-exp2-on-fma.json): every
# 3rd or 4th column group of an unmasked block's S with exp2 on the FMA pipe (a cubic on
# packed f16, the exponent added as an integer; about 11 instructions a pair for two
# MUFU.EX2; GPU tests against the FP8 model passed). d128 full 555/697/884/949 ->
# 540/669/829/882 (every 3rd), causal 327/518/730/865 -> 333/527/704/812 (every 4th); d64
# full 371/466/621/696 -> 376/462/597/644, causal 234/323/499/604 -> 239/329/468/562. +1-2%
# at 512-1k causal, -5-8% from 4k: the cubic costs more issue slots than it frees on MUFU
# (P's codes by rounding, which add none, then gained 5-19%; perf/h200-findings.md).
# Probe, not a candidate (2026-11-30, two rounds, -fp8-probe-no-row-sum.json; output wrong
# on purpose): the FP8 softmax without its row-sum additions (48 FADDs a thread per block
# at head dim 128, a sixth of the loop's instructions) runs d64 full 465/695 -> 487/737,
# d128 full 697/950 -> 722/997 at 1k / 16k. So issue slots bind there, and the sum is worth
# moving to the tensor cores: a column of ones beside V (P V with N = 136 at head dim 128,
# 6% more P V work) accumulates the row sum in O's accumulator, rescaled with O for free.
# The same probe on the 16-bit kernel (-fwd-probe-no-row-sum.json, output check bypassed)
# gains nothing: d64 full 418/533 -> 420/526, d128 593/651 -> 577/652 at 1k / 16k.
# Prototype (branch proto/fp8-row-sum-by-mma, 2026-11-30, two rounds, 1k / 16k,
# -fp8-sweep-row-sum-by-mma.json): the row sum from a second RS wgmma per k-step, P times
# an all-ones e4m3 tile (64x8 fp32, in P V's commit group), added one block late. Same max
# distance to SDPA; d64 full 465/693 -> 483/718, causal 322/605 -> 331/617; d128 full
# 698/934 -> 711/965, causal 517/863 -> 514/875. Landed as row_sum_on_tensor_cores in the
# variant without an LSE (the sum of the rounded P is no true LSE); perf/h200-findings.md has
# the sweep that picked its rows. Since then this script times the FP8 kernels without an
# LSE, as flash_attn_fp8 runs by default. With the row sums on the tensor cores, head dim
# 128 full on two warpgroups still lost to the row's three on 96-key blocks (two rounds,
# 512 / 1k / 2k; -fp8-sweep-d128-two-warpgroups.json): 568/717/857 -> 568/692/772 on
# 128-key blocks, 512/675/800 on 160, 563/676/811 on 192 (cuDNN 564/749/853).
# Not taken (2026-11-30, two rounds; -fp8-sweep-d64-two-warpgroups-q-in-registers.json,
# -fp8-sweep-d128-q-in-registers-variants.json): head dim 64 unmasked on two warpgroups
# with Q in registers, 387/486/599 -> 373/460/512 at 512 / 1k / 2k; on head dim 128's rows
# with Q in registers (two warpgroups, 128-key blocks), 160-key blocks (full 759/858 ->
# 713/790 at 1k / 2k, causal 601/732/808/858 -> 509/606/722/832 at 1k / 2k / 4k / 16k), a
# third K/V stage (761/848, 603/727/818/901: within the rounds' spread) and no ping-pong
# (760/848, 586/719/802/893). Three warpgroups on 96-key blocks cannot hold Q: ptxas spills
# 64 bytes and serialises the wgmmas, with the row sums on the tensor cores or without.
# Not taken (2026-11-30, three rounds, --control, 1k / 4k / 16k; -fp8-sweep-kv-multicast.json):
# head dim 128 unmasked with clusters of two CTAs sharing K and V by multicast
# (kv_multicast, which the 16-bit rows take from 16k at 128 and 4k at 256). Fastest rounds,
# the table's two copies against it: 857/852 -> 868, 1002/983 -> 984, 1053/1056 -> 1063,
# within their spread. Head dim 256, at 98% of the FP8 matmul's rate, was not swept.
# Taken at head dim 128 (2026-11-30, --group 8, causal, three rounds, --control;
# -fp8-sweep-head-clusters-gqa8.json; 24 GPU tests bit-identical to the rows): clusters of
# two query heads of one K/V head (cluster_heads, as the 16-bit causal rows under GQA), from
# 4k (flash4/dispatch.py, FP8_HEAD_CLUSTER_MIN_SEQLEN). Medians, the table's two copies ->
# clusters (cuDNN FP8), 4k / 16k: d128 923/915 -> 957 (820), 1016/1006 -> 1042 (870); d256
# 1125/1115 -> 1113 (974), 1260/1260 -> 1264 (928); d64 636/635 -> 622 (501), 761/763 ->
# 745 (555). Unmasked and below 4k not swept.
# Taken (2026-11-30; -fp8-sweep-dynamic.json): dynamic_tiles at head dims 64 and 128 from 4k
# (perf/h200-findings.md, the tenth sweep).
# Not pursued (2026-11-30, in the model only: flash4.reference.fp8_blockwise_attention with
# a kept max, FlashAttention-3's outlier inputs, 2 x 2048 x 4 heads): lazy_rescale for the FP8
# softmax. P is scaled to e4m3's top at the row max, so keeping a max needs headroom: P's
# scale lowered by h octaves. With P's codes by rounding, RMSE +1% (h = 1), +4% (2), +12-15%
# (3) against the kernel model (exp2 P: +0.1-0.4%); and rows still pass a kept max with 1-2
# octaves of headroom in 10-14% of their blocks at 2k, so a warp of 16 rows would rebase in
# most. The 16-bit kernel's 2^8 costs nothing, as P's 16 bits have that range to spare.
# Taken (2026-12-01, three rounds, --control; -fp8-sweep-rebuilt-divisors.json): the divider
# rows' scheduler divisors rebuilt in the kernel from its sizes, not carried (now what
# fast_tile_divmod=False does; perf/h200-findings.md, the twelfth sweep).
# Not taken (2026-12-01, three rounds, --control; -fp8-sweep-divider-elsewhere.json): the
# divider, divisors rebuilt, on the rows that keep the fast divisors, though their key loops
# are shorter with it (head dim 128 unmasked 418 -> 405 SASS instructions at 1k, 364 -> 354
# at 16k; 256 unmasked 506 -> 498). Table / table again -> divider: 128 full 853/855 -> 849,
# 1035/1031 -> 1042; 256 full 988/1001 -> 997, 1247/1250 -> 1255 (ties); 128 causal 1k
# 670/665 -> 645; 64 causal 441/444 -> 421 at 1k, 546/544 -> 523 at 2k (losses).
FP8_CANDIDATES: dict[int, list[dict[str, Any]]] = {h: [dict()] for h in (64, 128, 256)}
PEERS = ("sdpa-cudnn", "fa4")
FP8_PEERS = (bench.FLASH4, "cudnn-fp8")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """torch SDPA on flash4's (batch, seqlen, heads, head_dim) layout, k and v with fewer
    heads under GQA: what a candidate's output is measured against."""
    return torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2]
    ).transpose(1, 2)


def candidate(entry: KernelEntry, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench provider running ``entry``'s kernel; its distance to SDPA goes to ``diffs``
    (a fast wrong kernel is no candidate)."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        kernel = compiled_forward(entry)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        expected = sdpa(q, k, v, causal, scale)
        sms = device_sms(q.device.index or 0)

        def run() -> torch.Tensor:
            kernel(q, k, v, out, lse, scale * LOG2_E, sms, tile_counter(entry.config, q.device))
            return out

        def check(result: torch.Tensor) -> torch.Tensor:
            diffs[label] = float((result - expected).abs().max())
            return result

        return run, check

    return prepare


def fp8_candidate(entry: KernelEntry, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench provider running ``entry``'s FP8 kernel alone: quantization and V's layout
    are done beforehand; its distance to SDPA's bf16 output goes to ``diffs``."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        from flash4.fp8 import OUT_DTYPE, tile_descales
        from flash4.quantize import fp8_value_layout, quantize_fp8

        config = entry.config
        # Without an LSE, as flash_attn_fp8 runs by default (and as the bench times it).
        kernel = compiled_forward(entry, with_lse=False)
        q8, k8, v8 = quantize_fp8(q, config.tile_m), quantize_fp8(k, config.tile_n), quantize_fp8(v, None)
        batch, seqlen_q, heads, _ = q.shape
        kv_heads, blocks_q, blocks_k = k.shape[2], -(-seqlen_q // config.tile_m), -(-k.shape[1] // config.tile_n)
        vt = fp8_value_layout(v8.values)
        descales = (
            tile_descales(q8, batch, heads, blocks_q),
            tile_descales(k8, batch, kv_heads, blocks_k),
            tile_descales(v8, batch, kv_heads, blocks_k),
        )
        out = torch.empty(q.shape, dtype=OUT_DTYPE, device=q.device)
        expected = sdpa(q, k, v, causal, scale)
        sms = device_sms(q.device.index or 0)

        def run() -> torch.Tensor:
            kernel(q8.values, k8.values, vt, out, None, *descales, scale * LOG2_E, sms, tile_counter(config, q.device))
            return out

        def check(result: torch.Tensor) -> torch.Tensor:
            diffs[label] = float((result.float() - expected.float()).pow(2).mean().sqrt())
            return result

        return run, check

    return prepare


def backward_candidate(config: Any, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench backward provider running the backward kernels with ``config``."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        from flash4 import flash_attn_func
        from flash4.backward import attention_backward

        out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        dout = bench.dout_like(out)
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        expected = sdpa(*leaves, causal, scale)
        expected_grads = torch.autograd.grad(expected, leaves, dout)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))

        def run() -> Any:
            return attention_backward(
                q, k, v, out, dout, lse, scale, causal, grads=grads, deterministic=config.deterministic, config=config
            )

        def check(result: Any) -> torch.Tensor:
            # The largest distance over dq, dk and dv (dk and dv: what GQA's schemes change).
            diffs[label] = max(float((got - want).abs().max()) for got, want in zip(result, expected_grads))
            return result[0]

        return run, check

    return prepare


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hdim", type=int, nargs="+", default=sorted(CANDIDATES))
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fp8"), default="fwd")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the records, written after every shape")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per kv head (GQA/MQA when > 1), as `python -m flash4 bench --group`")
    parser.add_argument("--control", action="store_true",
                        help="time the selector's configuration a second time, after the candidates")
    parser.add_argument("--candidates", type=json.loads, default=None,
                        help="a JSON list of changes timed in place of the pass's CANDIDATES at every --hdim, "
                             "for a one-off probe that should not be committed as the next candidates")
    args = parser.parse_args()
    timer = bench.make_timer(quick=False)
    payload = {
        **bench.environment(), "mode": "sweep", "command": shlex.join(["python3", *sys.argv]),
        "timer": timer.description, "rounds": args.rounds, "records": [],
    }
    causal_modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    backward = args.pass_ == "bwd"
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, causal_modes, passes=(args.pass_,), group=args.group):
        diffs: dict[str, float] = {}
        providers: dict[str, Callable[..., bench.Prepared]] = {}
        if backward:
            from flash4.backward import backward_config

            grouped = args.group > 1
            base_config = backward_config(
                shape.head_dim, shape.causal, grouped, seqlen_k=shape.seqlen,
                kv_units=shape.batch * shape.heads // shape.group, sms=device_sms(torch.cuda.current_device()),
            )
            changes = args.candidates or (
                BACKWARD_CANDIDATES[shape.head_dim] + (GROUPED_BACKWARD_CANDIDATES if grouped else []))
            for change in changes:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "selector"
                try:
                    config = dataclasses.replace(base_config, **change)
                except ValueError:
                    continue  # the change does not apply to this shape
                if change and config == base_config:
                    continue  # the selector's own
                providers[label] = backward_candidate(config, diffs, label)
            if args.control:
                providers["selector again"] = backward_candidate(base_config, diffs, "selector again")
        elif args.pass_ == "fp8":
            from flash4.dispatch import FP8_DTYPE

            base = select("sm_90a", FP8_DTYPE, shape.head_dim, shape.causal, shape.seqlen, group=args.group)
            for change in args.candidates or FP8_CANDIDATES[shape.head_dim]:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "table"
                try:
                    config = dataclasses.replace(base.config, **change)
                except ValueError:
                    continue  # the change does not apply to this shape
                if change and config == base.config:
                    continue  # the row has it already
                providers[label] = fp8_candidate(dataclasses.replace(base, config=config), diffs, label)
            if args.control:
                providers["table again"] = fp8_candidate(base, diffs, "table again")
        else:
            base = select("sm_90a", "bfloat16", shape.head_dim, shape.causal, shape.seqlen, group=args.group)
            for change in args.candidates or CANDIDATES[shape.head_dim]:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "table"
                try:
                    config = dataclasses.replace(base.config, **change)
                except ValueError:
                    continue
                if change and config == base.config:
                    continue  # the row has it already
                providers[label] = candidate(dataclasses.replace(base, config=config), diffs, label)
            if args.control:
                providers["table again"] = candidate(base, diffs, "table again")
        peers = bench.PASS_PROVIDERS[args.pass_]
        providers.update({name: peers[name] for name in (FP8_PEERS if args.pass_ == "fp8" else PEERS)})
        record = bench.measure_shape(shape, timer, providers=providers, rounds=args.rounds)
        cells = []
        for name, m in record.results.items():
            if m.tflops is None:
                cells.append(f"{name}: {m.error}")
                continue
            low, high = (shape.flops / (ms * 1e-3) / 1e12 for ms in (max(m.ms_rounds), min(m.ms_rounds)))
            diff = f" diff {diffs[name]:.1e}" if name in diffs else ""
            cells.append(f"{name}: {m.tflops:.0f} [{low:.0f}-{high:.0f}]{diff}")
        print(f"{args.pass_} d{shape.head_dim} {'causal' if shape.causal else 'full'} s{shape.seqlen}: "
              + " | ".join(cells),
              flush=True)
        if args.out is not None:
            payload["records"].append({**dataclasses.asdict(record), "diffs": dict(diffs)})
            bench.write_json(args.out, payload, quiet=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
