"""Two kernels side by side from one ncu report: where the cycles go, not only how many.

On the GPU machine (``profile_once.py`` runs flash4 and a peer on the same tensors):

    ncu --clock-control none -k regex:'Sm90BackwardKernel|FlashAttentionBackwardSm90' --set full \\
        --import-source no -o run python3 perf/profile_once.py --pass bwd --hdim 128 --seqlen 4096 --causal
    ncu -i run.ncu-rep --page details --csv > details.csv
    ncu -i run.ncu-rep --page raw --csv > raw.csv
    ncu -i run.ncu-rep --page source --print-source sass --csv > sass.csv

(Several profiles from one device call: tar their folders into one file under $OUT; the
device tool brings back only a few files per call.)

Then, anywhere:

    python perf/ncu_compare.py --dir DIR [--kernels flash4 flash_attn] [--top 12]

For the last launch of each kernel (named by a substring of its name; warm-up launches come
first): the headline metrics (cycles, issue rate, throughputs), the warp-stall samples by
reason, the shared-memory instructions with their wavefronts against the ideal (bank
conflicts show as a ratio above 1), the executed opcodes, and the instructions that
collect the most samples of the stalls where the two differ most. Read what it prints
against the source: a stall sits on the instruction that waits, not on the one it waits
for.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path

# Headline metrics of the details page, by (section, name) prefix.
HEADLINE = (
    ("GPU Speed Of Light Throughput", "Elapsed Cycles"),
    ("GPU Speed Of Light Throughput", "Duration"),
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("GPU Speed Of Light Throughput", "Memory Throughput"),
    ("GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("Compute Workload Analysis", "Executed Ipc Active"),
    ("Compute Workload Analysis", "Issue Slots Busy"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("Instruction Statistics", "Executed Instructions"),
    ("Launch Statistics", "Registers Per Thread"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block"),
    ("Launch Statistics", "Grid Size"),
    ("Occupancy", "Achieved Active Warps Per SM"),
)
# Opcodes that go through shared memory (wavefront columns of the source page).
SHARED_OPCODES = ("LDS", "STS", "LDSM", "STSM")


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _pick(names: list[str], wanted: str) -> str:
    """The kernel whose name contains ``wanted`` (its last launch is used)."""
    matches = [name for name in names if wanted in name]
    if not matches:
        raise SystemExit(f"no kernel name contains {wanted!r}; names: {sorted(set(n[:80] for n in names))}")
    return matches[-1]


def details(path: Path, wanted: list[str]) -> list[dict[tuple[str, str], str]]:
    """Per wanted kernel, its last launch's (section, metric) -> 'value unit'."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    launches: dict[str, dict[tuple[str, str], str]] = collections.defaultdict(dict)
    order: list[str] = []
    for row in rows:
        if not row.get("Metric Name"):
            continue
        key = row["Kernel Name"] + "#" + row["ID"]
        if key not in launches:
            order.append(key)
        launches[key][(row["Section Name"], row["Metric Name"])] = f"{row['Metric Value']} {row['Metric Unit']}".strip()
    return [launches[_pick(order, w)] for w in wanted]


def stall_samples(path: Path, wanted: list[str]) -> list[dict[str, float]]:
    """Per wanted kernel, the warp-state samples by stall reason (issued or not)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, launches = rows[0], rows[2:]  # the second row holds units
    name_at = header.index("Kernel Name")
    result = []
    for w in wanted:
        row = [r for r in launches if w in r[name_at]][-1]
        result.append({
            m.group(1): _number(row[i])
            for i, column in enumerate(header)
            if (m := re.fullmatch(r"smsp__pcsamp_warps_issue_stalled_(\w+)", column)) and not column.endswith("_not_issued")
        })
    return result


def sass(path: Path, wanted: list[str]) -> list[list[dict[str, str]]]:
    """Per wanted kernel, its last launch's source-page rows (one per SASS instruction)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    kernels: list[tuple[str, list[dict[str, str]]]] = []
    header: list[str] | None = None
    for row in rows:
        if row and row[0] == "Kernel Name":
            kernels.append((row[1], []))
            header = None
        elif row and row[0] == "Address":
            header = row
        elif kernels and header and len(row) >= len(header) - 1:
            kernels[-1][1].append(dict(zip(header, row)))
    return [[rows for name, rows in kernels if w in name][-1] for w in wanted]


