"""Online softmax over the rows of a wgmma accumulator, kept in registers.

Per query row the state is the running max ``m`` of the raw scores and the running sum
``l`` of ``exp2((s - m) * scale_log2)``, where ``scale_log2 = softmax_scale * log2(e)``
folds the softmax scale and the change of base into one multiply. Four threads share a
row (a quad), so the max is reduced over the quad at once; the sum stays a per-thread
partial until ``finalize`` since only the final value needs the whole row.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32

from ..pipelines.stage_scalars import StageScalars
from .e4m3_codes import CODES_PER_OCTAVE, code_base
from .f16_scores import codes_in_place, round_down_to_f16, row_words, score_words, splat_f16x2
from .f16_scores import row_max as f16_row_max
from .mma_layouts import acc_rows_cols, leading_columns

# The four threads of a quad hold the columns of one accumulator row.
THREADS_PER_ROW = 4
# How far (log2 units) a block's scores may pass the kept row max before the row rebases
# (lazy_rescale): P is then at most 2^8, which a 16-bit P holds (fp16's largest is 65504)
# and the fp32 row sums and O take with room to spare.
MAX_HEADROOM_LOG2 = 8.0
MAX_HEADROOM = 2.0**MAX_HEADROOM_LOG2
# The largest P that ``rebase_p`` divides by: 1/P must stay a normal fp32 (rcp.approx
# flushes results below 2^-126 to zero). Larger P, or P = inf, need their scores again.
LARGEST_REBASED_P = 2.0**126


class OnlineSoftmax:
    def __init__(self, scale_log2: Float32, rows: int, sum_from_rescaled: bool = False):
        self.scale_log2 = scale_log2
        self.rows = rows
        # The row sum's additions start from the old sum times O's factor instead of from 0:
        # the factor's exponential is then needed first, and ptxas schedules O's rescale
        # among the block's MUFU.EX2 instead of after the last one (ncu, head dim 64: the
        # exp stream then throttled less, as in flash-attn-4). It pays where MUFU binds.
        self.sum_from_rescaled = sum_from_rescaled
        self.row_max = cute.make_rmem_tensor(rows, Float32)
        self.row_sum = cute.make_rmem_tensor(rows, Float32)

    def tile_inputs(self, scalars: Optional[StageScalars], slot) -> None:
        """Take what came with the tile's Q (slot ``slot`` of ``scalars``), right after the
        wait for it: nothing here (the block-scaled softmax takes its descales)."""

    def block_inputs(self, scalars: Optional[StageScalars], stage: Int32):
        """What ``update`` needs of a key block besides its scores, read from K's stage
        ``stage`` of ``scalars`` after the wait for it: nothing here (the block-scaled
        softmax reads the block's descales)."""
        return None

    @cute.jit
    def update(
        self, acc_s: cute.Tensor, block, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool],
        live_cols: cutlass.Constexpr = None,
    ) -> cute.Tensor:
        """Turn the scores of a key block (``block``: its ``block_inputs``) into unnormalised
        probabilities in place; return each row's factor ``exp2((m_old - m_new) *
        scale_log2)`` for rescaling O. Only a ``masked`` block can leave a row with no
        finite score. ``live_cols``: only the first that many columns of
        ``acc_rows_cols(acc_s)`` may hold a finite score; the others get P = 0 with no
        exponential, and the row sums still add every column, in the same order, so the
        result is bit for bit that of the whole block."""
        s = acc_rows_cols(acc_s)
        live = s if cutlass.const_expr(live_cols is None) else leading_columns(s, live_cols)
        row_scale = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            row = live[r, None].load()
            m_old, m_safe = self.raise_max(r, row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0), is_first, masked)
            p = cute.math.exp2(row * self.scale_log2 - m_safe * self.scale_log2, fastmath=True)
            live[r, None].store(p)
            if cutlass.const_expr(live_cols is not None):
                for j in cutlass.range_constexpr(live_cols, cute.size(s, mode=[1])):
                    s[r, j] = Float32(0.0)
                p = s[r, None].load()
            if cutlass.const_expr(is_first or not self.sum_from_rescaled):
                partial = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = partial
            else:
                scale = cute.math.exp2((m_old - m_safe) * self.scale_log2, fastmath=True)
                row_scale[r] = scale
                if cutlass.const_expr(self.sum_from_rescaled):
                    self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * scale, 0)
                else:
                    self.row_sum[r] = self.row_sum[r] * scale + partial
        return row_scale

    @cute.jit
    def passes_kept_max(self, acc_s: cute.Tensor):
        """Whether a score in this thread's columns lies more than MAX_HEADROOM_LOG2 above
        its row's kept max (a row that has seen no key, max -inf, always does). Each thread
        checks its own columns, no shuffle: the warp's vote covers the whole quad."""
        s = acc_rows_cols(acc_s)
        passes = False
        for r in cutlass.range_constexpr(self.rows):
            local_max = s[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            passes = passes | ((local_max - self.row_max[r]) * self.scale_log2 > MAX_HEADROOM_LOG2)
        return passes

    @cute.jit
    def update_under_kept_max(self, acc_s: cute.Tensor) -> None:
        """``update`` of an unmasked block none of whose scores passes its row's kept max by
        more than MAX_HEADROOM_LOG2: the max stays, so O keeps its scale and the row sum
        goes on from where it was."""
        s = acc_rows_cols(acc_s)
        for r in cutlass.range_constexpr(self.rows):
            row = s[r, None].load()
            p = cute.math.exp2(row * self.scale_log2 - self.row_max[r] * self.scale_log2, fastmath=True)
            s[r, None].store(p)
            self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r], 0)

    @cute.jit
    def exp_under_kept_max(self, acc_s: cute.Tensor) -> tuple:
        """Exponentials of an unmasked block against the kept row max, in place; returns
        each row's sum of this thread's P (not yet added) and whether one of them passes
        MAX_HEADROOM. Sums at most MAX_HEADROOM bound every P by it, with no max taken:
        one comparison per row instead of a max over every score."""
        s = acc_rows_cols(acc_s)
        partials = cute.make_rmem_tensor(self.rows, Float32)
        over = False
        for r in cutlass.range_constexpr(self.rows):
            row = s[r, None].load()
            p = cute.math.exp2(row * self.scale_log2 - self.row_max[r] * self.scale_log2, fastmath=True)
            s[r, None].store(p)
            partials[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            over = over | (partials[r] > MAX_HEADROOM)
        return partials, over

    @cute.jit
    def add_partials(self, partials: cute.Tensor) -> None:
        for r in cutlass.range_constexpr(self.rows):
            self.row_sum[r] = self.row_sum[r] + partials[r]

    @cute.jit
    def has_unseen_row(self):
        """Whether one of this thread's rows has seen no key yet (max -inf)."""
        unseen = self.row_max[0] == -Float32.inf
        for r in cutlass.range_constexpr(1, self.rows):
            unseen = unseen | (self.row_max[r] == -Float32.inf)
        return unseen

    @cute.jit
    def row_p_max(self, acc_s: cute.Tensor) -> cute.Tensor:
        """Each row's largest P (over its quad)."""
        s = acc_rows_cols(acc_s)
        p_max = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            local = s[r, None].load().reduce(cute.ReductionOp.MAX, Float32(0.0), 0)
            p_max[r] = cute.arch.warp_reduction_max(local, threads_in_group=THREADS_PER_ROW)
        return p_max

    @cute.jit
    def rebase_p(self, acc_s: cute.Tensor, p_max: cute.Tensor) -> cute.Tensor:
        """Raise the max of each row whose largest P (``p_max``, at most LARGEST_REBASED_P)
        passes 1 to that P's score: the row's P, its old sum and (through the returned
        factor) O are divided by it, so the largest P becomes 1 to within an fp32 ulp and
        rounds to exactly 1 in 16 bits, as a rebased row's largest P does in ``update``;
        the new P are added to the sum."""
        s = acc_rows_cols(acc_s)
        row_scale = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            rebase = p_max[r] > 1.0
            factor = cute.arch.rcp_approx(p_max[r]) if rebase else Float32(1.0)
            octaves = cute.math.log2(p_max[r], fastmath=True) if rebase else Float32(0.0)
            p = s[r, None].load() * factor
            s[r, None].store(p)
            self.row_max[r] = self.row_max[r] + octaves * cute.arch.rcp_approx(self.scale_log2)
            self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * factor, 0)
            row_scale[r] = factor
        return row_scale

    @cute.jit
    def raise_max(
        self, r: int, block_max: Float32, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]
    ) -> tuple:
        """Row ``r``'s running max after a block whose max (in this thread's columns) is
        ``block_max``, reduced over the row's quad; returns (old max, new max to subtract)."""
        m_new = block_max
        if cutlass.const_expr(not is_first):
            m_new = cute.arch.fmax(m_new, self.row_max[r])
        m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=THREADS_PER_ROW)
        m_old = self.row_max[r]
        self.row_max[r] = m_new
        # A row that has seen only masked keys has max -inf; subtracting 0 instead keeps
        # exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
        m_safe = m_new
        if cutlass.const_expr(masked):
            m_safe = 0.0 if m_new == -Float32.inf else m_new
        return m_old, m_safe

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor, when_needed: cutlass.Constexpr[bool] = False) -> None:
        """O's rows times ``row_scale``; ``when_needed``: only if a factor in the warp is not 1
        (the vote keeps the branch uniform, so the warp skips the multiplies as one)."""
        if cutlass.const_expr(when_needed):
            needed = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, self.rows):
                needed = needed | (row_scale[r] != 1.0)
            if cute.arch.vote_any_sync(needed):
                self._scale_rows(acc_o, row_scale)
        else:
            self._scale_rows(acc_o, row_scale)

    @cute.jit
    def _scale_rows(self, acc_o: cute.Tensor, row_scale: cute.Tensor) -> None:
        o = acc_rows_cols(acc_o)
        for r in cutlass.range_constexpr(self.rows):
            o[r, None].store(o[r, None].load() * row_scale[r])

    @cute.jit
    def finalize(self, lse: cute.Tensor) -> cute.Tensor:
        """Write each row's natural-log LSE into ``lse``; return 1/l for normalising O.

        A row that saw no key (l = 0) gets 1/l = 0, so its output is 0, and LSE = -inf.
        """
        inv_sum = cute.make_rmem_tensor(self.rows, Float32)
        for r in cutlass.range_constexpr(self.rows):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=THREADS_PER_ROW)
            empty = total == 0.0
            inv_sum[r] = 0.0 if empty else cute.arch.rcp_approx(total)
            lse[r] = (
                -Float32.inf
                if empty
                else self.row_max[r] * self.scale_log2 * math.log(2.0) + cute.math.log(total, fastmath=True)
            )
        return inv_sum


