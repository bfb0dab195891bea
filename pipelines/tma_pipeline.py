"""Shared-memory rings filled by TMA and drained by consumer warps, guarded by mbarriers.

Each stage of a ring has a *full* barrier (the producer thread arrives once and sets the
byte count it expects; the TMA engine completes it as the bytes land) and an *empty*
barrier (one lane of each consumer warp arrives when the warp is done reading).

    state           producer                         consumer
    -----           --------                         --------
    acquire(s)      wait empty[s] (phase), expect tx  -
    TMA copy        cp.async.bulk.tensor -> full[s]   -
    wait(s)         -                                 wait full[s] (phase)
    release(s)      -                                 arrive empty[s]  (1 per warp)
    advance         index+1, phase flips on wrap      index+1, phase flips on wrap

The mbarrier mechanics are CUTLASS's ``PipelineTmaAsync``; this module fixes how flash4
counts arrivals, checked at trace time so a wrong count fails compilation, not the GPU.
"""

from __future__ import annotations


import cutlass.cute as cute
import cutlass.pipeline as cpipe

from .warp_roles import THREADS_PER_WARP


def make_tma_ring(
    barriers: cute.Pointer, stages: int, tx_bytes: int, consumer_threads: int, multicast_ctas: int = 1,
    extra_producer_arrivals: int = 0,
) -> cpipe.PipelineTmaAsync:
    """A ring of ``stages`` buffers loaded by one TMA thread, read by ``consumer_threads``.

    PipelineTmaAsync lets only lane 0 of each consumer warp arrive on *empty*, so the
    arrive count is the number of consumer warps. With ``multicast_ctas`` > 1, every CTA of
    the cluster loads a share of each stage into all of them: a stage is free only when the
    consumers of every CTA are done with it, so lanes 0 .. multicast_ctas - 1 of each
    consumer warp arrive on the *empty* barrier of CTA (lane), and each *empty* counts
    consumer warps times CTAs. *full* still expects the whole stage's bytes.
    ``extra_producer_arrivals``: arrivals *full* waits for besides the TMA thread's, each
    made by the producer for values it copies some other way (pipelines/stage_scalars.py).
    """
    if consumer_threads % THREADS_PER_WARP:
        raise ValueError(f"consumer_threads={consumer_threads} is not a whole number of warps")
    if extra_producer_arrivals < 0:
        raise ValueError(f"extra_producer_arrivals={extra_producer_arrivals}: a count, at least 0")
    if stages < 1:
        raise ValueError(f"stages={stages}: a ring needs at least one stage")
    consumers = consumer_threads // THREADS_PER_WARP
    multicast = {}
    if multicast_ctas > 1:
        # The cluster's CTAs along one mode of (v, m, n, k), each stage multicast to all;
        # CUTLASS derives the arrive count from the consumer threads.
        consumers = consumer_threads
        multicast = dict(
            cta_layout_vmnk=cute.make_layout((1, multicast_ctas, 1, 1)),
            mcast_mode_mn=(0, 1),
            enable_multicast_signaling=True,
        )
    return cpipe.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, 1 + extra_producer_arrivals),
        consumer_group=cpipe.CooperativeGroup(cpipe.Agent.Thread, consumers),
        tx_count=tx_bytes,
        # The kernel fences and syncs once after initialising every ring.
        defer_sync=True,
        **multicast,
    )


def producer_state(stages: int) -> cpipe.PipelineState:
    """Producer's first state: phase 1, so the first pass does not wait on *empty*."""
    return cpipe.make_pipeline_state(cpipe.PipelineUserType.Producer, stages)


def consumer_state(stages: int) -> cpipe.PipelineState:
    return cpipe.make_pipeline_state(cpipe.PipelineUserType.Consumer, stages)


def barrier_words(stages: int) -> int:
    """mbarrier words a ring needs in shared memory: one full and one empty per stage."""
    return 2 * stages


def finish_init(cluster: bool = False) -> None:
    """Make the barriers' initialisation visible to every thread and the TMA engine, and,
    in a cluster, to the other CTAs, whose multicasts and arrivals reach these barriers."""
    cute.arch.mbarrier_init_fence()
    if cluster:
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
    else:
        cute.arch.sync_threads()


def finish_cluster() -> None:
    """Before a CTA of a cluster exits: the other CTAs' consumers arrive on this one's
    *empty* barriers until their last release, so its shared memory must outlive them."""
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
