"""``python -m flash4 bench``: the forward benchmark of DESIGN.md's performance protocol.

On a GPU that the selector serves, every protocol shape is timed for flash4 and for each
peer that can be imported (torch SDPA with its cuDNN and flash backends, flash-attn-4), in
this process and on the same tensors, and the figure that counts is printed per shape:
flash4's TFLOP/s over the best peer's. Without such a GPU, every kernel of the selector's
table is compiled for sm_90a instead, with its compile time and the PTX instructions the
design depends on, so the command still shows something real.

Peers are optional: a peer that fails to import or to run is recorded with its error for
that shape and the sweep goes on.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from flash4 import dispatch
from flash4.report import FLASH4, is_peer

if TYPE_CHECKING:
    from flash4.quantize import Fp8Tensor

# The sweep of the FlashAttention-3/4 papers: every shape holds the same number of tokens
# (batch * seqlen) and the same model width (heads * head_dim), so moving along seqlen changes
# only the attention length, not the amount of data.
TOKENS = 16384
HIDDEN = 2048
HEAD_DIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# --quick: a short, a middle and the longest sequence, enough to see the trend in a minute.
QUICK_SEQLENS = (1024, 4096, 16384)
# The 16-bit input types a run can time (--dtype); the FP8 pass quantizes bf16 inputs.
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DTYPE = "bf16"

# triton.testing.do_bench budgets in milliseconds (its defaults), and shorter ones for --quick.
WARMUP_MS, REP_MS = 25, 100
QUICK_WARMUP_MS, QUICK_REP_MS = 10, 30
# The CUDA-event fallback counts calls instead of milliseconds.
EVENT_WARMUP_CALLS, EVENT_TIMED_CALLS = 10, 50
# Larger than the H200's 50 MB L2, so clearing it evicts the previous call's inputs, as
# do_bench does: each timed call starts from a cold cache in both timers.
L2_FLUSH_BYTES = 256 * 1024 * 1024

# Without a supported GPU the table is compiled for this architecture (what CI checks too).
COMPILE_ONLY_ARCH = "sm_90a"
# The instructions the Hopper design depends on; a kernel whose PTX lacks one is flagged.
REQUIRED_INSTRUCTIONS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier")

PEERS = ("sdpa-cudnn", "sdpa-flash", "fa4", "cudnn-fp8")
# The backward's FLOPs are 2.5x the forward's (five GEMMs of the forward's size against two,
# the papers' convention: S is recomputed, and dV, dP, dK, dQ each cost a forward GEMM).
BACKWARD_FLOPS_NUM, BACKWARD_FLOPS_DEN = 5, 2
# fp8: the forward with e4m3 inputs; flash4's FP8 kernel beside cuDNN's FP8 attention, and
# flash4's own bf16 forward and FP8 path with its quantization (FLOPs: the forward's).
PASSES = ("fwd", "bwd", "fp8")
# The outputs every provider is checked against, first available first (flash4's bf16
# forward in the fp8 pass, which has no SDPA).
REFERENCE_PROVIDERS = ("sdpa-cudnn", "sdpa-flash", "flash4-bf16")
# Correct kernels differ from the reference by rounding: below 1% of its largest value on
# the protocol's shapes in bf16 (forward outputs and dq alike). 5% is wrong, not rounding.
WRONG_RELATIVE = 0.05
# FP8 rounds much more (cuDNN's e4m3 output alone errs by up to 1/16 of a value): a quarter
# of the largest value is wrong, not rounding.
FP8_WRONG_RELATIVE = 0.25
# That bound alone let an FP8 output off by a fifth of every value through, so FP8 outputs
# also face their RMS error relative to the reference's RMS: correct ones err by 5-6% (the
# float64 model on these inputs: flash4's blockwise FP8 4.6-5.5%, per-tensor scales with an
# e4m3 output 5.3-6.1%); 15% is wrong, not rounding.
FP8_WRONG_RMS_RELATIVE = 0.15


@dataclass(frozen=True)
class Shape:
    """One protocol shape; q is (batch, seqlen, heads, head_dim), k and v the same with
    ``heads // group`` heads (GQA/MQA when ``group`` > 1)."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int
    causal: bool
    # One of PASSES: the forward, the backward (dq, dk, dv from dout), the FP8 forward.
    pass_: str = "fwd"
    # Query heads per kv head: 1 is multi-head attention.
    group: int = 1

    def __post_init__(self) -> None:
        if self.group < 1 or self.heads % self.group:
            raise ValueError(
                f"group={self.group}: must be a positive divisor of heads={self.heads} (head_dim {self.head_dim})"
            )

    @property
    def kv_heads(self) -> int:
        return self.heads // self.group

    @property
    def backward(self) -> bool:
        return self.pass_ == "bwd"

    @property
    def flops(self) -> int:
        flops = attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)
        return flops * BACKWARD_FLOPS_NUM // BACKWARD_FLOPS_DEN if self.backward else flops

    def label(self) -> str:
        heads = f"h{self.heads:<3d} " if self.group == 1 else f"h{self.heads}/{self.kv_heads:<3d} "
        return f"{self.pass_} hdim {self.head_dim:3d}  seqlen {self.seqlen:5d}  " \
               f"b{self.batch:<3d} {heads}" + ("causal" if self.causal else "full  ")


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> int:
    """Forward FLOPs: two GEMMs (QKᵀ and PV) of 2·s_q·s_k·d each, per head.

    Causal attention counts half, the papers' convention (it ignores the diagonal blocks).
    """
    flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops // 2 if causal else flops


