"""FP8 (e4m3) quantization of attention inputs on the GPU: flash4.quantize_fp8's definition
in one read of the input per descale block instead of torch's several passes.

``QuantizeFp8Rows``: x (batch, seqlen, heads, head_dim) to e4m3 values of the same shape
(or, ``int8``, to int8 codes onto ±127: flash4.quantize_int8, the accurate mode's Q and K).
Blockwise, each CTA owns one block of rows of one head: it loads the block into registers,
takes its largest magnitude, writes descale = max(amax / 448, SMALLEST_DESCALE) (1 for an
all-zero block), and stores x · (1 / descale) rounded to e4m3 from the same registers.
Per tensor, the descale comes from ``TensorAmax``'s partial maxima, which every CTA folds
(the first one also writes the descale out).

``TensorAmax``: the largest magnitude of each 128 KiB of a tensor, for the per-tensor
descales: one read, no stores but one float per CTA. torch's reduction and the five small
launches that turned its result into a descale took twice as long.

``QuantizeFp8TransposedV``: V stored straight into the FP8 forward kernel's V layout
(flash4.quantize.fp8_value_layout): (batch, kv_heads, head_dim, keys), keys contiguous,
zero-padded to whole groups of 32 and renamed within each group by FP8_PV_KEY_ORDER. A CTA
transposes 128 keys through shared memory, so that both its loads (rows of V) and its
stores (16 keys of one head-dim row) are 16 bytes a thread. 16-bit or float32 V is
quantized on the way, over a per-tensor descale from ``TensorAmax``; e4m3 V (already
quantized) only moves.

Values are multiplied by the descale's reciprocal (``reciprocal``, rounded as an IEEE
division rounds it, once per thread) in float32 and rounded to nearest even. An IEEE
division per value took a dozen instructions (MUFU.RCP, a range check, a slow-path call)
and bound the blockwise kernel. |x| times the reciprocal may pass 448 by an ulp; cvt's
satfinite then gives 448, as torch's rounding does.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.warp_roles import THREADS_PER_WARP
from .e4m3_codes import SMALLEST_DESCALE
from .hadamard_rotation import HadamardSigns, RowRotation
from .int8_scores import INT8_CODE_MAX, SHIFT_BITS
from .inline_ptx import permute_bytes, ptx_on_f32
from .memory_pass import LOAD_BYTES, LOADS_IN_FLIGHT, load_batches, row_vector
from .mma_layouts import FP8_PV_KEY_ORDER
from .online_softmax import E4M3_MAX
from .packed_convert import convert_packed
from .wgmma import rows_first

# 1.5 * 2^23 as a PTX float literal (its bits), for to_int8's rounding add.
SHIFT_FLOAT_PTX = f"0f{SHIFT_BITS:08X}"
# Warps of a rows CTA that does not hold its block (per tensor, or read twice), and the
# step in which a resident one takes more: with one warp, a head-dim-256 block kept a warp
# busy for 128 loads in turn, and 16k tokens left too few loads in flight per SM.
ROW_WARPS = 4
ROW_THREADS = ROW_WARPS * THREADS_PER_WARP
# A blockwise CTA keeps at most this many bytes a thread in registers between its block's
# largest magnitude and its stores (64 registers, a quarter of a thread's 255): 16 loaded
# 16-byte vectors, or 64 rotated float32 values.
RESIDENT_BYTES = 256
# Threads a blockwise CTA may take to hold its block: at up to 90 registers each (ptxas,
# sm_90a), 512 take 70% of an SM's 64K; rotating at head dim 256 they take 128 each, all of
# it (one CTA an SM). A larger block (float32 at head dim 256, 192 rows) is read twice, the
# second time from L2.
MAX_RESIDENT_THREADS = 512
# Bytes of input per TensorAmax CTA, 32 vectors a thread of its 256: a 16k-token tensor of
# hidden size 2048 in bf16 gives 512 partial maxima, which each CTA of the pass that uses
# them folds (2 KiB from L2).
AMAX_BLOCK_BYTES = 128 * 1024
AMAX_THREADS = 2 * ROW_THREADS
# V's keys are renamed, and padded, in groups of this many: the FP8 wgmma's k-step.
KEY_GROUP = len(FP8_PV_KEY_ORDER)
# A V CTA: one warp stores each key group of its 128 keys.
V_WARPS = 4
V_THREADS = V_WARPS * THREADS_PER_WARP
V_KEYS = V_WARPS * KEY_GROUP
# Keys (consecutive positions of a group) in one 16-byte store of a head-dim row.
KEYS_PER_STORE = LOAD_BYTES
# Head-dim rows (4 bytes of a key) in a 32-bit shared-memory word.
ROWS_PER_WORD = 4


# CUDA's correctly rounded reciprocal (rcp.rn) without its slow path: MUFU.RCP, then one
# Newton step by two FFMAs. The slow path only takes divisors outside [2^-126, 2^126), and a
# descale lies inside (SMALLEST_DESCALE up; amax / 448 is at most 2^119); its call made
# ptxas spill in the per-tensor kernel.
_RECIPROCAL_ASM = (
    "{\n"
    ".reg .f32 r, e;\n"
    "rcp.approx.ftz.f32 r, $1;\n"
    "fma.rn.ftz.f32 e, $1, r, 0fBF800000;\n"
    "neg.ftz.f32 e, e;\n"
    "fma.rn.ftz.f32 $0, r, e, r;\n"
    "}\n"
)


def reciprocal(descale: Float32) -> Float32:
    """1 / descale, rounded as an IEEE division rounds it (as torch computes it)."""
    return ptx_on_f32(_RECIPROCAL_ASM, (descale,), Float32, pinned=False)


@cute.jit
def descale_of(amax: Float32, fp8_max: cutlass.Constexpr[float]) -> Float32:
    """flash4.quantize's descale of a block or tensor whose largest magnitude is ``amax``,
    scaled onto ``fp8_max``."""
    return cute.arch.fmax(amax / fp8_max, SMALLEST_DESCALE) if amax > 0.0 else Float32(1.0)


@cute.jit
def to_e4m3(x: cute.TensorSSA, inverse_descale: Float32, size: cutlass.Constexpr[int]) -> cute.Tensor:
    """``size`` float32 values times ``inverse_descale`` rounded to e4m3, four to a register:
    the definition every kernel here stores."""
    quotient = cute.make_rmem_tensor(cute.make_layout(size), Float32)
    quotient.store(x * inverse_descale)
    values = cute.make_rmem_tensor(cute.make_layout(size), cutlass.Float8E4M3FN)
    convert_packed(quotient, values)
    return values


@cute.jit
def to_int8(x: cute.TensorSSA, inverse_descale: Float32, size: cutlass.Constexpr[int]) -> cute.Tensor:
    """``size`` float32 values times ``inverse_descale`` rounded to the nearest integer, ties
    to even (torch.round): adding 1.5 * 2^23 rounds to an integer (floats there step by 1)
    whose low byte is the int8 code, two's complement. ``add.rn`` keeps ptxas from fusing
    the add with the product into one FFMA, which would round once instead of twice."""
    quotient = cute.make_rmem_tensor(cute.make_layout(size), Float32)
    quotient.store(x * inverse_descale)
    values = cute.make_rmem_tensor(cute.make_layout(size), cutlass.Int8)
    for i in cutlass.range_constexpr(size):
        bits = ptx_on_f32(f"{{ .reg .f32 t; add.rn.f32 t, $1, {SHIFT_FLOAT_PTX}; mov.b32 $0, t; }}", (quotient[i],),
                          Int32, pinned=False)
        values[i] = cutlass.Int8(bits)
    return values


@cute.jit
def magnitude(x: cute.Tensor) -> Float32:
    """The largest magnitude of a vector of values, in float32. Reduced in x's own dtype
    (exact) and only then converted: a float32 copy of the vector would be shared with the
    conversion before the stores, and a resident block would hold both across its barrier."""
    values = x.load()
    zero = x.element_type(0.0)
    if cutlass.const_expr(x.element_type is Float32):
        # Already float32 (rotated pieces, float32 input): one max a value, |x| folded into
        # it, where a max and a min took two (and at head dim 128 the registers for a
        # second CTA on an SM).
        return values.__abs__().reduce(cute.ReductionOp.MAX, zero, 0)
    return cute.arch.fmax(
        Float32(values.reduce(cute.ReductionOp.MAX, zero, 0)), -Float32(values.reduce(cute.ReductionOp.MIN, zero, 0))
    )


@cute.jit
def cta_max(value: Float32, tidx: Int32, warps: cutlass.Constexpr[int], scratch: cute.Tensor) -> Float32:
    """The largest of the CTA's threads' ``value`` (all >= 0), in every thread; ``scratch``
    holds a float per warp in shared memory."""
    value = cute.arch.warp_reduction_max(value, threads_in_group=THREADS_PER_WARP)
    if tidx % THREADS_PER_WARP == 0:
        scratch[tidx // THREADS_PER_WARP] = value
    cute.arch.barrier()
    result = Float32(0.0)
    for warp in cutlass.range_constexpr(warps):
        result = cute.arch.fmax(result, scratch[warp])
    return result


@cute.jit
def tensor_descale(
    mAmax: cute.Tensor, tidx: Int32, threads: cutlass.Constexpr[int], fp8_max: cutlass.Constexpr[float] = E4M3_MAX
) -> Float32:
    """The per-tensor descale from TensorAmax's partial maxima ``mAmax`` (flat), in every
    thread of the CTA, scaled onto ``fp8_max``."""
    scratch = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(threads // THREADS_PER_WARP))
    partials = cute.size(mAmax)
    amax = Float32(0.0)
    for first in cutlass.range(0, partials, threads * LOADS_IN_FLIGHT):
        # Past the last partial, the last one again: no load inside a branch (RowBlock.load_into).
        for j in cutlass.range_constexpr(LOADS_IN_FLIGHT):
            i = first + j * threads + tidx
            if i >= partials:
                i = partials - 1
            amax = cute.arch.fmax(amax, mAmax[i])
    return descale_of(cta_max(amax, tidx, threads // THREADS_PER_WARP, scratch), fp8_max)


class RowBlock:
    """The geometry that QuantizeFp8Rows and TensorAmax share: a CTA's block of ``rows``
    rows of one head, dealt out to ``threads`` threads in turns. In a turn a thread takes
    one *piece* of a row: a 16-byte vector (consecutive threads read consecutive 16 bytes
    of a row), or, when the rows are rotated first, a RowRotation's piece (``loads``
    vectors, the row spread over a few consecutive lanes), given back rotated in float32."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric], rows: int, threads: int,
                 hadamard: Optional[HadamardSigns] = None):
        self.dtype = dtype
        self.rows = rows
        self.threads = threads
        self.warps = threads // THREADS_PER_WARP
        self.vector = row_vector(dtype.width, head_dim)
        self.rotation = None if hadamard is None else RowRotation(head_dim, self.vector, hadamard)
        self.loads = 1 if self.rotation is None else self.rotation.loads
        self.lanes_per_row = head_dim // self.vector // self.loads
        self.turns = -(-rows * self.lanes_per_row // threads)
        # Bytes of registers a thread holds per load once the piece is ready to store: the
        # vector as loaded, or its values rotated in float32.
        self.held_bytes_per_load = LOAD_BYTES if self.rotation is None else self.vector * 4

    @cute.jit
    def place(self, turn: Int32, tidx: Int32, first_row: Int32) -> tuple:
        """(row, lane) of a thread's piece in ``turn``: lane is the piece's place among its
        row's (the first of its columns, counted in vectors). A thread keeps its lane from
        turn to turn (threads is a multiple of the lanes per row)."""
        index = turn * self.threads + tidx
        return first_row + index // self.lanes_per_row, index % self.lanes_per_row

    def new_piece(self) -> list:
        """Registers for one piece as loaded: ``loads`` vectors of the input dtype."""
        return [cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype) for _ in range(self.loads)]

    @cute.jit
    def load_into(self, piece: list, mX: cute.Tensor, row: Int32, end_row: Int32, lane: Int32, head: Int32,
                  batch: Int32):
        """piece = the vectors at (row, its columns), or, past the block's last row, at its
        last row. A load inside a branch would wait for the loads before it; a repeated row
        changes no largest magnitude, and its stores are skipped."""
        if row >= end_row:
            row = end_row - 1
        for j, x in enumerate(piece):
            cute.autovec_copy(
                cute.local_tile(mX[row, None, head, batch], (self.vector,), (lane + self.lanes_per_row * j,)), x
            )

    @cute.jit
    def ready(self, piece: list, lane: Int32, negatives: Int32) -> list:
        """The piece as its values are quantized: as loaded, or rotated in float32 (every
        lane of the warp takes part)."""
        if cutlass.const_expr(self.rotation is None):
            return piece
        rotated = [cute.make_rmem_tensor(cute.make_layout(self.vector), Float32) for _ in piece]
        for x, y in zip(piece, rotated):
            y.store(x.load().to(Float32))
        self.rotation.rotate(rotated, lane, negatives)
        return rotated

    @cute.jit
    def negatives(self, tidx: Int32) -> Int32:
        """The rotation's minus signs of this thread's pieces (0 without a rotation)."""
        if cutlass.const_expr(self.rotation is None):
            return Int32(0)
        return self.rotation.negatives(tidx % self.lanes_per_row)

    @cute.jit
    def amax_by_loop(self, mX: cute.Tensor, first_row: Int32, end_row: Int32, head: Int32, batch: Int32,
                     tidx: Int32) -> Float32:
        """This thread's largest magnitude over its pieces of the block, a batch of turns'
        loads in flight at a time, keeping none."""
        negatives = self.negatives(tidx)
        amax = Float32(0.0)
        for turn in cutlass.range(self.turns, unroll=max(1, LOADS_IN_FLIGHT // self.loads)):
            row, lane = self.place(turn, tidx, first_row)
            piece = self.new_piece()
            self.load_into(piece, mX, row, end_row, lane, head, batch)
            amax = fold_magnitude(amax, self.ready(piece, lane, negatives))
        return amax


@cute.jit
def fold_magnitude(amax: Float32, piece: list) -> Float32:
    """The larger of ``amax`` and the largest magnitude of a piece's vectors."""
    for x in piece:
        amax = cute.arch.fmax(amax, magnitude(x))
    return amax


@cute.jit
def _block_end(first_row: Int32, rows: cutlass.Constexpr[int], seqlen: Int32) -> Int32:
    """The end of the block's rows that exist: a last block may be partial."""
    end_row = first_row + rows
    if seqlen < end_row:
        end_row = seqlen
    return end_row


class QuantizeFp8Rows:
    """e4m3 values of a (batch, seqlen, heads, head_dim) tensor with one descale per
    ``block_rows`` rows of a head (written by the kernel), or one per tensor (from
    TensorAmax's partial maxima; written by the first CTA); with ``hadamard``, of its rows
    rotated first (flash4.quantize.hadamard_rotate, in registers: RowRotation)."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric], block_rows: int, per_tensor: bool,
                 hadamard: Optional[HadamardSigns] = None, fp8_max: float = E4M3_MAX, int8: bool = False):
        self.per_tensor = per_tensor
        # What a block's largest magnitude is scaled onto (e4m3's largest, or a smaller code
        # limit: kernels/f16_scores.py; int8's largest code).
        self.fp8_max = INT8_CODE_MAX if int8 else fp8_max
        self.int8 = int8
        # Blockwise: threads enough to hold the block in registers, if they fit on an SM.
        threads = None if per_tensor else resident_threads(RowBlock(head_dim, dtype, block_rows, ROW_THREADS, hadamard))
        self.resident = threads is not None
        self.block = RowBlock(head_dim, dtype, block_rows, threads or ROW_THREADS, hadamard)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (batch, seqlen, heads, head_dim), 16- or 32-bit
        mValues: cute.Tensor,  # (batch, seqlen, heads, head_dim), e4m3
        mDescale: cute.Tensor,  # (batch, heads, blocks) float32, or (1,) per tensor; written
        mAmax: Optional[cute.Tensor],  # per tensor: TensorAmax's partial maxima, flat
        stream: cuda.CUstream,
    ):
        mX, mValues = rows_first(mX), rows_first(mValues)
        blocks = cute.ceil_div(cute.size(mX.shape[0]), self.block.rows)
        self.kernel(mX, mValues, mDescale, mAmax).launch(
            grid=(blocks, cute.size(mX.shape[2]), cute.size(mX.shape[3])),
            block=[self.block.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mValues: cute.Tensor, mDescale: cute.Tensor, mAmax: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        first_row = m_block * self.block.rows
        end_row = _block_end(first_row, self.block.rows, mX.shape[0])
        negatives = self.block.negatives(tidx)
        pieces = [self.block.new_piece() for _ in range(self.block.turns if self.resident else 0)]
        descale = Float32(1.0)
        if cutlass.const_expr(self.per_tensor):
            descale = tensor_descale(mAmax, tidx, self.block.threads, self.fp8_max)
        else:
            amax = Float32(0.0)
            if cutlass.const_expr(self.resident):
                for turn, piece in enumerate(pieces):
                    row, lane = self.block.place(turn, tidx, first_row)
                    self.block.load_into(piece, mX, row, end_row, lane, head, batch)
                # Held as they are stored: rotated in float32 if rotating (rotating twice,
                # for the magnitude and for the stores, would double the shuffles).
                pieces = [self.block.ready(piece, self.block.place(turn, tidx, first_row)[1], negatives)
                          for turn, piece in enumerate(pieces)]
                for piece in pieces:
                    amax = fold_magnitude(amax, piece)
            else:
                amax = self.block.amax_by_loop(mX, first_row, end_row, head, batch, tidx)
            scratch = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.block.warps))
            descale = descale_of(cta_max(amax, tidx, self.block.warps, scratch), self.fp8_max)
        inverse_descale = reciprocal(descale)
        if cutlass.const_expr(self.resident):
            for turn, piece in enumerate(pieces):
                self._store(piece, mValues, inverse_descale, turn, tidx, first_row, end_row, head, batch)
        else:
            for turns in load_batches(self.block.turns, self.block.loads):
                batch_pieces = [self.block.new_piece() for _ in turns]
                for piece, turn in zip(batch_pieces, turns):
                    row, lane = self.block.place(turn, tidx, first_row)
                    self.block.load_into(piece, mX, row, end_row, lane, head, batch)
                for piece, turn in zip(batch_pieces, turns):
                    lane = self.block.place(turn, tidx, first_row)[1]
                    self._store(self.block.ready(piece, lane, negatives), mValues, inverse_descale, turn, tidx,
                                first_row, end_row, head, batch)
        # After the values: a store ahead of them would hold their loads behind it.
        if cutlass.const_expr(self.per_tensor):
            if (m_block == 0) & (head == 0) & (batch == 0) & (tidx == 0):
                mDescale[0] = descale
        elif tidx == 0:
            mDescale[batch, head, m_block] = descale

    @cute.jit
    def _store(self, piece: list, mValues: cute.Tensor, inverse_descale: Float32, turn: Int32, tidx: Int32,
               first_row: Int32, end_row: Int32, head: Int32, batch: Int32):
        """The piece's vectors rounded to e4m3 (or int8) into their places in ``mValues``,
        if their row exists."""
        row, lane = self.block.place(turn, tidx, first_row)
        to_codes = to_int8 if cutlass.const_expr(self.int8) else to_e4m3
        if row < end_row:
            for j, x in enumerate(piece):
                values = to_codes(x.load().to(Float32), inverse_descale, self.block.vector)
                column = lane + self.block.lanes_per_row * j
                cute.autovec_copy(values, cute.local_tile(mValues[row, None, head, batch], (self.block.vector,),
                                                          (column,)))


def resident_threads(geometry: RowBlock) -> Optional[int]:
    """The threads of a CTA that holds ``geometry``'s block in registers: the fewest, in
    steps of ROW_WARPS warps up to MAX_RESIDENT_THREADS, that hold at most RESIDENT_BYTES
    each; of those that deal every thread as many pieces, if any does (a thread short of a
    piece still loads and rotates a repeated row: at head dim 64, 192 rows on 256 threads
    made a third of the rotating work such repeats). None if no count holds the block."""
    pieces = geometry.rows * geometry.lanes_per_row
    piece_bytes = geometry.loads * geometry.held_bytes_per_load
    counts = range(ROW_THREADS, MAX_RESIDENT_THREADS + 1, ROW_THREADS)
    holding = [threads for threads in counts if -(-pieces // threads) * piece_bytes <= RESIDENT_BYTES]
    even = [threads for threads in holding if pieces % threads == 0]
    return (even or holding or [None])[0]


def amax_block_rows(head_dim: int, element_bytes: int) -> int:
    """Rows of one TensorAmax CTA (and so of one partial maximum): AMAX_BLOCK_BYTES of input."""
    return max(1, AMAX_BLOCK_BYTES // (head_dim * element_bytes))


class TensorAmax:
    """The largest magnitude of each AMAX_BLOCK_BYTES of rows of a (batch, seqlen, heads,
    head_dim) tensor (with ``hadamard``, of its rows rotated): (batch, heads, blocks)
    float32 partial maxima, whose largest is the tensor's."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric], hadamard: Optional[HadamardSigns] = None):
        self.block = RowBlock(head_dim, dtype, amax_block_rows(head_dim, dtype.width // 8), AMAX_THREADS, hadamard)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mAmax: cute.Tensor, stream: cuda.CUstream):
        mX = rows_first(mX)
        blocks = cute.ceil_div(cute.size(mX.shape[0]), self.block.rows)
        self.kernel(mX, mAmax).launch(
            grid=(blocks, cute.size(mX.shape[2]), cute.size(mX.shape[3])),
            block=[self.block.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mAmax: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        first_row = m_block * self.block.rows
        end_row = _block_end(first_row, self.block.rows, mX.shape[0])
        amax = self.block.amax_by_loop(mX, first_row, end_row, head, batch, tidx)
        scratch = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(self.block.warps))
        amax = cta_max(amax, tidx, self.block.warps, scratch)
        if tidx == 0:
            mAmax[batch, head, m_block] = amax


class QuantizeFp8TransposedV:
    """V (batch, seqlen, kv_heads, head_dim) as e4m3 bytes in the FP8 forward kernel's V
    layout (batch, kv_heads, head_dim, padded keys): quantized over a per-tensor descale from
    TensorAmax's partial maxima (written out by the first CTA), or, e4m3 V, moved as it is.

    A CTA owns V_KEYS keys of one head. It loads them a row at a time, 16 bytes a thread,
    and writes each key's e4m3 bytes to shared memory as a row at the key's position
    (positions x head dim, one word of padding per row). Each warp then stores one key
    group: a lane reads one 4-byte column (4 head-dim rows) of 16 positions, transposes the
    bytes four by four (prmt), and stores 16 positions of each of its 4 head-dim rows, two
    lanes filling a 32-byte sector."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric]):
        if head_dim % ROWS_PER_WORD:
            raise ValueError(f"head_dim={head_dim} must be a multiple of {ROWS_PER_WORD}")
        self.head_dim = head_dim
        self.dtype = dtype
        self.quantizes = dtype is not cutlass.Float8E4M3FN
        self.vector = row_vector(dtype.width, head_dim)
        self.vectors_per_row = head_dim // self.vector
        self.turns = V_KEYS * self.vectors_per_row // V_THREADS
        self.columns = head_dim // ROWS_PER_WORD
        # One word of padding: position p's row starts one bank after position p - 1's
        # (mod 32), so a warp's lanes, 16 columns of two positions 16 apart, read 32 banks.
        self.row_words = self.columns + 1
        # Half-warps of columns per key group: each lane of a half-warp takes one column.
        self.column_turns = -(-self.columns // (THREADS_PER_WARP // 2))

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # (batch, seqlen, kv_heads, head_dim), 16- or 32-bit, or e4m3
        mOut: cute.Tensor,  # (batch, kv_heads, head_dim, padded keys), uint8 (e4m3 bits)
        mAmax: Optional[cute.Tensor],  # TensorAmax's partial maxima of V, flat; None for e4m3 V
        mDescale: Optional[cute.Tensor],  # (1,) float32, written; None for e4m3 V
        stream: cuda.CUstream,
    ):
        mV = rows_first(mV)
        self.kernel(mV, mOut, mAmax, mDescale).launch(
            grid=(cute.ceil_div(cute.size(mOut.shape[3]), V_KEYS), cute.size(mOut.shape[1]), cute.size(mOut.shape[0])),
            block=[V_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mOut: cute.Tensor, mAmax: Optional[cute.Tensor],
               mDescale: Optional[cute.Tensor]):
        tidx = cute.arch.thread_idx()[0]
        tile, head, batch = cute.arch.block_idx()
        first_key = tile * V_KEYS
        tile_words = cutlass.memory.SmemAllocator().allocate_tensor(
            Int32, cute.make_layout((V_KEYS, self.columns), stride=(self.row_words, 1))
        )
        descale = Float32(1.0)
        if cutlass.const_expr(self.quantizes):
            descale = tensor_descale(mAmax, tidx, V_THREADS)
        inverse_descale = reciprocal(descale)
        words_per_vector = self.vector // ROWS_PER_WORD
        for turns in load_batches(self.turns):
            xs = [cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype) for _ in turns]
            for x, turn in zip(xs, turns):
                index = turn * V_THREADS + tidx
                # Past V's last key, its last key (no load inside a branch: see RowBlock.load_into).
                key = first_key + index // self.vectors_per_row
                if key >= mV.shape[0]:
                    key = mV.shape[0] - 1
                cute.autovec_copy(
                    cute.local_tile(mV[key, None, head, batch], (self.vector,), (index % self.vectors_per_row,)), x
                )
            # ptxas would otherwise sink each load to just before its shared-memory store (and
            # wait for it there): a warp barrier keeps the batch's loads ahead of them.
            cute.arch.sync_warp()
            for x, turn in zip(xs, turns):
                index = turn * V_THREADS + tidx
                key_in_tile = index // self.vectors_per_row
                if first_key + key_in_tile >= mV.shape[0]:
                    x.fill(0.0)  # padding keys: e4m3 zero
                position = key_in_tile // KEY_GROUP * KEY_GROUP + self._position_of(key_in_tile % KEY_GROUP)
                if cutlass.const_expr(self.quantizes):
                    words = cute.recast_tensor(to_e4m3(x.load().to(Float32), inverse_descale, self.vector), Int32)
                else:
                    words = cute.recast_tensor(x, Int32)
                for j in cutlass.range_constexpr(words_per_vector):
                    tile_words[position, index % self.vectors_per_row * words_per_vector + j] = words[j]
        cute.arch.barrier()
        warp = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARP)
        lane = tidx % THREADS_PER_WARP
        group_key = first_key + warp * KEY_GROUP
        if group_key < mOut.shape[3]:
            # Lanes 0-15 store positions 0-15 of the group, lanes 16-31 positions 16-31.
            first_position = warp * KEY_GROUP + lane // (THREADS_PER_WARP // 2) * KEYS_PER_STORE
            for column_turn in cutlass.range_constexpr(self.column_turns):
                column = column_turn * (THREADS_PER_WARP // 2) + lane % (THREADS_PER_WARP // 2)
                if column < self.columns:
                    self._store_column(tile_words, mOut, first_position, column, first_key, head, batch)
        if cutlass.const_expr(self.quantizes):
            if (tile == 0) & (head == 0) & (batch == 0) & (tidx == 0):
                mDescale[0] = descale

    @cute.jit
    def _store_column(self, tile_words: cute.Tensor, mOut: cute.Tensor, first_position: Int32, column: Int32,
                      first_key: Int32, head: Int32, batch: Int32):
        """Positions first_position .. + 15 of head-dim rows 4 column .. + 3: 16 words read
        (one per position, a byte per row), four 4x4 byte transposes, four 16-byte stores."""
        rows = [cute.make_rmem_tensor(cute.make_layout(KEYS_PER_STORE // ROWS_PER_WORD), Int32)
                for _ in range(ROWS_PER_WORD)]
        for quad in cutlass.range_constexpr(KEYS_PER_STORE // ROWS_PER_WORD):
            w = [tile_words[first_position + quad * ROWS_PER_WORD + p, column] for p in range(ROWS_PER_WORD)]
            # Pairs first: (w0.b0, w1.b0, w0.b1, w1.b1) and (w0.b2, w1.b2, w0.b3, w1.b3).
            low01, high01 = permute_bytes(w[0], w[1], 0x5140), permute_bytes(w[0], w[1], 0x7362)
            low23, high23 = permute_bytes(w[2], w[3], 0x5140), permute_bytes(w[2], w[3], 0x7362)
            rows[0][quad] = permute_bytes(low01, low23, 0x5410)
            rows[1][quad] = permute_bytes(low01, low23, 0x7632)
            rows[2][quad] = permute_bytes(high01, high23, 0x5410)
            rows[3][quad] = permute_bytes(high01, high23, 0x7632)
        store_block = (first_key + first_position) // KEYS_PER_STORE
        for r in cutlass.range_constexpr(ROWS_PER_WORD):
            cute.autovec_copy(
                cute.recast_tensor(rows[r], cutlass.Uint8),
                cute.local_tile(mOut[batch, head, column * ROWS_PER_WORD + r, None], (KEYS_PER_STORE,), (store_block,)),
            )

    @cute.jit
    def _position_of(self, key: Int32) -> Int32:
        """The position of ``key`` within its group: FP8_PV_KEY_ORDER moves each bit of a
        position to another bit of the key (flash4.quantize checks this of the order)."""
        position = Int32(0)
        for bit in cutlass.range_constexpr(KEY_GROUP.bit_length() - 1):
            moved = FP8_PV_KEY_ORDER[1 << bit].bit_length() - 1
            position = position | (((key >> moved) & 1) << bit)
        return position