def opcode(source: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return text.split(" ")[0] if text else "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True, help="holds details.csv, raw.csv, sass.csv")
    parser.add_argument("--kernels", nargs=2, default=("flash4", "flash_attn"), help="substrings of the names")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--stalls", nargs="+", default=None, metavar="REASON",
                        help="list these reasons' hottest instructions (e.g. long_scoreboard wait) instead of "
                             "the three where the first kernel trails most; 'all' for every sample")
    args = parser.parse_args()
    wanted = list(args.kernels)
    columns = " | ".join(f"{w:>18s}" for w in wanted)

    print(f"== headline ({columns})")
    metrics = details(args.dir / "details.csv", wanted)
    for section, name in HEADLINE:
        values = [next((v for (s, n), v in m.items() if s.startswith(section) and n == name), "-") for m in metrics]
        print(f"  {name[:44]:44s} " + " | ".join(f"{v:>18s}" for v in values))

    print(f"== stall samples ({columns})")
    stalls = stall_samples(args.dir / "raw.csv", wanted)
    reasons = sorted(set(stalls[0]) | set(stalls[1]), key=lambda r: -(stalls[0].get(r, 0) + stalls[1].get(r, 0)))
    for reason in reasons[:14]:
        a, b = stalls[0].get(reason, 0), stalls[1].get(reason, 0)
        print(f"  {reason:32s} {a:18.0f} | {b:18.0f}")

    instructions = sass(args.dir / "sass.csv", wanted)
    print(f"== shared memory: executed, wavefronts / ideal ({columns})")
    for w, rows in zip(wanted, instructions):
        per_op: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        for row in rows:
            op = opcode(row.get("Source", ""))
            if op.split(".")[0] in SHARED_OPCODES:
                entry = per_op[op]
                entry[0] += _number(row.get("Instructions Executed", "0"))
                entry[1] += _number(row.get("L1 Wavefronts Shared", "0"))
                entry[2] += _number(row.get("L1 Wavefronts Shared Ideal", "0"))
        for op, (executed, waves, ideal) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
            ratio = waves / ideal if ideal else float("nan")
            print(f"  {w:12s} {op:24s} {executed / 1e6:8.2f} M  {waves / 1e6:8.2f} M / {ideal / 1e6:8.2f} M  ({ratio:.2f}x)")

    print("== executed opcodes (M warp instructions)")
    counts = []
    for rows in instructions:
        c: collections.Counter = collections.Counter()
        for row in rows:
            c[opcode(row.get("Source", "")).split(".")[0]] += _number(row.get("Instructions Executed", "0"))
        counts.append(c)
    for op in sorted(set(counts[0]) | set(counts[1]), key=lambda o: -(counts[0][o] + counts[1][o]))[: args.top * 2]:
        print(f"  {op:12s} {counts[0][op] / 1e6:10.3f} | {counts[1][op] / 1e6:10.3f}")

    # The stall reasons where the first kernel collects the most samples beyond the second,
    # or the ones asked for.
    gaps = args.stalls or sorted(reasons, key=lambda r: -(stalls[0].get(r, 0) - stalls[1].get(r, 0)))[:3]
    for reason in gaps:
        column = {"short_scoreboard": "stall_short_sb", "long_scoreboard": "stall_long_sb", "mio_throttle": "stall_mio",
                  "math_pipe_throttle": "stall_math", "dispatch_stall": "stall_dispatch",
                  "all": "Warp Stall Sampling (All Samples)"}.get(reason, f"stall_{reason}")
        for w, rows in zip(wanted, instructions):
            if column not in rows[0]:
                continue
            print(f"== {w}: instructions with the most {reason} samples (index, samples, SASS)")
            ranked = sorted(range(len(rows)), key=lambda i: -_number(rows[i][column]))[: args.top]
            for i in sorted(ranked):
                print(f"  {i:6d} {_number(rows[i][column]):8.0f}  {rows[i]['Source'].strip()[:90]}")


if __name__ == "__main__":
    main()