def protocol_shapes(
    head_dims: Sequence[int] = HEAD_DIMS,
    seqlens: Sequence[int] = SEQLENS,
    causal_modes: Sequence[bool] = (False, True),
    passes: Sequence[str] = ("fwd",),
    group: int = 1,
) -> tuple[Shape, ...]:
    """The protocol's shapes, pass then head dim outermost; batch is at least one sequence.
    ``group``: query heads per kv head, the same at every head dim (it must divide the
    protocol's HIDDEN // head_dim heads)."""
    return tuple(
        Shape(batch=max(1, TOKENS // seqlen), seqlen=seqlen, heads=HIDDEN // head_dim, head_dim=head_dim,
              causal=causal, pass_=pass_, group=group)
        for pass_ in passes
        for head_dim in head_dims
        for causal in causal_modes
        for seqlen in seqlens
    )


@dataclass(frozen=True)
class Options:
    head_dims: tuple[int, ...] = HEAD_DIMS
    seqlens: tuple[int, ...] | None = None  # None: the protocol's (or the quick) list
    causal_modes: tuple[bool, ...] = (False, True)
    quick: bool = False
    passes: tuple[str, ...] = ("fwd",)
    # The peers timed beside flash4 (names from PEERS).
    peers: tuple[str, ...] = PEERS
    # Timings per provider, interleaved (see measure_shape).
    rounds: int = 1
    # Query heads per kv head (GQA/MQA); 1: multi-head attention, the protocol's.
    group: int = 1
    # The inputs' type (a key of DTYPES), the same for every shape and provider of a run.
    dtype: str = DEFAULT_DTYPE
    out: Path | None = None
    command: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {tuple(DTYPES)}")
        if self.dtype != DEFAULT_DTYPE and "fp8" in self.passes:
            raise ValueError(f"dtype={self.dtype!r}: the fp8 pass quantizes {DEFAULT_DTYPE} inputs; "
                             f"time it in a run of its own")

    def shapes(self) -> tuple[Shape, ...]:
        seqlens = self.seqlens or (QUICK_SEQLENS if self.quick else SEQLENS)
        return protocol_shapes(self.head_dims, seqlens, self.causal_modes, self.passes, self.group)


# --- timing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timer:
    description: str
    milliseconds: Callable[[Callable[[], Any]], float]
    # (low, median, high) of one timing's samples, where the timer keeps them: the spread
    # within a round, beside ms_rounds' spread between rounds.
    spread: Callable[[Callable[[], Any]], tuple[float, float, float]] | None = None


# A square GEMM this large runs the tensor cores at their sustained rate (the H200's bf16
# rate, 801 TFLOP/s, was measured this way).
CEILING_GEMM_SIZE = 8192
# Bytes copied for the memory ceiling: far beyond the 50 MB L2, so HBM is what is timed.
CEILING_COPY_BYTES = 2 * 1024**3
# Timings per ceiling, the fastest kept: the GPU starts a run at its idle clock (345 MHz on
# the H200), and one --quick timing of the GEMM from there read 774 TFLOP/s, below what a
# flash4 kernel then reached in the same run.
CEILING_ROUNDS = 3


def measure_ceilings(timer: Timer, device: str = "cuda", gemm_size: int = CEILING_GEMM_SIZE,
                     copy_bytes: int = CEILING_COPY_BYTES) -> dict[str, Any]:
    """What the GPU can do at all, timed like the kernels: bf16 and fp8 (e4m3) matmul
    TFLOP/s through torch, and device-to-device copy GB/s (bytes read plus written). A
    ceiling that cannot be measured (fp8 without support) is recorded as its error. Each is
    the fastest of ``CEILING_ROUNDS`` timings."""
    n = gemm_size
    ceilings: dict[str, Any] = {"gemm_size": n, "copy_bytes": copy_bytes}

    def fastest_ms(fn: Callable[[], Any]) -> float:
        return min(timer.milliseconds(fn) for _ in range(CEILING_ROUNDS))

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ceilings["bf16_matmul_tflops"] = 2 * n**3 / (fastest_ms(lambda: a @ b) * 1e-3) / 1e12
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device=device)
        ms = fastest_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        ceilings["fp8_matmul_tflops"] = 2 * n**3 / (ms * 1e-3) / 1e12
    except Exception as exc:  # no fp8 GEMM here: data, not a reason to stop
        ceilings["fp8_matmul_tflops"] = None
        ceilings["fp8_error"] = _error_text(exc)
    src = torch.empty(copy_bytes, device=device, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ceilings["copy_gb_per_s"] = 2 * copy_bytes / (fastest_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9
    del a, b, src, dst
    return ceilings


# The quantiles of a timing's samples recorded as its spread (low, median, high).
SPREAD_QUANTILES = (0.2, 0.5, 0.8)


def make_timer(quick: bool) -> Timer:
    warmup, rep = (QUICK_WARMUP_MS, QUICK_REP_MS) if quick else (WARMUP_MS, REP_MS)
    try:
        from triton.testing import do_bench
    except ImportError as exc:
        calls = EVENT_TIMED_CALLS // 5 if quick else EVENT_TIMED_CALLS
        return Timer(
            f"triton is not importable ({exc}); FALLBACK: median of CUDA events over {calls} calls, L2 flushed",
            lambda fn: event_median_ms(fn, calls),
        )
    def spread(fn: Callable[[], Any]) -> tuple[float, float, float]:
        low, median, high = do_bench(fn, warmup=warmup, rep=rep, quantiles=list(SPREAD_QUANTILES))
        return float(low), float(median), float(high)

    return Timer(
        f"median of triton.testing.do_bench(warmup={warmup} ms, rep={rep} ms); spread: its "
        f"{SPREAD_QUANTILES[0]:.0%} and {SPREAD_QUANTILES[2]:.0%} quantiles",
        lambda fn: spread(fn)[1],
        spread,
    )


def event_median_ms(fn: Callable[[], Any], calls: int, flush: Callable[[], Any] | None = None) -> float:
    """The median of ``calls`` timings of ``fn`` by CUDA events, each after ``flush`` (by
    default do_bench's: an L2_FLUSH_BYTES buffer zeroed; perf/l2_flush_probe.py passes
    others), following EVENT_WARMUP_CALLS untimed ones."""
    if flush is None:
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda").zero_
    for _ in range(EVENT_WARMUP_CALLS):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in pairs:
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


# --- providers ----------------------------------------------------------------------------

# A provider turns (q, k, v, causal, scale), all in flash4's (b, s, h, d) layout, into a
# no-argument call to time and a function that brings its result back to (b, s, h, d): the
# output of a forward, dq of a backward. Everything else (layout views, backend lookups, a
# backward's forward pass and dout) happens once, outside the timed call.
Prepared = tuple[Callable[[], Any], Callable[[Any], torch.Tensor]]


def _flash4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    from flash4.interface import flash_attn_func

    return (lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)), (lambda out: out)


def _flash4_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    from flash4.backward import attention_backward, check_backward_supported
    from flash4.checks import check_attention_args
    from flash4.interface import flash_attn_func

    # What autograd refuses (a kernel not yet verified on a GPU) is reported, not timed.
    check_backward_supported(check_attention_args(q, k, v, scale, causal).head_dim)

    out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
    dout = dout_like(out)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return (
        (lambda: attention_backward(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, grads=grads)),
        (lambda result: result[0]),
    )


def _quantized_qk(q: torch.Tensor, k: torch.Tensor, causal: bool) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Q and K quantized as flash_attn_fp8 quantizes them without the Hadamard rotation:
    per tile of the selected row, onto fp8_blocks' code limits (the f16-score kernels)."""
    from flash4.fp8 import fp8_blocks
    from flash4.quantize import quantize_fp8

    blocks = fp8_blocks(q.shape[-1], causal, q.shape[1])
    return quantize_fp8(q, blocks.q, False, blocks.q_max), quantize_fp8(k, blocks.kv, False, blocks.k_max)


def _flash4_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    """The FP8 kernel on inputs quantized beforehand as flash_attn_fp8 quantizes them
    (without the Hadamard rotation), V laid out for the kernel beforehand too
    (transpose_fp8_v), as a cache of quantized keys and values keeps them."""
    from flash4.fp8 import flash_attn_fp8_quantized
    from flash4.quantize import quantize_fp8, transpose_fp8_v

    q8, k8 = _quantized_qk(q, k, causal)
    v8 = transpose_fp8_v(quantize_fp8(v, None))
    return (lambda: flash_attn_fp8_quantized(q8, k8, v8, softmax_scale=scale, causal=causal)), (lambda out: out)


def _flash4_fp8_v_per_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    """As the flash4 FP8 provider, but V given as (batch, seqlen, heads, head_dim), as
    flash_attn_func's e4m3 inputs come: V's layout pass runs on every call."""
    from flash4.fp8 import flash_attn_fp8_quantized
    from flash4.quantize import quantize_fp8

    q8, k8 = _quantized_qk(q, k, causal)
    v8 = quantize_fp8(v, None)
    return (lambda: flash_attn_fp8_quantized(q8, k8, v8, softmax_scale=scale, causal=causal)), (lambda out: out)


def _flash4_fp8_quantizing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    """flash_attn_fp8 from bf16 inputs: its quantization included."""
    from flash4.fp8 import flash_attn_fp8

    return (lambda: flash_attn_fp8(q, k, v, softmax_scale=scale, causal=causal)), (lambda out: out)


def _flash4_fp8_hadamard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    """flash_attn_fp8 with the Hadamard rotation, quantization included."""
    from flash4.fp8 import flash_attn_fp8

    return (lambda: flash_attn_fp8(q, k, v, softmax_scale=scale, causal=causal, hadamard=True)), (lambda out: out)


def _flash4_fp8_int8_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
    """The accurate mode's kernel (int8 Q and K, rotated; e4m3 V laid out beforehand) on
    inputs quantized beforehand, as the flash4 FP8 provider times its kernel."""
    from flash4.fp8 import fp8_blocks, flash_attn_fp8_quantized
    from flash4.quantize import quantize_fp8, quantize_int8, transpose_fp8_v

    blocks = fp8_blocks(q.shape[-1], causal, q.shape[1])
    q8, k8 = quantize_int8(q, blocks.q), quantize_int8(k, blocks.kv)
    v8 = transpose_fp8_v(quantize_fp8(v, None))
    return (lambda: flash_attn_fp8_quantized(q8, k8, v8, softmax_scale=scale, causal=causal)), (lambda out: out)


def dout_like(out: torch.Tensor) -> torch.Tensor:
    """The upstream gradient every backward provider of a shape gets: the same draw."""
    generator = torch.Generator(device=out.device).manual_seed(DOUT_SEED)
    return torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=generator)


