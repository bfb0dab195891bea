"""What the timer's L2 flush adds to a short kernel's time: the bench's providers timed after
three kinds of flush, and by do_bench itself.

triton.testing.do_bench (the protocol's timer) zeroes a 256 MB buffer before every timed
call, so the call starts with the L2 full of that buffer's dirty lines (its size, 50 MB on the
H100 and H200), and its own reads evict them: the write-backs cross DRAM inside the timed
window. Against the FP8 forward's 168 MB at head dim 128 causal 512 (e4m3 Q, K, V in,
bf16 O out) that is up to 30% more bytes, against the bf16 forward's 268 MB up to 19%,
pulling the ratio of the two below the bytes' own 1.6 (perf/short_row_ceiling.py). On an
H100 the write-backs cost both kernels about 7 us a call there, 1.50x -> 1.56x with a
clean L2 (perf/h200-findings.md, "The timer's flush").

Each call is timed with CUDA events after one of:

- ``zero``: the buffer zeroed (do_bench's flush): cold inputs, the L2 dirty;
- ``read``: the buffer summed (read, not written): cold inputs, the L2 clean;
- ``none``: nothing (the calls back to back: what the last call left, inputs partly warm);
- ``do_bench``: triton.testing.do_bench itself, its median, to check ``zero`` against.

The providers take turns (``--rounds``), each mode's median per round, the fastest round
kept; the ratio of the first provider to each other one is printed per mode.

    python perf/l2_flush_probe.py [--hdim 128] [--seqlen 512 1024 2048] [--causal both]
                                  [--pass fp8] [--providers flash4 flash4-bf16 cudnn-fp8]
                                  [--out perf/results/h100/DATE-l2-flush-probe.json]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any, Callable

import torch

from flash4 import bench

MODES = ("zero", "read", "none", "do_bench")
# Timed calls per mode and round (after bench.EVENT_WARMUP_CALLS untimed ones).
CALLS = 50


def flushes() -> dict[str, Callable[[], Any]]:
    buffer = torch.empty(bench.L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    total = torch.empty((), dtype=torch.int64, device="cuda")
    return {
        "zero": buffer.zero_,
        # The sum's single output is all it writes.
        "read": lambda: torch.sum(buffer, dim=0, dtype=torch.int64, out=total),
        "none": lambda: None,
    }


def median_ms(call: Callable[[], Any], mode: str, flush: dict[str, Callable[[], Any]]) -> float:
    if mode == "do_bench":
        import triton.testing

        return float(triton.testing.do_bench(call, return_mode="median"))
    return bench.event_median_ms(call, CALLS, flush[mode])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--pass", dest="pass_", choices=tuple(bench.PASS_PROVIDERS), default="fp8")
    parser.add_argument("--providers", nargs="+", default=[bench.FLASH4, "flash4-bf16", "cudnn-fp8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    causal_modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    flush = flushes()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: L2 {l2_bytes / 2**20:.0f} MiB")
    records: list[dict[str, Any]] = []
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, causal_modes, passes=(args.pass_,)):
        q, k, v = (torch.randn(shape.batch, shape.seqlen, shape.heads, shape.head_dim, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        scale = 1.0 / math.sqrt(shape.head_dim)
        calls: dict[str, Callable[[], Any]] = {}
        errors: dict[str, str] = {}
        for name in args.providers:
            try:
                calls[name] = bench.PASS_PROVIDERS[shape.pass_][name](q, k, v, shape.causal, scale)[0]
                calls[name]()
            except Exception as exc:  # a peer missing or a shape it refuses: reported, not timed
                errors[name] = f"{type(exc).__name__}: {exc}"[:200]
        rounds: dict[str, dict[str, list[float]]] = {mode: {name: [] for name in calls} for mode in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                for name, call in calls.items():
                    rounds[mode][name].append(median_ms(call, mode, flush))
        flops = bench.attention_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim,
                                      shape.causal)
        fastest = {mode: {name: min(ms) for name, ms in by_name.items()} for mode, by_name in rounds.items()}
        label = f"d{shape.head_dim} {'causal' if shape.causal else 'full'} s{shape.seqlen}"
        first = next(iter(calls), None)
        for mode in MODES:
            cells = [f"{name} {ms * 1e3:7.1f} us {flops / ms / 1e9:5.0f}" for name, ms in fastest[mode].items()]
            ratios = [f"{first}/{name} {fastest[mode][name] / fastest[mode][first]:.3f}"
                      for name in fastest[mode] if name != first]
            print(f"{label} {mode:4s}: " + " | ".join(cells) + "  (" + ", ".join(ratios) + ")", flush=True)
        for name, error in errors.items():
            print(f"{label}: {name} not timed ({error})")
        records.append({"shape": vars(shape), "flops": flops, "ms_rounds": rounds, "errors": errors})
        if args.out:
            bench.write_probe_json(args.out, records, modes=MODES, calls=CALLS, flush_bytes=bench.L2_FLUSH_BYTES,
                                   l2_bytes=l2_bytes)


if __name__ == "__main__":
    main()
