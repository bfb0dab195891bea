"""Compiling flash4's kernels: the compile cache and the compile-only report.

Kernels are compiled once per selector row (``KernelEntry``, a frozen dataclass, is the
cache key) against *fake* tensors: sizes are symbolic, so one compiled kernel serves every
batch, sequence length and head count; only the head dim is fixed. Strides are 64-bit
symbols, so offsets stay exact for tensors past 2^31 elements. Compiling with TVM FFI lets
the compiled function take torch tensors directly and launch on torch's current stream.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flash4.dispatch import KernelEntry
from flash4.kernels.configs import DQTileGeometry

# Instructions the Hopper forward kernel's design depends on; the compile-only report and
# the CPU tests look for each in the PTX.
KEY_INSTRUCTIONS = ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg", "mbarrier")
# TMA moves 16-byte units: every stride but the innermost must be a multiple of 16 bytes,
# i.e. 8 elements of a 2-byte dtype, and the base address 16-byte aligned.
TMA_ALIGN_BYTES = 16
# The Float32 LSE is written element by element: 4-byte alignment is all it needs.
LSE_ALIGN_BYTES = 4
# The dynamic grids' tile counter: one int32, added to by atomics.
TILE_COUNTER_ALIGN_BYTES = 4


# ptxas's remarks when it cannot keep wgmmas in flight: it injected a wait or an arrive
# (C7517, C7519) or serialised the instructions (C7512: too few registers; C7514, C7515:
# other instructions reading or writing a wgmma's accumulator while it runs), so a
# GEMM's instructions run one after another instead of pipelined. Seen with a wgmma
# accumulator in flight across a loop's back edge, with scalar converts between the P V
# wgmmas, and with the backward's Pᵀ held twice at head dim 64.
PTXAS_SERIALIZED_WGMMA = ("C7512", "C7514", "C7515", "C7517", "C7519")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")


@dataclass(frozen=True)
class CompileReport:
    """What compiling one selector row produced."""

    seconds: float
    instructions: dict[str, int]
    ptx: str
    # ptxas's own account of the kernel: registers at launch (before setmaxnreg), bytes
    # spilled to local memory, and how many wgmma groups it had to serialise.
    registers: int = 0
    spill_bytes: int = 0
    serialized_wgmma: int = 0
    # The machine code, when asked for (``keep_cubin``): for reading the SASS with nvdisasm.
    cubin: bytes = b""


def _cutlass_dtype(name: str) -> Any:
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def _fake_tensor(dtype: Any, shape: tuple, align: int) -> Any:
    """A fake tensor with 64-bit symbolic strides and a unit innermost stride."""
    import cutlass.cute as cute

    elems_per_align = max(align * 8 // dtype.width, 1)
    stride = tuple(
        1 if i == len(shape) - 1 else cute.sym_int64(divisibility=elems_per_align)
        for i in range(len(shape))
    )
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _forward_arguments(entry: KernelEntry, with_lse: bool) -> tuple:
    import cutlass
    import cutlass.cute as cute

    dtype = _cutlass_dtype(entry.dtype)
    batch, seqlen_q, seqlen_k, heads, kv_heads = (cute.sym_int() for _ in range(5))
    d = entry.head_dim
    q = _fake_tensor(dtype, (batch, seqlen_q, heads, d), TMA_ALIGN_BYTES)
    k = _fake_tensor(dtype, (batch, seqlen_k, kv_heads, d), TMA_ALIGN_BYTES)
    v = _fake_tensor(dtype, (batch, seqlen_k, kv_heads, d), TMA_ALIGN_BYTES)
    o = _fake_tensor(dtype, (batch, seqlen_q, heads, d), TMA_ALIGN_BYTES)
    lse = _fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), LSE_ALIGN_BYTES) if with_lse else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Int32(1), _fake_tile_counter(entry.config), stream


def _fake_tile_counter(config: Any) -> Any:
    import cutlass

    return _fake_tensor(cutlass.Int32, (1,), TILE_COUNTER_ALIGN_BYTES) if config.dynamic_tiles else None


def tile_counter(config: Any, device: Any) -> Any:
    """The zeroed int32 counter a ``dynamic_tiles`` kernel hands its tiles out by (one a
    launch, zeroed on the current stream before it; graph capture records the zeroing with
    the kernel), or None for the others. Runs on every launch: the rows without a counter
    return before anything else."""
    if not config.dynamic_tiles:
        return None
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device)


def _kernel(entry: KernelEntry) -> Any:
    if entry.kernel != "kernels.sm90_fwd.Sm90ForwardKernel":
        raise ValueError(f"no builder for kernel {entry.kernel}")
    from flash4.kernels.sm90_fwd import Sm90ForwardKernel

    return Sm90ForwardKernel(entry.config, _cutlass_dtype(entry.dtype))


def _compile(entry: KernelEntry, *options: str, with_lse: bool = True) -> Any:
    import cutlass.cute as cute

    if entry.config.fp8:
        from flash4.dispatch import FP8_OUT_DTYPE

        return compile_fp8_forward(entry.config, FP8_OUT_DTYPE, *options, with_lse=with_lse)

    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(_kernel(entry), *_forward_arguments(entry, with_lse), options=flags)


@functools.lru_cache(maxsize=None)
def compiled_forward(entry: KernelEntry, with_lse: bool = True) -> Callable[..., Any]:
    """The compiled kernel for one selector row, for the GPU this process runs on.

    Call it as ``fn(q, k, v, out, lse, softmax_scale_log2, max_ctas, counter)`` with torch
    tensors (``max_ctas``: the SM count, the most CTAs a persistent kernel launches;
    ``counter``: ``tile_counter(entry.config, device)``); built ``with_lse=False`` it takes
    ``None`` for lse and skips writing it.
    """
    return _compile(entry, with_lse=with_lse)


# FP8 descales are read one float32 at a time.
DESCALE_ALIGN_BYTES = 4


def _fp8_forward_arguments(config: Any, out_dtype_name: str, with_lse: bool) -> tuple:
    import cutlass
    import cutlass.cute as cute

    e4m3 = cutlass.Float8E4M3FN
    # Q and K: e4m3, or int8 in the accurate mode.
    qk = cutlass.Int8 if config.fp8_qk_int8 else e4m3
    batch, seqlen_q, seqlen_k, padded_k, heads, kv_heads, m_blocks, n_blocks = (cute.sym_int() for _ in range(8))
    d = config.head_dim
    q = _fake_tensor(qk, (batch, seqlen_q, heads, d), TMA_ALIGN_BYTES)
    k = _fake_tensor(qk, (batch, seqlen_k, kv_heads, d), TMA_ALIGN_BYTES)
    # V transposed: (batch, kv_heads, head_dim, keys padded to whole key groups).
    vt = _fake_tensor(e4m3, (batch, kv_heads, d, padded_k), TMA_ALIGN_BYTES)
    o = _fake_tensor(_cutlass_dtype(out_dtype_name), (batch, seqlen_q, heads, d), TMA_ALIGN_BYTES)
    lse = _fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), LSE_ALIGN_BYTES) if with_lse else None
    q_descale = _fake_tensor(cutlass.Float32, (batch, heads, m_blocks), DESCALE_ALIGN_BYTES)
    k_descale = _fake_tensor(cutlass.Float32, (batch, kv_heads, n_blocks), DESCALE_ALIGN_BYTES)
    # A per-tensor V's kernel reads one float, the first: its descale may come as a (1, 1, 1)
    # view of the tensor's own, with no expanded copy made on every call.
    v_shape = tuple(cute.sym_int() for _ in range(3)) if config.fp8_v_per_tensor else (batch, kv_heads, n_blocks)
    v_descale = _fake_tensor(cutlass.Float32, v_shape, DESCALE_ALIGN_BYTES)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, vt, o, lse, q_descale, k_descale, v_descale, cutlass.Float32(1.0), cutlass.Int32(1),
            _fake_tile_counter(config), stream)


def compile_fp8_forward(config: Any, out_dtype_name: str, *options: str, with_lse: bool = True) -> Any:
    """The FP8 forward kernel (kernels/sm90_fwd_fp8.py) for one ``Sm90ForwardConfig`` with
    ``fp8=True``. Call it as ``fn(q, k, vt, out, lse, q_descale, k_descale, v_descale,
    softmax_scale_log2, max_ctas, counter)`` with torch tensors (see flash4.quantize for vt and the
    descales)."""
    import cutlass.cute as cute

    from flash4.kernels.sm90_fwd_fp8 import Sm90Fp8ForwardKernel

    kernel = Sm90Fp8ForwardKernel(config, _cutlass_dtype(out_dtype_name))
    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(kernel, *_fp8_forward_arguments(config, out_dtype_name, with_lse), options=flags)


# The dQ accumulator is written in 16-byte vectors.
DQ_ACCUM_ALIGN_BYTES = 16
# Turn counters are read and added one int32 at a time.
TURNS_ALIGN_BYTES = 4


def _backward_preprocess_arguments(dtype_name: str, head_dim: int, with_counters: bool) -> tuple:
    import cutlass
    import cutlass.cute as cute

    dtype = _cutlass_dtype(dtype_name)
    batch, seqlen_q, heads, padded = (cute.sym_int() for _ in range(4))
    o = _fake_tensor(dtype, (batch, seqlen_q, heads, head_dim), TMA_ALIGN_BYTES)
    do = _fake_tensor(dtype, (batch, seqlen_q, heads, head_dim), TMA_ALIGN_BYTES)
    lse = _fake_tensor(cutlass.Float32, (batch, heads, seqlen_q), LSE_ALIGN_BYTES)
    d = _fake_tensor(cutlass.Float32, (batch, heads, padded), LSE_ALIGN_BYTES)
    lse_log2 = _fake_tensor(cutlass.Float32, (batch, heads, padded), LSE_ALIGN_BYTES)
    dq_accum = _fake_tensor(cutlass.Float32, (batch, heads, padded * head_dim), DQ_ACCUM_ALIGN_BYTES)
    dq_ready = _fake_tensor(cutlass.Int32, (batch, heads), TURNS_ALIGN_BYTES)
    dq_counters = _fake_tensor(cutlass.Int32, (batch, heads, cute.sym_int()), TURNS_ALIGN_BYTES) if with_counters else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return o, do, lse, d, lse_log2, dq_accum, dq_ready, dq_counters, stream


def compile_backward_preprocess(
    dtype_name: str, head_dim: int, block_rows: int, *options: str, dq_counters_per_block: int = 0
) -> Any:
    """The backward preprocess (kernels/sm90_bwd_preprocess.py) for one dtype, head dim and
    query block size. Call it as ``fn(out, dout, lse, d, lse_log2, dq_accum, dq_ready,
    dq_counters)`` with torch tensors; ``d``, ``lse_log2`` (batch, heads, padded seqlen_q)
    and ``dq_accum`` (batch, heads, padded seqlen_q * head_dim) are float32, padded to whole
    blocks of ``block_rows``; ``dq_ready`` (batch, heads) int32. ``dq_counters_per_block``
    (the main kernel's ``dq_first_stores``): int32 ``dq_counters`` (batch, heads, query
    blocks x that many) are zeroed instead of ``dq_accum``; otherwise pass None.
    """
    import cutlass.cute as cute

    from flash4.kernels.sm90_bwd_preprocess import Sm90BackwardPreprocess

    kernel = Sm90BackwardPreprocess(head_dim, _cutlass_dtype(dtype_name), block_rows, dq_counters_per_block)
    flags = " ".join(("--enable-tvm-ffi", *options))
    arguments = _backward_preprocess_arguments(dtype_name, head_dim, dq_counters_per_block > 0)
    return cute.compile(kernel, *arguments, options=flags)


compiled_backward_preprocess = functools.lru_cache(maxsize=None)(compile_backward_preprocess)


def compile_backward_postprocess(
    dtype_name: str, geometry: DQTileGeometry, *options: str, overlap: bool = False
) -> Any:
    """The backward postprocess (kernels/sm90_bwd_postprocess.py): dQ out of its fp32
    accumulator. Call it as ``fn(dq_accum, dq, dq_ready, key_blocks, softmax_scale)``:
    dq_accum float32 (batch, heads, padded seqlen_q * head_dim), tiled as ``geometry`` says
    (the main kernel's ``config.dq_tile_geometry``); dq 16-bit (batch, seqlen_q, heads,
    head_dim); dq_ready int32 (batch, heads), read only with ``overlap`` (launched while the
    main kernel runs, each CTA waiting for its head's ``key_blocks`` signals)."""
    import cutlass
    import cutlass.cute as cute

    from flash4.kernels.sm90_bwd_postprocess import Sm90BackwardPostprocess

    dtype = _cutlass_dtype(dtype_name)
    batch, seqlen_q, heads, padded = (cute.sym_int() for _ in range(4))
    accum = _fake_tensor(cutlass.Float32, (batch, heads, padded), DQ_ACCUM_ALIGN_BYTES)
    dq = _fake_tensor(dtype, (batch, seqlen_q, heads, geometry.head_dim), TMA_ALIGN_BYTES)
    ready = _fake_tensor(cutlass.Int32, (batch, heads), TURNS_ALIGN_BYTES)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    flags = " ".join(("--enable-tvm-ffi", *options))
    kernel = Sm90BackwardPostprocess(geometry, dtype, overlap)
    return cute.compile(kernel, accum, dq, ready, cutlass.Int32(1), cutlass.Float32(1.0), stream, options=flags)


compiled_backward_postprocess = functools.lru_cache(maxsize=None)(compile_backward_postprocess)


def _backward_arguments(
    dtype_name: str, head_dim: int, kv_accumulate: bool, deterministic: bool, overlap_postprocess: bool,
    dq_counters: bool,
) -> tuple:
    import cutlass
    import cutlass.cute as cute

    dtype = _cutlass_dtype(dtype_name)
    batch, seqlen_q, seqlen_k, heads, kv_heads, padded = (cute.sym_int() for _ in range(6))
    q, do = (_fake_tensor(dtype, (batch, seqlen_q, heads, head_dim), TMA_ALIGN_BYTES) for _ in range(2))
    k, v = (_fake_tensor(dtype, (batch, seqlen_k, kv_heads, head_dim), TMA_ALIGN_BYTES) for _ in range(2))
    # dK, dV: in the input dtype, or fp32 accumulators for GQA/MQA.
    grad_dtype, grad_align = (cutlass.Float32, DQ_ACCUM_ALIGN_BYTES) if kv_accumulate else (dtype, TMA_ALIGN_BYTES)
    dk, dv = (_fake_tensor(grad_dtype, (batch, seqlen_k, kv_heads, head_dim), grad_align) for _ in range(2))
    # Read and written by TMA, per query block.
    lse_log2, d = (_fake_tensor(cutlass.Float32, (batch, heads, padded), TMA_ALIGN_BYTES) for _ in range(2))
    dq_accum = _fake_tensor(cutlass.Float32, (batch, heads, padded, head_dim), TMA_ALIGN_BYTES)
    # Deterministic: int32 turn counters per (query block, head) and (key block, kv head);
    # dq_first_stores alone: dQ's tickets, one per (query block, head).
    m_blocks, n_blocks = cute.sym_int(), cute.sym_int()
    dq_counters = _fake_tensor(cutlass.Int32, (batch, heads, m_blocks), TURNS_ALIGN_BYTES) if dq_counters else None
    kv_turns = (
        _fake_tensor(cutlass.Int32, (batch, kv_heads, n_blocks), TURNS_ALIGN_BYTES)
        if deterministic and kv_accumulate
        else None
    )
    # overlap_postprocess: int32 per (batch, head), the key blocks whose dQ has landed.
    dq_ready = _fake_tensor(cutlass.Int32, (batch, heads), TURNS_ALIGN_BYTES) if overlap_postprocess else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return q, k, v, do, lse_log2, d, dq_accum, dk, dv, dq_counters, kv_turns, dq_ready, cutlass.Float32(1.0), stream


def compile_backward(config: Any, dtype_name: str, *options: str) -> Any:
    """The main backward kernel (kernels/sm90_bwd.py) for one ``Sm90BackwardConfig`` and
    dtype. Call it as ``fn(q, k, v, dout, lse_log2, d, dq_accum, dk, dv, dq_counters, kv_turns,
    dq_ready, softmax_scale)``
    with torch tensors (see flash4.backward for the buffers)."""
    import cutlass.cute as cute

    from flash4.kernels.sm90_bwd import Sm90BackwardKernel

    kernel = Sm90BackwardKernel(config, _cutlass_dtype(dtype_name))
    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(
        kernel,
        *_backward_arguments(
            dtype_name, config.head_dim, config.kv_accumulate, config.deterministic, config.overlap_postprocess,
            config.deterministic or config.dq_first_stores,
        ),
        options=flags,
    )


compiled_backward = functools.lru_cache(maxsize=None)(compile_backward)


# The FP8 quantization's inputs (e4m3: V's values laid out for the FP8 kernel, over a
# descale of 1, which leaves each value as it is).
QUANTIZE_INPUT_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")
# Rows per CTA when the descale is given (per tensor): as many as a blockwise block.
PER_TENSOR_BLOCK_ROWS = 128


def _quantize_dtype(name: str) -> Any:
    import cutlass

    return {"float32": cutlass.Float32, "float8_e4m3fn": cutlass.Float8E4M3FN}.get(name) or _cutlass_dtype(name)


def _kernel_hadamard(head_dim: int, hadamard: bool) -> Any:
    """flash4.quantize's rotation as the kernels take it (None: no rotation)."""
    from flash4.kernels.hadamard_rotation import HadamardSigns
    from flash4.quantize import hadamard_scale, hadamard_signs

    if not hadamard:
        return None
    return HadamardSigns(tuple(int(sign) for sign in hadamard_signs(head_dim).tolist()), hadamard_scale(head_dim))


def compile_quantize_fp8(
    dtype_name: str, head_dim: int, block_rows: int | None, hadamard: bool = False, *options: str,
    fp8_max: float | None = None, int8: bool = False,
) -> Any:
    """flash4.quantize_fp8 on the GPU (kernels/quantize_fp8.py) for one input dtype, head
    dim, descale block (None: one descale per tensor), rotation (``hadamard``: the rows
    rotated first, in the kernel) and largest value (``fp8_max``; None: e4m3's); with
    ``int8``, flash4.quantize_int8 instead. Call it
    as ``fn(x, values, descale, amax)`` with torch tensors: x (batch, seqlen, heads,
    head_dim), values e4m3 (int8) of the same shape, descale
    float32 (batch, heads, blocks) or, per tensor, (1,), written; amax per tensor
    ``compiled_tensor_amax``'s partial maxima (of the rotated rows, if rotating), flat,
    else None."""
    import cutlass
    import cutlass.cute as cute

    from flash4.kernels.quantize_fp8 import QuantizeFp8Rows

    dtype = _quantize_dtype(dtype_name)
    batch, seqlen, heads, blocks, partials = (cute.sym_int() for _ in range(5))
    x = _fake_tensor(dtype, (batch, seqlen, heads, head_dim), TMA_ALIGN_BYTES)
    codes = cutlass.Int8 if int8 else cutlass.Float8E4M3FN
    values = _fake_tensor(codes, (batch, seqlen, heads, head_dim), TMA_ALIGN_BYTES)
    per_tensor = block_rows is None
    descale = _fake_tensor(cutlass.Float32, (1,) if per_tensor else (batch, heads, blocks), LSE_ALIGN_BYTES)
    amax = _fake_tensor(cutlass.Float32, (partials,), LSE_ALIGN_BYTES) if per_tensor else None
    kernel = QuantizeFp8Rows(
        head_dim, dtype, PER_TENSOR_BLOCK_ROWS if per_tensor else block_rows, per_tensor,
        _kernel_hadamard(head_dim, hadamard), **({} if fp8_max is None else dict(fp8_max=fp8_max)), int8=int8,
    )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(kernel, x, values, descale, amax, stream, options=flags)


compiled_quantize_fp8 = functools.lru_cache(maxsize=None)(compile_quantize_fp8)


def compile_tensor_amax(dtype_name: str, head_dim: int, hadamard: bool = False, *options: str) -> Any:
    """The partial maxima of a tensor's magnitudes (kernels/quantize_fp8.py, TensorAmax), for
    a per-tensor descale; with ``hadamard``, of its rows rotated. Call it as ``fn(x, amax)``:
    x (batch, seqlen, heads, head_dim),
    amax float32 (batch, heads, ceil(seqlen / rows)) with rows =
    ``kernels.quantize_fp8.amax_block_rows``, written (flash4.quantize._partial_maxima)."""
    import cutlass
    import cutlass.cute as cute

    from flash4.kernels.quantize_fp8 import TensorAmax

    dtype = _quantize_dtype(dtype_name)
    batch, seqlen, heads, blocks = (cute.sym_int() for _ in range(4))
    x = _fake_tensor(dtype, (batch, seqlen, heads, head_dim), TMA_ALIGN_BYTES)
    amax = _fake_tensor(cutlass.Float32, (batch, heads, blocks), LSE_ALIGN_BYTES)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(TensorAmax(head_dim, dtype, _kernel_hadamard(head_dim, hadamard)), x, amax, stream,
                        options=flags)


compiled_tensor_amax = functools.lru_cache(maxsize=None)(compile_tensor_amax)


def compile_quantize_fp8_transposed_v(dtype_name: str, head_dim: int, *options: str) -> Any:
    """V into the FP8 kernel's V layout (kernels/quantize_fp8.py). Call it as ``fn(v, out,
    amax, descale)``: v (batch, seqlen, kv_heads, head_dim), out uint8 (batch, kv_heads,
    head_dim, keys padded to whole groups of 32); 16-bit or float32 v is quantized per
    tensor, amax ``compiled_tensor_amax``'s partial maxima of v, flat, and descale float32
    (1,) written; e4m3 v only moves, amax and descale None."""
    import cutlass
    import cutlass.cute as cute

    from flash4.kernels.quantize_fp8 import QuantizeFp8TransposedV

    dtype = _quantize_dtype(dtype_name)
    batch, seqlen, heads, padded, partials = (cute.sym_int() for _ in range(5))
    v = _fake_tensor(dtype, (batch, seqlen, heads, head_dim), TMA_ALIGN_BYTES)
    out = _fake_tensor(cutlass.Uint8, (batch, heads, head_dim, padded), TMA_ALIGN_BYTES)
    quantizes = dtype is not cutlass.Float8E4M3FN
    amax = _fake_tensor(cutlass.Float32, (partials,), LSE_ALIGN_BYTES) if quantizes else None
    descale = _fake_tensor(cutlass.Float32, (1,), LSE_ALIGN_BYTES) if quantizes else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    flags = " ".join(("--enable-tvm-ffi", *options))
    return cute.compile(QuantizeFp8TransposedV(head_dim, dtype), v, out, amax, descale, stream, options=flags)


compiled_quantize_fp8_transposed_v = functools.lru_cache(maxsize=None)(compile_quantize_fp8_transposed_v)


def compile_backward_postprocess_report(
    dtype_name: str, geometry: DQTileGeometry, arch: str = "sm_90a", overlap: bool = False
) -> CompileReport:
    """``compile_entry`` for the backward postprocess."""
    return _compile_with_report(
        lambda *flags: compile_backward_postprocess(dtype_name, geometry, *flags, overlap=overlap), arch, False
    )


def compile_quantize_report(
    dtype_name: str, head_dim: int, block_rows: int | None, transposed_v: bool = False, amax: bool = False,
    arch: str = "sm_90a", hadamard: bool = False, int8: bool = False,
) -> CompileReport:
    """``compile_entry`` for the FP8 quantization kernels: the rows kernel (``int8``: to
    int8 codes), or V's layout (``transposed_v``), or the partial maxima (``amax``); the
    first and last rotating the rows first with ``hadamard``."""
    if transposed_v:
        return _compile_with_report(
            lambda *flags: compile_quantize_fp8_transposed_v(dtype_name, head_dim, *flags), arch, False
        )
    if amax:
        return _compile_with_report(
            lambda *flags: compile_tensor_amax(dtype_name, head_dim, hadamard, *flags), arch, False
        )
    return _compile_with_report(
        lambda *flags: compile_quantize_fp8(dtype_name, head_dim, block_rows, hadamard, *flags, int8=int8), arch,
        False,
    )


def compile_entry(
    entry: KernelEntry, arch: str = "sm_90a", with_lse: bool = True, keep_cubin: bool = False
) -> CompileReport:
    """Compile one selector row for ``arch`` (no GPU needed) and count key PTX instructions."""
    return _compile_with_report(
        lambda *flags: _compile(entry, *flags, with_lse=with_lse), arch, keep_cubin
    )


def compile_backward_report(
    config: Any, dtype_name: str = "bfloat16", arch: str = "sm_90a", keep_cubin: bool = False
) -> CompileReport:
    """``compile_entry`` for the main backward kernel of one ``Sm90BackwardConfig``."""
    return _compile_with_report(lambda *flags: compile_backward(config, dtype_name, *flags), arch, keep_cubin)


def _compile_with_report(compile_fn: Callable[..., Any], arch: str, keep_cubin: bool) -> CompileReport:
    start = time.perf_counter()
    remarks = io.StringIO()
    # The DSL prints ptxas's remarks (registers, spills, serialisation) as Python warnings
    # text on stderr; they are read back here instead of shown.
    # The DSL writes the kept PTX to a file; a scratch folder keeps it out of the caller's
    # working directory.
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stderr(remarks):
        keep = ("--keep-ptx", "--keep-cubin") if keep_cubin else ("--keep-ptx",)
        compiled = compile_fn(f"--gpu-arch={arch}", *keep, f"--dump-dir={scratch}", "remarks{ptx}")
        ptx = compiled.__ptx__ or ""
        cubins = sorted(Path(scratch).glob("*.cubin")) if keep_cubin else []
        cubin = cubins[0].read_bytes() if cubins else b""
    seconds = time.perf_counter() - start
    log = remarks.getvalue()
    registers = _PTXAS_REGISTERS.search(log)
    return CompileReport(
        seconds,
        {name: ptx.count(name) for name in KEY_INSTRUCTIONS},
        ptx,
        registers=int(registers.group(1)) if registers else 0,
        spill_bytes=sum(int(n) for n in _PTXAS_SPILLS.findall(log)),
        serialized_wgmma=sum(log.count(code) for code in PTXAS_SERIALIZED_WGMMA),
        cubin=cubin,
    )