# One dout per shape for all backward providers, so their dq can be compared.
DOUT_SEED = 1234


def autograd_backward(
    forward: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
) -> Prepared:
    """A peer's backward through torch autograd: ``forward(q, k, v)`` runs once here, with q,
    k, v as leaves in flash4's layout; the timed call is ``torch.autograd.grad`` of its output
    (the graph is kept for the next call). ``layout`` swaps the output between the peer's
    layout and flash4's (a transpose is its own inverse)."""
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = forward(*leaves)
    dout = layout(dout_like(layout(out.detach())))
    return (lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)), (lambda grads: grads[0])


def _sdpa(backend_name: str) -> Callable[..., Prepared]:
    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        backend = getattr(SDPBackend, backend_name)
        # SDPA wants (b, h, s, d); transposed views cost nothing and keep the same storage.
        # Its is_causal is aligned top-left, flash4's bottom-right: equal here, as s_q == s_k.
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        gqa = k.shape[2] != q.shape[2]

        # The backend is chosen inside the timed call, as a user would: its host cost (a few
        # microseconds) is hidden behind the timer's L2 flush on the GPU, like flash4's own.
        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                return scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale, enable_gqa=gqa)

        return run, (lambda out: out.transpose(1, 2))

    return prepare


def _sdpa_backward(backend_name: str) -> Callable[..., Prepared]:
    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        def forward(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor) -> torch.Tensor:
            # The backward runs on the backend of the forward that built the graph.
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                return scaled_dot_product_attention(
                    *(x.transpose(1, 2) for x in (q_, k_, v_)), is_causal=causal, scale=scale,
                    enable_gqa=k_.shape[2] != q_.shape[2],
                )

        return autograd_backward(forward, q, k, v, layout=lambda x: x.transpose(1, 2))

    return prepare


