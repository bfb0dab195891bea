"""What the GPU was doing around a benchmark run: its clocks, power, temperature and driver.

The H200's clock follows its power and temperature, so two runs of one kernel can differ
by up to 10%; a report that records the SM clock (and its maximum), power draw and
temperature before and after the run lets a reader tell a slow kernel from a hot GPU.
Read through ``nvidia-smi``; where it is missing the record says so instead.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import torch

# nvidia-smi's query fields, and the names they get in the report.
QUERY_FIELDS = {
    "clocks.sm": "sm_clock_mhz",
    "clocks.max.sm": "sm_clock_max_mhz",
    "clocks.mem": "memory_clock_mhz",
    "power.draw": "power_w",
    "power.limit": "power_limit_w",
    "temperature.gpu": "temperature_c",
    "driver_version": "driver",
}
# A stuck nvidia-smi must not hang the benchmark.
NVIDIA_SMI_TIMEOUT_S = 10


def parse_query(csv_line: str) -> dict[str, Any]:
    """One line of ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``."""
    values = [v.strip() for v in csv_line.strip().split(",")]
    if len(values) != len(QUERY_FIELDS):
        raise ValueError(f"expected {len(QUERY_FIELDS)} fields from nvidia-smi, got {csv_line!r}")
    state: dict[str, Any] = {}
    for (field, name), value in zip(QUERY_FIELDS.items(), values):
        if field == "driver_version":
            state[name] = value
            continue
        try:
            state[name] = float(value)
        except ValueError:  # "[N/A]" on GPUs that do not report the field
            state[name] = None
    return state


def gpu_state(index: int = 0) -> dict[str, Any]:
    """The GPU's clocks, power, temperature and driver now (or why they are unknown)."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return {"error": "nvidia-smi not found"}
    try:
        done = subprocess.run(
            [executable, f"--id={index}", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
        )
        if done.returncode != 0:
            return {"error": f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[:200]}"}
        return parse_query(done.stdout.splitlines()[0])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"error": f"nvidia-smi: {type(exc).__name__}: {exc}"[:300]}


def device_facts(index: int = 0) -> dict[str, Any]:
    """What does not change during a run: the GPU's name, SM count and memory."""
    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    props = torch.cuda.get_device_properties(index)
    return {"name": props.name, "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}"}
