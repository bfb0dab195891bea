"""Issue rates of the softmax's instructions on one SM: the exponential on MUFU in fp32 and
packed 16-bit forms, and the conversions that pack P for the next GEMM.

    python perf/mufu_rate.py [--iters 4096] [--out rates.json]   # on a GPU
    CUTE_DSL_ARCH=sm_90a python perf/mufu_rate.py --sass         # no GPU: the SASS of each

Each op runs in independent dependency chains, enough of them per SM to cover latency, so
the time measures throughput: instructions per clock per SM (the clock read after the run).
The question it answers: does ``ex2.approx.f16x2`` (or ``.bf16x2``) give two exponentials
per MUFU slot, which would halve the exponential's cost where P is rounded to 16 or 8 bits
anyway? On sm_90 ptxas splits it into two ``MUFU.EX2.F16`` (``--sass`` shows it) and the
H200 issues those at the fp32 rate: no.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T

# Independent chains per thread, and threads per CTA and CTAs per SM: 64 warps of 8 chains
# each keep every pipe's queue full.
CHAINS = 8
THREADS = 256
CTAS_PER_SM = 8

# name -> (register kind: "f" fp32 or "r" 32-bit integer, PTX reading $1 and writing $0).
# Each result feeds the same op again; the negation keeps ex2's argument bounded.
OPS: dict[str, tuple[str, str]] = {
    "ex2_f32": ("f", "{ .reg .f32 t; neg.f32 t, $1; ex2.approx.ftz.f32 $0, t; }"),
    "ex2_f16x2": ("r", "{ .reg .b32 t; xor.b32 t, $1, 0x80008000; ex2.approx.f16x2 $0, t; }"),
    "ex2_bf16x2": ("r", "{ .reg .b32 t; xor.b32 t, $1, 0x80008000; ex2.approx.ftz.bf16x2 $0, t; }"),
    "cvt_f16x2_f32": ("r", "{ .reg .f32 a; mov.b32 a, $1; cvt.rn.f16x2.f32 $0, a, a; }"),
    "cvt_bf16x2_f32": ("r", "{ .reg .f32 a; mov.b32 a, $1; cvt.rn.bf16x2.f32 $0, a, a; }"),
    "cvt_e4m3x2_f32": (
        "r", "{ .reg .f32 a; .reg .b16 h; mov.b32 a, $1; cvt.rn.satfinite.e4m3x2.f32 h, a, a; cvt.u32.u16 $0, h; }"
    ),
    "cvt_e4m3x2_f16x2": ("r", "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f16x2 h, $1; cvt.u32.u16 $0, h; }"),
    # An exponential and a conversion in one chain: if they shared a pipe, the pair would
    # take the sum of their times.
    "ex2_then_cvt_bf16x2": ("r", "{ .reg .f32 a; mov.b32 a, $1; ex2.approx.ftz.f32 a, a; cvt.rn.bf16x2.f32 $0, a, a; }"),
    "ex2_then_fma": ("f", "{ .reg .f32 t; ex2.approx.ftz.f32 t, $1; fma.rn.f32 $0, t, 0fBF000001, 0f3E000000; }"),
    "fma_f32": ("f", "fma.rn.f32 $0, $1, 0f3F000001, 0f3E000000;"),
    "hfma2": ("r", "{ .reg .b32 c; mov.b32 c, 0x3C003C00; fma.rn.f16x2 $0, $1, c, c; }"),
}


def _apply(kind: str, text: str, value):
    result_type, constraint, wrap = (T.f32(), "=f,f", Float32) if kind == "f" else (T.i32(), "=r,r", Int32)
    return wrap(
        llvm.inline_asm(result_type, [wrap(value).ir_value()], text, constraint, has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    )


def make_launcher(op: str, iters: int):
    kind, text = OPS[op]

    @cute.kernel
    def kernel(out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(kind == "f"):
            chains = [Float32(tidx) * Float32(1e-3) + Float32(0.01 * c) for c in range(CHAINS)]
        else:
            chains = [Int32(tidx) + Int32(0x3C00 * (c + 1)) for c in range(CHAINS)]
        for _ in cutlass.range(iters, unroll=4):
            for c in cutlass.range_constexpr(CHAINS):
                chains[c] = _apply(kind, text, chains[c])
        total = chains[0]
        for c in cutlass.range_constexpr(1, CHAINS):
            total = total + chains[c]
        # Stored, so that no chain is dead code.
        out[bidx * THREADS + tidx] = Int32(total)

    @cute.jit
    def launch(out: cute.Tensor, ctas: Int32):
        kernel(out).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1))

    return launch


def sm_clock_mhz() -> float:
    query = ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
    return float(subprocess.run(query, capture_output=True, text=True, check=True).stdout.split()[0])


def print_sass(iters: int) -> None:
    from sass_local import disassemble

    for op in OPS:
        with tempfile.TemporaryDirectory() as scratch:
            out = cute.runtime.make_fake_tensor(Int32, (THREADS,), stride=(1,), assumed_align=16)
            cute.compile(make_launcher(op, iters), out, Int32(1),
                         options=f"--gpu-arch=sm_90a --keep-cubin --dump-dir={scratch}")
            cubin = next(Path(scratch).glob("*.cubin")).read_bytes()
        opcodes = (instruction.split()[0] for instruction in disassemble(cubin))
        ops = sorted({o for o in opcodes if o.split(".")[0] in ("MUFU", "F2FP", "FFMA", "HFMA2")})
        print(f"{op:22s} {' '.join(ops)}")


def measure(iters: int) -> dict[str, dict[str, float]]:
    import torch
    from cutlass.cute.runtime import from_dlpack

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms * CTAS_PER_SM
    out = torch.zeros(ctas * THREADS, dtype=torch.int32, device="cuda")
    rates = {}
    for op in OPS:
        launch = cute.compile(make_launcher(op, iters), from_dlpack(out), Int32(ctas))
        for _ in range(3):
            launch(from_dlpack(out), Int32(ctas))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            launch(from_dlpack(out), Int32(ctas))
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 10
        clock = sm_clock_mhz()
        per_clock = ctas * THREADS * iters * CHAINS / (ms * 1e-3) / sms / (clock * 1e6)
        rates[op] = dict(ms=round(ms, 4), instructions_per_clock_per_sm=round(per_clock, 2), sm_clock_mhz_after=clock)
        print(f"{op:22s} {ms:8.3f} ms  {per_clock:6.2f} instructions/clock/SM  ({clock:.0f} MHz after)")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=4096)
    parser.add_argument("--sass", action="store_true", help="print each op's SASS opcodes (no GPU needed)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.sass:
        print_sass(args.iters)
        return
    from flash4 import bench

    rates = measure(args.iters)
    if args.out:
        payload = {**bench.environment(), "command": f"python3 perf/mufu_rate.py --iters {args.iters}", "rates": rates}
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
