"""FP8 (e4m3) quantization of attention inputs on the GPU: flash4.quantize_fp8's definition
in one pass over the input per descale block instead of torch's several.

``QuantizeFp8Rows``: x (batch, seqlen, heads, head_dim) to e4m3 values of the same shape.
Blockwise, each CTA owns one block of rows of one head: it reads the block once for its
largest magnitude, writes descale = max(amax / 448, SMALLEST_DESCALE) (1 for an all-zero
block), then reads the block again (from L2, where the first read left it) and stores
x · (1 / descale) rounded to e4m3. Per tensor, the descale is given and only the second
read happens.

``QuantizeFp8TransposedV``: V with a given per-tensor descale, stored straight into the FP8
forward kernel's V layout (flash4.quantize.fp8_value_layout): (batch, kv_heads, head_dim,
keys), keys contiguous, zero-padded to whole groups of 32 and renamed within each group by
FP8_PV_KEY_ORDER. One warp per group: lane p reads key FP8_PV_KEY_ORDER[p] and writes
position p, so the 32 lanes' byte stores fill one 32-byte segment per head-dim row.

Values are multiplied by the descale's reciprocal (``reciprocal``, rounded as an IEEE
division rounds it, once per thread) in float32 and rounded to nearest even. An IEEE
division per value took a dozen instructions (MUFU.RCP, a range check, a slow-path call)
and bound the blockwise kernel: on the H200, 16k tokens of Q took 59-61 us with it and
38-55 us without (head dims 64 / 128 / 256; perf/fp8_quantize_timing.py). |x| times the
reciprocal may pass 448 by an ulp; cvt's satfinite then gives 448, as torch's rounding does.

A block's CTA has four warps: with one, a head-dim-256 block of 128 rows kept one warp
busy for 128 loads in turn, and the 1024 CTAs of a 16k-token tensor left 8 warps per SM,
too few loads in flight (quantizing took 2.5x the FP8 attention it fed at seqlen 1k). The
warps combine their largest magnitudes through shared memory. The V kernel has one warp
per key group, four groups to a CTA.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.warp_roles import THREADS_PER_WARP
from .e4m3_codes import SMALLEST_DESCALE
from .inline_ptx import ptx_on_f32
from .memory_pass import LOADS_IN_FLIGHT, load_batches, row_vector
from .mma_layouts import FP8_PV_KEY_ORDER
from .online_softmax import E4M3_MAX
from .packed_convert import convert_packed
from .wgmma import rows_first

# Warps of a blockwise CTA (see the module docstring).
ROW_WARPS = 4
ROW_THREADS = ROW_WARPS * THREADS_PER_WARP
# V's keys are renamed, and padded, in groups of this many: the FP8 wgmma's k-step.
KEY_GROUP = len(FP8_PV_KEY_ORDER)
# Warps (key groups) of a V CTA: with one, 32-thread CTAs cap an SM at 32 warps (its limit
# of 32 resident CTAs), half of the 64 it can hold.
V_WARPS = 4


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
def to_e4m3(x: cute.TensorSSA, inverse_descale: Float32, size: cutlass.Constexpr[int]) -> cute.Tensor:
    """``size`` float32 values times ``inverse_descale`` rounded to e4m3, four to a register:
    the definition both kernels store."""
    quotient = cute.make_rmem_tensor(cute.make_layout(size), Float32)
    quotient.store(x * inverse_descale)
    values = cute.make_rmem_tensor(cute.make_layout(size), cutlass.Float8E4M3FN)
    convert_packed(quotient, values)
    return values


class QuantizeFp8Rows:
    """e4m3 values of a (batch, seqlen, heads, head_dim) tensor with one descale per
    ``block_rows`` rows of a head (written by the kernel), or one given per tensor."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric], block_rows: int, per_tensor: bool):
        self.head_dim = head_dim
        self.dtype = dtype
        self.block_rows = block_rows
        self.per_tensor = per_tensor
        self.vector = row_vector(dtype.width, head_dim)
        self.vectors_per_row = head_dim // self.vector
        # The block's vectors, dealt out to the threads in turn (consecutive threads read
        # consecutive 16 bytes of a row).
        self.turns = -(-block_rows * self.vectors_per_row // ROW_THREADS)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (batch, seqlen, heads, head_dim), 16- or 32-bit
        mValues: cute.Tensor,  # (batch, seqlen, heads, head_dim), e4m3
        mDescale: cute.Tensor,  # (batch, heads, blocks) float32, or (1,) given per tensor
        stream: cuda.CUstream,
    ):
        mX, mValues = rows_first(mX), rows_first(mValues)
        blocks = cute.ceil_div(cute.size(mX.shape[0]), self.block_rows)
        self.kernel(mX, mValues, mDescale).launch(
            grid=(blocks, cute.size(mX.shape[2]), cute.size(mX.shape[3])),
            block=[ROW_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mValues: cute.Tensor, mDescale: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        m_block, head, batch = cute.arch.block_idx()
        seqlen = mX.shape[0]
        first_row = m_block * self.block_rows
        # The block's rows that exist: a last block may be partial.
        end_row = first_row + self.block_rows
        if seqlen < end_row:
            end_row = seqlen
        descale = Float32(1.0)
        if cutlass.const_expr(self.per_tensor):
            descale = mDescale[0]
        else:
            warp_amax = cutlass.memory.SmemAllocator().allocate_tensor(Float32, cute.make_layout(ROW_WARPS))
            amax = Float32(0.0)
            for turn in cutlass.range(self.turns, unroll=LOADS_IN_FLIGHT):
                index = turn * ROW_THREADS + tidx
                row = first_row + index // self.vectors_per_row
                if row < end_row:
                    x = self._load(mX, row, index % self.vectors_per_row, head, batch)
                    amax = cute.arch.fmax(amax, cute.arch.fmax(
                        x.reduce(cute.ReductionOp.MAX, Float32(0.0), 0),
                        -x.reduce(cute.ReductionOp.MIN, Float32(0.0), 0),
                    ))
            amax = cute.arch.warp_reduction_max(amax, threads_in_group=THREADS_PER_WARP)
            if tidx % THREADS_PER_WARP == 0:
                warp_amax[tidx // THREADS_PER_WARP] = amax
            cute.arch.barrier()
            for warp in cutlass.range_constexpr(ROW_WARPS):
                amax = cute.arch.fmax(amax, warp_amax[warp])
            descale = cute.arch.fmax(amax / E4M3_MAX, SMALLEST_DESCALE) if amax > 0.0 else Float32(1.0)
            if tidx == 0:
                mDescale[batch, head, m_block] = descale
        inverse_descale = reciprocal(descale)
        for turns in load_batches(self.turns):
            xs = [cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype) for _ in turns]
            for x, turn in zip(xs, turns):
                index = turn * ROW_THREADS + tidx
                row = first_row + index // self.vectors_per_row
                if row < end_row:
                    self._load_into(x, mX, row, index % self.vectors_per_row, head, batch)
            for x, turn in zip(xs, turns):
                index = turn * ROW_THREADS + tidx
                row = first_row + index // self.vectors_per_row
                if row < end_row:
                    column = index % self.vectors_per_row
                    values = to_e4m3(x.load().to(Float32), inverse_descale, self.vector)
                    cute.autovec_copy(values, cute.local_tile(mValues[row, None, head, batch], (self.vector,), (column,)))

    @cute.jit
    def _load(self, mX: cute.Tensor, row: Int32, column: Int32, head: Int32, batch: Int32) -> cute.TensorSSA:
        """One 16-byte vector of ``row`` (the ``column``-th of the row), as float32."""
        x = cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype)
        self._load_into(x, mX, row, column, head, batch)
        return x.load().to(Float32)

    @cute.jit
    def _load_into(self, x: cute.Tensor, mX: cute.Tensor, row: Int32, column: Int32, head: Int32, batch: Int32):
        cute.autovec_copy(cute.local_tile(mX[row, None, head, batch], (self.vector,), (column,)), x)


class QuantizeFp8TransposedV:
    """V (batch, seqlen, kv_heads, head_dim) over a given per-tensor descale, as e4m3 bytes
    in the FP8 forward kernel's V layout (batch, kv_heads, head_dim, padded keys)."""

    def __init__(self, head_dim: int, dtype: Type[cutlass.Numeric]):
        self.head_dim = head_dim
        self.dtype = dtype
        self.vector = row_vector(dtype.width, head_dim)

    @cute.jit
    def __call__(
        self,
        mV: cute.Tensor,  # (batch, seqlen, kv_heads, head_dim), 16- or 32-bit
        mOut: cute.Tensor,  # (batch, kv_heads, head_dim, padded keys), uint8 (e4m3 bits)
        mDescale: cute.Tensor,  # (1,) float32
        stream: cuda.CUstream,
    ):
        mV = rows_first(mV)
        groups = cute.size(mOut.shape[3]) // KEY_GROUP
        self.kernel(mV, mOut, mDescale).launch(
            grid=(cute.ceil_div(groups, V_WARPS), cute.size(mOut.shape[1]), cute.size(mOut.shape[0])),
            block=[V_WARPS * THREADS_PER_WARP, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mOut: cute.Tensor, mDescale: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        block, head, batch = cute.arch.block_idx()
        group = block * V_WARPS + cute.arch.make_warp_uniform(tidx // THREADS_PER_WARP)
        position = tidx % THREADS_PER_WARP
        if group < mOut.shape[3] // KEY_GROUP:
            inverse_descale = reciprocal(mDescale[0])
            key = group * KEY_GROUP + self._key_at(position)
            column = group * KEY_GROUP + position
            chunks = self.head_dim // self.vector
            for batch_chunks in load_batches(chunks):
                xs = [cute.make_rmem_tensor(cute.make_layout(self.vector), self.dtype) for _ in batch_chunks]
                if key < mV.shape[0]:
                    for x, chunk in zip(xs, batch_chunks):
                        cute.autovec_copy(cute.local_tile(mV[key, None, head, batch], (self.vector,), (chunk,)), x)
                for x, chunk in zip(xs, batch_chunks):
                    words = cute.make_rmem_tensor(cute.make_layout(self.vector // 4), Int32)
                    words.fill(0)  # padding keys: e4m3 zero
                    if key < mV.shape[0]:
                        values = to_e4m3(x.load().to(Float32), inverse_descale, self.vector)
                        words.store(cute.recast_tensor(values, Int32).load())
                    for j in cutlass.range_constexpr(self.vector):
                        byte = (words[j // 4] >> (8 * (j % 4))) & 0xFF
                        mOut[batch, head, chunk * self.vector + j, column] = cutlass.Uint8(byte)

    @cute.jit
    def _key_at(self, position: Int32) -> Int32:
        """FP8_PV_KEY_ORDER[position]: the order moves each bit of the position to another
        bit of the key (flash4.quantize checks this of the order)."""
        key = Int32(0)
        for bit in cutlass.range_constexpr(KEY_GROUP.bit_length() - 1):
            moved = FP8_PV_KEY_ORDER[1 << bit].bit_length() - 1
            key = key | (((position >> bit) & 1) << moved)
        return key
