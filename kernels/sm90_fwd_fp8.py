"""Hopper (sm_90a) FP8 forward attention: e4m3 Q, K, V with one descale per tile, 16-bit O;
or (``fp8_qk_int8``, the accurate mode) int8 Q and K with e4m3 V.

The forward kernel of sm90_fwd.py with other inputs; its pipelines, scheduling, masks and
epilogue are the same. What changes:

- Both GEMMs are FP8 wgmmas, which read both operands K-major. For S = Q Kᵀ that is how
  Q and K sit (head_dim contiguous). For O = P V the k-dimension is the keys, so V comes
  transposed, (batch, kv_heads, head_dim, keys) with keys contiguous, as
  ``flash4.quantize.fp8_value_layout`` writes it; no transpose runs in the kernel.
- P goes from the S accumulator to the A operand of the second GEMM without leaving its
  thread: the keys of each 32-key group are renamed (``FP8_PV_KEY_ORDER``) so that the
  values a thread holds are its A values, and V's keys are stored in that order.
- Descales: the Q tile's and key block j's K descale multiply the softmax scale; block j's
  V descale is folded into P's scale onto e4m3's range (``BlockScaledSoftmax``). They reach
  the consumers in shared memory, copied by the producer with Q's and K's stages
  (pipelines/stage_scalars.py): no consumer makes a global load.
"""

from __future__ import annotations

from typing import Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.stage_scalars import element_address
from .configs import Sm90ForwardConfig
from .f16_scores import pack_codes
from .int8_scores import SHIFT_FLOAT
from .mma_layouts import acc_as_fp8_a_operand
from .online_softmax import BlockScaledSoftmax
from .packed_convert import convert_packed
from .sm90_fwd import Loads, Sm90ForwardKernel, Tile
from .wgmma import tma_tile


class Sm90Fp8ForwardKernel(Sm90ForwardKernel):
    """The FP8 forward kernel for one configuration, writing O in ``out_dtype``."""

    def __init__(self, config: Sm90ForwardConfig, out_dtype: Type[cutlass.Numeric]):
        if not config.fp8:
            raise ValueError(f"{config}: the FP8 kernel needs a configuration with fp8=True")
        super().__init__(config, cutlass.Float8E4M3FN)
        self.out_dtype = out_dtype
        if config.fp8_qk_int8:
            self.qk_dtype = cutlass.Int8

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim), e4m3
        mK: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim), e4m3
        mVt: cute.Tensor,  # (batch, kv_heads, head_dim, padded seqlen_k), e4m3, keys renamed
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim), out_dtype
        mLSE: cute.Tensor,  # (batch, heads, seqlen_q), float32, or None
        mQDescale: cute.Tensor,  # (batch, heads, query blocks), float32
        mKDescale: cute.Tensor,  # (batch, kv_heads, key blocks), float32
        mVDescale: cute.Tensor,  # (batch, kv_heads, key blocks), float32; V per tensor: any shape, its first float
        softmax_scale_log2: Float32,
        max_ctas: Int32,
        mTileCounter: Optional[cute.Tensor],  # (1,) int32, zeroed (dynamic_tiles), or None
        stream: cuda.CUstream,
    ):
        self.launch(
            mQ, mK, mVt, mO, mLSE, mQDescale, mKDescale, mVDescale, softmax_scale_log2, max_ctas, mTileCounter, stream
        )

    # V arrives transposed: rows are head-dim columns, keys contiguous.
    def v_rows_first(self, mV: cute.Tensor) -> cute.Tensor:
        """(batch, kv_heads, head_dim, keys) viewed as (head_dim, keys, kv_heads, batch)."""
        return cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 3, 1, 0]))

    def v_major(self) -> cute.nvgpu.OperandMajorMode:
        return cute.nvgpu.OperandMajorMode.K

    def v_tile(self) -> tuple[int, int]:
        return self.head_dim, self.tile_n

    def v_operand(self, sV: cute.Tensor) -> cute.Tensor:
        return sV

    def v_tiles(self, atom: cute.CopyAtom, sV: cute.Tensor, mV: cute.Tensor, cta_rank=0):
        # One row of tiles (all of head_dim); the key blocks are the last mode.
        return tma_tile(atom, sV, mV, self.v_tile(), 0, None, cta_rank, self.config.cluster_ctas)

    def make_softmax(self, softmax_scale_log2: Float32, rows: int) -> BlockScaledSoftmax:
        return BlockScaledSoftmax(
            softmax_scale_log2,
            rows,
            self.config.fp8_v_per_tensor,
            self.sums_on_tensor_cores,
            self.p_by_rounding,
            SHIFT_FLOAT if cutlass.const_expr(self.config.fp8_int8_shift_in_softmax) else 0.0,
        )

    # The descales travel with the stages the consumers wait for (pipelines/stage_scalars.py),
    # in the order BlockScaledSoftmax reads them: Q's stage the Q tile's, then V's when V
    # has one per tensor; K's stage the block's K descale, then its V descale.
    @property
    def q_scalar_count(self) -> int:
        return 2 if self.config.fp8_v_per_tensor else 1

    @property
    def k_scalar_count(self) -> int:
        return 1 if self.config.fp8_v_per_tensor else 2

    @cute.jit
    def q_scalar_sources(self, loads: Loads, tile: Tile) -> tuple:
        q_descale, _, v_descale = loads.descales
        q_block = tile.m_block
        if cutlass.const_expr(self.config.cluster_ctas > 1):
            # A cluster's query block past seqlen_q has no descale; its rows are never stored.
            q_block = cutlass.min(q_block, q_descale.shape[2] - 1)
        sources = (element_address(q_descale, (tile.batch, tile.head, q_block)),)
        if cutlass.const_expr(self.config.fp8_v_per_tensor):
            # V per tensor: its descale is the tensor's first float, whatever shape it comes in.
            sources = sources + (v_descale.iterator,)
        return sources

    @cute.jit
    def k_scalar_sources(self, loads: Loads, tile: Tile, kv_head: Int32, n_block: Int32) -> tuple:
        _, k_descale, v_descale = loads.descales
        block = (tile.batch, kv_head, n_block)
        sources = (element_address(k_descale, block),)
        if cutlass.const_expr(not self.config.fp8_v_per_tensor):
            sources = sources + (element_address(v_descale, block),)
        return sources

    @property
    def p_by_rounding(self) -> bool:
        """P's codes rounded from the scores: only where the row sums run on the tensor
        cores (this compiled variant writes no LSE), which sum the same P."""
        return self.config.fp8_p_by_rounding and self.sums_on_tensor_cores

    @cute.jit
    def store_p(self, acc_s: cute.Tensor, p: cute.Tensor) -> None:
        """P (already scaled onto e4m3's range, or its codes) into the FP8 A operand, four
        per register."""
        if cutlass.const_expr(self.f16_scores):
            pack_codes(acc_s, p)
        else:
            convert_packed(acc_as_fp8_a_operand(acc_s), p, self.p_by_rounding)
