"""Hopper (sm_90a) backward attention: dQ, dK, dV from Q, K, V, dO, and the forward's LSE.

GQA/MQA: several query heads share a kv head, so their CTAs add dK and dV in fp32 into
zeroed accumulators (``kv_accumulate``) instead of storing them; or (``kv_group_in_cta``)
a CTA per kv head walks the query blocks of each query head of its group in turn, the
store warp adding each head's dQ into that head's accumulator, and stores dK and dV once.

A CTA owns ``tile_n`` = 128 keys of one head and walks the query blocks that see them. Its
two consumer warpgroups own 64 keys each and compute everything transposed, keys as rows:

    Sᵀ  = K Qᵀ                 (SS wgmma: K, Q in shared memory)
    dPᵀ = V dOᵀ                (SS)
    Pᵀ  = exp2(Sᵀ · scale · log2(e) − lse_log2[query])      (registers)
    dSᵀ = Pᵀ ∘ (dPᵀ − D[query])                              (registers)
    dV += Pᵀ dO                (RS: Pᵀ straight from registers as the A operand)
    dK += dSᵀ Q                (RS)
    dQ  = dS K                 (SS: dSᵀ goes to shared memory, read transposed)
    dQ_accum[query block] += dQ (fp32, one linear bulk reduction per part from shared memory;
                                the block's first contribution stores: dq_first_stores)

Keeping keys as rows is what lets P and dS feed the dV and dK GEMMs from registers: each
warpgroup's 64 key rows of Pᵀ are exactly the rows of dV it owns. dQ needs all 128 keys of
both warpgroups, so dSᵀ alone goes through shared memory; each warpgroup then computes
its part of dQ (half of the columns, or its 64 query rows at head dim 64) and writes it to
shared memory for the store warp to add into the accumulator, so the two warpgroups meet
once per query block (when dSᵀ is written) and dSᵀ takes two buffers. Staggered
(``staggered_warpgroups``) they do not meet: warpgroup 1 runs half a step behind
warpgroup 0, each waiting for the other's rows of dSᵀ on a barrier of its own, and
warpgroup 0 computes each block's dQ a step late, so that one's exponentials and dS math
run beside the other's GEMMs.

Transposed (``dq_transposed``, head dim 128) each warpgroup computes dQᵀ = Kᵀ dSᵀ for its
64 head-dim columns instead, N = the query block, so that blocks need not be 64 rows: the
selector's 80 unmasked read 5% fewer shared-memory bytes per FLOP (perf/bwd_smem_bound.py).

At head dim 256 a warpgroup's dK and dV of 64 keys would take 256 registers per thread, so
there (``head_dim_split``) the CTA owns 64 keys, shared by both warpgroups: they split the
queries of Sᵀ and dPᵀ and the head-dim columns of dV, dK and dQ, and Pᵀ joins dSᵀ in
shared memory, where each warpgroup's dV and dK GEMMs read all queries of both (SS).

The preprocess (kernels/sm90_bwd_preprocess.py) supplies D =
rowsum(dO ∘ O) and lse_log2 = LSE · log2(e), padded with +inf so that rows past seqlen_q
get P = 0; the postprocess (kernels/sm90_bwd_postprocess.py) converts the dQ accumulator
to the input dtype, times the softmax scale.

Warp roles: warpgroup 0, warp 0 loads K and V once, then Q and dO of each query block
into rings, each with its rows' lse_log2 or D; warpgroup 0, warp 1 (the dQ store warp,
kernels/dq_store_warp.py) issues the bulk reductions of the dQ parts the consumers hand
over and, once the last has landed, counts the key block on its head's counter, which the
postprocess (launched while this grid runs: ``overlap_postprocess``) waits on;
warpgroups 1 and 2 are the consumers. Which query blocks a key block walks, in what
order, and which need a mask: kernels/bwd_blocks.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..pipelines.global_semaphore import pass_turn, wait_for_turn
from ..pipelines.named_barriers import NamedBarrier
from ..pipelines.tma_pipeline import barrier_words, consumer_state, finish_init, make_tma_ring, producer_state
from ..pipelines.warp_roles import THREADS_PER_WARP, THREADS_PER_WARPGROUP, register_budget
from .bwd_blocks import masked_block_end, mirror_block, query_block_at, query_block_range
from .configs import (
    BACKWARD_DS_STAGES, FP32_BYTES, ROWS_PER_CONSUMER_WARPGROUP, SMEM_ALIGN_BYTES, TMA_SMEM_ALIGN_BYTES,
    Sm90BackwardConfig,
)
from .dq_store_warp import DQ_HANDOFF_THREADS, DQ_STORE_WARP, DQReduction, DQStoreWarp
from .memory_pass import FP32_PER_VECTOR
from .mma_layouts import a_operand_as_acc, acc_as_a_operand, acc_rows_cols
from .packed_convert import convert_packed
from .wgmma import (
    accumulator_tile_layout, register_order_tile_layout, rows_first, smem_tile_layout, tma_tile, warpgroup_gemm,
)


@dataclass(frozen=True)
class KeyBlock:
    """This CTA's keys: block ``n_block`` of one head of one batch entry."""

    n_block: Int32
    head: Int32
    kv_head: Int32
    # This head's place among the query heads of its kv head (GQA/MQA).
    rank_in_group: Int32
    batch: Int32
    seqlen_q: Int32
    seqlen_k: Int32


@dataclass(frozen=True)
class QueryHeads:
    """The query heads a CTA walks over its key block: its own, or (kv_group_in_cta) the
    ``count`` heads of its kv head's group from ``first`` on."""

    first: Int32
    count: Any  # 1, or the group's size (Int32)
    batch: Int32


@dataclass(frozen=True)
class BackwardLoads:
    """What the producer reads: the TMA views of Q, K, V, dO and of the preprocess's per-row
    LSE·log2(e) and D, and their copy atoms."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mdO: cute.Tensor
    mLSELog2: cute.Tensor
    mD: cute.Tensor
    atom_q: cute.CopyAtom
    atom_k: cute.CopyAtom
    atom_v: cute.CopyAtom
    atom_do: cute.CopyAtom
    atom_lse: cute.CopyAtom
    atom_delta: cute.CopyAtom


@dataclass(frozen=True)
class BackwardRings:
    """The shared-memory rings and their buffers: K and V (one stage, loaded once per key
    block); Q with its rows' LSE·log2(e) (``sLSE``) and dO with its rows' D (``sD``), each
    row buffer (tile_m, stages) on its tile's barrier."""

    kv: Any
    q: Any
    do: Any
    sK: cute.Tensor
    sV: cute.Tensor
    sQ: cute.Tensor
    sdO: cute.Tensor
    sLSE: cute.Tensor
    sD: cute.Tensor


@dataclass(frozen=True)
class DQOutputs:
    """Where dQ goes: the consumers' shared-memory tile, the fp32 accumulator the store warp
    adds it into, its ticket or turn counters and the postprocess's per-head count (each
    None where the configuration has none)."""

    sdQ: cute.Tensor
    mdQAccum: cute.Tensor
    mdQCounters: Optional[cute.Tensor]
    mdQReady: Optional[cute.Tensor]


