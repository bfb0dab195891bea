"""Host cost per call at a tiny shape, where the GPU work is negligible (issue 3's protocol).

    python perf/host_overhead.py [--calls 1000] [--breakdown] [--fp8 [--short-shapes]]

Wall time of ``calls`` back-to-back calls followed by one synchronize, divided by calls:
what a framework pays per attention call when the kernel itself takes a few microseconds.
Shape: batch 1, seqlen 128, 16 heads, head dim 64, bf16; beside flash4's call, its kernel
alone, its call under torch.compile and its custom op called eagerly (flash4/custom_ops.py),
SDPA and flash-attn-4. ``--breakdown`` times each step
of ``flash_attn_func`` on its own instead. ``--fp8``: the same for the FP8 calls, on the
bench's FP8 inputs (Q and K blockwise, V per tensor and laid out beforehand), beside
cuDNN's FP8 graph where it imports; with ``--breakdown``, each step of
``flash_attn_fp8_quantized`` and of ``flash_attn_fp8`` (with and without the rotation);
with ``--short-shapes``, the call against its kernel alone
on the FP8 bench's shapes at seqlen 512 and 1k.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, NamedTuple

import torch

import flash4
from flash4 import forward
from flash4.checks import check_attention_args
from flash4.devices import device_sms
from flash4.forward import _KERNELS, LOG2_E

BATCH, SEQLEN, HEADS, HEAD_DIM = 1, 128, 16, 64


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def breakdown(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: int) -> None:
    """Microseconds of each step of ``flash_attn_func``, timed alone."""
    problem = check_attention_args(q, k, v, None, False)
    kernel, _ = forward.forward_kernel(q.device.index, problem, False)
    out = torch.empty_like(q)
    sms = device_sms(q.device.index)
    steps: dict[str, Callable[[], object]] = {
        "flash_attn_func": lambda: flash4.flash_attn_func(q, k, v),
        "check_attention_args": lambda: check_attention_args(q, k, v, None, False),
        "torch.empty_like(q) for out": lambda: torch.empty_like(q, memory_format=torch.contiguous_format),
        "torch.empty(q.shape, ...)": lambda: torch.empty(q.shape, dtype=q.dtype, device=q.device),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "forward_kernel lookup": lambda: forward.forward_kernel(q.device.index, problem, False),
        "kernel call (same out)": lambda: kernel(q, k, v, out, None, 0.18, sms, None),
        "kernel call (fresh out)": lambda: kernel(q, k, v, torch.empty_like(q), None, 0.18, sms, None),
    }
    for name, fn in steps.items():
        print(f"{name:32s} {per_call_us(fn, calls):7.2f} us", flush=True)


class Fp8Calls(NamedTuple):
    """``flash_attn_fp8_quantized`` on the inputs the bench's FP8 provider times (Q and K
    blockwise, V per tensor and laid out beforehand), and its compiled kernel called alone
    with the arguments the call gives it."""

    call: Callable[[], object]
    kernel_only: Callable[[], object]
    inputs: tuple  # q8, k8, v8
    entry: object  # the selector's row


def fp8_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Fp8Calls:
    from flash4.compiler import compiled_forward, tile_counter
    from flash4.dispatch import select_fp8
    from flash4.fp8 import flash_attn_fp8_quantized, fp8_blocks, kernel_descales
    from flash4.quantize import quantize_fp8, transpose_fp8_v

    batch, seqlen, heads, head_dim = q.shape
    scale = head_dim**-0.5
    blocks = fp8_blocks(head_dim, causal, seqlen)
    q8, k8, v8 = quantize_fp8(q, blocks.q), quantize_fp8(k, blocks.kv), transpose_fp8_v(quantize_fp8(v, None))
    entry = select_fp8("sm_90a", head_dim, causal, seqlen, v_per_tensor=True)
    kernel = compiled_forward(entry, False)
    out = torch.empty_like(q)
    descales = kernel_descales(q8, k8, v8, batch, heads, k.shape[2], -(-seqlen // entry.config.tile_m),
                               -(-k.shape[1] // entry.config.tile_n))
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    counter = tile_counter(entry.config, q.device)
    return Fp8Calls(
        lambda: flash_attn_fp8_quantized(q8, k8, v8, softmax_scale=scale, causal=causal),
        lambda: kernel(q8.values, k8.values, v8.values, out, None, *descales, scale * LOG2_E, sms, counter),
        (q8, k8, v8),
        entry,
    )


def fp8_overhead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: int, steps: bool) -> None:
    """Host cost of the FP8 calls (or, ``steps``, of each step of
    ``flash_attn_fp8_quantized``), beside cuDNN's FP8 graph where it imports."""
    from flash4 import bench
    from flash4.compiler import compiled_forward, compiled_quantize_fp8_transposed_v
    from flash4.dispatch import select_fp8
    from flash4.fp8 import OUT_DTYPE, check_fp8_args, flash_attn_fp8
    from flash4.quantize import _partial_maxima, quantize_fp8_transposed_v, quantize_on_gpu

    scale = HEAD_DIM**-0.5
    fp8 = fp8_calls(q, k, v, False)
    if steps:
        (q8, k8, v8), entry = fp8.inputs, fp8.entry
        v_layout_kernel = compiled_quantize_fp8_transposed_v("bfloat16", HEAD_DIM)
        layout_shape = tuple(v8.values.shape)
        v_out = torch.empty(layout_shape, dtype=torch.uint8, device=v.device)
        v_amax = _partial_maxima(v)
        v_descale = torch.empty(1, dtype=torch.float32, device=v.device)
        for name, fn in {
            "flash_attn_fp8_quantized": fp8.call,
            "check_fp8_args": lambda: check_fp8_args(q8, k8, v8, scale, False),
            "select_fp8": lambda: select_fp8("sm_90a", HEAD_DIM, False, SEQLEN, v_per_tensor=True),
            "compiled_forward lookup": lambda: compiled_forward(entry, False),
            "torch.empty_like for out": lambda: torch.empty_like(
                q8.values, dtype=OUT_DTYPE, memory_format=torch.contiguous_format
            ),
            "kernel call (same out)": fp8.kernel_only,
            # flash_attn_fp8's steps: its check, two quantizations, V's layout, the launch.
            "flash_attn_fp8 (quantizing)": lambda: flash_attn_fp8(q, k, v, softmax_scale=scale),
            "flash_attn_fp8 hadamard": lambda: flash_attn_fp8(q, k, v, softmax_scale=scale, hadamard=True),
            "check_attention_args": lambda: check_attention_args(q, k, v, scale, False),
            "quantize_on_gpu(q, tile_m)": lambda: quantize_on_gpu(q, entry.config.tile_m, False),
            "quantize_on_gpu(q, tile_m, rotated)": lambda: quantize_on_gpu(q, entry.config.tile_m, True),
            "quantize_on_gpu(k, tile_n)": lambda: quantize_on_gpu(k, entry.config.tile_n, False),
            "quantize_fp8_transposed_v(v)": lambda: quantize_fp8_transposed_v(v),
            # Its steps: the partial maxima's kernel (with its allocation), the layout's
            # allocations, and the layout kernel's call alone.
            "_partial_maxima(v)": lambda: _partial_maxima(v),
            "torch.empty for V's layout": lambda: torch.empty(
                layout_shape, dtype=torch.uint8, device=v.device
            ),
            "torch.empty(()) for a descale": lambda: torch.empty((), dtype=torch.float32, device=v.device),
            "V layout kernel call (same out)": lambda: v_layout_kernel(v, v_out, v_amax, v_descale),
        }.items():
            print(f"{name:32s} {per_call_us(fn, calls):7.2f} us", flush=True)
        return
    providers: dict[str, Callable[[], object]] = {
        "flash4 fp8 (quantized inputs)": fp8.call,
        "flash4 fp8 compiled kernel only": fp8.kernel_only,
        "flash_attn_fp8 (quantizing)": lambda: flash_attn_fp8(q, k, v, softmax_scale=scale),
    }
    if "cudnn-fp8" in bench.FP8_PROVIDERS:
        try:
            providers["cudnn fp8"] = bench.FP8_PROVIDERS["cudnn-fp8"](q, k, v, False, scale)[0]
        except ImportError as exc:
            print(f"cudnn fp8: {exc}")
    for name, fn in providers.items():
        print(f"{name:32s} {per_call_us(fn, calls):7.1f} us per call", flush=True)


