"""``python -m flash4``: ``info`` prints the selector's table, ``bench`` runs the benchmark,
``report`` turns a benchmark's JSON into markdown and plots."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from flash4 import dispatch

_CAUSAL_MODES = {"both": (False, True), "yes": (True,), "no": (False,)}


def info(arch: str | None) -> int:
    """Print the table rows for ``arch``, or for the current GPU's architecture."""
    if arch is not None:
        if arch not in dispatch.SUPPORTED_ARCHS:
            print(f"flash4 has no kernels for {arch}; supported architectures: "
                  f"{', '.join(dispatch.SUPPORTED_ARCHS)} (Hopper: H100/H200)")
            return 1
        print(dispatch.format_table(arch))
        return 0

    import torch  # only here: the explicit-arch path above stays fast

    if not torch.cuda.is_available():
        print("No CUDA GPU found; showing the table for every architecture.")
        print(dispatch.format_table())
        return 0
    major, minor = torch.cuda.get_device_capability()
    current = dispatch.arch_of_capability(major, minor)
    print(f"GPU: {torch.cuda.get_device_name()} (compute capability {major}.{minor}, {current})")
    if current not in dispatch.SUPPORTED_ARCHS:
        print(f"flash4 has no kernels for {current}; showing the table for every architecture.")
        print(dispatch.format_table())
        return 0
    print(dispatch.format_table(current))
    return 0


def bench(args: argparse.Namespace, command: str) -> int:
    if args.compare:
        return compare(*args.compare)
    from flash4 import bench as bench_module  # imports torch; keep `info --arch` light

    try:
        options = bench_module.Options(
            head_dims=tuple(args.hdim) if args.hdim else bench_module.HEAD_DIMS,
            seqlens=tuple(args.seqlen) if args.seqlen else None,
            causal_modes=_CAUSAL_MODES[args.causal],
            quick=args.quick,
            passes=tuple(args.passes),
            peers=tuple(args.peers),
            rounds=args.rounds,
            group=args.group,
            dtype=args.dtype,
            out=args.out,
            command=command,
        )
        options.shapes()  # a --group that does not divide some head dim's heads
    except ValueError as exc:
        print(f"cannot bench: {exc}")
        return 2
    return bench_module.run(options)


def report_command(run: Path, plots: Path | None) -> int:
    """Print a run's markdown report and, with ``plots``, draw its PNG plots there."""
    from flash4 import report

    try:
        payload = report.load(run)
    except ValueError as exc:
        print(f"cannot report: {exc}")
        return 2
    print(report.report_markdown(payload))
    if plots is not None:
        try:
            for path in report.plot_report(payload, plots, prefix=f"{run.stem}-"):
                print(f"wrote {path}")
        except ImportError as exc:
            print(f"cannot plot: {exc}")
            return 2
    return 0


def compare(a: Path, b: Path) -> int:
    """Print the shape-by-shape comparison of two benchmark JSON files."""
    from flash4 import report

    try:
        runs = [report.load(path) for path in (a, b)]
    except ValueError as exc:
        print(f"cannot compare: {exc}")
        return 2
    print(report.compare_markdown(*runs, a_name=a.stem, b_name=b.stem), end="")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flash4", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    info_parser = commands.add_parser("info", help="print the kernel selector's table")
    info_parser.add_argument("--arch", help="an architecture such as sm_90a (default: this GPU's)")

    report_parser = commands.add_parser("report", help="a benchmark JSON as a markdown report, and its plots")
    report_parser.add_argument("run", type=Path, help="the JSON that `bench --out` wrote")
    report_parser.add_argument("--plots", type=Path, help="draw the PNG plots into this folder (needs matplotlib)")

    bench_parser = commands.add_parser(
        "bench", help="time the forward pass against peers (or, without a supported GPU, compile every kernel)"
    )
    bench_parser.add_argument("--hdim", type=int, nargs="+", choices=(64, 128, 256), help="head dims (default: all)")
    bench_parser.add_argument("--seqlen", type=_positive_int, nargs="+",
                              help="sequence lengths (default: 512 ... 16384); batch = 16384 // seqlen")
    bench_parser.add_argument("--causal", choices=tuple(_CAUSAL_MODES), default="both")
    bench_parser.add_argument("--quick", action="store_true",
                              help="seqlens 1024/4096/16384 (unless --seqlen) and shorter timing")
    bench_parser.add_argument("--pass", dest="passes", nargs="+", choices=("fwd", "bwd", "fp8"), default=["fwd"],
                              help="forward, backward (dq, dk, dv from dout; FLOPs 2.5x forward) and/or the FP8 "
                                   "forward (against cuDNN's FP8 attention)")
    bench_parser.add_argument("--peers", nargs="+", choices=("sdpa-cudnn", "sdpa-flash", "fa4", "cudnn-fp8"),
                              default=["sdpa-cudnn", "sdpa-flash", "fa4", "cudnn-fp8"],
                              help="the peers timed beside flash4 (default: all four; cudnn-fp8 in the fp8 pass)")
    bench_parser.add_argument("--group", type=_positive_int, default=1,
                              help="query heads per kv head (GQA/MQA; default 1, multi-head); it must divide "
                                   "every head dim's heads (2048 // head dim)")
    bench_parser.add_argument("--rounds", type=_positive_int, default=1,
                              help="time every provider this many times, taking turns, and keep each "
                                   "one's median (evens out clock drift between providers; default 1)")
    bench_parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16",
                              help="the inputs' type in the fwd and bwd passes (default bf16; the fp8 pass "
                                   "quantizes bf16, so it runs alone)")
    bench_parser.add_argument("--out", type=Path,
                              help="FILE.json: the results there and a markdown report beside it (.md); "
                                   "otherwise a folder for report.json and report.md")
    bench_parser.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                              help="instead of timing: compare two runs' results shape by shape")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "info":
        return info(args.arch)
    if args.command == "report":
        return report_command(args.run, args.plots)
    from flash4.bench import default_command

    command = default_command() if argv is None else "python -m flash4 " + " ".join(argv)
    return bench(args, command)