# The f16 code scale (8 codes per octave times the block's scale, rounded to f16) errs by
# at most 2^-11 of itself, so the row max's code by 2^-11 of its score in codes; the
# offset leaves twice that below the top code, and CODE_MARGIN more for f16's subnormal
# scales, so that no code rounds past the top one (127 is NaN).
CODE_SCALE_ERROR = 2.0**-10
CODE_MARGIN = 2.0**-6

# e4m3's largest finite value: FP8 probabilities are scaled onto [0, E4M3_MAX].
E4M3_MAX = 448.0


class BlockScaledSoftmax(OnlineSoftmax):
    """The online softmax of the FP8 forward, whose inputs carry one descale per tile.

    Key block j's raw scores are Q8 K8ᵀ; times ``scale_log2`` (softmax scale and log2(e)),
    the Q tile's descale and k_descale[j] they are log2-domain scores, so the running max
    ``m`` is kept in those units. P is rounded to e4m3 for the P V GEMM, scaled by
    E4M3_MAX · v_descale[j] / v_ref, where v_ref is the largest V descale seen so far: P
    then uses e4m3's range (above its subnormals) and V's descale is folded in for free,
    through the exponent. When v_ref grows, O is rescaled with the max's factor. The row
    sum adds each block's P divided by its scale, so it counts true probabilities;
    ``finalize`` returns 1/l times v_ref / E4M3_MAX, the factor O needs.

    With ``sums_on_tensor_cores`` (V per tensor only) the row sums come from the GEMM
    beside P V instead (kernels/tensor_core_row_sum.py), through ``add_tensor_core_sums``:
    sums of the rounded P, whole rows, one block behind the max.
    """

    def __init__(
        self, scale_log2: Float32, rows: int, v_per_tensor: bool = False, sums_on_tensor_cores: bool = False,
        p_by_rounding: bool = False, score_shift: float = 0.0,
    ):
        """The descales come with the tile's stages (pipelines/stage_scalars.py): Q's stage
        holds the Q tile's descale, then V's when ``v_per_tensor``; each K stage its block's
        K descale, then its V descale when V has one per block.
        ``score_shift``: a constant every raw score carries (int8 Q and K's shift, left in by
        Sm90ForwardConfig.fp8_int8_shift_in_softmax), taken off each row's max exactly and
        out of each row's constant."""
        super().__init__(scale_log2, rows)
        if sums_on_tensor_cores and not v_per_tensor:
            raise ValueError("sums_on_tensor_cores=True: only with v_per_tensor=True (one P scale for all blocks)")
        if p_by_rounding and not sums_on_tensor_cores:
            raise ValueError("p_by_rounding=True: only with sums_on_tensor_cores=True (P's scale then cancels)")
        self.sums_on_tensor_cores = sums_on_tensor_cores
        # P as e4m3 codes rounded from the scores (kernels/e4m3_codes.py): ``update`` leaves
        # F16_INTEGER_BASE plus each code in S's registers, for ``convert_codes``.
        self.p_by_rounding = p_by_rounding
        self.v_ref = cute.make_rmem_tensor(1, Float32)
        # Scores in f16 (kernels/f16_scores.py): each row's offset of its codes, an f16 value.
        self.code_offset = cute.make_rmem_tensor(rows, Float32)
        # One V descale for all blocks (any of them): P's scale is E4M3_MAX itself, and V's
        # descale multiplies O once, in finalize.
        self.v_per_tensor = v_per_tensor
        self.score_shift = score_shift

    def tile_inputs(self, scalars: StageScalars, slot) -> None:
        values = scalars.read(slot)
        self.q_descale = values[0]
        if self.v_per_tensor:
            self.v_descale = values[1]

    def block_inputs(self, scalars: StageScalars, stage: Int32) -> tuple:
        """The block's K and V descales (None: V per tensor)."""
        values = scalars.read(stage)
        return values if cutlass.const_expr(not self.v_per_tensor) else (values[0], None)

    @cute.jit
    def update(
        self, acc_s: cute.Tensor, block: tuple, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]
    ) -> cute.Tensor:
        """``OnlineSoftmax.update`` for a key block whose descales ``block`` holds; the
        returned factors include v_ref's growth."""
        if cutlass.const_expr(acc_s.element_type == Float16):
            return self.update_f16_scores(acc_s, block, is_first, masked)
        s = acc_rows_cols(acc_s)
        k_descale, v_descale = block
        scale = self.scale_log2 * self.q_descale * k_descale
        if cutlass.const_expr(self.v_per_tensor):
            # No V descale per block: no running v_ref, no division, constant P scale.
            v_old = v_new = 1.0
            p_log2 = math.log2(E4M3_MAX)
            inv_p_scale = 1.0 / E4M3_MAX
        else:
            v_old = self.v_ref[0]
            v_new = v_descale
            if cutlass.const_expr(not is_first):
                v_new = cute.arch.fmax(v_old, v_descale)
            self.v_ref[0] = v_new
            p_scale = E4M3_MAX * v_descale / v_new
            p_log2 = cute.math.log2(p_scale, fastmath=True)
            inv_p_scale = cute.arch.rcp_approx(p_scale)
        row_scale = cute.make_rmem_tensor(self.rows, Float32)
        if cutlass.const_expr(self.p_by_rounding):
            code_scale = scale * CODES_PER_OCTAVE
        for r in cutlass.range_constexpr(self.rows):
            row = s[r, None].load()
            block_max = row.reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
            if cutlass.const_expr(self.score_shift != 0.0):
                # Exact: the shifted max and the shift are floats of one binade.
                block_max = block_max - self.score_shift
            m_old, m_safe = self.raise_max(r, block_max * scale, is_first, masked)
            # Each row's constant; with a score shift, less the shift's share of it.
            if cutlass.const_expr(self.p_by_rounding):
                scaled = row * code_scale
                offset = code_base(p_log2) - m_safe * CODES_PER_OCTAVE
                if cutlass.const_expr(self.score_shift != 0.0):
                    offset = offset - self.score_shift * code_scale
                p = scaled + offset
            else:
                scaled = row * scale
                bias = m_safe - p_log2
                if cutlass.const_expr(self.score_shift != 0.0):
                    bias = bias + self.score_shift * scale
                p = cute.math.exp2(scaled - bias, fastmath=True)
            s[r, None].store(p)
            if cutlass.const_expr(self.sums_on_tensor_cores):
                partial = Float32(0.0)
            else:
                partial = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * inv_p_scale
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                self.row_sum[r] = partial
            else:
                factor = cute.math.exp2(m_old - m_safe, fastmath=True)
                if cutlass.const_expr(self.v_per_tensor):
                    row_scale[r] = factor
                else:
                    row_scale[r] = factor * (v_old / v_new)
                if cutlass.const_expr(not self.sums_on_tensor_cores):
                    self.row_sum[r] = self.row_sum[r] * factor + partial
        return row_scale

    @cute.jit
    def update_f16_scores(
        self, acc_s: cute.Tensor, block: tuple, is_first: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]
    ) -> cute.Tensor:
        """``update`` for P's codes from f16 scores (kernels/f16_scores.py): V per tensor, row
        sums on the tensor cores. Each row's factor is that of its codes' offset."""
        k_descale, _ = block
        scale = self.scale_log2 * self.q_descale * k_descale
        words = score_words(acc_s)
        code_scale = splat_f16x2(scale * CODES_PER_OCTAVE)
        top = code_base(math.log2(E4M3_MAX))
        row_scale = cute.make_rmem_tensor(self.rows, Float32)
        for r, indices in enumerate(row_words(acc_s)):
            _, m_safe = self.raise_max(r, f16_row_max(words, indices) * scale, is_first, masked)
            top_score = m_safe * CODES_PER_OCTAVE
            margin = cute.arch.fmax(top_score, -top_score) * CODE_SCALE_ERROR + CODE_MARGIN
            offset = round_down_to_f16(top - top_score - margin)
            codes_in_place(words, indices, code_scale, splat_f16x2(offset))
            if cutlass.const_expr(is_first):
                row_scale[r] = 1.0
                # The tensor cores' sums of this block's P join it with the next block.
                self.row_sum[r] = 0.0
            else:
                row_scale[r] = cute.math.exp2((offset - self.code_offset[r]) * (1.0 / CODES_PER_OCTAVE), fastmath=True)
            self.code_offset[r] = offset
        return row_scale

    @cute.jit
    def add_tensor_core_sums(self, sums: cute.Tensor, row_scale) -> None:
        """Add the row sums of the P that the last P V read (``sums``: the row-sum GEMM's
        accumulator, every column the whole row), which are in the units of the max before
        this block's; then apply this block's ``row_scale`` (None after the last block)."""
        l = acc_rows_cols(sums)
        for r in cutlass.range_constexpr(self.rows):
            total = self.row_sum[r] + l[r, 0] * (1.0 / E4M3_MAX)
            if cutlass.const_expr(row_scale is not None):
                total = total * row_scale[r]
            self.row_sum[r] = total

    @cute.jit
    def finalize(self, lse: cute.Tensor) -> cute.Tensor:
        """``OnlineSoftmax.finalize``, with O's factor v_ref / E4M3_MAX folded into 1/l."""
        inv_sum = cute.make_rmem_tensor(self.rows, Float32)
        o_factor = (self.v_descale if cutlass.const_expr(self.v_per_tensor) else self.v_ref[0]) * (1.0 / E4M3_MAX)
        for r in cutlass.range_constexpr(self.rows):
            total = self.row_sum[r]
            if cutlass.const_expr(not self.sums_on_tensor_cores):
                total = cute.arch.warp_reduction_sum(total, threads_in_group=THREADS_PER_ROW)
            empty = total == 0.0
            inv_sum[r] = 0.0 if empty else cute.arch.rcp_approx(total) * o_factor
            lse[r] = -Float32.inf if empty else self.row_max[r] * math.log(2.0) + cute.math.log(total, fastmath=True)
        return inv_sum
