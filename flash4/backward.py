"""The Hopper backward pass, host side: buffers, the three launches, and the dQ conversion.
``flash_attn_func``'s autograd Function (flash4/autograd.py) calls it.

    preprocess  D = rowsum(dO ∘ O), lse_log2 = LSE · log2(e), dQ's ticket counters (short
                rows) or its fp32 accumulator (long rows) = 0
    main        dK, dV per key block; dQ stored (first) or added into the fp32 accumulator
    postprocess dQ = accumulator · softmax_scale, in the input dtype
"""

from __future__ import annotations

import torch

from flash4.checks import check_attention_args, tma_misaligned
from flash4.compiler import compiled_backward, compiled_backward_postprocess, compiled_backward_preprocess
from flash4.devices import device_sms
from flash4.kernels.configs import Sm90BackwardConfig

# Per head dim: query rows per block, and for head dim 256 the head-dim split (its dK and
# dV do not fit one warpgroup's registers; see Sm90BackwardConfig). 128 query rows where
# the Sᵀ and dPᵀ accumulators of 64 keys x 128 queries fit beside dK and dV (head dim 64);
# 64 at head dim 128 (80 unmasked, with dQ transposed: TRANSPOSED_DQ_TILE_M). Head dim 256
# holds one Q and one dO tile: with the fp32 dQ tile (64 KiB) a second stage of either
# passes the 227 KiB of shared memory.
_CONFIGS: dict[int, dict] = {
    64: dict(tile_m=128, dq_rows=True),
    128: dict(tile_m=64),
    256: dict(tile_m=64, tile_n=64, q_stages=1, do_stages=1, head_dim_split=True),
}
SUPPORTED_HEAD_DIMS = tuple(sorted(_CONFIGS))
# From this many keys on, the preprocess zeroes dQ's accumulator and every contribution
# adds (dq_first_stores off). The zeros cost a fixed 4 bytes per query row and head-dim
# column, a share of the call that falls as the rows grow; first stores cost each CTA's
# store warp a ticket and a wait per query block, a share that does not (H200, three
# rounds, faster rounds: the zeros 1-3% ahead at 8k and 16k at every head dim, first
# stores up to 8% ahead at 1k and 2k, 4k even; perf/h200-findings.md).
ZEROED_DQ_MIN_SEQLEN_K = 8192
# GQA/MQA unmasked: a CTA per kv head walks its group's query heads, dK and dV in registers
# (no fp32 accumulators, atomics or conversion), instead of a CTA per query head adding into
# accumulators the group shares. H200, 8 query heads per kv head, three rounds, medians,
# 1k / 4k / 16k: +19% / +6% / +1% at head dim 128, +16% / +5-9% / even at 64, +16% / +5% /
# even at 256, every grid there filling 97% of its last wave. Its grid is a group's worth
# smaller, so where that leaves more of the last wave idle (MQA at batch 1, say) the grid of
# query heads stays. Causal it lost from 4k (and at 1k at head dims 128 and 256): the key
# blocks' walks shorten along the diagonal and are 8x longer, so the grid's tail idles
# (mirrored pairs, below, even them out).
KV_GROUP_IN_CTA_MIN_WAVE_FILL = 0.95
# GQA/MQA causal, up to this many keys per head dim: the kv head's CTA walks key block n and
# then its mirror, key_blocks - 1 - n (mirror_pairs), so its walks are all about as long and
# the grid's tail does not idle. H200, 8 query heads per kv head, three rounds, medians,
# against the shared accumulators (1k / 2k / 4k / 16k): head dim 64 276 -> 340, 365 -> 401,
# 435 -> 449, 514 -> 489; 128 307 -> 333, 403 -> 391, 487 -> 435, 572 -> 510; 256 lost at
# every length (265 -> 249 at 1k). Longer rows lose what the shorter walks gained; why the
# crossing sits 2x further out at head dim 64 (same FLOPs per block) was not shown. With 4
# query heads per kv head the pairs won at 1k, and at 4k at head dim 64 (440 -> 472) and
# at 128 as well (474 -> 502), where 8 lost; the bound follows the groups of 8.
MIRRORED_KV_GROUP_MAX_SEQLEN_K: dict[int, int] = {64: 4096, 128: 1024}
# The key split's warpgroups half a step apart (staggered_warpgroups) where that
# paid: the main kernel alone, in step -> staggered, three paired rounds (two at 1k) on the
# H200 (2026-12-01, perf/results/h200/2026-12-01-bwd-staggered.json). Head dim 128 full 16k
# 602/599/590 -> 613/612/606, 4k 584/584/568 -> 601/590/591, 1k 544/532 -> 536/541;
# causal 16k 615/597/597 -> 608/609/614, 4k 540/556/546 -> 611/550/549, 1k 435/441 ->
# 433/436. Head dim 64 full 16k 535/534/530 -> 544/556/539, 1k 470/468 -> 469/478; not
# causal, where it lost at 1k (385/384/379 -> 374/370/375) and tied from 4k. GQA, 8 query
# heads per kv head, one round (-bwd-staggered.json): the same way round under every kv
# scheme, head dim 128 full 1k / 16k 584 -> 594, 594 -> 604 (a CTA per kv head), causal 1k
# 385 -> 387 (mirrored pairs), 16k 583 -> 592 (shared accumulators); 64 full 16k 521 ->
# 532, causal 4k 492 -> 480 (mirrored pairs). Grouped head dim 64 is staggered unmasked
# (its walks' loop bound, the group size, now a kernel argument: it spilled 4 bytes when the
# kernel divided it out) and in step causal, where it lost (and the mirrored pairs spill 24
# bytes staggered). Head dim 64 causal again from 4k (H100, five rounds, 2026-12-06,
# perf/results/h100/2026-12-06-bwd-sweep-d64-causal-staggered.json): 4k 453 -> 457, 8k
# 503 -> 489, 16k 535 -> 528, so it stays in step. Keyed by (grouped, causal).
STAGGERED_HEAD_DIMS: dict[tuple[bool, bool], tuple[int, ...]] = {
    (False, False): (64, 128), (False, True): (128,), (True, False): (64, 128), (True, True): (128,),
}

