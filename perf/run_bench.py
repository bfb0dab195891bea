"""Run ``python -m flash4 bench`` and store its JSON under perf/results/<gpu>/<date>-fwd.json.

Usage, from the project's root on the GPU machine:
    python perf/run_bench.py [--quick] [--hdim 128] [--seqlen 4096 ...] [--out FILE]

Any option of ``python -m flash4 bench`` passes through. Without ``--out`` the results go to
perf/results/<gpu>/<UTC date>-fwd.json, with <gpu> the device name less "NVIDIA" ("h200");
without a CUDA GPU nothing is written unless ``--out`` is given (the compile-only report
is no measurement to keep).
"""

from __future__ import annotations

import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from flash4.cli import main

RESULTS = Path(__file__).resolve().parent / "results"


def gpu_folder(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def default_out() -> Path | None:
    if not torch.cuda.is_available():
        return None
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / gpu_folder(torch.cuda.get_device_name()) / f"{date}-fwd.json"


if __name__ == "__main__":
    args = sys.argv[1:]
    out = default_out()
    if "--out" not in args and out is not None:
        args += ["--out", str(out)]
    sys.exit(main(["bench", *args]))
