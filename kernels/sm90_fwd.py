"""Hopper (sm_90a) forward attention: O = softmax(scale * Q K^T + mask) V, and its LSE.

A tile is ``tile_m`` query rows of one head (of one batch entry). A CTA computes one tile,
or, when persistent, loops over tiles (pipelines/tile_scheduler.py): the rings' states and
the ping-pong turn carry over from tile to tile, so the producer loads the next tile's K
and Q while the consumers still finish the current one.

Warp roles
  warpgroup 0, warp 0   producer: per tile, TMA loads of Q, then K and V blocks into rings,
                        from the last key block to the first. Gives registers away.
  warpgroups 1..W       consumers, 64 query rows each: S = Q K^T (wgmma, both operands in
                        shared memory, or Q in registers: q_in_registers), masking, online
                        softmax, O += P V (wgmma, P from registers), then the epilogue.

Pipelines (producer -> consumer; arrivals on *empty* = consumer warps, 4 per warpgroup)
  Q ring   q_stages          TMA thread -> all consumer warps; freed after a tile's last S
                             GEMM (q_in_registers: once loaded into registers), or, when a
                             persistent kernel stages O in Q's buffer (head dim 256, one
                             stage), by the storing thread once O is read
  K ring   kv_stages         TMA thread -> all consumer warps
  V ring   kv_stages         TMA thread -> all consumer warps; walks the K ring's states
Named barriers: WARPGROUP_TURN_0 + w (ping-pong of GEMM issue), EPILOGUE (O in smem), or
EPILOGUE_WARPGROUP_0 + w where each warpgroup stores its own rows of O.

Consumer timeline (blocks n_max-1 down to n_min; the first ones carry the masks)
  S = Q K[n_max-1] (issued in the ping-pong turn: first_block_turn); mask; softmax -> P
  for each further block j:   issue S_j = Q K_j;  issue O += P V[j+1];  wait S_j
                              mask (if needed); softmax S_j;  wait P V;  rescale O;  P = P_j
  O += P V[n_min];  O *= 1/l;  O -> smem (its own buffer where it fits, else Q's) -> TMA
  store (per tile, or per warpgroup: o_store_per_warpgroup);  LSE -> global (only in the
  variant compiled with an LSE tensor)
FP8 rows with row_sum_on_tensor_cores issue a second GEMM beside each P V, P times ones:
the row sums, taken one block late (kernels/tensor_core_row_sum.py). On int8 Q and K
(fp8_qk_int8) each S completes in s32 and is shifted into fp32 before the mask
(``float_scores``, kernels/int8_scores.py).
Issuing the next S GEMM before the softmax of the current block keeps the tensor cores
busy while the CUDA cores do the exponentials; ping-pong does the same across warpgroups.

Walking the key blocks backwards puts the blocks that need masks (the tail of seqlen_k and
the causal diagonal) first, so the rest of the loop runs without any mask arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..pipelines import tile_queue
from ..pipelines.named_barriers import NamedBarrier, WarpgroupPingPong
from ..pipelines.stage_scalars import SCALAR_ARRIVALS, StageScalars, scalar_words
from ..pipelines.tile_queue import TILE_QUEUE_STAGES, TileQueue, tile_queue_barrier_words
from ..pipelines.tile_scheduler import TileScheduler
from ..pipelines.tma_pipeline import (
    barrier_words,
    consumer_state,
    finish_cluster,
    finish_init,
    make_tma_ring,
    producer_state,
)
from ..pipelines.warp_roles import THREADS_PER_WARP, THREADS_PER_WARPGROUP, register_budget
from .configs import ROWS_PER_CONSUMER_WARPGROUP, ROWS_PER_WARP, SMEM_ALIGN_BYTES, Sm90ForwardConfig
from .f16_scores import NEG_INF_X2, score_words
from .int8_scores import float_scores
from .mask import mask_scores
from .mma_layouts import acc_as_a_operand, acc_rows_cols
from .online_softmax import LARGEST_REBASED_P, THREADS_PER_ROW, OnlineSoftmax
from .packed_convert import convert_packed
from .tensor_core_row_sum import TensorCoreRowSum, fill_ones, ones_tile_layout
from .wgmma import RegisterOperandA, issue_gemm, rows_first, smem_tile_layout, tma_tile, warpgroup_gemm


@dataclass(frozen=True)
class Rings:
    """The Q, K and V shared-memory rings: their mbarrier pipelines and their buffers."""

    q: Any
    k: Any
    v: Any
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    # The row-sum GEMM's all-ones B operand (kernels/tensor_core_row_sum.py), or None.
    sOnes: Optional[cute.Tensor] = None
    # Values that travel with each Q stage and each K stage (pipelines/stage_scalars.py:
    # the FP8 kernel's descales), or None.
    q_scalars: Optional[StageScalars] = None
    k_scalars: Optional[StageScalars] = None


@dataclass(frozen=True)
class Loads:
    """What the producer reads: the TMA views of Q, K and V and their copy atoms, and the
    FP8 descales (Q's, K's, V's; None for 16-bit inputs), which travel with Q's and K's
    stages."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    atom_q: cute.CopyAtom
    atom_k: cute.CopyAtom
    atom_v: cute.CopyAtom
    descales: tuple


@dataclass(frozen=True)
class Outputs:
    """Where a tile's results go: O through the shared-memory slab ``sO`` by TMA (``atom_o``)
    into ``mO``, and LSE into ``mLSE`` (None: not written)."""

    sO: cute.Tensor
    mO: cute.Tensor
    mLSE: Optional[cute.Tensor]
    atom_o: cute.CopyAtom


@dataclass(frozen=True)
class Tile:
    """This CTA's work: one query block of one head, and how many key blocks it sees."""

    m_block: Int32
    head: Int32
    batch: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    n_block_max: Int32


@dataclass(frozen=True)
class ConsumerOperands:
    """One consumer thread's GEMM operands, accumulators and element coordinates."""

    tiled_mma_qk: cute.TiledMma
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor
    tSrK: cute.Tensor
    tOrVt: cute.Tensor
    s_shape: Any
    acc_o: cute.Tensor
    p: cute.Tensor
    coords: cute.Tensor
    coords0: cute.Tensor
    # This tile's Q slot in shared memory (lazy_rescale recomputes overflowed scores from it).
    sQ: Optional[cute.Tensor] = None
    # The row sums of P by a second GEMM beside P V (``sums_on_tensor_cores``), or None.
    row_sums: Optional[TensorCoreRowSum] = None
    # q_in_registers: Q's slot as the S GEMM's register operand (``tSrQ`` is its fragment);
    # None when the S GEMM reads Q from shared memory.
    q_registers: Optional[RegisterOperandA] = None


class Sm90ForwardKernel:
    """The forward kernel for one configuration and one 16-bit dtype.

    The FP8 kernel (sm90_fwd_fp8.py) is this one with other inputs: it overrides the
    methods that place V, convert P and keep the softmax (``v_*``, ``store_p``,
    ``make_softmax``), says which descales travel with Q's and K's stages (``*_scalars``)
    and passes the descales through ``launch``.
    """

    def __init__(self, config: Sm90ForwardConfig, dtype: Type[cutlass.Numeric]):
        self.config = config
        self.dtype = dtype
        # Q's and K's dtype (the FP8 kernel's accurate mode reads int8 Q and K, e4m3 V).
        self.qk_dtype = dtype
        # O's dtype (the FP8 kernel writes 16-bit O from e4m3 inputs).
        self.out_dtype = dtype
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.head_dim = config.head_dim
        self.stages = config.kv_stages
        self.causal = config.causal
        self.consumer_warpgroups = config.consumer_warpgroups
        self.consumer_threads = self.consumer_warpgroups * THREADS_PER_WARPGROUP
        self.budget = register_budget(self.consumer_warpgroups)
        self.pingpong = config.pingpong
        # Q's buffer is given back once nothing reads it any more: after the tile's last S
        # GEMM, or, when a persistent kernel stages O in it, after the TMA store has read O.
        self.q_freed_by_store = config.persistent and config.o_in_q_buffer
        self.q_stages = config.q_stages
        # Set per compiled variant by ``launch`` (it depends on whether an LSE is written).
        self.sums_on_tensor_cores = False
        # The threads that store a slab of O together (one barrier, one TMA store): all
        # consumers, or each warpgroup its own 64 rows.
        self.o_store_threads = THREADS_PER_WARPGROUP if config.o_store_per_warpgroup else self.consumer_threads
        self.o_store_rows = ROWS_PER_CONSUMER_WARPGROUP if config.o_store_per_warpgroup else self.tile_m

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim)
        mO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSE: Optional[cute.Tensor],  # (batch, heads, seqlen_q), float32; None: not written
        softmax_scale_log2: Float32,
        max_ctas: Int32,  # persistent kernels launch at most this many CTAs (the SM count)
        mTileCounter: Optional[cute.Tensor],  # (1,) int32, zeroed (dynamic_tiles), or None
        stream: cuda.CUstream,
    ):
        self.launch(mQ, mK, mV, mO, mLSE, None, None, None, softmax_scale_log2, max_ctas, mTileCounter, stream)

    @cute.jit
    def launch(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        # FP8: float32 descales, one per tile: (batch, heads, query blocks) for Q and
        # (batch, kv_heads, key blocks) for K and V.
        mQDescale: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        softmax_scale_log2: Float32,
        max_ctas: Int32,
        mTileCounter: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        if cutlass.const_expr((mTileCounter is not None) != self.config.dynamic_tiles):
            raise ValueError(f"{self.config}: a tile counter exactly when dynamic_tiles=True")
        # Decided per compiled variant: the tensor cores' row sum is of the rounded P, which
        # normalises O but is not the true LSE (Sm90ForwardConfig.row_sum_on_tensor_cores).
        self.sums_on_tensor_cores = self.config.row_sum_on_tensor_cores and mLSE is None
        mQ, mK, mO = (rows_first(t) for t in (mQ, mK, mO))
        mV = self.v_rows_first(mV)
        if cutlass.const_expr(mLSE is not None):
            mLSE = rows_first(mLSE)

        major_k = cute.nvgpu.OperandMajorMode.K
        q_source = warpgroup.OperandSource.RMEM if self.config.q_in_registers else warpgroup.OperandSource.SMEM
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.qk_dtype, self.qk_dtype, major_k, major_k, self.score_dtype,
            (self.consumer_warpgroups, 1, 1), (ROWS_PER_CONSUMER_WARPGROUP, self.tile_n),
            a_source=q_source,
        )
        tiled_mma_pv = self.pv_mma(self.consumer_warpgroups)

        sQ_layout = smem_tile_layout(self.qk_dtype, self.tile_m, self.head_dim, self.q_stages)
        sK_layout = smem_tile_layout(self.qk_dtype, self.tile_n, self.head_dim, self.stages)
        sV_layout = smem_tile_layout(self.dtype, *self.v_tile(), self.stages)
        # O's buffer: one tile, or one 64-row slab per consumer warpgroup (each stored alone).
        sO_layout = smem_tile_layout(self.out_dtype, self.tile_m, self.head_dim)
        if cutlass.const_expr(self.config.o_store_per_warpgroup):
            sO_layout = smem_tile_layout(self.out_dtype, self.o_store_rows, self.head_dim, self.consumer_warpgroups)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.head_dim)
        )
        # kv_multicast: each CTA of a cluster loads its share of a K or V block into all.
        ctas = self.config.cluster_ctas
        load_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if ctas > 1 else load
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            load_kv, mK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, self.head_dim), ctas
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            load_kv, mV, cute.select(sV_layout, mode=[0, 1]), self.v_tile(), ctas
        )
        # O goes out through shared memory (Q's buffer or its own, see the epilogue).
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (self.o_store_rows, self.head_dim)
        )
        self.q_bytes = cute.size_in_bytes(self.qk_dtype, cute.select(sQ_layout, mode=[0, 1]))
        # A K block's bytes, and a V block's: V's dtype has K's width in every kernel.
        self.kv_bytes = cute.size_in_bytes(self.qk_dtype, cute.select(sK_layout, mode=[0, 1]))

        scheduler = self.scheduler(mQ, max_ctas)
        grid = scheduler.grid(max_ctas)
        cluster = {}
        if cutlass.const_expr(ctas > 1):
            cluster = dict(cluster=[ctas, 1, 1])
            if cutlass.const_expr(self.config.cluster_heads and not self.config.persistent):
                # A one-tile grid is (query blocks, heads, batch): the pair lies along heads.
                cluster = dict(cluster=[1, ctas, 1])
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, mLSE, mQDescale, mKDescale, mVDescale, mTileCounter,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            softmax_scale_log2, scheduler,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            tiled_mma_qk, tiled_mma_pv,
            self.shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout),
        ).launch(
            grid=grid,
            block=[self.budget.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            **cluster,
        )

    @property
    def f16_scores(self) -> bool:
        """Scores in f16 (Sm90ForwardConfig.scores_in_f16): only in the variant compiled
        without an LSE, whose P's codes are rounded from the scores."""
        return self.config.scores_in_f16 and self.sums_on_tensor_cores

    @property
    def score_dtype(self) -> Type[cutlass.Numeric]:
        """The S GEMM's accumulator type (int8 Q and K: s32, converted by ``float_scores``)."""
        if self.config.fp8_qk_int8:
            return Int32
        return Float16 if self.f16_scores else Float32

    def float_scores(self, acc_s: cute.Tensor) -> cute.Tensor:
        """The completed S accumulator as the softmax reads it: int8 Q and K's s32 scores
        converted to fp32 in place (kernels/int8_scores.py), the others as they are."""
        if cutlass.const_expr(self.config.fp8_qk_int8):
            return float_scores(acc_s, keep_shift=self.config.fp8_int8_shift_in_softmax)
        return acc_s

    def pv_mma(self, warpgroups: int) -> cute.TiledMma:
        """O = P V on ``warpgroups`` consumer warpgroups along M: V is the B operand
        (N = head_dim, K = keys), N-major as it sits in shared memory (keys, head_dim) here;
        K-major where it arrives transposed."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, self.v_major(), Float32,
            (warpgroups, 1, 1), (ROWS_PER_CONSUMER_WARPGROUP, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )

    def shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout) -> Type:
        """The kernel's shared memory: ring barriers, then Q, K, V (and O when persistent)."""
        q_elems = cute.cosize(sQ_layout)

        def buffer(elems: int, dtype=self.dtype):
            return cute.struct.Align[cute.struct.MemRange[dtype, elems], SMEM_ALIGN_BYTES]

        # Fields in address order; built as a dict because this module's annotations are
        # strings (``from __future__ import annotations``) and cute.struct needs the types.
        fields = {
            "q_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(self.q_stages)],
            "k_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(self.stages)],
            "v_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(self.stages)],
            "sQ": buffer(q_elems, self.qk_dtype),
            "sK": buffer(cute.cosize(sK_layout), self.qk_dtype),
            "sV": buffer(cute.cosize(sV_layout)),
        }
        if not self.config.o_in_q_buffer:
            fields["sO"] = buffer(cute.cosize(sO_layout), self.out_dtype)
        if self.sums_on_tensor_cores:
            fields["sOnes"] = buffer(cute.cosize(ones_tile_layout(self.dtype, self.tile_n)))
        for name, values, stages in (("q_scalars", self.q_scalar_count, self.q_stages),
                                     ("k_scalars", self.k_scalar_count, self.stages)):
            if values:
                fields[name] = cute.struct.MemRange[Float32, scalar_words(values, stages)]
        if self.config.dynamic_tiles:
            fields["tile_barriers"] = cute.struct.MemRange[cutlass.Int64, tile_queue_barrier_words()]
            fields["tile_positions"] = cute.struct.MemRange[Int32, TILE_QUEUE_STAGES]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def scheduler(self, mQ: cute.Tensor, max_ctas: Int32) -> TileScheduler:
        """Tiles of ``mQ`` viewed as (seqlen, head_dim, heads, batch), on at most ``max_ctas``
        CTAs when persistent."""
        ctas = self.config.cluster_ctas
        m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m)
        if cutlass.const_expr(ctas > 1 and not self.config.cluster_heads):
            # Whole clusters: a query block past seqlen_q loads zeros for Q, and the O store
            # and the LSE skip its rows.
            m_blocks = cute.ceil_div(m_blocks, ctas) * ctas
        return TileScheduler(
            m_blocks,
            cute.size(mQ.shape[2]),
            cute.size(mQ.shape[3]),
            persistent=self.config.persistent,
            causal_pairs=self.causal and self.config.persistent and not self.config.dynamic_tiles,
            longest_first=self.causal,
            dynamic=self.config.dynamic_tiles,
            cluster_ctas=ctas,
            cluster_heads=self.config.cluster_heads,
            max_ctas=max_ctas,
            fast_divmod=self.config.fast_tile_divmod,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mQDescale: Optional[cute.Tensor],
        mKDescale: Optional[cute.Tensor],
        mVDescale: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        tma_atom_Q: cute.CopyAtom,
        tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom,
        tma_atom_O: cute.CopyAtom,
        softmax_scale_log2: Float32,
        scheduler: TileScheduler,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        # When the store frees Q's buffer, the one thread that issues the store releases it.
        q_releasers = THREADS_PER_WARP if self.q_freed_by_store else self.consumer_threads
        ctas = self.config.cluster_ctas
        rings = Rings(
            q=make_tma_ring(
                storage.q_barriers.data_ptr(), self.q_stages, self.q_bytes, q_releasers,
                extra_producer_arrivals=SCALAR_ARRIVALS if self.q_scalar_count else 0,
            ),
            k=make_tma_ring(
                storage.k_barriers.data_ptr(), self.stages, self.kv_bytes, self.consumer_threads, ctas,
                extra_producer_arrivals=SCALAR_ARRIVALS if self.k_scalar_count else 0,
            ),
            v=make_tma_ring(
                storage.v_barriers.data_ptr(), self.stages, self.kv_bytes, self.consumer_threads, ctas
            ),
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
        )
        if cutlass.const_expr(self.sums_on_tensor_cores):
            ones_layout = ones_tile_layout(self.dtype, self.tile_n)
            rings = replace(rings, sOnes=storage.sOnes.get_tensor(ones_layout.outer, swizzle=ones_layout.inner))
            fill_ones(storage.sOnes.data_ptr(), self.tile_n, cute.arch.thread_idx()[0], self.budget.threads)
        if cutlass.const_expr(self.q_scalar_count):
            rings = replace(rings, q_scalars=StageScalars.make(storage.q_scalars.data_ptr(), self.q_scalar_count, self.q_stages))
        if cutlass.const_expr(self.k_scalar_count):
            rings = replace(rings, k_scalars=StageScalars.make(storage.k_scalars.data_ptr(), self.k_scalar_count, self.stages))
        # O goes out through Q's buffer unless it has its own: each warpgroup overwrites only
        # the 64 rows of Q that it alone read, after its last GEMM on them has completed.
        sO = rings.sQ[None, None, 0]
        if cutlass.const_expr(not self.config.o_in_q_buffer):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        queue = None
        if cutlass.const_expr(self.config.dynamic_tiles):
            queue = TileQueue.make(
                storage.tile_barriers.data_ptr(), storage.tile_positions.get_tensor(cute.make_layout(TILE_QUEUE_STAGES)),
                self.consumer_threads,
            )
        finish_init(cluster=ctas > 1)

        if warp_idx < THREADS_PER_WARPGROUP // THREADS_PER_WARP:
            cute.arch.setmaxregister_decrease(self.budget.producer)
            if warp_idx == 0:
                loads = Loads(mQ, mK, mV, tma_atom_Q, tma_atom_K, tma_atom_V, (mQDescale, mKDescale, mVDescale))
                if cutlass.const_expr(self.config.dynamic_tiles):
                    self.produce_dynamic(loads, rings, scheduler, queue, mTileCounter)
                else:
                    self.produce(loads, rings, scheduler)
        else:
            cute.arch.setmaxregister_increase(self.budget.consumer)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
            self.consume(
                tiled_mma_qk, tiled_mma_pv, rings, Outputs(sO, mO, mLSE, tma_atom_O), scheduler, queue,
                mQ.shape[0], mK.shape[0], softmax_scale_log2, tidx,
            )
        if cutlass.const_expr(ctas > 1):
            finish_cluster()

    @cute.jit
    def make_tile(self, scheduler: TileScheduler, position: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Tile:
        m_block, head, batch = scheduler.tile(position)
        return Tile(
            m_block=m_block, head=head, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            n_block_max=self.key_block_end(m_block, seqlen_q, seqlen_k),
        )

    @cute.jit
    def produce(self, loads: Loads, rings: Rings, scheduler: TileScheduler):
        """The producer warp: every tile's loads, in the order the consumers use them."""
        q_state = producer_state(self.q_stages)
        kv_state = producer_state(self.stages)
        position = scheduler.first()
        while position < scheduler.end():
            if scheduler.valid(position):
                q_state, kv_state = self.load_tile(loads, rings, scheduler, position, q_state, kv_state)
            position = scheduler.next(position)

    @cute.jit
    def produce_dynamic(self, loads: Loads, rings: Rings, scheduler: TileScheduler, queue: TileQueue,
                        counter: cute.Tensor):
        """The producer warp of a dynamic grid: its first tile by block index, then each next
        one from the counter once the current one's loads are issued (as late as its lead
        over the consumers allows), every position handed to the consumers; at the end, one
        past the tiles."""
        q_state = producer_state(self.q_stages)
        kv_state = producer_state(self.stages)
        tile_state = tile_queue.producer_state()
        position = scheduler.first()
        while position < scheduler.end():
            tile_state = queue.push(tile_state, position)
            q_state, kv_state = self.load_tile(loads, rings, scheduler, position, q_state, kv_state)
            position = tile_queue.next_ticket(counter.iterator) + scheduler.walkers()
        queue.push(tile_state, scheduler.end())

    @cute.jit
    def load_tile(self, loads: Loads, rings: Rings, scheduler: TileScheduler, position: Int32, q_state, kv_state):
        """The loads of the tile at ``position``; returns the rings' next states."""
        tile = self.make_tile(scheduler, position, loads.mQ.shape[0], loads.mK.shape[0])
        if tile.n_block_max > 0:
            q_state, kv_state = self.load(loads, rings, tile, q_state, kv_state)
        elif cutlass.const_expr(self.q_freed_by_store):
            # A tile that sees no key still stores O (zeros) through Q's buffer, so it
            # claims the buffer like any other tile: by loading its Q.
            q_state = self.load_q(loads, rings, tile, q_state)
        return q_state, kv_state

    @cute.jit
    def consume(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        rings: Rings,
        outputs: Outputs,
        scheduler: TileScheduler,
        queue: Optional[TileQueue],
        seqlen_q: Int32,
        seqlen_k: Int32,
        softmax_scale_log2: Float32,
        tidx: Int32,
    ):
        """A consumer thread: every tile's GEMMs, softmax and epilogue (``queue``: the
        positions of a dynamic grid)."""
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        pingpong = WarpgroupPingPong(warpgroup_idx, self.consumer_warpgroups, THREADS_PER_WARPGROUP)
        if cutlass.const_expr(self.pingpong):
            # Once per CTA: each tile passes the turn as often as it waits for it, so the
            # last warpgroup's final pass of one tile is the first turn of the next.
            pingpong.start()
        q_state = consumer_state(self.q_stages)
        kv_state = consumer_state(self.stages)
        tile_args = (tiled_mma_qk, tiled_mma_pv, rings, outputs, scheduler, seqlen_q, seqlen_k,
                     softmax_scale_log2, pingpong, warpgroup_idx, tidx)
        if cutlass.const_expr(self.config.dynamic_tiles):
            position, tile_state = queue.pop(tile_queue.consumer_state())
            while position < scheduler.end():
                q_state, kv_state = self.consume_tile(*tile_args, position, q_state, kv_state)
                position, tile_state = queue.pop(tile_state)
        else:
            position = scheduler.first()
            while position < scheduler.end():
                if scheduler.valid(position):
                    q_state, kv_state = self.consume_tile(*tile_args, position, q_state, kv_state)
                position = scheduler.next(position)
        # Shared memory must outlive the TMA engine's reads of the last O tile.
        if self.stores_o(tidx):
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume_tile(
        self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, rings: Rings, outputs: Outputs,
        scheduler: TileScheduler, seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32,
        pingpong: WarpgroupPingPong, warpgroup_idx: Int32, tidx: Int32, position: Int32, q_state, kv_state,
    ):
        """A consumer thread's part of the tile at ``position``; returns the rings' next states."""
        tile = self.make_tile(scheduler, position, seqlen_q, seqlen_k)
        ops = self.consumer_operands(tiled_mma_qk, tiled_mma_pv, rings, self.q_slot(q_state), warpgroup_idx, tidx)
        lse = cute.make_rmem_tensor(cute.size(acc_rows_cols(ops.coords), mode=[0]), Float32)
        # A tile whose rows see no key (causal, seqlen_q > seqlen_k) keeps O = 0, LSE = -inf.
        lse.fill(-Float32.inf)
        if tile.n_block_max > 0:
            softmax = self.make_softmax(softmax_scale_log2, cute.size(lse))
            q_state, kv_state = self.mainloop(ops, rings, tile, lse, softmax, pingpong, q_state, kv_state)
        elif cutlass.const_expr(self.q_freed_by_store):
            rings.q.consumer_wait(q_state)
        self.epilogue(ops, lse, outputs, tile, tidx)
        if cutlass.const_expr(self.q_freed_by_store):
            if tidx == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                rings.q.consumer_release(q_state)
            q_state.advance()
        return q_state, kv_state

    # ------------------------------------------------------------------ inputs
    # How V is laid out and the softmax kept: 16-bit V as it comes, (keys, head_dim); the
    # FP8 kernel overrides these.
    def v_rows_first(self, mV: cute.Tensor) -> cute.Tensor:
        return rows_first(mV)

    def v_major(self) -> cute.nvgpu.OperandMajorMode:
        return cute.nvgpu.OperandMajorMode.MN

    def v_tile(self) -> tuple[int, int]:
        """The shape of one V block in shared memory."""
        return self.tile_n, self.head_dim

    def v_operand(self, sV: cute.Tensor) -> cute.Tensor:
        """The V ring as the B operand of O = P V: (head_dim, keys, stage)."""
        return cute.composition(sV, cute.make_ordered_layout((self.head_dim, self.tile_n, self.stages), order=(1, 0, 2)))

    def v_tiles(self, atom: cute.CopyAtom, sV: cute.Tensor, mV: cute.Tensor, cta_rank=0):
        """TMA partitions of the V ring and of one head's V blocks (the last mode); with
        kv_multicast, the share of the CTA ranked ``cta_rank`` in its cluster."""
        return tma_tile(atom, sV, mV, self.v_tile(), None, 0, cta_rank, self.config.cluster_ctas)

    def make_softmax(self, softmax_scale_log2: Float32, rows: int) -> OnlineSoftmax:
        return OnlineSoftmax(softmax_scale_log2, rows, self.config.sum_from_rescaled)

    # Values that travel with each Q stage and each K stage (``Rings.q_scalars``): none for
    # 16-bit inputs; the FP8 kernel's descales.
    q_scalar_count = 0
    k_scalar_count = 0

    def q_scalar_sources(self, loads: Loads, tile: Tile) -> tuple:
        """Pointers to the ``q_scalar_count`` float32 values of ``tile``'s Q stage."""
        return ()

    def k_scalar_sources(self, loads: Loads, tile: Tile, kv_head: Int32, n_block: Int32) -> tuple:
        """Pointers to the ``k_scalar_count`` float32 values of key block ``n_block``."""
        return ()

    # ------------------------------------------------------------------ key ranges
    @cute.jit
    def key_block_end(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """One past the last key block any row of the tile sees (<= 0: none)."""
        n_end = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.causal):
            last_block = m_block
            ctas = self.config.cluster_ctas
            if cutlass.const_expr(ctas > 1 and not self.config.cluster_heads):
                # The CTAs of a cluster walk the key blocks of its last query block: the
                # others mask their extra blocks whole.
                last_block = m_block // ctas * ctas + ctas - 1
            # The tile's last row sees keys up to row + seqlen_k - seqlen_q.
            last_key = (last_block + 1) * self.tile_m - 1 + seqlen_k - seqlen_q
            if last_key < 0:
                n_end = 0
            else:
                n_end = cutlass.min(n_end, last_key // self.tile_n + 1)
        return n_end

    @cute.jit
    def unmasked_block_end(self, tile: Tile) -> Int32:
        """Key blocks below this index are fully visible to every row of the tile."""
        n_end = tile.seqlen_k // self.tile_n
        if cutlass.const_expr(self.causal):
            # The tile's first row is the most restricted: it sees keys <= first_key_limit.
            first_key_limit = tile.m_block * self.tile_m + tile.seqlen_k - tile.seqlen_q
            if first_key_limit < 0:
                n_end = 0
            else:
                n_end = cutlass.min(n_end, (first_key_limit + 1) // self.tile_n)
        return n_end

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, loads: Loads, rings: Rings, tile: Tile, q_state, state):
        """One tile's Q, K and V loads; returns the rings' states for the next tile."""
        mQ, mK, mV = loads.mQ, loads.mK, loads.mV
        tma_atom_K, tma_atom_V = loads.atom_k, loads.atom_v
        kv_head = tile.head // (mQ.shape[2] // mK.shape[2])
        kv_tile = (self.tile_n, self.head_dim)
        ctas = self.config.cluster_ctas
        rank = 0
        kv_copy = {}
        if cutlass.const_expr(ctas > 1):
            # This CTA's share of each K and V block, multicast to every CTA of the cluster.
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            kv_copy = dict(mcast_mask=cutlass.Int16((1 << ctas) - 1))
        tKsK, tKgK = tma_tile(tma_atom_K, rings.sK, mK[None, None, kv_head, tile.batch], kv_tile, None, 0, rank, ctas)
        tVsV, tVgV = self.v_tiles(tma_atom_V, rings.sV, mV[None, None, kv_head, tile.batch], rank)
        k_ring, v_ring = rings.k, rings.v

        # K of the first block goes out before Q: both are needed for the first GEMM, and
        # K's ring is the one the loop keeps waiting on. With more than one Q slot, Q's
        # acquire does not wait for this CTA's previous tile, so Q goes first and lands
        # while that tile finishes.
        if cutlass.const_expr(self.q_stages > 1):
            q_state = self.load_q(loads, rings, tile, q_state)
        n_block = tile.n_block_max - 1
        k_ring.producer_acquire(state)
        cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, state.index],
                  tma_bar_ptr=k_ring.producer_get_barrier(state), **kv_copy)
        self.load_k_scalars(loads, rings, tile, kv_head, n_block, state)
        if cutlass.const_expr(self.q_stages == 1):
            q_state = self.load_q(loads, rings, tile, q_state)
        # Steady state: K of the next block runs one block ahead of V, in the order the
        # consumers use them (S_j is issued before P V_{j+1}).
        for i in cutlass.range(tile.n_block_max - 1, unroll=1):
            v_state = state.clone()
            state.advance()
            k_ring.producer_acquire(state)
            cute.copy(tma_atom_K, tKgK[None, n_block - 1], tKsK[None, state.index],
                      tma_bar_ptr=k_ring.producer_get_barrier(state), **kv_copy)
            self.load_k_scalars(loads, rings, tile, kv_head, n_block - 1, state)
            v_ring.producer_acquire(v_state)
            cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, v_state.index],
                      tma_bar_ptr=v_ring.producer_get_barrier(v_state), **kv_copy)
            n_block -= 1
        v_ring.producer_acquire(state)
        cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, state.index],
                  tma_bar_ptr=v_ring.producer_get_barrier(state), **kv_copy)
        state.advance()
        return q_state, state

    def q_slot(self, q_state):
        """The slot of Q's ring that ``q_state`` names; a compile-time 0 for one slot."""
        return q_state.index if cutlass.const_expr(self.q_stages > 1) else 0

    @cute.jit
    def load_q(self, loads: Loads, rings: Rings, tile: Tile, q_state):
        """The tile's Q, once the consumers have given the buffer back (see
        ``q_freed_by_store``); returns the Q ring's next state."""
        q_tile = (self.tile_m, self.head_dim)
        sQ = rings.sQ[None, None, self.q_slot(q_state)]
        tQsQ, tQgQ = tma_tile(loads.atom_q, sQ, loads.mQ[None, None, tile.head, tile.batch], q_tile, tile.m_block)
        rings.q.producer_acquire(q_state)
        cute.copy(loads.atom_q, tQgQ, tQsQ, tma_bar_ptr=rings.q.producer_get_barrier(q_state))
        if cutlass.const_expr(self.q_scalar_count):
            rings.q_scalars.load(
                self.q_scalar_sources(loads, tile), self.q_slot(q_state), rings.q.producer_get_barrier(q_state)
            )
        q_state.advance()
        return q_state

    @cute.jit
    def load_k_scalars(self, loads: Loads, rings: Rings, tile: Tile, kv_head: Int32, n_block: Int32, state):
        """Key block ``n_block``'s values into K's stage ``state``, after its acquire."""
        if cutlass.const_expr(self.k_scalar_count):
            rings.k_scalars.load(
                self.k_scalar_sources(loads, tile, kv_head, n_block), state.index, rings.k.producer_get_barrier(state)
            )

    # ------------------------------------------------------------------ consumers
    def warpgroup_slice(self, tiled_mma: cute.TiledMma, warpgroup_idx: Int32):
        """The consumer warpgroup's slice of ``tiled_mma``: its 64 rows."""
        wg_threads = cute.make_layout(self.consumer_warpgroups, stride=THREADS_PER_WARPGROUP)
        return tiled_mma.get_slice(wg_threads(warpgroup_idx))

    @cute.jit
    def consumer_operands(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        rings: Rings,
        q_slot,
        warpgroup_idx: Int32,
        tidx: Int32,
    ) -> ConsumerOperands:
        """``q_slot``: the slot of Q's ring that holds this tile's Q."""
        # Each warpgroup's MMA slice: its 64 rows of Q and of S, O.
        wg_mma_qk = self.warpgroup_slice(tiled_mma_qk, warpgroup_idx)
        wg_mma_pv = self.warpgroup_slice(tiled_mma_pv, warpgroup_idx)
        sVt = self.v_operand(rings.sV)
        acc_o = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        # O starts at zero so every P V GEMM accumulates; one fill per tile is cheaper than
        # tracking which GEMM is the first.
        acc_o.fill(0.0)
        tile_coords = cute.make_identity_tensor((self.tile_m, self.tile_n))
        row_sums = None
        if cutlass.const_expr(self.sums_on_tensor_cores):
            row_sums = TensorCoreRowSum.make(
                self.dtype, self.consumer_warpgroups, rings.sOnes, warpgroup_idx * THREADS_PER_WARPGROUP
            )
        sQ = rings.sQ[None, None, q_slot]
        q_registers = None
        if cutlass.const_expr(self.config.q_in_registers):
            q_registers = RegisterOperandA.make(tiled_mma_qk, wg_mma_qk, self.qk_dtype, sQ, tidx)
            tSrQ = q_registers.fragment
        else:
            tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        return ConsumerOperands(
            tiled_mma_qk=tiled_mma_qk,
            tiled_mma_pv=tiled_mma_pv,
            tSrQ=tSrQ,
            tSrK=wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(rings.sK)),
            tOrVt=wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt)),
            s_shape=wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n)),
            acc_o=acc_o,
            # P in the input dtype, as the register A operand of O += P V. One buffer
            # suffices: it is rewritten only after the GEMM that read it has completed.
            p=wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n))),
            # Tile-local (row, col) of each S element this thread holds: masks, LSE rows.
            coords=tiled_mma_qk.get_slice(tidx).partition_C(tile_coords),
            # Thread 0's coordinates: known at compile time (see mask_scores).
            coords0=tiled_mma_qk.get_slice(0).partition_C(tile_coords),
            sQ=sQ,
            row_sums=row_sums,
            q_registers=q_registers,
        )

    @cute.jit
    def mainloop(
        self,
        ops: ConsumerOperands,
        rings: Rings,
        tile: Tile,
        lse: cute.Tensor,
        softmax: OnlineSoftmax,
        pingpong: WarpgroupPingPong,
        q_state,
        state,
    ):
        """All key blocks of the tile; leaves O normalised in ``ops.acc_o`` and LSE in ``lse``.
        Returns the Q and K/V rings' states for the next tile."""
        rings.q.consumer_wait(q_state)
        # Before anything can release Q's stage: the values that came with it.
        softmax.tile_inputs(rings.q_scalars, self.q_slot(q_state))
        if cutlass.const_expr(self.config.q_in_registers):
            ops.q_registers.load()
            if cutlass.const_expr(not self.q_freed_by_store):
                # Q now lives in registers: its slot can take a later tile's Q at once.
                rings.q.consumer_release(q_state)
                q_state.advance()

        # First block: the highest one, masked for the tail of seqlen_k and the diagonal.
        n_block = tile.n_block_max - 1
        rings.k.consumer_wait(state)
        block = softmax.block_inputs(rings.k_scalars, state.index)
        first_turn = self.pingpong and self.config.first_block_turn
        if cutlass.const_expr(first_turn):
            pingpong.wait_turn()
        acc_s = cute.make_rmem_tensor(ops.s_shape, self.score_dtype)
        if cutlass.const_expr(self.config.skip_unseen_first_block):
            # A warpgroup that skips the GEMM keeps -inf, what the mask would have made of
            # every one of its scores.
            if cutlass.const_expr(self.f16_scores):
                score_words(acc_s).fill(NEG_INF_X2)
            else:
                acc_s.fill(-Float32.inf)
            if self.warpgroup_sees_block(ops, tile, n_block):
                warpgroup_gemm(ops.tiled_mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, state.index], True)
                warpgroup.wait_group(0)
            if cutlass.const_expr(first_turn):
                pingpong.pass_turn()
        else:
            warpgroup_gemm(ops.tiled_mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, state.index], True)
            if cutlass.const_expr(first_turn):
                pingpong.pass_turn()
            warpgroup.wait_group(0)
        acc_s = self.float_scores(acc_s)
        rings.k.consumer_release(state)
        if cutlass.const_expr(self.config.masked_column_slices):
            # One compiled softmax per count of leading slices the warp can see; the switch
            # is uniform over the warp, the only unit the softmax's shuffles span.
            slices = self.live_column_slices(ops, tile, n_block)
            slice_count = self.config.masked_column_slices
            slice_cols = cute.size(acc_rows_cols(acc_s), mode=[1]) // slice_count
            for count in cutlass.range_constexpr(1, slice_count + 1):
                if slices == count:
                    self.first_softmax(acc_s, ops, tile, n_block, softmax, block, count * slice_cols)
        else:
            self.first_softmax(acc_s, ops, tile, n_block, softmax, block)
        self.store_p(acc_s, ops.p)

        # Blocks that cross the diagonal keep the causal mask; the rest run without.
        masked_count = cutlass.max(n_block - self.unmasked_block_end(tile), 0)
        for i in cutlass.range(masked_count, unroll=1):
            n_block -= 1
            state = self.step(ops, rings, state, softmax, pingpong, tile, n_block, True)
        for i in cutlass.range(n_block, unroll=1):
            n_block -= 1
            state = self.step(ops, rings, state, softmax, pingpong, tile, n_block, False)

        if cutlass.const_expr(not self.q_freed_by_store and not self.config.q_in_registers):
            # Every S GEMM has completed: Q's buffer can take the next tile's Q.
            rings.q.consumer_release(q_state)
            q_state.advance()
        # The last block's P V.
        rings.v.consumer_wait(state)
        self.pv_gemm(ops, state.index)
        warpgroup.wait_group(0)
        rings.v.consumer_release(state)
        state.advance()
        if cutlass.const_expr(self.sums_on_tensor_cores):
            softmax.add_tensor_core_sums(ops.row_sums.acc, None)
        softmax.rescale(ops.acc_o, softmax.finalize(lse))
        return q_state, state

    @cute.jit
    def step(
        self,
        ops: ConsumerOperands,
        rings: Rings,
        state,
        softmax: OnlineSoftmax,
        pingpong: WarpgroupPingPong,
        tile: Tile,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
    ):
        """One key block: S for block ``n_block`` overlapped with P V of the block before."""
        v_state = state.clone()
        state.advance()
        rings.k.consumer_wait(state)
        if cutlass.const_expr(self.pingpong):
            pingpong.wait_turn()
        acc_s = cute.make_rmem_tensor(ops.s_shape, self.score_dtype)
        warpgroup_gemm(ops.tiled_mma_qk, acc_s, ops.tSrQ, ops.tSrK[None, None, None, state.index], True)
        rings.v.consumer_wait(v_state)
        self.pv_gemm(ops, v_state.index)
        if cutlass.const_expr(self.pingpong):
            pingpong.pass_turn()
        block = softmax.block_inputs(rings.k_scalars, state.index)
        # Wait for S only; P V may still run while the softmax below does.
        warpgroup.wait_group(1)
        acc_s = self.float_scores(acc_s)
        by_sums = self.config.lazy_rescale and self.config.lazy_check_by_sums and not masked
        if cutlass.const_expr(by_sums):
            warpgroup.wait_group(0)
            rings.v.consumer_release(v_state)
            if cutlass.const_expr(self.causal):
                # A row that has seen no key has no max to keep: its P would be inf.
                if cute.arch.vote_any_sync(softmax.has_unseen_row()):
                    self.rebased_softmax(acc_s, ops, softmax, block)
                else:
                    self.softmax_by_sums(acc_s, ops, rings, state.index, softmax, block)
            else:
                self.softmax_by_sums(acc_s, ops, rings, state.index, softmax, block)
            # Released only now: a warp whose P overflowed reads K again.
            rings.k.consumer_release(state)
            self.store_p(acc_s, ops.p)
            return state
        rings.k.consumer_release(state)
        if cutlass.const_expr(self.config.lazy_rescale and not masked):
            passes = softmax.passes_kept_max(acc_s)
            # The rebasing branch rescales O, so P V must be done; waiting here, before the
            # exponentials, is also where ptxas puts that wait in the plain step.
            warpgroup.wait_group(0)
            rings.v.consumer_release(v_state)
            if cute.arch.vote_any_sync(passes):
                self.rebased_softmax(acc_s, ops, softmax, block)
            else:
                self.softmax_under_kept_max(acc_s, softmax)
            self.store_p(acc_s, ops.p)
            return state
        if cutlass.const_expr(masked):
            self.mask(acc_s, ops, tile, n_block)
        row_scale = softmax.update(acc_s, block, is_first=False, masked=masked)
        warpgroup.wait_group(0)
        rings.v.consumer_release(v_state)
        if cutlass.const_expr(self.sums_on_tensor_cores):
            # The sums of the P that this P V read, then this block's factor, as O gets.
            softmax.add_tensor_core_sums(ops.row_sums.acc, row_scale)
        if cutlass.const_expr(self.config.p_before_rescale):
            self.store_p(acc_s, ops.p)
            softmax.rescale(ops.acc_o, row_scale, self.config.rescale_when_needed)
        else:
            softmax.rescale(ops.acc_o, row_scale, self.config.rescale_when_needed)
            self.store_p(acc_s, ops.p)
        return state

    @cute.jit
    def rebased_softmax(self, acc_s: cute.Tensor, ops: ConsumerOperands, softmax: OnlineSoftmax, block) -> None:
        """lazy_rescale's branch for a warp whose scores pass the kept max: the block's
        softmax with the max raised, and O rescaled (its P V has completed). Methods of the
        kernel, so that the branch carries no Python object."""
        row_scale = softmax.update(acc_s, block, is_first=False, masked=False)
        softmax.rescale(ops.acc_o, row_scale, self.config.rescale_when_needed)

    @cute.jit
    def softmax_by_sums(
        self, acc_s: cute.Tensor, ops: ConsumerOperands, rings: Rings, k_index, softmax: OnlineSoftmax, block
    ) -> None:
        """lazy_rescale's step with the branch chosen by the row sums of P under the kept max."""
        partials, over = softmax.exp_under_kept_max(acc_s)
        if cute.arch.vote_any_sync(over):
            self.rebase_p(acc_s, ops, rings, k_index, softmax, block)
        else:
            self.add_partials(softmax, partials)

    @cute.jit
    def add_partials(self, softmax: OnlineSoftmax, partials: cute.Tensor) -> None:
        """The common branch's end: the block's sums join the rows' (a kernel method, as
        ``rebased_softmax``, so that the branch carries no Python object)."""
        softmax.add_partials(partials)

    @cute.jit
    def rebase_p(
        self, acc_s: cute.Tensor, ops: ConsumerOperands, rings: Rings, k_index, softmax: OnlineSoftmax, block
    ) -> None:
        """A warp whose P passed MAX_HEADROOM: P, its row sums and O divided by each row's
        largest P. Where a P passed LARGEST_REBASED_P (a score 126 octaves above the kept
        max, or inf) the scores are needed, so the warp computes them again and rebases them."""
        p_max = softmax.row_p_max(acc_s)
        overflow = p_max[0] > LARGEST_REBASED_P
        for r in cutlass.range_constexpr(1, softmax.rows):
            overflow = overflow | (p_max[r] > LARGEST_REBASED_P)
        if cute.arch.vote_any_sync(overflow):
            self.recompute_scores(acc_s, ops, rings, k_index)
            self.rebased_softmax(acc_s, ops, softmax, block)
        else:
            self.rescale_rebased_p(acc_s, ops, softmax, p_max)

    @cute.jit
    def rescale_rebased_p(self, acc_s: cute.Tensor, ops: ConsumerOperands, softmax: OnlineSoftmax, p_max) -> None:
        """P divided by its rows' largest values, and O with it (P V has completed)."""
        row_scale = softmax.rebase_p(acc_s, p_max)
        softmax.rescale(ops.acc_o, row_scale, self.config.rescale_when_needed)

    @cute.jit
    def recompute_scores(self, acc_s: cute.Tensor, ops: ConsumerOperands, rings: Rings, k_index) -> None:
        """This thread's scores of the block again, from Q's and K's shared-memory slots,
        by fp32 FMAs: a path for scores far past any seen before, not for speed."""
        s = acc_rows_cols(acc_s)
        c = acc_rows_cols(ops.coords)
        sK = rings.sK[None, None, k_index]
        rows, cols = cute.size(s, mode=[0]), cute.size(s, mode=[1])
        for r in cutlass.range_constexpr(rows):
            for j in cutlass.range_constexpr(cols):
                s[r, j] = Float32(0.0)
        for d in cutlass.range(self.head_dim, unroll=1):
            k = cute.make_rmem_tensor(cols, Float32)
            for j in cutlass.range_constexpr(cols):
                k[j] = Float32(sK[c[0, j][1], d])
            for r in cutlass.range_constexpr(rows):
                q = Float32(ops.sQ[c[r, 0][0], d])
                for j in cutlass.range_constexpr(cols):
                    s[r, j] = s[r, j] + q * k[j]

    @cute.jit
    def softmax_under_kept_max(self, acc_s: cute.Tensor, softmax: OnlineSoftmax) -> None:
        softmax.update_under_kept_max(acc_s)

    @cute.jit
    def pv_gemm(self, ops: ConsumerOperands, v_index) -> None:
        """O += P V with V from slot ``v_index`` of its ring (and P's row sums beside it),
        one commit group."""
        warpgroup.fence()
        issue_gemm(ops.tiled_mma_pv, ops.acc_o, ops.p, ops.tOrVt[None, None, None, v_index], False)
        if cutlass.const_expr(self.sums_on_tensor_cores):
            ops.row_sums.issue(ops.p)
        warpgroup.commit_group()

    @cute.jit
    def mask(
        self, acc_s: cute.Tensor, ops: ConsumerOperands, tile: Tile, n_block: Int32, cols: cutlass.Constexpr = None
    ) -> None:
        mask_scores(
            acc_s, ops.coords, ops.coords0, tile.m_block * self.tile_m, n_block * self.tile_n,
            tile.seqlen_q, tile.seqlen_k, self.causal, cols,
        )

    @cute.jit
    def first_softmax(
        self, acc_s: cute.Tensor, ops: ConsumerOperands, tile: Tile, n_block: Int32, softmax: OnlineSoftmax, block,
        live_cols: cutlass.Constexpr = None,
    ) -> None:
        """The first key block's mask and softmax (over its first ``live_cols`` columns of
        ``acc_rows_cols``, if given). A method of the kernel so that the switch over
        ``live_cols`` carries no Python object through its runtime branches."""
        self.mask(acc_s, ops, tile, n_block, live_cols)
        if cutlass.const_expr(live_cols is None):
            softmax.update(acc_s, block, is_first=True, masked=True)
        else:
            softmax.update(acc_s, block, is_first=True, masked=True, live_cols=live_cols)

    @cute.jit
    def warpgroup_sees_block(self, ops: ConsumerOperands, tile: Tile, n_block: Int32):
        """Whether some row of this thread's warpgroup sees a key of causal block ``n_block``
        (uniform over the warpgroup)."""
        this_row = acc_rows_cols(ops.coords)[0, 0][0]
        last_row = this_row // ROWS_PER_CONSUMER_WARPGROUP * ROWS_PER_CONSUMER_WARPGROUP + ROWS_PER_CONSUMER_WARPGROUP - 1
        last_key = tile.m_block * self.tile_m + last_row + tile.seqlen_k - tile.seqlen_q
        return cute.arch.make_warp_uniform(last_key) >= n_block * self.tile_n

    @cute.jit
    def live_column_slices(self, ops: ConsumerOperands, tile: Tile, n_block: Int32) -> Int32:
        """How many of key block ``n_block``'s ``masked_column_slices`` column slices hold a key
        that some row of this thread's warp sees: from 1 (a warp that sees none still runs
        one, which the mask fills with -inf) to all. Uniform over the warp."""
        this_row = acc_rows_cols(ops.coords)[0, 0][0]
        warp_last_row = this_row // ROWS_PER_WARP * ROWS_PER_WARP + ROWS_PER_WARP - 1
        key_end = tile.seqlen_k
        if cutlass.const_expr(self.causal):
            key_end = cutlass.min(
                key_end, tile.m_block * self.tile_m + warp_last_row + 1 + tile.seqlen_k - tile.seqlen_q
            )
        slice_count = self.config.masked_column_slices
        slice_keys = self.tile_n // slice_count
        # Keys of the block the warp sees, kept >= 0 so the division rounds up.
        live_keys = cutlass.max(key_end - n_block * self.tile_n, 0)
        slices = cutlass.min(cutlass.max((live_keys + slice_keys - 1) // slice_keys, 1), slice_count)
        return cute.arch.make_warp_uniform(slices)

    @cute.jit
    def store_p(self, acc_s: cute.Tensor, p: cute.Tensor) -> None:
        """Convert the probabilities to the input dtype into P's A-operand registers."""
        convert_packed(acc_as_a_operand(acc_s), p)

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def epilogue(
        self,
        ops: ConsumerOperands,
        lse: cute.Tensor,
        outputs: Outputs,
        tile: Tile,
        tidx: Int32,
    ):
        o = cute.make_rmem_tensor_like(ops.acc_o, self.out_dtype)
        o.store(ops.acc_o.load().to(self.out_dtype))
        # The threads storing this slab of O together (see ``o_store_threads``).
        barrier_id = int(NamedBarrier.EPILOGUE)
        store_mma, sO_slab, o_block, slab_tidx = ops.tiled_mma_pv, outputs.sO, tile.m_block, tidx
        if cutlass.const_expr(self.config.o_store_per_warpgroup):
            warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
            barrier_id = int(NamedBarrier.EPILOGUE_WARPGROUP_0) + warpgroup_idx
            # One warpgroup's 64 rows: its accumulator fragment is that of a one-warpgroup MMA.
            store_mma, sO_slab = self.pv_mma(1), outputs.sO[None, None, warpgroup_idx]
            o_block = tile.m_block * self.consumer_warpgroups + warpgroup_idx
            slab_tidx = tidx % THREADS_PER_WARPGROUP
        if cutlass.const_expr(not self.config.o_in_q_buffer):
            # The slab may still be read by the TMA store of this CTA's previous tile.
            if self.stores_o(tidx):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.o_store_threads)
        # stmatrix: each warp writes 8x8 tiles of 16-bit values straight from mma fragments.
        store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32)
        thr_store = cute.make_tiled_copy_C(store_atom, store_mma).get_slice(slab_tidx)
        cute.copy(thr_store, thr_store.retile(o), thr_store.partition_D(sO_slab))

        if cutlass.const_expr(outputs.mLSE is not None):
            self.store_lse(lse, outputs.mLSE, ops, tile, tidx)

        # The TMA engine reads the slab through the async proxy: make the generic-proxy
        # writes above visible to it, then wait for every storing thread's part.
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.o_store_threads)
        if self.stores_o(tidx):
            o_tile = (self.o_store_rows, self.head_dim)
            gO = outputs.mO[None, None, tile.head, tile.batch]
            tOsO, tOgO = tma_tile(outputs.atom_o, sO_slab, gO, o_tile, o_block)
            # Rows past seqlen_q are clipped by the TMA engine.
            cute.copy(outputs.atom_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()

    def stores_o(self, tidx: Int32):
        """Whether consumer thread ``tidx`` issues (and waits for) TMA stores of O."""
        if cutlass.const_expr(self.config.o_store_per_warpgroup):
            return tidx % THREADS_PER_WARPGROUP == 0
        return tidx == 0

    @cute.jit
    def store_lse(self, lse: cute.Tensor, mLSE: cute.Tensor, ops: ConsumerOperands, tile: Tile, tidx: Int32):
        """LSE straight from registers: the first thread of each quad owns its rows."""
        lse_rows = mLSE[None, tile.head, tile.batch]
        c = acc_rows_cols(ops.coords)
        if tidx % THREADS_PER_ROW == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tile.m_block * self.tile_m + c[r, 0][0]
                if row < tile.seqlen_q:
                    lse_rows[row] = lse[r]
