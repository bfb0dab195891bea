"""Tile configurations of the kernels, as frozen dataclasses.

Kept apart from the kernel modules so the selector (and ``python -m flash4 info``) can read
them without importing the CuTe-DSL compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

# One Hopper warpgroup: four warps issue one wgmma together.
THREADS_PER_WARPGROUP = 128
# A wgmma tile is 64 rows tall: each consumer warpgroup owns 64 query rows.
ROWS_PER_CONSUMER_WARPGROUP = 64
# Usable shared memory per CTA on sm_90 (228 KiB minus the 1 KiB the driver reserves).
SM90_SMEM_BYTES = 227 * 1024
# Room reserved for the rings' mbarriers ahead of the 1 KiB-aligned tiles.
BARRIER_BYTES = 1024
# Accumulators, LSE and D are fp32.
FP32_BYTES = 4
# Shared-memory buffers read by TMA and wgmma start on 1 KiB: the 128-byte swizzle
# pattern repeats every 1024 bytes and must line up with the buffer's start.
SMEM_ALIGN_BYTES = 1024
# A TMA tile copy's shared-memory side starts on 128 bytes: every stage of a ring, the
# backward's per-row LSE and D rings included.
TMA_SMEM_ALIGN_BYTES = 128
# An FP8 wgmma's k-step: 32 one-byte elements, one 32-byte row of its operand core matrix.
FP8_MMA_K = 32
# Q in registers (Sm90ForwardConfig.q_in_registers) up to this head dim: at 256, Q's 64
# rows would take 128 registers a thread (bf16), as many as O's accumulator.
Q_IN_REGISTERS_MAX_HEAD_DIM = 128
# The FP8 row-sum GEMM's width (kernels/tensor_core_row_sum.py): wgmma's narrowest N.
ROW_SUM_COLUMNS = 8
# Query blocks per cluster with kv_multicast: the smallest cluster that shares a load.
KV_MULTICAST_CTAS = 2
# A wgmma accumulator gives each warp of a warpgroup 16 consecutive rows of its 64.
ROWS_PER_WARP = 16
# Counts of column slices masked_column_slices may cut the first key block into (0: off);
# each count is that many compiled copies of the block's softmax behind a switch.
MASKED_COLUMN_SLICE_COUNTS = (0, 2, 4, 8)
# wgmma's accumulator holds columns in groups of 8 (two per thread of a quad).
ACC_COLUMN_GROUP = 8
# The backward's consumer warpgroups: 2 x 240 registers per thread hold its accumulators.
BACKWARD_CONSUMER_WARPGROUPS = 2
# The backward's dSᵀ (and head-dim split's Pᵀ) buffers: the warpgroups do not meet after
# their dQ GEMMs, so one may still read a block's tile while the other writes the next.
BACKWARD_DS_STAGES = 2


@dataclass(frozen=True)
class Sm90ForwardConfig:
    """One compiled variant of the Hopper forward kernel.

    ``tile_n`` keys per KV block; ``kv_stages`` slots in the K and V shared-memory rings.
    """

    head_dim: int
    tile_n: int
    kv_stages: int = 2
    consumer_warpgroups: int = 2
    causal: bool = False
    # Round-robin GEMM issue between consumer warpgroups (see pipelines.named_barriers).
    pingpong: bool = True
    # The tile's first S GEMM also waits for the warpgroup's turn. Without the turn every
    # warpgroup issues that GEMM at once and then all run the first block's softmax
    # together while the tensor cores idle; in turn, the first warpgroup's softmax runs
    # under the next one's GEMM. Head dim 128 takes it (+0-3%, perf/h200-findings.md).
    first_block_turn: bool = False
    # The tile scheduler's divisions (a position's query block, head and batch) by multiply
    # and shift (True), or by the divider's ~25 instructions on the uniform datapath, its
    # divisors rebuilt in the kernel (False, pipelines.tile_scheduler). The FP8 rows of
    # head dim 64 unmasked and 256 causal ran 2-8% faster with the divider while ptxas
    # rebuilt K's descale address in every key block; since then the descales reach the
    # consumers in shared memory (pipelines/stage_scalars.py), and only the FP8 row of head
    # dim 256 causal keeps it, where CUDA 12's ptxas spills without it (perf/h200-findings.md,
    # the thirteenth FP8 sweep).
    fast_tile_divmod: bool = True
    # One CTA per SM looping over tiles (see pipelines.tile_scheduler). O gets its own
    # shared-memory buffer where it fits, so the next tile's Q lands while this tile's O is
    # stored; otherwise O is staged in Q's buffer (see ``o_in_q_buffer``).
    persistent: bool = False
    # Slots in Q's ring (persistent, O in a buffer of its own): with two, the producer loads
    # the next tile's Q before this tile's last blocks instead of after its last S GEMM, so
    # short tiles (ncu at seqlen 512: 3% of the consumers' stall samples on Q's barrier) do
    # not start by waiting for it (perf/h200-findings.md has the sweep).
    q_stages: int = 1
    # e4m3 Q, K and V (V given transposed, keys contiguous: FP8 wgmma reads both operands
    # K-major) with one descale per tile, and a 16-bit O (kernels/sm90_fwd_fp8.py).
    fp8: bool = False
    # O is rescaled in the key loop only when some row of the warp raised its max (a warp
    # vote and a uniform branch): after the first blocks the max rarely moves, and the
    # rescale is one FMUL per O register per block, a tenth of the softmax's issue slots at
    # head dim 128. Exact: a skipped factor is exactly 1. The FP8 rows and head dim
    # 256 take it (perf/h200-findings.md has the sweeps).
    rescale_when_needed: bool = False
    # FP8 with V's descale the same for every key block (per tensor, flash_attn_fp8's V):
    # P's scale is the constant 448 and V's descale multiplies O once, so each key block
    # loses a descale load and two IEEE divisions (FCHK + Newton steps in SASS) of the
    # general path (1-20% on the H200 at head dim 64; perf/h200-findings.md).
    fp8_v_per_tensor: bool = False
    # The softmax's row sum starts from the rescaled old sum (OnlineSoftmax), so O's
    # rescale interleaves with the block's exponentials: where MUFU binds (head dim 64;
    # perf/h200-findings.md has the sweep). 16-bit only.
    sum_from_rescaled: bool = False
    # P converted for the P V GEMM before O's rescale instead of after. Where the rescale is
    # a branch (rescale_when_needed), ptxas does not move the conversions above it, so all
    # of them (and FP8's byte permutes) trail the block's exponentials instead of filling
    # the gaps of the MUFU.EX2 stream. Same bits. The FP8 head-dim-256 rows take it (+2-6%);
    # elsewhere it tied or lost (perf/h200-findings.md).
    p_before_rescale: bool = False
    # FP8, V per tensor: each block's row sums from a second wgmma, P times a tile of ones,
    # in P V's commit group, instead of FADDs on the CUDA cores, whose issue slots bind
    # (kernels/tensor_core_row_sum.py). Only the variant compiled without an LSE takes it:
    # it sums the e4m3-rounded P, which normalises O exactly but is not the true LSE.
    row_sum_on_tensor_cores: bool = False
    # Each consumer warpgroup stores its own 64 rows of O (its slab of O's buffer, its own
    # TMA store, a barrier of its 128 threads) instead of all of them meeting twice per
    # tile: under ping-pong the warpgroup ahead then starts the next tile while the other
    # finishes this one. Needs O in a buffer of its own.
    o_store_per_warpgroup: bool = False
    # Q loaded once per tile from shared memory into registers (ldmatrix), and the S GEMM
    # issued with its A operand there: an SS wgmma reads A and B from shared memory, 96
    # bytes a clock at 64x128x16 (bf16) and 107 at FP8's 64x96x32, against the 128 bytes a
    # clock shared memory serves, which TMA's writes of K and V share too; from registers
    # it reads B alone (64). Q's slot is then released as soon as it is loaded. Costs
    # head_dim / 2 registers a thread (bf16; head_dim / 4 for FP8). The FP8 rows at head
    # dim 64 causal and 128 take it; the 16-bit kernel lost with it (perf/h200-findings.md).
    q_in_registers: bool = False
    # FP8 kernels whose row sums run on the tensor cores (compiled without an LSE): P's e4m3
    # codes rounded straight from the log2-domain scores, 8 codes per power of two, linear
    # in between (Schraudolph's exponential), by one f16 conversion, instead of exp2 on
    # MUFU and an e4m3 conversion (kernels/e4m3_codes.py). The sums are of the same P, so
    # its scale cancels; the variant with an LSE keeps exp2. MUFU's 16 exponentials a clock
    # bound the FP8 loop at head dims 64 and 128: without them it ran 5-19% faster (H200;
    # perf/h200-findings.md, the ninth sweep).
    fp8_p_by_rounding: bool = False
    # With fp8_p_by_rounding: the S GEMM accumulates in f16, not fp32 (the FP8 wgmma has
    # both at the same rate), and the softmax runs on pairs: one max.f16x2 per two scores
    # for the row max, one fma.rn.f16x2 that leaves each pair's codes (an f16 steps by 1
    # on [1024, 2048)), one max.f16x2 clamp, where fp32 scores take two FMNMX, two FFMA
    # and a conversion (kernels/f16_scores.py). A raw score must stay inside f16's range:
    # only for Q and K codes with head_dim * |q code| * |k code| <= F16_SCORE_BOUND, as
    # flash4.quantize_fp8(..., fp8_max=...) writes them; any other input overflows.
    scores_in_f16: bool = False
    # FP8 with int8 Q and K (the accurate mode): the S GEMM multiplies s8 by s8 into s32, at
    # the e4m3 rate, and each score becomes fp32 exactly by one integer add of 1.5 * 2^23
    # and one FADD (kernels/int8_scores.py); V and P stay e4m3. After the rotation Q and K
    # are near-Gaussian, which int8's 255 even steps round about 3x finer than e4m3's three
    # mantissa bits: in the float64 model of the kernel's algorithm on FlashAttention-3's
    # inputs, 0.29-0.37x cuDNN's per-tensor FP8 error against e4m3's 0.45-0.53x
    # (perf/fp8_accuracy_model.py). An s32 accumulator rules out scores_in_f16.
    fp8_qk_int8: bool = False
    # With fp8_qk_int8: the shift's FADD left out, the scores kept as 1.5 * 2^23 + s, and
    # the softmax takes the shift off each row's max (exactly) and out of each row's
    # constant of its FFMA (rounded once per row and block: at most 0.75 raw s32 steps of
    # the scores, about 1% of the int8 rounding's own error; perf/h200-findings.md). One
    # instruction a score instead of two.
    fp8_int8_shift_in_softmax: bool = False
    # Two CTAs of adjacent query blocks of one head form a cluster and share every K and V
    # block: each loads half of it and multicasts it to both, so L2 serves each block once
    # per pair instead of twice (at head dim 128, 64 KiB of K and V per 2048 tensor clocks of
    # a CTA). Causal: the pair walks its later block's keys, the earlier block masking the
    # extra ones whole (persistent causal grids pair whole clusters' blocks). The
    # 16-bit unmasked rows take it at head dim 256 from 4k queries (+3-4%) and 128 from 16k
    # (+1-2%), the causal ones from 8k (+1-3%; perf/h200-findings.md).
    kv_multicast: bool = False
    # With kv_multicast, the CTAs of a cluster take the same query block of two query heads
    # that share one K/V head (grouped-query attention) instead of adjacent query blocks of
    # one head: both walk the same key blocks, so causal tiles mask nothing extra. Only for
    # an even number of query heads per K/V head (flash4/dispatch.py selects it).
    cluster_heads: bool = False
    # Causal, persistent: tiles handed out at run time to whichever CTA is free first, in
    # sections of heads, longest first (pipelines/tile_scheduler.py, pipelines/tile_queue.py;
    # the launch takes a zeroed int32 counter), instead of long-short pairs dealt out in
    # turn, whose whole units leave a partial last round of the grid idle.
    dynamic_tiles: bool = False
    # The first (highest) key block of a tile, which the causal diagonal and seqlen_k's
    # tail cut, in this many slices of columns (0: not cut): each warp computes the
    # exponentials of only the leading slices that some row of the warp can see, and sets P
    # to 0 in the rest. On the diagonal of a 128 x 128 tile its 16-row warps see 16 to 128
    # keys, so in 4 slices the first block's MUFU.EX2 count drops to 5/8. That block runs
    # before any GEMM of the tile can overlap it. The same bits: masked scores are
    # exp2(-inf) = 0. 16-bit only.
    masked_column_slices: int = 0
    # Causal: a consumer warpgroup none of whose 64 rows sees a key of the tile's first
    # (highest) key block skips that block's S GEMM and takes its scores as -inf (P = 0).
    # Where blocks are narrower than the tile (head dim 256's 64 and 80 keys against 128
    # rows) the first warpgroup sees no key of the diagonal's top block in most tiles: half
    # of that block's S GEMM is waste. No other wgmma is in flight there, so the branch
    # around it leaves the GEMMs pipelined. The same bits.
    skip_unseen_first_block: bool = False
    # Unmasked key blocks keep the row's running max while no score of the warp's rows
    # passes it by more than MAX_HEADROOM_LOG2 (kernels/online_softmax.py): each thread
    # checks its own columns against the kept max, so the quad's max shuffles, O's rescale
    # and its factor's exponential are skipped, and the exponentials wait only for the
    # thread's own max. A warp whose scores pass it (a vote, a uniform branch) rebases as
    # every block does without it. P then lies in [0, 2^8]. 16-bit only. Every row takes it
    # but head dim 64's causal ones below 1k (+1-4%, and with lazy_check_by_sums up to 10%;
    # perf/h200-findings.md).
    lazy_rescale: bool = False
    # lazy_rescale's branch chosen after the exponentials, by the block's row sums of P
    # under the kept max (sums within MAX_HEADROOM bound every P by it), instead of before
    # them by each thread's max over its scores: the common branch then takes no max at
    # all. A warp whose sums pass divides each row's P, sum and O by its largest P (which
    # becomes 1); one where a P passed LARGEST_REBASED_P computes its scores again from
    # shared memory (K is released after the softmax) and rebases as without lazy_rescale.
    # Causal rows that have seen no key rebase before their exponentials. The rows of
    # every head dim take it but 256 causal (+2-10%; perf/h200-findings.md).
    lazy_check_by_sums: bool = False

    @property
    def tile_m(self) -> int:
        return self.consumer_warpgroups * ROWS_PER_CONSUMER_WARPGROUP

    @property
    def cluster_ctas(self) -> int:
        """CTAs per cluster: a pair of query blocks (or of heads) with kv_multicast, else one."""
        return KV_MULTICAST_CTAS if self.kv_multicast else 1

    @property
    def o_in_q_buffer(self) -> bool:
        """Whether O is staged for its TMA store in Q's shared-memory buffer.

        One tile per CTA: always, since Q is dead by then. Persistent: only when a buffer of
        its own does not fit (head dim 256); the next tile's Q load then waits until the
        TMA engine has read this tile's O. FP8: never, as O is twice Q's size.
        """
        if self.fp8:
            return False
        return not self.persistent or self._smem_bytes(own_o_buffer=True) > SM90_SMEM_BYTES

    def smem_bytes(self) -> int:
        """Q tile, O tile (unless O is staged in Q's buffer), the K and V rings, the row-sum
        GEMM's ones tile (if any), barriers."""
        return self._smem_bytes(not self.o_in_q_buffer)

    def _smem_bytes(self, own_o_buffer: bool) -> int:
        in_bytes = 1 if self.fp8 else 2
        q = self.q_stages * self.tile_m * self.head_dim * in_bytes
        o = self.tile_m * self.head_dim * 2 if own_o_buffer else 0
        kv = 2 * self.kv_stages * self.tile_n * self.head_dim * in_bytes
        ones = ROW_SUM_COLUMNS * self.tile_n if self.row_sum_on_tensor_cores else 0
        ones = -(-ones // SMEM_ALIGN_BYTES) * SMEM_ALIGN_BYTES
        return q + o + kv + ones + BARRIER_BYTES

    def __post_init__(self) -> None:
        if self.fp8_p_by_rounding and not (self.fp8 and self.fp8_v_per_tensor and self.row_sum_on_tensor_cores):
            raise ValueError(
                "fp8_p_by_rounding=True: only with fp8, fp8_v_per_tensor and row_sum_on_tensor_cores "
                "(one P scale, which the row sums of the same P cancel)"
            )
        if self.scores_in_f16 and not self.fp8_p_by_rounding:
            raise ValueError("scores_in_f16=True: only with fp8_p_by_rounding=True (the f16 scores' codes are P)")
        if self.fp8_qk_int8 and (not self.fp8 or self.scores_in_f16 or self.skip_unseen_first_block):
            raise ValueError(
                "fp8_qk_int8=True: only with fp8=True, scores_in_f16=False (an s8 wgmma accumulates in s32) and "
                "skip_unseen_first_block=False"
            )
        if self.fp8_int8_shift_in_softmax and not self.fp8_qk_int8:
            raise ValueError("fp8_int8_shift_in_softmax=True: only with fp8_qk_int8=True")
        if self.consumer_warpgroups not in (2, 3, 4):
            raise ValueError(f"consumer_warpgroups={self.consumer_warpgroups}: 2, 3 or 4 are supported")
        if self.kv_stages < 1:
            raise ValueError(f"kv_stages={self.kv_stages}: the K/V rings need at least one stage")
        if self.q_stages < 1 or (self.q_stages > 1 and not (self.persistent and not self.o_in_q_buffer)):
            raise ValueError(
                f"q_stages={self.q_stages}: at least 1; more only when persistent with O in its own buffer "
                "(O staged in Q's buffer ties Q's release to the store)"
            )
        if self.head_dim % 8 or not 8 <= self.head_dim <= 256:
            raise ValueError(f"head_dim={self.head_dim}: must be a multiple of 8 in [8, 256]")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n={self.tile_n}: must be a multiple of 16 in [16, 256]")
        if self.lazy_rescale and self.fp8:
            raise ValueError("lazy_rescale=True: the 16-bit softmax only (fp8=False)")
        if self.first_block_turn and not self.pingpong:
            raise ValueError("first_block_turn=True: only with pingpong=True")
        if self.lazy_check_by_sums and not self.lazy_rescale:
            raise ValueError("lazy_check_by_sums=True: only with lazy_rescale=True")
        if self.lazy_check_by_sums and self.q_in_registers:
            raise ValueError(
                "lazy_check_by_sums=True: not with q_in_registers=True (overflowed scores are computed again "
                "from Q's slot, which Q in registers frees early)"
            )
        if self.sum_from_rescaled and self.fp8:
            raise ValueError("sum_from_rescaled=True: the 16-bit softmax only (fp8=False)")
        if self.fp8_v_per_tensor and not self.fp8:
            raise ValueError("fp8_v_per_tensor=True: only with fp8=True")
        if self.o_store_per_warpgroup and self.o_in_q_buffer:
            raise ValueError(
                "o_store_per_warpgroup=True: only where O has a buffer of its own (persistent, not o_in_q_buffer)"
            )
        if self.row_sum_on_tensor_cores and not self.fp8_v_per_tensor:
            raise ValueError(
                "row_sum_on_tensor_cores=True: only with fp8_v_per_tensor=True (the FP8 P whose scale is the same "
                "for every key block)"
            )
        if self.q_in_registers and self.head_dim > Q_IN_REGISTERS_MAX_HEAD_DIM:
            raise ValueError(
                f"q_in_registers=True: head_dim up to {Q_IN_REGISTERS_MAX_HEAD_DIM} (beyond it Q and O's "
                f"accumulator do not fit a thread's registers together); got {self.head_dim}"
            )
        if self.dynamic_tiles and not (self.causal and self.persistent and not self.kv_multicast):
            raise ValueError(
                "dynamic_tiles=True: only causal (unmasked tiles are all as long) and persistent, without "
                "kv_multicast (its grids share out whole clusters' blocks)"
            )
        slices = self.masked_column_slices
        if slices not in MASKED_COLUMN_SLICE_COUNTS:
            raise ValueError(f"masked_column_slices={slices}: one of {MASKED_COLUMN_SLICE_COUNTS}")
        if slices and (self.fp8 or self.tile_n % (slices * ACC_COLUMN_GROUP)):
            raise ValueError(
                f"masked_column_slices={slices}: 16-bit only (fp8=False) and tile_n a multiple of "
                f"{slices * ACC_COLUMN_GROUP} (slices of whole 8-column groups); got fp8={self.fp8}, "
                f"tile_n={self.tile_n}"
            )
        if self.skip_unseen_first_block and not self.causal:
            raise ValueError("skip_unseen_first_block=True: only causal (every row of an unmasked tile sees each block)")
        if self.cluster_heads and not self.kv_multicast:
            raise ValueError("cluster_heads=True: only with kv_multicast=True (it says which CTAs share K and V)")
        if self.fp8 and self.tile_n % FP8_MMA_K:
            raise ValueError(f"tile_n={self.tile_n}: FP8 needs a multiple of {FP8_MMA_K} (its wgmma's k-step)")
        if self.smem_bytes() > SM90_SMEM_BYTES:
            raise ValueError(
                f"{self}: needs {self.smem_bytes()} bytes of shared memory, "
                f"sm_90 has {SM90_SMEM_BYTES}"
            )


# An fp32 accumulator tile written by 8-byte stores takes its 128-byte swizzle lines two per
# row (64 floats): a half-warp's stores cover four rows, one 32-byte bank group each
# (wgmma.accumulator_tile_layout).
ACCUMULATOR_ROW_FLOATS = 64
# The 128-byte swizzle in fp32 elements: a 16-byte unit's index (bits 2-4) XOR'd with the
# 128-byte line's index within 1 KiB (bits 5-7). A shared-memory pointer swizzles byte
# addresses, two bits further up.
ACCUMULATOR_SWIZZLE = (3, 2, 3)
FP32_ADDRESS_BITS = 2


def accumulator_tile_offset(row, col, rows: int):
    """The element offset of (row, col) in one stage of ``wgmma.accumulator_tile_layout``
    with ``rows`` rows, swizzle included: where a linear bulk copy of the tile puts that
    value. Python ints, Int32 or integer torch tensors."""
    linear = (row * ACCUMULATOR_ROW_FLOATS + col % ACCUMULATOR_ROW_FLOATS
              + (col // ACCUMULATOR_ROW_FLOATS) * (rows * ACCUMULATOR_ROW_FLOATS))
    bits, base, shift = ACCUMULATOR_SWIZZLE
    return linear ^ (((linear >> (base + shift)) & ((1 << bits) - 1)) << base)


def accumulator_register_offset(row, col):
    """Where (row, col) of a warpgroup's m64nN wgmma accumulator sits when every thread
    stores its registers in order, four (16 bytes) at a time: register i of thread t at
    (i // 4) * 512 + 4 t + i % 4. Lane l of warp w holds rows 16w + l // 4 and + 8 and the
    column pairs 8j + 2 (l % 4); registers 4j .. 4j + 3 are (row, col), (row, col + 1),
    (row + 8, col), (row + 8, col + 1). Python ints, Int32 or integer torch tensors."""
    thread = 32 * (row // 16) + 4 * (row % 8) + (col % 8) // 2
    return (col // 8) * (4 * THREADS_PER_WARPGROUP) + 4 * thread + 2 * ((row % 16) // 8) + col % 2


def accumulator_register_coords(index):
    """The (row, col) of a warpgroup's m64nN accumulator stored at ``index`` in register
    order: ``accumulator_register_offset``'s inverse."""
    group, thread, register = index // (4 * THREADS_PER_WARPGROUP), (index // 4) % THREADS_PER_WARPGROUP, index % 4
    row = 16 * (thread // 32) + (thread % 32) // 4 + 8 * (register // 2)
    return row, 8 * group + 2 * (thread % 4) + register % 2


@dataclass(frozen=True)
class DQTileGeometry:
    """How the backward's fp32 dQ accumulator holds a query block: ``tile_m`` rows of
    ``head_dim``, in parts of (``part_rows``, ``part_cols``), one per consumer warpgroup,
    stored one after another (row-major over the grid of parts), each part in
    ``kernels.wgmma.accumulator_tile_layout``; or (``transposed``: the dQᵀ GEMM's
    accumulator, its M the part's 64 columns and its N the block's rows) as the
    warpgroup's threads hold it (``accumulator_register_offset``). The main kernel writes
    it, the postprocess reads it."""

    head_dim: int
    tile_m: int
    part_rows: int
    part_cols: int
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.transposed and (self.part_rows != self.tile_m or self.part_cols != ROWS_PER_CONSUMER_WARPGROUP):
            raise ValueError(
                f"transposed=True: a part is one warpgroup's dQᵀ accumulator, {ROWS_PER_CONSUMER_WARPGROUP} columns "
                f"by the block's {self.tile_m} rows; got part_rows={self.part_rows}, part_cols={self.part_cols}"
            )

    def offset(self, row, col):
        """Where dQ's (row, col) sits in a head's accumulator (ints, Int32 or tensors)."""
        block, row_in_block = row // self.tile_m, row % self.tile_m
        part = (row_in_block // self.part_rows) * (self.head_dim // self.part_cols) + col // self.part_cols
        if self.transposed:
            inside = accumulator_register_offset(col % self.part_cols, row_in_block)
        else:
            inside = accumulator_tile_offset(row_in_block % self.part_rows, col % self.part_cols, self.part_rows)
        return block * (self.tile_m * self.head_dim) + part * (self.part_rows * self.part_cols) + inside


@dataclass(frozen=True)
class Sm90BackwardConfig:
    """One compiled variant of the Hopper backward kernel (kernels/sm90_bwd.py).

    A CTA owns ``tile_n`` keys of one head and walks the query blocks of ``tile_m`` rows,
    through rings of ``q_stages`` Q tiles and ``do_stages`` dO tiles, with two consumer
    warpgroups. They split the work one of two ways:

    - by keys (``head_dim_split=False``): each owns 64 of the 128 keys, keeps Pᵀ and dSᵀ
      in registers and feeds them to its dV and dK GEMMs from there;
    - by head dim (``head_dim_split=True``, for head dim 256, where a warpgroup's dK and dV
      of 64 keys would need 256 registers per thread): both share 64 keys, split the
      queries of Sᵀ and dPᵀ and the head dim of dV, dK and dQ, and pass Pᵀ and dSᵀ through
      shared memory.
    """

    head_dim: int
    tile_m: int
    tile_n: int = 128
    q_stages: int = 2
    do_stages: int = 2
    causal: bool = False
    # GQA/MQA: dK and dV added in fp32 into accumulators shared by a kv head's query heads.
    kv_accumulate: bool = False
    # GQA/MQA, instead of kv_accumulate: a CTA owns a key block of one kv head and walks the
    # query blocks of each query head of its group in turn, dK and dV staying in its
    # registers across them, then stores them once in the input dtype: no fp32
    # accumulators to zero, no atomics, no conversion, K and V loaded once per group. The
    # grid has a CTA per kv head instead of per query head.
    kv_group_in_cta: bool = False
    head_dim_split: bool = False
    # Bit-identical gradients run to run: the fp32 additions into dQ (and kv_accumulate's
    # dK, dV) take turns in a fixed order, through counters in global memory.
    deterministic: bool = False
    # The dQ GEMM's warpgroups split the query rows (each its own 64, all head-dim columns)
    # instead of the columns: at tile_m 128 and head dim 64 each then issues 64x64 wgmmas
    # reading half of dS, not 64x32 ones reading all of it, whose A and B operands outrun
    # shared memory's 128 bytes per clock (H200 sweep: +0-5% over columns at head dim 64).
    dq_rows: bool = False
    # Key split: the dQ GEMM transposed, dQᵀ = Kᵀ dSᵀ (M = head dim, 64 columns per
    # warpgroup; N = the query block), so that tile_m need not be a multiple of 64:
    # flash-attn-4's 80-row blocks at head dim 128, whose step reads 5% fewer shared-memory
    # bytes per FLOP than 64 rows (perf/bwd_smem_bound.py). The warpgroup waits for its dV
    # GEMM before issuing it (at 80 rows ptxas otherwise serialises every wgmma, C7512:
    # dV's and dK's accumulators, Pᵀ, dSᵀ and dQᵀ's do not all fit), and stores dQᵀ in its
    # registers' order, 16 bytes a thread (DQTileGeometry.transposed): into the accumulator
    # tile each pair of a thread's values would be two queries, two rows, at two wavefronts
    # a store.
    dq_transposed: bool = False
    # The postprocess (dQ out of its fp32 accumulator) launched while this kernel runs
    # (programmatic dependent launch): each key block's CTA signals its head's counter once
    # its dQ has landed, and the postprocess of a head starts when all have, on the SMs
    # that the main grid's last wave leaves idle. The pre- and postprocess each take
    # 54-80 us at any seqlen of the protocol's 16k tokens, a sixth of the call at 1k (H200
    # sweep, 3 rounds: +1-6% at 1k, within noise at 4k and 16k).
    overlap_postprocess: bool = True
    # The first key block to hand over a query block's dQ stores it into the fp32
    # accumulator, the others add after that store has landed (a ticket counter per query
    # block; deterministic: the first in turn order), so the preprocess writes no zeros: 4
    # bytes per dQ element, 128 MB at the protocol's 16k tokens, on the critical path at
    # every seqlen (H200, two rounds: 512 unmasked 326/370/292 -> 342/403/314 at head dims
    # 64/128/256, causal 208/239/201 -> 218/264/228; causal 1k +3-6%). The selector turns
    # it off from 8k keys, where the zeros cost less than the tickets
    # (flash4/backward.py, ZEROED_DQ_MIN_SEQLEN_K).
    dq_first_stores: bool = True
    # Non-causal, not deterministic: each key block walks the query blocks from its own
    # start (block n from n * (query blocks // key blocks)), wrapping around, so the key
    # blocks of a head reach each query block at different steps, not all at once: first
    # stores in order lost 4-7% unmasked at 16k, waiting for the first store; rotated the
    # long rows are within the rounds' spread.
    rotate_query_blocks: bool = True
    # Causal: a CTA walks key block n and then its mirror, key_blocks - 1 - n (half the
    # grid), so every CTA walks about as many query blocks: causal walks shorten along the
    # diagonal, and the longest ones (key block 0 of a late head) otherwise start in the
    # grid's last wave while short ones have run out. Between the two, dK and dV of the
    # first are stored and K and V of the second loaded. The selector pairs them under
    # kv_group_in_cta, on short rows (flash4/backward.py, MIRRORED_KV_GROUP_MAX_SEQLEN_K);
    # a CTA per query head gained nothing from them (H200, three rounds: -3% to +3%).
    mirror_pairs: bool = False
    # Key split only: the consumer warpgroups run about half a step apart instead of in step,
    # so that one's exponentials and dS math run under the other's GEMMs. In step they meet
    # at every query block, since each one's dQ GEMM reads the dSᵀ rows of both. Staggered,
    # warpgroup 1 starts a query block once warpgroup 0 has written its dSᵀ rows of it, and
    # warpgroup 0, ahead, computes each block's dQ one step late, once warpgroup 1's rows are
    # there too (the last after its walk). Same bits as in step (deterministic, a GPU test
    # compares them).
    staggered_warpgroups: bool = False

    @property
    def consumer_warpgroups(self) -> int:
        return BACKWARD_CONSUMER_WARPGROUPS

    @property
    def dq_tile_geometry(self) -> DQTileGeometry:
        """Each warpgroup's part of dQ: its half of the columns, or (dq_rows) of the rows."""
        wgs = self.consumer_warpgroups
        if self.dq_rows:
            return DQTileGeometry(self.head_dim, self.tile_m, self.tile_m // wgs, self.head_dim)
        return DQTileGeometry(self.head_dim, self.tile_m, self.tile_m, self.head_dim // wgs, self.dq_transposed)

    @property
    def row_stage_bytes(self) -> int:
        """One stage of the LSE or D ring: tile_m fp32 values, padded to a TMA alignment
        (80 rows take 384 bytes, not 320)."""
        return -(-self.tile_m * FP32_BYTES // TMA_SMEM_ALIGN_BYTES) * TMA_SMEM_ALIGN_BYTES

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """K and V, the Q and dO rings with their rows' fp32 LSE and D, dSᵀ (and Pᵀ when
        the head dim is split; keys x queries), the fp32 dQ tile, plus barriers."""
        kv = 2 * self.tile_n * self.head_dim * elem_bytes
        rings = (self.q_stages + self.do_stages) * (self.tile_m * self.head_dim * elem_bytes + self.row_stage_bytes)
        ds = (2 if self.head_dim_split else 1) * BACKWARD_DS_STAGES * self.tile_n * self.tile_m * elem_bytes
        dq = self.tile_m * self.head_dim * FP32_BYTES
        return kv + rings + ds + dq + BARRIER_BYTES

    def __post_init__(self) -> None:
        keys = ROWS_PER_CONSUMER_WARPGROUP * (1 if self.head_dim_split else BACKWARD_CONSUMER_WARPGROUPS)
        if self.tile_n != keys:
            raise ValueError(
                f"tile_n={self.tile_n}: {keys} keys per CTA "
                f"({'shared by' if self.head_dim_split else '64 for each of'} the two consumer warpgroups)"
            )
        if self.tile_m % 16 or not 16 <= self.tile_m <= 128:
            raise ValueError(f"tile_m={self.tile_m}: a multiple of 16 in [16, 128]")
        if self.head_dim_split and self.tile_m % (16 * BACKWARD_CONSUMER_WARPGROUPS):
            raise ValueError(f"tile_m={self.tile_m}: the warpgroups split the queries, so a multiple of 32")
        if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim={self.head_dim}: a multiple of 16 in [16, 256]")
        if self.head_dim_split and self.head_dim % (16 * BACKWARD_CONSUMER_WARPGROUPS):
            raise ValueError(f"head_dim={self.head_dim}: the warpgroups split it, so a multiple of 32")
        if self.staggered_warpgroups and self.head_dim_split:
            raise ValueError("staggered_warpgroups=True: the head-dim split's warpgroups share every GEMM, so they cannot run apart")
        if min(self.q_stages, self.do_stages) < 1:
            raise ValueError(f"q_stages={self.q_stages}, do_stages={self.do_stages}: at least 1 each")
        rows_per_split = ROWS_PER_CONSUMER_WARPGROUP * BACKWARD_CONSUMER_WARPGROUPS
        if self.dq_rows and (self.head_dim_split or self.tile_m != rows_per_split):
            raise ValueError(
                f"dq_rows=True: each warpgroup takes 64 query rows, so tile_m={rows_per_split} "
                f"(got {self.tile_m}) and no head_dim_split"
            )
        if self.dq_transposed and (self.head_dim_split or self.dq_rows or self.head_dim != rows_per_split):
            raise ValueError(
                f"dq_transposed=True: the key split (no head_dim_split, no dq_rows), each warpgroup's "
                f"{ROWS_PER_CONSUMER_WARPGROUP} head-dim columns its M, so head_dim={rows_per_split}; got "
                f"head_dim={self.head_dim}, head_dim_split={self.head_dim_split}, dq_rows={self.dq_rows}"
            )
        if not (self.head_dim_split or self.dq_rows or self.dq_transposed) and self.tile_m % ROWS_PER_CONSUMER_WARPGROUP:
            raise ValueError(f"tile_m={self.tile_m}: dQ's wgmmas take 64 query rows each, so a multiple of 64")
        if self.kv_group_in_cta and (self.kv_accumulate or self.deterministic):
            raise ValueError(
                "kv_group_in_cta=True: not with kv_accumulate (dK and dV have one writer) nor deterministic "
                "(its turn order is per query head)"
            )
        if self.mirror_pairs and (not self.causal or self.deterministic):
            raise ValueError(
                "mirror_pairs=True: causal only (unmasked walks are all as long), and not deterministic "
                "(its turns take the key blocks in grid order)"
            )
        if self.smem_bytes() > SM90_SMEM_BYTES:
            raise ValueError(f"{self}: needs {self.smem_bytes()} bytes of shared memory, sm_90 has {SM90_SMEM_BYTES}")