# Head dim 128, one kv head per query head, unmasked, not deterministic: 80-row query
# blocks with dQ transposed (Sm90BackwardConfig.dq_transposed), flash-attn-4's tile there,
# whose step moves 5% fewer shared-memory bytes per FLOP than 64 rows
# (perf/bwd_smem_bound.py). H100, 2026-12-06, three rounds, fastest (sweep, --control,
# perf/results/h100/2026-12-06-bwd-sweep-d128-transposed.json), 64 rows -> 80 (again),
# in us: 1k 749 -> 720 (724), 2k 1300 -> 1238 (1253), 4k 2302 -> 2259 (2256), 8k 4468 ->
# 4265 (4261), 16k 8732 -> 8217 (8242); flash-attn-4 757, 1298, 2361, 4439, 8996. The main
# kernel alone, 16k: 8982 -> 8345 us; the postprocess, which stages the transposed blocks
# through shared memory, 74 -> 88. Causal (two rounds, 2k / 16k: 759 -> 774, 4370 -> 4247)
# was not taken: it trades the 2k loss for the 16k gain and spills 8 bytes; GQA/MQA and
# deterministic kernels were not timed at 80 rows (their GPU tests pass there).
TRANSPOSED_DQ_TILE_M = 80


def wave_fill(ctas: int, sms: int) -> float:
    """The share of SMs a grid of ``ctas`` keeps busy over its waves (one CTA per SM: the
    backward takes all of shared memory)."""
    return ctas / (-(-ctas // sms) * sms)


def check_backward_supported(head_dim: int) -> None:
    """Raise, before any launch, for a head dim whose gradients flash4 cannot compute."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise NotImplementedError(
            f"head_dim={head_dim}: flash4's backward supports head dims {SUPPORTED_HEAD_DIMS}; "
            f"the forward alone runs under torch.no_grad() or with inputs that do not require grad"
        )


def backward_config(
    head_dim: int, causal: bool, grouped: bool = False, deterministic: bool = False, *, seqlen_k: int,
    kv_units: int | None = None, sms: int | None = None,
) -> Sm90BackwardConfig:
    """``grouped``: several query heads share each kv head (GQA/MQA); a CTA per kv head
    walks them (kv_group_in_cta; causal, in mirrored pairs of key blocks and only up to
    MIRRORED_KV_GROUP_MAX_SEQLEN_K) when its grid (``kv_units``: batch x kv heads, on
    ``sms`` SMs; left out, taken to fill its waves) fills KV_GROUP_IN_CTA_MIN_WAVE_FILL,
    otherwise they add into shared fp32 dK and dV (kv_accumulate). Deterministic kernels
    keep first stores at any length: their turns, not tickets, pick the first."""
    if head_dim not in _CONFIGS:
        raise ValueError(f"head_dim={head_dim}: the backward supports head dims {SUPPORTED_HEAD_DIMS}")
    shape = _CONFIGS[head_dim]
    short_enough = not causal or seqlen_k <= MIRRORED_KV_GROUP_MAX_SEQLEN_K.get(head_dim, 0)
    group_in_cta = grouped and not deterministic and short_enough
    if group_in_cta and kv_units is not None and sms is not None:
        key_blocks = -(-seqlen_k // shape.get("tile_n", Sm90BackwardConfig.tile_n))
        ctas = (-(-key_blocks // 2) if causal else key_blocks) * kv_units
        group_in_cta = wave_fill(ctas, sms) >= KV_GROUP_IN_CTA_MIN_WAVE_FILL
    if head_dim == 128 and not (causal or grouped or deterministic):
        shape = dict(shape, tile_m=TRANSPOSED_DQ_TILE_M, dq_transposed=True)
    return Sm90BackwardConfig(
        head_dim=head_dim, causal=causal, kv_accumulate=grouped and not group_in_cta, kv_group_in_cta=group_in_cta,
        mirror_pairs=group_in_cta and causal, deterministic=deterministic,
        dq_first_stores=deterministic or seqlen_k < ZEROED_DQ_MIN_SEQLEN_K,
        staggered_warpgroups=head_dim in STAGGERED_HEAD_DIMS[grouped, causal], **shape,
    )


def dq_accumulator(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """dQ's fp32 accumulator, left as allocated: the preprocess zeroes it, or the main
    kernel's first contribution to each query block stores (``dq_first_stores``). The GPU tests
    replace this function with one that fills it with NaN, so that a part nobody wrote
    shows."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    deterministic: bool = False,
    config: Sm90BackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``flash_attn_func(q, k, v, softmax_scale, causal)`` given its ``out``
    and ``lse`` and the gradient ``dout`` of out. ``grads`` may give the three output
    tensors (contiguous, like q, k, v); they are fully overwritten. ``deterministic``: the
    fp32 additions of different CTAs into one gradient take turns in a fixed order, so the
    gradients are bit-identical run to run. ``config`` replaces the selector's kernel
    configuration (sweeps and tests of candidates)."""
    if deterministic and config is not None and not config.deterministic:
        raise ValueError(
            "deterministic=True, but the given config has deterministic=False: its gradients would not be "
            "bit-identical run to run; pass a deterministic config or leave config out"
        )
    problem = check_attention_args(q, k, v, softmax_scale, causal)
    for name, tensor in (("out", out), ("dout", dout)):
        if tensor.shape != q.shape or tensor.dtype != q.dtype or tensor.device != q.device:
            raise ValueError(f"{name} must be like q ({q.dtype}, {tuple(q.shape)}, {q.device}); got "
                             f"{tensor.dtype}, {tuple(tensor.shape)}, {tensor.device}")
        if tensor.stride(-1) != 1 or tma_misaligned(tensor):
            raise ValueError(f"{name} must have a contiguous last dimension and 16-byte aligned strides "
                             f"and start (TMA); got strides {tuple(tensor.stride())}")
    lse_shape = (problem.batch, problem.heads, problem.seqlen_q)
    if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 tensor of shape {lse_shape}; got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    grouped = problem.kv_heads != problem.heads
    if config is None:
        config = backward_config(
            problem.head_dim, causal, grouped, deterministic, seqlen_k=problem.seqlen_k,
            kv_units=problem.batch * problem.kv_heads, sms=device_sms(q.device.index),
        )
    if grouped and not (config.kv_accumulate or config.kv_group_in_cta):
        raise ValueError(
            f"config: {problem.heads} query heads share {problem.kv_heads} kv heads, so dK and dV need "
            f"kv_accumulate=True or kv_group_in_cta=True; got {config}"
        )
    batch, heads, seqlen_q, head_dim = problem.batch, problem.heads, problem.seqlen_q, problem.head_dim
    padded = -(-seqlen_q // config.tile_m) * config.tile_m
    f32 = dict(dtype=torch.float32, device=q.device)
    delta = torch.empty(batch, heads, padded, **f32)
    lse_log2 = torch.empty(batch, heads, padded, **f32)
    dq_accum = dq_accumulator((batch, heads, padded * head_dim), q.device)
    if grads is None:
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    dq, dk, dv = grads
    # GQA/MQA with kv_accumulate: the query heads of a group add into shared fp32 accumulators.
    dk_out, dv_out = (torch.zeros(t.shape, **f32) for t in (k, v)) if config.kv_accumulate else (dk, dv)
    # dQ's counters: the turns of its additions (deterministic), one per query block and
    # part (each warpgroup writes its own); or (dq_first_stores alone) a ticket per query
    # block that picks which key block stores first. With dq_first_stores the preprocess
    # zeroes them. Deterministic GQA: a turn counter per (key block, kv head) for dK and dV.
    counters = dict(dtype=torch.int32, device=q.device)
    per_block = config.consumer_warpgroups if config.deterministic else 1
    dq_counters = kv_turns = None
    if config.dq_first_stores:
        dq_counters = torch.empty(batch, heads, padded // config.tile_m * per_block, **counters)
    elif config.deterministic:
        dq_counters = torch.zeros(batch, heads, padded // config.tile_m * per_block, **counters)
    if config.deterministic and grouped:
        kv_turns = torch.zeros(batch, problem.kv_heads, -(-problem.seqlen_k // config.tile_n), **counters)
    # Each head's count of key blocks whose dQ has landed (zeroed by the preprocess), which
    # the postprocess waits on when it overlaps the main kernel.
    dq_ready = torch.empty(batch, heads, dtype=torch.int32, device=q.device)
    key_blocks = -(-problem.seqlen_k // config.tile_n)
    compiled_backward_preprocess(
        problem.dtype, head_dim, config.tile_m, dq_counters_per_block=per_block if config.dq_first_stores else 0
    )(out, dout, lse, delta, lse_log2, dq_accum, dq_ready, dq_counters if config.dq_first_stores else None)
    compiled_backward(config, problem.dtype)(
        q, k, v, dout, lse_log2, delta, dq_accum.view(batch, heads, padded, head_dim), dk_out, dv_out,
        dq_counters, kv_turns, dq_ready if config.overlap_postprocess else None, problem.softmax_scale,
    )
    # A CuTe kernel, not torch's strided mixed-dtype multiply (H200: +13-21% at seqlen 512,
    # where the conversion is a large part of the call). Right after the main kernel, which
    # it may overlap.
    compiled_backward_postprocess(problem.dtype, config.dq_tile_geometry, overlap=config.overlap_postprocess)(
        dq_accum, dq, dq_ready, key_blocks, problem.softmax_scale
    )
    if config.kv_accumulate:
        dk.copy_(dk_out)
        dv.copy_(dv_out)
    return dq, dk, dv