@dataclass(frozen=True)
class KVOutputs:
    """Where dK and dV go: TMA stores (their atoms), or (kv_accumulate) fp32 accumulators
    with, deterministic, their turn counters."""

    mdK: cute.Tensor
    mdV: cute.Tensor
    atom_dk: Optional[cute.CopyAtom]
    atom_dv: Optional[cute.CopyAtom]
    mdKVTurns: Optional[cute.Tensor]


@dataclass(frozen=True)
class BackwardOperands:
    """One consumer thread's GEMM operands, accumulators and element coordinates."""

    tiled_mma_sdp: cute.TiledMma
    tiled_mma_dkv: cute.TiledMma
    tiled_mma_dq: cute.TiledMma
    tSrK: cute.Tensor
    tSrQ: cute.Tensor
    tdPrV: cute.Tensor
    tdPrdO: cute.Tensor
    tdVrdO: cute.Tensor
    tdKrQ: cute.Tensor
    tdQrdS: cute.Tensor
    tdQrK: cute.Tensor
    st_shape: Any
    dq_shape: Any
    # Pᵀ and dSᵀ in the input dtype, the A operands of the dV and dK GEMMs: registers, or
    # (head-dim split) their tiles in shared memory.
    pt: cute.Tensor
    dst: cute.Tensor
    acc_dv: cute.Tensor
    acc_dk: cute.Tensor
    # (key, query) of each Sᵀ element this thread holds.
    st_coords: cute.Tensor
    store_ds: Any
    sdS: cute.Tensor
    # The head-dim split's Pᵀ in shared memory (None otherwise).
    sP: Optional[cute.Tensor]
    store_dq: Any
    warpgroup_idx: Int32


