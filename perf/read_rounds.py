"""Each provider's fastest and slowest round, in TFLOP/s, from the JSON of a bench run,
a sweep or a probe with several rounds (records holding ``shape``, ``flops`` and
``results`` with ``ms_rounds``). Medians hide a slow round of one provider (on the H200 a
provider's round at 16k ran 10-20% slow at times, whatever it timed), so the sweeps are
decided by the fastest rounds, with the selector timed twice (``--control``) for scale.

    python3 perf/read_rounds.py perf/results/h200/2026-11-30-bwd-sweep-zeroed-from-8k-d128.json [...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flash4.bench import Shape


def round_rates(record: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Per provider: (fastest, slowest) round in TFLOP/s; providers without rounds left out."""
    flops = record.get("flops") or Shape(**record["shape"]).flops  # probes' records may lack it
    rates = {}
    for name, result in record["results"].items():
        rounds = result.get("ms_rounds") or ()
        if rounds:
            rates[name] = (flops / min(rounds) / 1e9, flops / max(rounds) / 1e9)
    return rates


def shape_label(shape: dict[str, Any]) -> str:
    mask = "causal" if shape["causal"] else "full"
    return f"{shape.get('pass_', 'fwd')} d{shape['head_dim']} {mask} s{shape['seqlen']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+")
    args = parser.parse_args()
    for path in args.json:
        print(f"# {path.name}: fastest / slowest round, TFLOP/s")
        for record in json.loads(path.read_text())["records"]:
            cells = " | ".join(f"{name} {fast:.0f}/{slow:.0f}" for name, (fast, slow) in round_rates(record).items())
            print(f"{shape_label(record['shape'])}: {cells}")


if __name__ == "__main__":
    main()