# Peers outside torch (flash-attn-4) are adapted in perf/peer_providers.py, never in the
# flash4 package: flash4 imports no peer. A flash4 imported from a checkout (an editable
# install) loads that file from the checkout, whatever the working directory or script;
# an installed flash4 elsewhere records those peers as not available.
PEER_PROVIDERS_FILE = Path(__file__).resolve().parents[1] / "perf" / "peer_providers.py"


def _not_available(name: str) -> Callable[..., Prepared]:
    def prepare(*_: Any) -> Prepared:
        raise ImportError(f"{name} is measured from a flash4 checkout ({PEER_PROVIDERS_FILE} is absent)")

    return prepare


# The peers each table of perf/peer_providers.py holds.
CHECKOUT_PEERS = {"PROVIDERS": ("fa4",), "BACKWARD_PROVIDERS": ("fa4",), "FP8_PROVIDERS": ("cudnn-fp8",)}


def _checkout_peers(table: str = "PROVIDERS") -> dict[str, Callable[..., Prepared]]:
    """The checkout's peer adapters: ``PROVIDERS`` (forward), ``BACKWARD_PROVIDERS`` or
    ``FP8_PROVIDERS``."""
    if not PEER_PROVIDERS_FILE.is_file():
        return {name: _not_available(name) for name in CHECKOUT_PEERS[table]}
    spec = importlib.util.spec_from_file_location("flash4_peer_providers", PEER_PROVIDERS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(getattr(module, table))


PROVIDERS: dict[str, Callable[..., Prepared]] = {
    FLASH4: _flash4,
    "sdpa-cudnn": _sdpa("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa("FLASH_ATTENTION"),
    **_checkout_peers("PROVIDERS"),
}
BACKWARD_PROVIDERS: dict[str, Callable[..., Prepared]] = {
    FLASH4: _flash4_backward,
    "sdpa-cudnn": _sdpa_backward("CUDNN_ATTENTION"),
    "sdpa-flash": _sdpa_backward("FLASH_ATTENTION"),
    **_checkout_peers("BACKWARD_PROVIDERS"),
}
FP8_PROVIDERS: dict[str, Callable[..., Prepared]] = {
    FLASH4: _flash4_fp8,
    "flash4-v-per-call": _flash4_fp8_v_per_call,
    "flash4-quantizing": _flash4_fp8_quantizing,
    "flash4-hadamard": _flash4_fp8_hadamard,
    "flash4-int8-qk": _flash4_fp8_int8_qk,
    "flash4-bf16": _flash4,
    **_checkout_peers("FP8_PROVIDERS"),
}
PASS_PROVIDERS = {"fwd": PROVIDERS, "bwd": BACKWARD_PROVIDERS, "fp8": FP8_PROVIDERS}


# --- one shape ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One provider on one shape: a time (the median over rounds), or the error that
    prevented it. ``ms_rounds`` keeps every round's time, so the spread can be read."""

    ms: float | None = None
    tflops: float | None = None
    error: str | None = None
    ms_rounds: tuple[float, ...] = ()
    # Within the rounds: the lowest low and the highest high quantile of the timer's samples
    # (None when the timer keeps no samples).
    ms_spread: tuple[float, float] | None = None
    # When each round of this provider began, in seconds since the shape's first round did:
    # a round slower than the others can be matched with the moment it ran (in the backward
    # sweeps of 2026-11-30 one round at 16k ran 10-20% slow, whichever provider stood there).
    rounds_started_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class ShapeRecord:
    shape: Shape
    flops: int
    results: dict[str, Measurement]
    # flash4's output against the first SDPA backend that ran (a sanity check, not a test).
    max_abs_diff: float | None
    diff_against: str | None
    ratio_vs_best_peer: float | None
    best_peer: str | None


def _error_text(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"[:300]


def measure_shape(
    shape: Shape,
    timer: Timer,
    providers: dict[str, Callable[..., Prepared]] | None = None,
    device: str = "cuda",
    rounds: int = 1,
    dtype: torch.dtype = DTYPES[DEFAULT_DTYPE],
) -> ShapeRecord:
    """Time every provider on one set of tensors of ``dtype``; ``providers`` and ``device``
    are for tests.

    With several ``rounds`` the providers are timed in turn, round after round, and each
    keeps its median: the GPU's clock follows its power and temperature, which drift over
    seconds, so back-to-back timings of one kernel differed by up to 10% on the H200, and
    timing one provider after another would hand that drift to the ratio.

    Before the first round the last provider runs through the timer once, its time
    discarded, so that every provider's every round follows the same one under load.
    Without it the first provider's first round came right after the shape's setup, the
    GPU idle before it: flash4 (timed first) ran its second round 1-2% slower than its
    first in the median shape of four H200 runs on 2026-12-02, up to 19% in one shape,
    while cuDNN's two rounds matched within 0.1%.
    """
    if providers is None:
        providers = PASS_PROVIDERS[shape.pass_]
    q = torch.randn((shape.batch, shape.seqlen, shape.heads, shape.head_dim), dtype=dtype, device=device)
    k, v = (torch.randn((shape.batch, shape.seqlen, shape.kv_heads, shape.head_dim), dtype=dtype, device=device)
            for _ in range(2))
    scale = 1.0 / math.sqrt(shape.head_dim)
    errors: dict[str, str] = {}
    runs: dict[str, Callable[[], Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, prepare in providers.items():
        try:
            run, to_bshd = prepare(q, k, v, shape.causal, scale)
            # The first call compiles (flash4, fa4) and gives the output for the sanity check;
            # synchronizing surfaces its launch errors here rather than inside the timer.
            outputs[name] = to_bshd(run())
            if q.is_cuda:
                torch.cuda.synchronize()
            runs[name] = run
        except Exception as exc:  # a peer that cannot run is data, not a reason to stop
            errors[name] = _error_text(exc)
    if shape.pass_ == "fp8":
        errors.update(wrong_outputs(outputs, FP8_WRONG_RELATIVE, FP8_WRONG_RMS_RELATIVE))
    else:
        errors.update(wrong_outputs(outputs, WRONG_RELATIVE))
    times: dict[str, list[float]] = {name: [] for name in runs}
    spreads: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    started: dict[str, list[float]] = {name: [] for name in runs}
    runnable = [run for name, run in runs.items() if name not in errors]
    if runnable:
        timer.milliseconds(runnable[-1])
    first_round = time.perf_counter()
    for _ in range(rounds):
        for name, run in runs.items():
            if name in errors:
                continue
            started[name].append(time.perf_counter() - first_round)
            try:
                if timer.spread is None:
                    times[name].append(timer.milliseconds(run))
                else:
                    low, median, high = timer.spread(run)
                    times[name].append(median)
                    spreads[name].append((low, high))
            except Exception as exc:
                errors[name] = _error_text(exc)
    results: dict[str, Measurement] = {}
    for name in providers:
        if name in errors:
            results[name] = Measurement(error=errors[name])
            continue
        ms = statistics.median(times[name])
        spread = None
        if spreads[name]:
            spread = (min(low for low, _ in spreads[name]), max(high for _, high in spreads[name]))
        results[name] = Measurement(
            ms=ms, tflops=shape.flops / (ms * 1e-3) / 1e12, ms_rounds=tuple(times[name]), ms_spread=spread,
            rounds_started_s=tuple(started[name]),
        )

    diff, against = None, None
    reference = next((n for n in REFERENCE_PROVIDERS if n in outputs), None)
    if FLASH4 in outputs and reference is not None:
        diff = float((outputs[FLASH4].float() - outputs[reference].float()).abs().max())
        against = reference

    peers = {n: m.tflops for n, m in results.items() if is_peer(n) and m.tflops is not None}
    best = max(peers, key=peers.__getitem__) if peers else None
    ours = results[FLASH4].tflops if FLASH4 in results else None
    ratio = ours / peers[best] if best is not None and ours is not None else None
    return ShapeRecord(shape, shape.flops, results, diff, against, ratio, best)


def wrong_outputs(
    outputs: dict[str, torch.Tensor], relative: float = WRONG_RELATIVE, rms_relative: float | None = None
) -> dict[str, str]:
    """Providers whose output (forward) or dq (backward) is wrong, with the reason: not
    finite, farther from the first reference provider's than ``relative`` of its largest
    magnitude, or (with ``rms_relative``) with an RMS error above that share of its RMS. A
    wrong kernel is reported, not timed."""
    reference = next((n for n in REFERENCE_PROVIDERS if n in outputs), None)
    if reference is None:
        return {}
    expected = outputs[reference].float()
    size = float(expected.abs().max())
    rms = float(expected.pow(2).mean().sqrt())
    wrong = {}
    for name, output in outputs.items():
        error = output.float() - expected
        diff = float(error.abs().max())
        if not math.isfinite(diff) or diff > relative * size:
            wrong[name] = (f"wrong output: max|diff| {diff:.3g} against {reference}, more than "
                           f"{relative:.0%} of its largest value {size:.3g}; not timed")
        elif rms_relative is not None and (rms_error := float(error.pow(2).mean().sqrt())) > rms_relative * rms:
            wrong[name] = (f"wrong output: RMS error {rms_error:.3g} against {reference}, "
                           f"more than {rms_relative:.0%} of its RMS {rms:.3g}; not timed")
    return wrong


# --- output -------------------------------------------------------------------------------


def _cell(m: Measurement | None) -> str:
    if m is None:  # a peer left out with --peers
        return f"{'-':>10}"
    return f"{m.tflops:10.1f}" if m.tflops is not None else f"{'error':>10}"


def table_header() -> str:
    names = "".join(f"{n:>11}" for n in (FLASH4, *PEERS))
    return f"{'shape':46}{names}  {'flash4/best':>11}  {'max|diff|':>9}"


def table_row(record: ShapeRecord) -> str:
    cells = "".join(" " + _cell(record.results.get(n)) for n in (FLASH4, *PEERS))
    ratio = f"{record.ratio_vs_best_peer:11.3f}" if record.ratio_vs_best_peer is not None else f"{'-':>11}"
    diff = f"{record.max_abs_diff:9.2e}" if record.max_abs_diff is not None else f"{'-':>9}"
    return f"{record.shape.label():46}{cells}  {ratio}  {diff}"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": _version("nvidia-cutlass-dsl"),
        "flash_attn_4": _version("flash-attn-4"),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": _version("triton"),
    }


def results_json(payload: dict[str, Any]) -> str:
    """``payload`` as JSON with one line per top-level field and per item of a top-level
    list (a run's records): a diff shows which shapes changed, and the results folder stays
    small enough to travel to the GPU machine beside the toolchain (64 MiB in all)."""

    def compact(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"))

    def field(key: str, value: Any) -> str:
        if isinstance(value, list) and value:
            items = ",\n".join(f"  {compact(item)}" for item in value)
            return f"{compact(key)}: [\n{items}\n]"
        return f"{compact(key)}: {compact(value)}"

    return "{\n" + ",\n".join(field(k, v) for k, v in payload.items()) + "\n}\n"


def write_json(path: Path, payload: dict[str, Any], quiet: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(results_json(payload))
    if not quiet:
        print(f"wrote {path}")


def write_probe_json(path: Path, records: list[dict[str, Any]], **fields: Any) -> None:
    """A perf/ script's results: the environment, its command line, ``fields``, its records
    (rewritten after each, so that a run cut short keeps what it measured)."""
    write_json(path, {**environment(), "command": default_command(), **fields, "records": records}, quiet=True)


# --- entry points -------------------------------------------------------------------------


def supported_gpu() -> tuple[bool, str]:
    """Whether this process sees a GPU the selector serves, and what it sees, in words."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    arch = dispatch.arch_of_capability(major, minor)
    found = f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}, {arch})"
    return arch in dispatch.SUPPORTED_ARCHS, found


def run(options: Options) -> int:
    """The benchmark on a supported GPU, else the compile-only report; the exit status."""
    ok, found = supported_gpu()
    if not ok:
        print(f"No supported GPU found: {found}. flash4 runs on {', '.join(dispatch.SUPPORTED_ARCHS)} (H100/H200).")
        print(f"Compiling every kernel of the selector table for {COMPILE_ONLY_ARCH} instead.")
        return compile_only(options)
    return benchmark(options, found)


def benchmark(options: Options, found: str) -> int:
    from flash4.machine import device_facts, gpu_state

    started = time.monotonic()
    timer = make_timer(options.quick)
    env = environment()
    machine = {"device": device_facts(), "before": gpu_state()}
    print(f"GPU: {found}; torch {env['torch']}, cutlass-dsl {env['cutlass_dsl']}, flash-attn-4 {env['flash_attn_4']}")
    print(f"timing: {timer.description}, {options.rounds} round(s) per provider, interleaved, "
          f"median kept; TFLOP/s ({'+'.join(options.passes)}; backward FLOPs = 2.5x forward), {DTYPES[options.dtype]}")
    ceilings = measure_ceilings(timer)
    print("ceilings: " + ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in ceilings.items()))
    print(table_header())
    records: list[ShapeRecord] = []

    def payload(so_far: list[ShapeRecord], **more: Any) -> dict[str, Any]:
        return {**env, "mode": "benchmark", "command": options.command, "timer": timer.description,
                "rounds": options.rounds, "dtype": options.dtype, **more, "machine": machine, "ceilings": ceilings,
                "records": [dataclasses.asdict(r) for r in so_far]}

    shapes = options.shapes()
    for index, shape in enumerate(shapes, 1):
        table = PASS_PROVIDERS[shape.pass_]
        providers = {name: prepare for name, prepare in table.items() if not is_peer(name) or name in options.peers}
        record = measure_shape(shape, timer, providers=providers, rounds=options.rounds, dtype=DTYPES[options.dtype])
        records.append(record)
        print(f"{table_row(record)}  [{index}/{len(shapes)}]", flush=True)
        if options.out is not None:
            # A run cut short (a time limit, a crash in a peer) keeps what it measured.
            write_json(_partial_path(options.out), {**payload(records), "mode": "partial"}, quiet=True)
        torch.cuda.empty_cache()
    machine["after"] = gpu_state()
    print(f"GPU state before: {machine['before']}\nGPU state after:  {machine['after']}")
    errors = sorted({(n, m.error) for r in records for n, m in r.results.items() if m.error})
    for name, error in errors:
        print(f"{name}: {error}")
    wall_s = time.monotonic() - started
    print(f"wall time: {wall_s:.0f} s for {len(shapes)} shapes")
    if options.out is not None:
        write_report(options.out, payload(records, wall_s=round(wall_s, 1)))
        _partial_path(options.out).unlink(missing_ok=True)
    return 0


def _partial_path(out: Path) -> Path:
    """Where the records measured so far are kept during a run."""
    return out.with_suffix(".partial.json") if out.suffix == ".json" else out / "report.partial.json"


def write_report(out: Path, payload: dict[str, Any]) -> None:
    """``out`` ending in .json: that file and the markdown report beside it (.md); anything
    else is a folder that gets report.json and report.md."""
    from flash4.report import report_markdown

    json_path, md_path = (out, out.with_suffix(".md")) if out.suffix == ".json" else (out / "report.json", out / "report.md")
    write_json(json_path, payload)
    md_path.write_text(report_markdown(payload) + "\n")
    print(f"wrote {md_path}")
    write_plots(payload, md_path.parent, md_path.stem)


def write_plots(payload: dict[str, Any], folder: Path, stem: str) -> None:
    """The PNG plots beside the report (``<stem>-fwd.png`` ...), where matplotlib is
    installed; elsewhere (the GPU machine need not have it) say how to make them later."""
    from flash4.report import plot_report

    try:
        written = plot_report(payload, folder, prefix=f"{stem}-")
    except ImportError as exc:
        print(f"plots skipped ({exc}); later: python -m flash4 report RUN.json --plots DIR")
        return
    for path in written:
        print(f"wrote {path}")


def compile_only(options: Options) -> int:
    """Compile each selected table entry for sm_90a and report what its PTX holds."""
    try:
        compiler = importlib.import_module("flash4.compiler")
    except ImportError as exc:
        print(f"cannot compile: flash4.compiler does not import ({_error_text(exc)})")
        return 1
    entries = [
        e for e in dispatch.TABLE if e.head_dim in options.head_dims and e.causal in options.causal_modes
    ]
    failures = 0
    reports = []
    for entry in entries:
        c = entry.config
        config = f"{entry.dtype:8} hdim {entry.head_dim:3d} {'causal' if entry.causal else 'full  '} " \
                 f"tile {c.tile_m}x{c.tile_n} stages {c.kv_stages}"
        try:
            report = compiler.compile_entry(entry, arch=COMPILE_ONLY_ARCH)
        except Exception as exc:  # report every entry, then fail at the end
            failures += 1
            print(f"{config}  FAILED {_error_text(exc)}", flush=True)
            reports.append({"entry": dataclasses.asdict(entry), "error": _error_text(exc)})
            continue
        counts = "  ".join(f"{name}={count}" for name, count in report.instructions.items())
        missing = [n for n in REQUIRED_INSTRUCTIONS if not report.instructions.get(n)]
        failures += bool(missing)
        flag = f"  MISSING {', '.join(missing)}" if missing else ""
        ptxas = {"registers": report.registers, "spill_bytes": report.spill_bytes,
                 "serialized_wgmma": report.serialized_wgmma}
        print(f"{config}  {report.seconds:6.1f} s  {counts}  "
              + "  ".join(f"{k}={v}" for k, v in ptxas.items()) + flag, flush=True)
        reports.append({"entry": dataclasses.asdict(entry), "seconds": report.seconds,
                        "instructions": dict(report.instructions), "ptxas": ptxas})
    print(f"{len(entries) - failures} of {len(entries)} kernels compiled with every required instruction")
    if options.out is not None:
        write_json(options.out, {**environment(), "mode": f"compile-only {COMPILE_ONLY_ARCH}",
                                 "command": options.command, "compiles": reports})
    return 1 if failures else 0


def default_command() -> str:
    return shlex.join(getattr(sys, "orig_argv", sys.argv))