def fp8_short_shapes(calls: int) -> None:
    """The FP8 bench's shapes at seqlen 512 and 1k, where a kernel takes 60-240 us: the call
    against its compiled kernel alone in do_bench (GPU time between launches: what the
    call launches besides the kernel), twice each, alternating, and the call's wall time
    per call back to back (at or above the kernel's time once the host binds)."""
    from triton.testing import do_bench

    for head_dim in (64, 128, 256):
        for causal in (False, True):
            for seqlen in (512, 1024):
                batch, heads = 16384 // seqlen, 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                fp8 = fp8_calls(q, k, v, causal)
                (call_1, alone_1), (call_2, alone_2) = (
                    [do_bench(fn, warmup=25, rep=100) * 1e3 for fn in (fp8.call, fp8.kernel_only)] for _ in range(2)
                )
                print(f"head dim {head_dim:3d} {'causal' if causal else 'full  '} seqlen {seqlen:4d}: do_bench call "
                      f"{call_1:6.1f} / {call_2:6.1f} us, kernel alone {alone_1:6.1f} / {alone_2:6.1f} us; "
                      f"call wall {per_call_us(fp8.call, calls):6.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--fp8", action="store_true")
    parser.add_argument("--short-shapes", action="store_true", help="with --fp8: the bench's FP8 shapes at 512 and 1k")
    args = parser.parse_args()
    q, k, v = (torch.randn(BATCH, SEQLEN, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    if args.fp8 and args.short_shapes:
        fp8_short_shapes(args.calls // 4)
        return
    if args.fp8:
        fp8_overhead(q, k, v, args.calls, args.breakdown)
        return
    flash4.flash_attn_func(q, k, v)
    if args.breakdown:
        breakdown(q, k, v, args.calls)
        return
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.empty_like(q)
    kernel, _ = next(iter(_KERNELS.values()))
    scale_log2 = HEAD_DIM**-0.5 * LOG2_E
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    providers: dict[str, Callable[[], object]] = {
        "flash4": lambda: flash4.flash_attn_func(q, k, v),
        # The compiled kernel alone (TVM FFI call and launch): the floor under flash4's checks.
        "flash4 compiled kernel only": lambda: kernel(q, k, v, out, None, scale_log2, sms, None),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
    }
    try:
        from flash_attn.cute import flash_attn_func as fa4

        providers["fa4"] = lambda: fa4(q, k, v)
    except ImportError:
        pass
    # Under torch.compile the call is flash4's custom op (flash4/custom_ops.py) in a graph of
    # one node: what the dispatcher's custom-op path and the compiled graph's call cost.
    compiled = torch.compile(lambda q, k, v: flash4.flash_attn_func(q, k, v), fullgraph=True)
    providers["flash4 under torch.compile"] = lambda: compiled(q, k, v)
    providers["flash4 custom op, eager"] = lambda: torch.ops.flash4.attention_forward(
        q, k, v, HEAD_DIM**-0.5, False, False, False
    )
    for name, fn in providers.items():
        print(f"{name:28s} {per_call_us(fn, args.calls):7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
