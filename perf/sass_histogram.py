"""Executed SASS instructions per opcode, from ncu's source page, for comparing kernels.

    ncu --section SourceCounters -k regex:NAME -o run python perf/profile_once.py ...
    ncu -i run.ncu-rep --page source --print-source sass --csv > run.csv
    python perf/sass_histogram.py run.csv [other.csv ...]

Prints, per file, the total warp-level instructions executed and the top opcodes (the
mnemonic without modifiers), then the stall-sample columns' totals when present.
"""

from __future__ import annotations

import collections
import csv
import re
import sys

TOP = 30


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def histogram(path: str) -> tuple[collections.Counter, dict[str, float]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, row in enumerate(rows) if "Source" in row)
    header = rows[header_at]
    source = header.index("Source")
    executed = next(i for i, name in enumerate(header) if name.startswith("Warp Instructions Executed")
                    or name == "Instructions Executed")
    stalls = [i for i, name in enumerate(header) if "Sampl" in name]
    counts: collections.Counter = collections.Counter()
    stall_totals: dict[str, float] = collections.defaultdict(float)
    for row in rows[header_at + 1:]:
        if len(row) <= executed:
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", row[source].strip())
        opcode = text.split(" ")[0].split(".")[0] if text else "?"
        counts[opcode] += _number(row[executed])
        for i in stalls:
            stall_totals[header[i]] += _number(row[i])
    return counts, stall_totals


def main() -> None:
    for path in sys.argv[1:]:
        counts, stalls = histogram(path)
        total = sum(counts.values())
        print(f"== {path}: {total / 1e6:.2f} M warp instructions executed")
        for opcode, n in counts.most_common(TOP):
            print(f"  {opcode:12s} {n / 1e6:8.3f} M  {100 * n / total:5.1f}%")
        for name, n in sorted(stalls.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  stall {name[:60]:60s} {n:12.0f}")


if __name__ == "__main__":
    main()
