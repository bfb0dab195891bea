"""The GPU state recorded around a benchmark run: nvidia-smi's answer parsed, and a clear
record (never an exception) where it is missing."""

from __future__ import annotations

import pytest

from flash4 import machine


def test_parse_query_reads_numbers_and_unknowns():
    state = machine.parse_query("1755, 1980, 3201, 645.13, 700.00, 61, 570.124.06\n")
    assert state == {
        "sm_clock_mhz": 1755.0, "sm_clock_max_mhz": 1980.0, "memory_clock_mhz": 3201.0,
        "power_w": 645.13, "power_limit_w": 700.0, "temperature_c": 61.0, "driver": "570.124.06",
    }
    assert machine.parse_query("[N/A], 1980, 3201, [N/A], 700, 40, 1.0")["power_w"] is None
    with pytest.raises(ValueError, match="expected 7 fields"):
        machine.parse_query("1755, 1980")


def test_missing_nvidia_smi_is_recorded_not_raised(monkeypatch):
    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    assert machine.gpu_state() == {"error": "nvidia-smi not found"}


def test_failing_nvidia_smi_is_recorded(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'no devices' >&2\nexit 9\n")
    fake.chmod(0o755)
    monkeypatch.setattr(machine.shutil, "which", lambda name: str(fake))
    assert machine.gpu_state() == {"error": "nvidia-smi exited 9: no devices"}