class Sm90BackwardKernel:
    """The main backward kernel for one configuration and one 16-bit dtype."""

    def __init__(self, config: Sm90BackwardConfig, dtype: Type[cutlass.Numeric]):
        self.config = config
        self.dtype = dtype
        self.tile_m, self.tile_n, self.head_dim = config.tile_m, config.tile_n, config.head_dim
        self.causal = config.causal
        # Causal key blocks start their walks apart already (each at its diagonal), and
        # deterministic mode fixes the order of the additions.
        self.rotate = config.rotate_query_blocks and not config.causal and not config.deterministic
        self.split = config.head_dim_split
        self.staggered = config.staggered_warpgroups
        self.ds_stages = BACKWARD_DS_STAGES
        self.consumer_threads = config.consumer_warpgroups * THREADS_PER_WARPGROUP
        self.budget = register_budget(config.consumer_warpgroups)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim)
        mdO: cute.Tensor,  # (batch, seqlen_q, heads, head_dim)
        mLSELog2: cute.Tensor,  # (batch, heads, padded seqlen_q), float32
        mD: cute.Tensor,  # (batch, heads, padded seqlen_q), float32
        mdQAccum: cute.Tensor,  # (batch, heads, padded seqlen_q, head_dim), float32, tiled (DQReduction)
        mdK: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim); float32 if kv_accumulate
        mdV: cute.Tensor,  # (batch, seqlen_k, kv_heads, head_dim); float32 if kv_accumulate
        # Deterministic: zeroed int32 turn counters of the fp32 additions, (batch, heads,
        # query blocks x parts) for dQ and (batch, kv_heads, key blocks) for kv_accumulate's
        # dK, dV. dq_first_stores alone: dQ's ticket counters, (batch, heads, query blocks).
        mdQCounters: Optional[cute.Tensor],
        mdKVTurns: Optional[cute.Tensor],
        # overlap_postprocess: zeroed int32 (batch, heads), key blocks whose dQ has landed.
        mdQReady: Optional[cute.Tensor],
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mdO, mdK, mdV = (rows_first(t) for t in (mQ, mK, mV, mdO, mdK, mdV))
        mLSELog2, mD = rows_first(mLSELog2), rows_first(mD)
        if cutlass.const_expr(mdQCounters is not None):
            mdQCounters = rows_first(mdQCounters)
        if cutlass.const_expr(mdKVTurns is not None):
            mdKVTurns = rows_first(mdKVTurns)
        mdQAccum = cute.make_tensor(mdQAccum.iterator, cute.select(mdQAccum.layout, mode=[2, 3, 1, 0]))
        major_k, major_mn = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wgs, rows = self.config.consumer_warpgroups, ROWS_PER_CONSUMER_WARPGROUP
        if cutlass.const_expr(self.split):
            # Both warpgroups on the same 64 keys: Sᵀ and dPᵀ split by queries, dV and dK by
            # head-dim columns, with Pᵀ and dSᵀ read from shared memory.
            sdp_atoms, sdp_tile = (1, wgs, 1), (rows, self.tile_m // wgs)
            dkv_atoms, dkv_tile, dkv_a = (1, wgs, 1), (rows, self.head_dim // wgs), warpgroup.OperandSource.SMEM
        else:
            # 64 keys per warpgroup: Pᵀ and dSᵀ stay in the registers that computed them.
            sdp_atoms, sdp_tile = (wgs, 1, 1), (rows, self.tile_m)
            dkv_atoms, dkv_tile, dkv_a = (wgs, 1, 1), (rows, self.head_dim), warpgroup.OperandSource.RMEM
        # Sᵀ and dPᵀ: M = keys, N = queries, K = head_dim.
        tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_k, major_k, Float32, sdp_atoms, sdp_tile
        )
        # dV and dK: M = keys, N = head_dim, K = queries; A is Pᵀ or dSᵀ, B (dO, Q) is read as
        # (head_dim, queries), head_dim contiguous.
        tiled_mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_k, major_mn, Float32, dkv_atoms, dkv_tile, a_source=dkv_a
        )
        # dQ: M = queries, N = head_dim, K = keys, the warpgroups splitting N (or, dq_rows,
        # M); dS read as (queries, keys) and K as (head_dim, keys), both from shared memory.
        dq_atoms, dq_tile = (1, wgs, 1), (rows, self.head_dim // wgs)
        if cutlass.const_expr(self.config.dq_rows):
            dq_atoms, dq_tile = (wgs, 1, 1), (rows, self.head_dim)
        if cutlass.const_expr(self.config.dq_transposed):
            # dQᵀ: M = head_dim, 64 columns per warpgroup; N = queries; Kᵀ read as (head_dim,
            # keys) and dS as (queries, keys): the same views in the other roles.
            dq_atoms, dq_tile = (wgs, 1, 1), (rows, self.tile_m)
        tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, major_mn, major_mn, Float32, dq_atoms, dq_tile
        )

        sQ_layout = smem_tile_layout(self.dtype, self.tile_m, self.head_dim, self.config.q_stages)
        sdO_layout = smem_tile_layout(self.dtype, self.tile_m, self.head_dim, self.config.do_stages)
        sK_layout = smem_tile_layout(self.dtype, self.tile_n, self.head_dim)
        sdS_layout = smem_tile_layout(self.dtype, self.tile_n, self.tile_m, self.ds_stages)
        # dQ's fp32 tile, one part per warpgroup: its columns (or, dq_rows, its rows; or,
        # dq_transposed, its columns as dQᵀ's accumulator holds them).
        dq = self.config.dq_tile_geometry
        tile_layout = register_order_tile_layout if dq.transposed else accumulator_tile_layout
        sdQ_layout = tile_layout(dq.part_rows, dq.part_cols, wgs)
        row_layout = cute.make_layout(self.tile_m)

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        atom_q, tma_q = cpasync.make_tiled_tma_atom(load, mQ, cute.select(sQ_layout, mode=[0, 1]), (self.tile_m, self.head_dim))
        atom_do, tma_do = cpasync.make_tiled_tma_atom(load, mdO, cute.select(sdO_layout, mode=[0, 1]), (self.tile_m, self.head_dim))
        # A query block's LSE·log2(e) and D come with its Q and dO tiles, on their barriers.
        atom_lse, tma_lse = cpasync.make_tiled_tma_atom(load, mLSELog2, row_layout, (self.tile_m,))
        atom_delta, tma_delta = cpasync.make_tiled_tma_atom(load, mD, row_layout, (self.tile_m,))
        atom_k, tma_k = cpasync.make_tiled_tma_atom(load, mK, sK_layout, (self.tile_n, self.head_dim))
        atom_v, tma_v = cpasync.make_tiled_tma_atom(load, mV, sK_layout, (self.tile_n, self.head_dim))
        # dK, dV: stored through shared memory by TMA, or (kv_accumulate) added in fp32
        # straight from registers into accumulators that several query heads share.
        atom_dk, tma_dk, atom_dv, tma_dv = None, mdK, None, mdV
        if cutlass.const_expr(not self.config.kv_accumulate):
            atom_dk, tma_dk = cpasync.make_tiled_tma_atom(store, mdK, sK_layout, (self.tile_n, self.head_dim))
            atom_dv, tma_dv = cpasync.make_tiled_tma_atom(store, mdV, sK_layout, (self.tile_n, self.head_dim))
        row_bytes = cute.size_in_bytes(Float32, row_layout)
        self.q_bytes = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1])) + row_bytes
        self.kv_bytes = 2 * cute.size_in_bytes(self.dtype, sK_layout)

        self.kernel(
            tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, tma_lse, tma_delta, mdQAccum, mdQCounters, mdKVTurns, mdQReady,
            atom_q, atom_k, atom_v, atom_do, atom_dk, atom_dv, atom_lse, atom_delta,
            softmax_scale,
            # Query heads per kv head, divided on the host: a kernel argument is a uniform
            # value, as the kv_group_in_cta walks' loop bound should be (the quotient
            # computed in the kernel took a register, spilled at head dim 64 staggered).
            cute.size(mQ.shape[2]) // cute.size(mK.shape[2]),
            sQ_layout, sdO_layout, sK_layout, sdS_layout, sdQ_layout,
            tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq,
            self.shared_storage(sQ_layout, sdO_layout, sK_layout, sdS_layout, sdQ_layout),
        ).launch(
            grid=(self.grid_key_blocks(mK), self.grid_heads(mQ, mK), cute.size(mQ.shape[3])),
            block=[self.budget.threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    def grid_key_blocks(self, mK: cute.Tensor):
        """The grid's key-block axis: a CTA per key block, or (mirror_pairs) per pair."""
        key_blocks = cute.ceil_div(cute.size(mK.shape[0]), self.tile_n)
        if cutlass.const_expr(self.config.mirror_pairs):
            return cute.ceil_div(key_blocks, 2)
        return key_blocks

    def grid_heads(self, mQ: cute.Tensor, mK: cute.Tensor):
        """The grid's head axis: a CTA per query head, or (kv_group_in_cta) per kv head."""
        if cutlass.const_expr(self.config.kv_group_in_cta):
            return cute.size(mK.shape[2])
        return cute.size(mQ.shape[2])

    def shared_storage(self, sQ_layout, sdO_layout, sK_layout, sdS_layout, sdQ_layout) -> Type:
        def buffer(layout, dtype=self.dtype):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], SMEM_ALIGN_BYTES]

        def rows(stages: int):
            floats = self.config.row_stage_bytes // FP32_BYTES * stages
            return cute.struct.Align[cute.struct.MemRange[Float32, floats], TMA_SMEM_ALIGN_BYTES]

        fields = {
            "kv_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(1)],
            "q_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(self.config.q_stages)],
            "do_barriers": cute.struct.MemRange[cutlass.Int64, barrier_words(self.config.do_stages)],
            "sK": buffer(sK_layout),
            "sV": buffer(sK_layout),
            "sQ": buffer(sQ_layout),
            "sdO": buffer(sdO_layout),
            "sdS": buffer(sdS_layout),
            "sdQ": buffer(sdQ_layout, Float32),
            "sLSE": rows(self.config.q_stages),
            "sD": rows(self.config.do_stages),
        }
        if self.split:
            # Pᵀ, keys x queries like dSᵀ: the head-dim split's dV GEMM reads it here.
            fields["sP"] = buffer(sdS_layout)
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def row_ring_layout(self, stages: int) -> cute.Layout:
        """An LSE or D ring: ``stages`` of ``tile_m`` values, each stage TMA-aligned."""
        return cute.make_layout((self.tile_m, stages), stride=(1, self.config.row_stage_bytes // FP32_BYTES))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSELog2: cute.Tensor,
        mD: cute.Tensor,
        mdQAccum: cute.Tensor,
        mdQCounters: Optional[cute.Tensor],
        mdKVTurns: Optional[cute.Tensor],
        mdQReady: Optional[cute.Tensor],
        atom_q: cute.CopyAtom,
        atom_k: cute.CopyAtom,
        atom_v: cute.CopyAtom,
        atom_do: cute.CopyAtom,
        atom_dk: Optional[cute.CopyAtom],
        atom_dv: Optional[cute.CopyAtom],
        atom_lse: cute.CopyAtom,
        atom_delta: cute.CopyAtom,
        softmax_scale: Float32,
        heads_per_kv_head: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(mdQReady is not None):
            # The postprocess may be scheduled once every CTA of this grid has started: it
            # then waits per head (DQStoreWarp.signal_ready), and only takes SMs this grid has left.
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.config.deterministic and self.causal):
            # Key blocks last to first (see bwd_blocks.dq_turn_rank).
            n_block = cute.ceil_div(mK.shape[0], self.tile_n) - 1 - n_block
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        rings = BackwardRings(
            kv=make_tma_ring(storage.kv_barriers.data_ptr(), 1, self.kv_bytes, self.consumer_threads),
            q=make_tma_ring(storage.q_barriers.data_ptr(), self.config.q_stages, self.q_bytes, self.consumer_threads),
            do=make_tma_ring(storage.do_barriers.data_ptr(), self.config.do_stages, self.q_bytes, self.consumer_threads),
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sLSE=storage.sLSE.get_tensor(self.row_ring_layout(self.config.q_stages)),
            sD=storage.sD.get_tensor(self.row_ring_layout(self.config.do_stages)),
        )
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sP = storage.sP.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner) if self.split else None
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        finish_init()

        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        m_begin, m_end = query_block_range(n_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal)
        heads = QueryHeads(head, 1, batch)
        if cutlass.const_expr(self.config.kv_group_in_cta):
            heads = QueryHeads(head * heads_per_kv_head, heads_per_kv_head, batch)
        if warp_idx < THREADS_PER_WARPGROUP // THREADS_PER_WARP:
            cute.arch.setmaxregister_decrease(self.budget.producer)
            if warp_idx == 0:
                loads = BackwardLoads(mQ, mK, mV, mdO, mLSELog2, mD, atom_q, atom_k, atom_v, atom_do, atom_lse, atom_delta)
                kv_state = producer_state(1)
                q_state = producer_state(self.config.q_stages)
                do_state = producer_state(self.config.do_stages)
                kv_state, q_state, do_state = self.produce(loads, rings, heads, n_block, m_begin, m_end, kv_state,
                                                           q_state, do_state)
                if cutlass.const_expr(self.config.mirror_pairs):
                    mirror, begin, end = self.mirror_walk(n_block, seqlen_q, seqlen_k)
                    if mirror > n_block:
                        self.produce(loads, rings, heads, mirror, begin, end, kv_state, q_state, do_state)
            if warp_idx == DQ_STORE_WARP:
                dq_out = DQOutputs(sdQ, mdQAccum, mdQCounters, mdQReady)
                self.store_key_block(dq_out, heads, seqlen_q, seqlen_k, n_block, m_begin, m_end)
                if cutlass.const_expr(self.config.mirror_pairs):
                    mirror, begin, end = self.mirror_walk(n_block, seqlen_q, seqlen_k)
                    if mirror > n_block:
                        self.store_key_block(dq_out, heads, seqlen_q, seqlen_k, mirror, begin, end)
        else:
            cute.arch.setmaxregister_increase(self.budget.consumer)
            tidx = cute.arch.thread_idx()[0] - THREADS_PER_WARPGROUP
            group = mQ.shape[2] // mK.shape[2]
            kv_head = heads.first // group
            block = KeyBlock(n_block, heads.first, kv_head, heads.first - kv_head * group, batch, seqlen_q, seqlen_k)
            ops = self.consumer_operands(tiled_mma_sdp, tiled_mma_dkv, tiled_mma_dq, rings, sdS, sP, tidx)
            kv_out = KVOutputs(mdK, mdV, atom_dk, atom_dv, mdKVTurns)
            self.consume(ops, rings, sdQ, kv_out, softmax_scale, block, heads.count, m_begin, m_end, tidx)

    def mirror_walk(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """mirror_pairs: the key block walked after ``n_block``, and its query blocks."""
        mirror = mirror_block(n_block, cute.ceil_div(seqlen_k, self.tile_n))
        return (mirror, *query_block_range(mirror, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal))

    @cute.jit
    def store_key_block(self, dq_out: DQOutputs, heads: QueryHeads, seqlen_q: Int32, seqlen_k: Int32, n_block: Int32,
                        m_begin: Int32, m_end: Int32):
        """The store warp's work for one key block: each walked head's dQ, then the
        postprocess's count."""
        store_warp = DQStoreWarp(self.config, self.rotate)
        walk = (n_block, seqlen_q, seqlen_k, m_begin, m_end)
        if cutlass.const_expr(self.config.kv_group_in_cta):
            for g in cutlass.range(heads.count, unroll=1):
                self.store_dq(store_warp, dq_out, heads.first + g, heads.batch, *walk, signal=False)
            # Counted once every walk is done: between two walks the wait for the
            # landing would hold back the next head's first dQ hand-over.
            if cutlass.const_expr(dq_out.mdQReady is not None):
                self.signal_walks(dq_out.mdQReady, heads)
        else:
            self.store_dq(store_warp, dq_out, heads.first, heads.batch, *walk, signal=True)

    @cute.jit
    def signal_walks(self, mdQReady: cute.Tensor, heads: QueryHeads):
        """kv_group_in_cta, the store warp: count this key block for each walked head's
        postprocess."""
        for g in cutlass.range(heads.count, unroll=1):
            DQStoreWarp(self.config, self.rotate).signal_ready(mdQReady, heads.first + g, heads.batch)

    @cute.jit
    def store_dq(self, store_warp: DQStoreWarp, dq_out: DQOutputs, head: Int32, batch: Int32, n_block: Int32,
                 seqlen_q: Int32, seqlen_k: Int32, m_begin: Int32, m_end: Int32, signal: cutlass.Constexpr[bool]):
        """The store warp's work for one query head's walk over this key block; with
        ``signal``, its count for the postprocess after it."""
        dq_counters = None
        if cutlass.const_expr(dq_out.mdQCounters is not None):
            dq_counters = dq_out.mdQCounters[None, head, batch]
        reduction = DQReduction(dq_out.sdQ, dq_out.mdQAccum[None, None, head, batch], dq_counters)
        store_warp.run(reduction, n_block, seqlen_q, seqlen_k, m_begin, m_end)
        if cutlass.const_expr(signal and dq_out.mdQReady is not None):
            store_warp.signal_ready(dq_out.mdQReady, head, batch)

    # ------------------------------------------------------------------ producer
    @cute.jit
    def produce(
        self, loads: BackwardLoads, rings: BackwardRings, heads: QueryHeads, n_block: Int32, m_begin: Int32,
        m_end: Int32, kv_state, q_state, do_state,
    ):
        """The producer's loads for one key block: its K and V, then each walked head's
        query blocks; returns the rings' states after them."""
        rings.kv.producer_acquire(kv_state)
        kv_head = heads.first // (loads.mQ.shape[2] // loads.mK.shape[2])
        gK, gV = (t[None, None, kv_head, heads.batch] for t in (loads.mK, loads.mV))
        self.load_tile(loads.atom_k, rings.sK, gK, self.tile_n, n_block, rings.kv, kv_state)
        self.load_tile(loads.atom_v, rings.sV, gV, self.tile_n, n_block, rings.kv, kv_state)
        key_blocks = cute.ceil_div(loads.mK.shape[0], self.tile_n)
        walk = (loads, rings, n_block, key_blocks)
        if cutlass.const_expr(self.config.kv_group_in_cta):
            for g in cutlass.range(heads.count, unroll=1):
                q_state, do_state = self.load_walk(*walk, heads.first + g, heads.batch, m_begin, m_end, q_state,
                                                   do_state)
        else:
            q_state, do_state = self.load_walk(*walk, heads.first, heads.batch, m_begin, m_end, q_state, do_state)
        kv_state.advance()
        return kv_state, q_state, do_state

    @cute.jit
    def load_walk(self, loads: BackwardLoads, rings: BackwardRings, n_block: Int32, key_blocks: Int32, head: Int32,
                  batch: Int32, m_begin: Int32, m_end: Int32, q_state, do_state):
        """One query head's Q, dO, LSE and D tiles for this key block's walk; returns the
        rings' states after them."""
        gQ, gdO = (t[None, None, head, batch] for t in (loads.mQ, loads.mdO))
        gLSE, gD = (t[None, head, batch] for t in (loads.mLSELog2, loads.mD))
        for step in cutlass.range(m_begin, m_end, unroll=1):
            m_block = query_block_at(step, n_block, m_end, key_blocks, self.rotate)
            rings.q.producer_acquire(q_state)
            self.load_tile(loads.atom_q, rings.sQ[None, None, q_state.index], gQ, self.tile_m, m_block, rings.q, q_state)
            self.load_rows(loads.atom_lse, rings.sLSE[None, q_state.index], gLSE, m_block, rings.q, q_state)
            q_state.advance()
            rings.do.producer_acquire(do_state)
            self.load_tile(loads.atom_do, rings.sdO[None, None, do_state.index], gdO, self.tile_m, m_block, rings.do,
                           do_state)
            self.load_rows(loads.atom_delta, rings.sD[None, do_state.index], gD, m_block, rings.do, do_state)
            do_state.advance()
        return q_state, do_state

    @cute.jit
    def load_tile(self, atom, smem, gmem, rows: int, block: Int32, ring, state):
        """TMA of the (rows, head_dim) tile ``block`` of ``gmem`` into ``smem``, counted on
        ``ring``'s barrier at ``state`` (acquired by the caller)."""
        s_tile, g_tile = tma_tile(atom, smem, gmem, (rows, self.head_dim), block)
        cute.copy(atom, g_tile, s_tile, tma_bar_ptr=ring.producer_get_barrier(state))

    @cute.jit
    def load_rows(self, atom, smem, gmem, block: Int32, ring, state):
        """TMA of the ``tile_m`` per-row values of query block ``block`` of ``gmem``."""
        tiles = cute.local_tile(gmem, (self.tile_m,), (block,))
        s_tile, g_tile = cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 1), cute.group_modes(tiles, 0, 1)
        )
        cute.copy(atom, g_tile, s_tile, tma_bar_ptr=ring.producer_get_barrier(state))

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(
        self, ops: BackwardOperands, rings: BackwardRings, sdQ: cute.Tensor, kv_out: KVOutputs,
        softmax_scale: Float32, block: KeyBlock, heads_walked, m_begin: Int32, m_end: Int32, tidx: Int32,
    ):
        """A consumer thread: every query block's GEMMs for this key block (of each query
        head it walks, from ``block.head`` on), then dK, dV; with mirror_pairs, the same
        for the mirror key block."""
        scale_log2 = softmax_scale * math.log2(math.e)
        kv_state = consumer_state(1)
        q_state = consumer_state(self.config.q_stages)
        do_state = consumer_state(self.config.do_stages)
        consume = (ops, rings, sdQ, kv_out, softmax_scale, scale_log2, heads_walked, tidx)
        if cutlass.const_expr(self.config.mirror_pairs):
            kv_state, q_state, do_state = self.consume_key_block(
                *consume, block, m_begin, m_end, Int32(0), kv_state, q_state, do_state
            )
            mirror, begin, end = self.mirror_walk(block.n_block, block.seqlen_q, block.seqlen_k)
            if mirror > block.n_block:
                mirrored = KeyBlock(mirror, block.head, block.kv_head, block.rank_in_group, block.batch,
                                    block.seqlen_q, block.seqlen_k)
                # The dSᵀ buffers take turns on from where the first block's walks left them.
                ds_offset = heads_walked * (m_end - m_begin) + m_begin - begin
                self.consume_key_block(*consume, mirrored, begin, end, ds_offset, kv_state, q_state, do_state)
        else:
            self.consume_key_block(*consume, block, m_begin, m_end, None, kv_state, q_state, do_state)

    @cute.jit
    def consume_key_block(
        self, ops: BackwardOperands, rings: BackwardRings, sdQ: cute.Tensor, kv_out: KVOutputs,
        softmax_scale: Float32, scale_log2: Float32, heads_walked, tidx: Int32, block: KeyBlock, m_begin: Int32,
        m_end: Int32, ds_offset: Optional[Int32], kv_state, q_state, do_state,
    ):
        """One key block: its walks, then its dK and dV; returns the rings' states after
        it. ``ds_offset``: added to each step's index to pick its dSᵀ buffer (mirror_pairs;
        None: nothing), so that they keep taking turns after an earlier block's walks."""
        if cutlass.const_expr(self.config.mirror_pairs):
            ops.acc_dv.fill(0.0)
            ops.acc_dk.fill(0.0)
        rings.kv.consumer_wait(kv_state)
        masked_end = masked_block_end(
            block.n_block, m_begin, m_end, block.seqlen_q, block.seqlen_k, self.tile_m, self.tile_n, self.causal
        )
        walk = (ops, rings, sdQ, m_begin, masked_end, m_end, scale_log2, tidx)
        if cutlass.const_expr(self.config.kv_group_in_cta):
            for g in cutlass.range(heads_walked, unroll=1):
                head_block = KeyBlock(
                    block.n_block, block.head + g, block.kv_head, g, block.batch, block.seqlen_q, block.seqlen_k
                )
                # The dSᵀ buffers keep taking turns from one head's walk to the next.
                offset = g * (m_end - m_begin)
                if cutlass.const_expr(ds_offset is not None):
                    offset = offset + ds_offset
                q_state, do_state = self.walk(*walk, head_block, offset, q_state, do_state)
        else:
            q_state, do_state = self.walk(*walk, block, ds_offset, q_state, do_state)
        # dK and dV: of the kv head, which the walks' query heads share.
        self.epilogue(ops, softmax_scale, rings, kv_out, block, tidx)
        if cutlass.const_expr(self.config.mirror_pairs):
            # Each thread is done with K's and V's buffers: its GEMMs have completed, and
            # thread 0 arrives once the TMA store of dK and dV has read them.
            rings.kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state, q_state, do_state

    @cute.jit
    def walk(self, ops: BackwardOperands, rings: BackwardRings, sdQ: cute.Tensor, m_begin: Int32, masked_end: Int32,
             m_end: Int32, scale_log2: Float32, tidx: Int32, block: KeyBlock, ds_offset: Optional[Int32], q_state,
             do_state):
        """One query head's walk over the query blocks that see this key block, the masked
        ones first; returns the rings' states after it. ``ds_offset``: added to each step's
        index to pick its dSᵀ buffer (None: nothing), so that they keep taking turns after
        earlier walks."""
        key_blocks = cute.ceil_div(block.seqlen_k, self.tile_n)
        parts = ((m_begin, masked_end, True), (masked_end, m_end, False))
        for part in cutlass.range_constexpr(len(parts)):
            begin, end, masked = parts[part]
            for step in cutlass.range(begin, end, unroll=1):
                m_block = query_block_at(step, block.n_block, m_end, key_blocks, self.rotate)
                self.step(ops, rings, q_state, do_state, sdQ, block, m_block, self.ds_stage(step, ds_offset),
                          scale_log2, tidx, masked, step == m_begin)
                q_state.advance()
                do_state.advance()
        if cutlass.const_expr(self.staggered):
            if ops.warpgroup_idx == 0:
                if m_end > m_begin:
                    # The walk's last dQ of warpgroup 0, one step late like the others.
                    self.wait_ds_written(1)
                    acc_dq = cute.make_rmem_tensor(ops.dq_shape, Float32)
                    stage = self.ds_stage(m_end - 1, ds_offset)
                    self.dq_gemm(ops, acc_dq, stage)
                    warpgroup.wait_group(0)
                    self.write_dq(ops, acc_dq, sdQ)
                    self.publish_dq(ops)
        return q_state, do_state

    def ds_stage(self, step: Int32, ds_offset: Optional[Int32]) -> Int32:
        """The dSᵀ buffer of a walk's step: they take turns by step (not by query block,
        which a rotated walk wraps), from ``ds_offset`` on (None: 0)."""
        if cutlass.const_expr(ds_offset is not None):
            step = step + ds_offset
        return step % self.ds_stages

    def wait_ds_written(self, writer: int) -> None:
        """Staggered: sync until warpgroup ``writer`` has written its rows of the next
        query block's dSᵀ tile in order (and fenced them for the wgmma's reads)."""
        cute.arch.barrier(barrier_id=int(NamedBarrier.DS_WRITTEN_0) + writer, number_of_threads=self.consumer_threads)

    @cute.jit
    def consumer_operands(
        self, tiled_mma_sdp: cute.TiledMma, tiled_mma_dkv: cute.TiledMma, tiled_mma_dq: cute.TiledMma,
        rings: BackwardRings, sdS: cute.Tensor, sP: Optional[cute.Tensor], tidx: Int32,
    ) -> BackwardOperands:
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)
        wg_threads = cute.make_layout(self.config.consumer_warpgroups, stride=THREADS_PER_WARPGROUP)
        wg_sdp = tiled_mma_sdp.get_slice(wg_threads(warpgroup_idx))
        wg_dkv = tiled_mma_dkv.get_slice(wg_threads(warpgroup_idx))
        d, tile_m, tile_n = self.head_dim, self.tile_m, self.tile_n
        sQ, sK, sV, sdO = rings.sQ, rings.sK, rings.sV, rings.sdO
        wg_dq = tiled_mma_dq.get_slice(wg_threads(warpgroup_idx))
        # Transposed views (B operands read with head_dim contiguous, dQ's A operand with
        # queries contiguous): the same swizzled bytes in another index order.
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tile_m, self.config.q_stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((d, tile_m, self.config.do_stages), order=(1, 0, 2)))
        sKt = cute.composition(sK, cute.make_ordered_layout((d, tile_n), order=(1, 0)))
        sdSt = cute.composition(sdS, cute.make_ordered_layout((tile_m, tile_n, self.ds_stages), order=(1, 0, 2)))
        acc_dv = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tile_n, d)), Float32)
        acc_dk = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tile_n, d)), Float32)
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        return BackwardOperands(
            tiled_mma_sdp=tiled_mma_sdp,
            tiled_mma_dkv=tiled_mma_dkv,
            tiled_mma_dq=tiled_mma_dq,
            tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(sK)),
            tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(sQ)),
            tdPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(sV)),
            tdPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(sdO)),
            tdVrdO=wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt)),
            tdKrQ=wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt)),
            tdQrdS=(wg_dq.make_fragment_B(wg_dq.partition_B(sdSt)) if self.config.dq_transposed
                    else wg_dq.make_fragment_A(wg_dq.partition_A(sdSt))),
            tdQrK=(wg_dq.make_fragment_A(wg_dq.partition_A(sKt)) if self.config.dq_transposed
                   else wg_dq.make_fragment_B(wg_dq.partition_B(sKt))),
            st_shape=wg_sdp.partition_shape_C((tile_n, tile_m)),
            dq_shape=wg_dq.partition_shape_C((d, tile_m) if self.config.dq_transposed else (tile_m, d)),
            pt=wg_dkv.make_fragment_A(wg_dkv.partition_A(sP) if self.split else wg_dkv.partition_shape_A((tile_n, tile_m))),
            dst=wg_dkv.make_fragment_A(wg_dkv.partition_A(sdS) if self.split else wg_dkv.partition_shape_A((tile_n, tile_m))),
            acc_dv=acc_dv,
            acc_dk=acc_dk,
            st_coords=tiled_mma_sdp.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_n, tile_m))),
            store_ds=cute.make_tiled_copy_C(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32), tiled_mma_sdp
            ).get_slice(tidx),
            sdS=sdS,
            sP=sP,
            # Pairs of adjacent fp32 columns as one 8-byte store (transposed: none here, see
            # write_registers_in_order).
            store_dq=None if self.config.dq_transposed else cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64), tiled_mma_dq
            ).get_slice(tidx),
            warpgroup_idx=warpgroup_idx,
        )

    @cute.jit
    def step(
        self,
        ops: BackwardOperands,
        rings: BackwardRings,
        q_state,
        do_state,
        sdQ: cute.Tensor,
        block: KeyBlock,
        m_block: Int32,
        ds_stage: Int32,
        scale_log2: Float32,
        tidx: Int32,
        masked: cutlass.Constexpr[bool],
        first: cutlass.Boolean,
    ):
        """One query block: Sᵀ and dPᵀ, then P and dS, then the dV, dK and dQ GEMMs.
        ``ds_stage``: the dSᵀ buffer (see ``ds_stage()``); ``first``: the walk's first step."""
        self.p_and_ds(ops, rings, q_state, do_state, block, m_block, ds_stage, scale_log2, masked, first)
        acc_dq = cute.make_rmem_tensor(ops.dq_shape, Float32)
        if cutlass.const_expr(self.split):
            # One Q and one dO stage: each is freed as soon as its last GEMM is done, so the
            # next block's tiles load under the rest of this one.
            warpgroup_gemm(
                ops.tiled_mma_dkv, ops.acc_dk, ops.dst[None, None, None, ds_stage], ops.tdKrQ[None, None, None, q_state.index],
                False,
            )
            warpgroup_gemm(
                ops.tiled_mma_dkv, ops.acc_dv, ops.pt[None, None, None, ds_stage], ops.tdVrdO[None, None, None, do_state.index],
                False,
            )
            self.dq_gemm(ops, acc_dq, ds_stage)
            warpgroup.wait_group(2)
            rings.q.consumer_release(q_state)
            warpgroup.wait_group(1)
            rings.do.consumer_release(do_state)
            warpgroup.wait_group(0)
            self.write_dq(ops, acc_dq, sdQ)
            self.publish_dq(ops)
        else:
            dq_stage, dq_due = ds_stage, True
            if cutlass.const_expr(self.staggered):
                # Warpgroup 0 computes the previous block's dQ. On a walk's first step there is
                # none: it still runs the GEMM, on a buffer no one writes during it, and drops
                # the result (a wgmma under a branch would serialise them all in ptxas).
                dq_stage = (ds_stage + self.ds_stages - 1 + ops.warpgroup_idx) % self.ds_stages
                dq_due = (ops.warpgroup_idx != 0) | (not first)
            # dQ before dK, so that dQ's way out overlaps the dK GEMM.
            if cutlass.const_expr(self.config.dq_transposed):
                # dV done: its accumulator's registers stay, Pᵀ's are free for dQᵀ's.
                warpgroup.wait_group(0)
            self.dq_gemm(ops, acc_dq, dq_stage)
            warpgroup_gemm(ops.tiled_mma_dkv, ops.acc_dk, ops.dst, ops.tdKrQ[None, None, None, q_state.index], False)
            # dQ done, and with it dV, the last reader of dO (groups complete in order).
            warpgroup.wait_group(1)
            rings.do.consumer_release(do_state)
            if dq_due:
                self.write_dq(ops, acc_dq, sdQ)
                self.publish_dq(ops)
            warpgroup.wait_group(0)
            rings.q.consumer_release(q_state)

    @cute.jit
    def dq_gemm(self, ops: BackwardOperands, acc_dq: cute.Tensor, stage: Int32):
        """dQ = dS K into ``acc_dq`` from dSᵀ buffer ``stage`` (dq_transposed: dQᵀ = Kᵀ dSᵀ)."""
        ds = ops.tdQrdS[None, None, None, stage]
        if cutlass.const_expr(self.config.dq_transposed):
            warpgroup_gemm(ops.tiled_mma_dq, acc_dq, ops.tdQrK, ds, True)
        else:
            warpgroup_gemm(ops.tiled_mma_dq, acc_dq, ds, ops.tdQrK, True)

    @cute.jit
    def probabilities(
        self, ops: BackwardOperands, acc_st: cute.Tensor, sLSE: cute.Tensor, q_state, block: KeyBlock,
        m_block: Int32, scale_log2: Float32, masked: cutlass.Constexpr[bool],
    ):
        """Sᵀ into Pᵀ = exp2(Sᵀ · scale · log2(e) − lse_log2) in place, masked keys 0. Each
        column's statistic is read from shared memory where it is used: holding all of this
        thread's columns in registers spilled 250-320 bytes at head dim 64, whose query
        blocks are 128 wide."""
        c = acc_rows_cols(ops.st_coords)
        st = acc_rows_cols(acc_st)
        for j in cutlass.range_constexpr(cute.size(c, mode=[1])):
            lse_log2_j = sLSE[c[0, j][1], q_state.index]
            for i in cutlass.range_constexpr(cute.size(st, mode=[0])):
                key = block.n_block * self.tile_n + c[i, 0][0]
                score = st[i, j]
                if cutlass.const_expr(masked):
                    last_key = block.seqlen_k - 1
                    if cutlass.const_expr(self.causal):
                        query = m_block * self.tile_m + c[i, j][1]
                        last_key = cutlass.min(last_key, query + block.seqlen_k - block.seqlen_q)
                    score = score if key <= last_key else -Float32.inf
                st[i, j] = cute.math.exp2(score * scale_log2 - lse_log2_j, fastmath=True)

    @cute.jit
    def p_and_ds(
        self, ops: BackwardOperands, rings: BackwardRings, q_state, do_state, block: KeyBlock, m_block: Int32,
        ds_stage: Int32, scale_log2: Float32, masked: cutlass.Constexpr[bool], first: cutlass.Boolean,
    ):
        """Sᵀ and dPᵀ of this warpgroup's keys (or, head-dim split, queries), Pᵀ and dSᵀ;
        dV's GEMM issued from registers (keys) or Pᵀ and dSᵀ in shared memory (split)."""
        if cutlass.const_expr(self.staggered):
            if ops.warpgroup_idx == 1:
                # Half a step behind: this block's dSᵀ rows of warpgroup 0 are written.
                self.wait_ds_written(0)
        rings.q.consumer_wait(q_state)
        acc_st = cute.make_rmem_tensor(ops.st_shape, Float32)
        warpgroup_gemm(ops.tiled_mma_sdp, acc_st, ops.tSrK, ops.tSrQ[None, None, None, q_state.index], True)
        rings.do.consumer_wait(do_state)
        acc_dpt = cute.make_rmem_tensor(ops.st_shape, Float32)
        warpgroup_gemm(ops.tiled_mma_sdp, acc_dpt, ops.tdPrV, ops.tdPrdO[None, None, None, do_state.index], True)

        # Pᵀ once Sᵀ is done, while dPᵀ still runs.
        warpgroup.wait_group(1)
        self.probabilities(ops, acc_st, rings.sLSE, q_state, block, m_block, scale_log2, masked)
        st = acc_rows_cols(acc_st)
        c = acc_rows_cols(ops.st_coords)
        if cutlass.const_expr(not self.split):
            convert_packed(acc_as_a_operand(acc_st), ops.pt)

        warpgroup.wait_group(0)
        dpt = acc_rows_cols(acc_dpt)
        for j in cutlass.range_constexpr(cute.size(c, mode=[1])):
            delta_j = rings.sD[c[0, j][1], do_state.index]
            for i in cutlass.range_constexpr(cute.size(dpt, mode=[0])):
                dpt[i, j] = st[i, j] * (dpt[i, j] - delta_j)

        # dSᵀ (and, head-dim split, Pᵀ) to shared memory: the dQ GEMM reads all keys of
        # dSᵀ, the split's dV and dK GEMMs all queries of Pᵀ and dSᵀ. Two buffers take
        # turns: the GEMMs of the block before last, whose buffer this one reuses, are done
        # in both warpgroups, as each waited for its own before the last DS_TILE barrier
        # (staggered: the other's GEMM on it was done before the arrival the writer last
        # waited for). After the writes, the wgmma (async proxy) reads what stmatrix
        # (generic proxy) wrote.
        if cutlass.const_expr(self.split):
            for acc, smem in ((acc_st, ops.sP), (acc_dpt, ops.sdS)):
                packed = cute.make_rmem_tensor_like(acc, self.dtype)
                convert_packed(acc, packed)
                cute.copy(ops.store_ds, ops.store_ds.retile(packed), ops.store_ds.partition_D(smem[None, None, ds_stage]))
        else:
            convert_packed(acc_as_a_operand(acc_dpt), ops.dst)
            warpgroup_gemm(ops.tiled_mma_dkv, ops.acc_dv, ops.pt, ops.tdVrdO[None, None, None, do_state.index], False)
            # The packed dSᵀ of the dK GEMM, seen as an accumulator, is what stmatrix stores:
            # no second conversion, no second copy in registers.
            ds_acc = a_operand_as_acc(ops.dst, acc_dpt)
            if cutlass.const_expr(self.staggered):
                if ops.warpgroup_idx == 0:
                    if not first:
                        # The previous block's rows of warpgroup 1 are written, so its dQ GEMM
                        # of the block before, the last reader of this buffer, is done.
                        self.wait_ds_written(1)
            cute.copy(ops.store_ds, ops.store_ds.retile(ds_acc), ops.store_ds.partition_D(ops.sdS[None, None, ds_stage]))
        cute.arch.fence_view_async_shared()
        if cutlass.const_expr(self.staggered):
            cute.arch.barrier_arrive(
                barrier_id=int(NamedBarrier.DS_WRITTEN_0) + ops.warpgroup_idx, number_of_threads=self.consumer_threads
            )
        else:
            cute.arch.barrier(barrier_id=int(NamedBarrier.DS_TILE), number_of_threads=self.consumer_threads)

    @cute.jit
    def write_dq(self, ops: BackwardOperands, acc_dq: cute.Tensor, sdQ: cute.Tensor):
        """This thread's dQ into its warpgroup's part (columns, or rows) of the shared-memory
        tile, seen whole: (tile_m, head_dim); transposed, its registers in order."""
        # The TMA engine has read this part's previous dQ (the store warp's arrive).
        cute.arch.barrier(
            barrier_id=int(NamedBarrier.DQ_EMPTY_0) + ops.warpgroup_idx, number_of_threads=DQ_HANDOFF_THREADS
        )
        if cutlass.const_expr(self.config.dq_transposed):
            self.write_registers_in_order(acc_dq, sdQ[None, None, ops.warpgroup_idx])
        else:
            tile = cute.group_modes(sdQ, 1, 3)
            if cutlass.const_expr(self.config.dq_rows):
                # smem holds (rows of a part, head_dim, part); the view's row r is row r % 64 of part r // 64.
                rows, parts = self.tile_m // self.config.consumer_warpgroups, self.config.consumer_warpgroups
                tile = cute.composition(
                    sdQ, cute.make_layout(((rows, parts), self.head_dim), stride=((1, rows * self.head_dim), rows))
                )
            cute.copy(ops.store_dq, ops.store_dq.retile(acc_dq), ops.store_dq.partition_D(tile))

    @cute.jit
    def write_registers_in_order(self, acc: cute.Tensor, part: cute.Tensor):
        """A warpgroup's accumulator into its ``part`` of the tile as its threads hold it:
        register i of thread t at (i // 4) * 512 + 4 t + i % 4 (configs.accumulator_register_offset),
        so a warp's 16-byte stores fill 512 contiguous bytes, the fewest wavefronts a store
        takes. The copy is made here, from the thread's index read here: made once before
        the loops (in BackwardOperands), its offsets held registers and at 80 rows ptxas
        spilled 8 bytes."""
        store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_layout(THREADS_PER_WARPGROUP),
            cute.make_layout(FP32_PER_VECTOR),
        ).get_slice(cute.arch.thread_idx()[0] % THREADS_PER_WARPGROUP)
        slots = store.partition_D(cute.make_tensor(part.iterator, cute.make_layout(cute.size(part))))
        cute.copy(store, cute.make_tensor(acc.iterator, cute.make_layout(slots.shape)), slots)

    @cute.jit
    def publish_dq(self, ops: BackwardOperands):
        """Hand the part write_dq wrote over to the store warp (kernels/dq_store_warp.py),
        which issues its bulk reduction; the TMA engine (async proxy) reads what the threads
        (generic proxy) wrote."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier_arrive(
            barrier_id=int(NamedBarrier.DQ_FULL_0) + ops.warpgroup_idx, number_of_threads=DQ_HANDOFF_THREADS
        )

    @staticmethod
    def add_pair(address, pair: cute.Tensor) -> None:
        """Atomically add two adjacent fp32 values into global memory (8-byte aligned)."""
        cute.arch.red(address, pair.load().ir_value(), op="add", dtype="f32", sem="relaxed", scope="gpu")

    # ------------------------------------------------------------------ epilogue
    @cute.jit
    def epilogue(self, ops: BackwardOperands, softmax_scale: Float32, rings: BackwardRings, kv_out: KVOutputs,
                 block: KeyBlock, tidx: Int32):
        """dK (times the softmax scale) and dV: stored, or added into shared accumulators
        (deterministic: by the query heads of a group in head order)."""
        if cutlass.const_expr(self.config.kv_accumulate):
            turn = None
            if cutlass.const_expr(kv_out.mdKVTurns is not None):
                turn = kv_out.mdKVTurns[None, block.kv_head, block.batch].iterator + block.n_block
                if tidx == 0:
                    wait_for_turn(turn, block.rank_in_group)
                cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.consumer_threads)
            coords = ops.tiled_mma_dkv.get_slice(tidx).partition_C(
                cute.make_identity_tensor((self.tile_n, self.head_dim))
            )
            dk_rows = kv_out.mdK[None, None, block.kv_head, block.batch]
            dv_rows = kv_out.mdV[None, None, block.kv_head, block.batch]
            pair = cute.make_rmem_tensor(2, Float32)
            for i in cutlass.range_constexpr(cute.size(ops.acc_dk) // 2):
                key, col = coords[2 * i]
                key = block.n_block * self.tile_n + key
                if key < block.seqlen_k:
                    pair[0] = ops.acc_dk[2 * i] * softmax_scale
                    pair[1] = ops.acc_dk[2 * i + 1] * softmax_scale
                    self.add_pair(dk_rows.iterator + cute.crd2idx((key, col), dk_rows.layout), pair)
                    pair[0] = ops.acc_dv[2 * i]
                    pair[1] = ops.acc_dv[2 * i + 1]
                    self.add_pair(dv_rows.iterator + cute.crd2idx((key, col), dv_rows.layout), pair)
            if cutlass.const_expr(kv_out.mdKVTurns is not None):
                # Every thread's additions are performed before the one thread passes the
                # turn (its release covers what the barrier ordered before it).
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.consumer_threads)
                if tidx == 0:
                    pass_turn(turn)
        else:
            self.store_dkv(ops, softmax_scale, rings.sK, rings.sV, kv_out, block, tidx)

    @cute.jit
    def store_dkv(self, ops: BackwardOperands, softmax_scale: Float32, sK: cute.Tensor, sV: cute.Tensor,
                  kv_out: KVOutputs, block: KeyBlock, tidx: Int32):
        """dK and dV through K's and V's buffers, then TMA."""
        store = cute.make_tiled_copy_C(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32), ops.tiled_mma_dkv
        ).get_slice(tidx)
        dk = cute.make_rmem_tensor_like(ops.acc_dk, self.dtype)
        dk.store((ops.acc_dk.load() * softmax_scale).to(self.dtype))
        dv = cute.make_rmem_tensor_like(ops.acc_dv, self.dtype)
        dv.store(ops.acc_dv.load().to(self.dtype))
        # Every GEMM that read K and V has completed in this warpgroup; the barrier covers
        # the other one.
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.consumer_threads)
        cute.copy(store, store.retile(dk), store.partition_D(sK))
        cute.copy(store, store.retile(dv), store.partition_D(sV))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(NamedBarrier.EPILOGUE), number_of_threads=self.consumer_threads)
        if tidx == 0:
            tile = (self.tile_n, self.head_dim)
            # A CTA per query head stores dK and dV of its head (MHA); one walking a group, of
            # the group's kv head.
            head = block.kv_head if cutlass.const_expr(self.config.kv_group_in_cta) else block.head
            sdk, gdk = tma_tile(kv_out.atom_dk, sK, kv_out.mdK[None, None, head, block.batch], tile, block.n_block)
            cute.copy(kv_out.atom_dk, sdk, gdk)
            sdv, gdv = tma_tile(kv_out.atom_dv, sV, kv_out.mdV[None, None, head, block.batch], tile, block.n_block)
            cute.copy(kv_out.atom_dv, sdv, gdv)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
