"""Markdown reports and comparisons of benchmark runs, from the JSON of real H200 runs kept
in perf/results/h200 (recorded fixtures: the numbers below are read from them)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from flash4 import bench, cli, report

RESULTS = Path(__file__).resolve().parents[1] / "perf" / "results" / "h200"
RUN_A = RESULTS / "2026-11-29-fwd.json"
RUN_B = RESULTS / "2026-11-29-fwd-rounds3.json"


def _table_rows(markdown: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in markdown.splitlines()
            if line.startswith("| full") or line.startswith("| causal")]


def test_report_summarises_the_ratio_range_and_tables_every_shape():
    payload = report.load(RUN_B)
    payload["ceilings"] = {"bf16_matmul_tflops": 800.0}
    ratios = [r["ratio_vs_best_peer"] for r in payload["records"]]
    text = report.report_markdown(payload)
    assert f"{min(ratios):.2f}–{max(ratios):.2f} over {len(ratios)} shapes" in text
    assert f"ahead (>= 1.00) on {sum(r >= 1 for r in ratios)}" in text
    rows = _table_rows(text)
    assert len(rows) == len(payload["records"]) == 36
    # Each row carries the record's numbers: find d128 causal s1024 in the second table.
    record = next(r for r in payload["records"] if report.key(r) == ("fwd", 128, True, 1024))
    row = [r for r in rows if r[:2] == ["causal", "1024"]][1]
    assert row[2] == f"{record['results']['flash4']['tflops']:.0f}"
    assert row[-2] == f"{record['ratio_vs_best_peer']:.3f}"
    assert row[-1] == f"{record['results']['flash4']['tflops'] / 800.0:.0%}"
    assert "## Backward" not in text


def test_report_gives_the_fastest_rounds_ratios_and_names_uneven_rounds():
    payload = report.load(RUN_B)
    records = payload["records"]
    fastest = [report.fastest_round_ratio(r) for r in records]
    assert f"By each provider's fastest round: flash4 / best peer {min(fastest):.2f}–{max(fastest):.2f}, " \
           f"ahead on {sum(r >= 1 for r in fastest)}" in report.report_markdown(payload)
    # flash4's rounds 20% apart: named with its best peer's rounds, and its fastest round counts.
    record = records[0]
    record["results"]["flash4"]["ms_rounds"] = [0.2, 0.24, 0.22]
    peer_fastest = min(min(m["ms_rounds"]) for name, m in record["results"].items() if name != "flash4")
    assert report.fastest_round_ratio(record) == pytest.approx(peer_fastest / 0.2)
    label = report._label(report.key(record))
    peer = record["best_peer"]
    peer_rounds = " / ".join(f"{ms:.3f}" for ms in record["results"][peer]["ms_rounds"])
    assert f"{label}: flash4 0.200 / 0.240 / 0.220; {peer} {peer_rounds}" in report.report_markdown(payload)
    # A run of one round has neither line.
    text = report.report_markdown(report.load(RUN_A))
    assert "fastest round" not in text and "apart" not in text


def test_compare_gives_flash4_speedups_shape_by_shape():
    a, b = report.load(RUN_A), report.load(RUN_B)
    text = report.compare_markdown(a, b, "old", "new")
    lines = [line for line in text.splitlines() if line.startswith("| fwd")]
    assert len(lines) == 36
    k = ("fwd", 256, True, 4096)
    ta = next(report.tflops(r, "flash4") for r in a["records"] if report.key(r) == k)
    tb = next(report.tflops(r, "flash4") for r in b["records"] if report.key(r) == k)
    line = next(line for line in lines if line.startswith("| fwd d256 causal s4096 |"))
    assert f"| {tb / ta:.3f} |" in line
    # A shape missing from one run is named, not silently dropped.
    b_less = copy.deepcopy(b)
    b_less["records"] = [r for r in b_less["records"] if report.key(r) != k]
    assert "In one run only: fwd d256 causal s4096." in report.compare_markdown(a, b_less)


def test_cli_compare_prints_the_table_and_rejects_unreadable_files(tmp_path, capsys):
    assert cli.main(["bench", "--compare", str(RUN_A), str(RUN_B)]) == 0
    assert "geometric mean" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"gpu": "x"}))
    assert cli.main(["bench", "--compare", str(bad), str(RUN_B)]) == 2
    assert "no 'records' list" in capsys.readouterr().out


@pytest.mark.parametrize("name", ("run.json", "reportdir"))
def test_write_report_writes_json_and_markdown(tmp_path, name):
    payload = report.load(RUN_B)
    out = tmp_path / name
    if out.suffix != ".json":
        out.mkdir()
    bench.write_report(out, payload)
    json_path, md_path = (out, out.with_suffix(".md")) if out.suffix == ".json" else (out / "report.json", out / "report.md")
    assert json.loads(json_path.read_text())["records"] == payload["records"]
    assert md_path.read_text().startswith("# flash4 benchmark: NVIDIA H200")
    assert (md_path.parent / f"{md_path.stem}-fwd.png").read_bytes()[:4] == b"\x89PNG"


def test_results_json_keeps_the_values_one_line_per_record():
    payload = report.load(RUN_B)
    text = bench.results_json(payload)
    assert json.loads(text) == payload
    lines = text.splitlines()
    # One line per top-level field, plus one per record and the list's closing bracket.
    assert len(lines) == 2 + len(payload) + len(payload["records"]) + 1
    assert all(json.loads(line.strip().rstrip(",")) == record
               for line, record in zip(lines[lines.index('"records": [') + 1:], payload["records"]))


def test_report_states_the_gpu_clock_before_and_after_when_recorded():
    payload = report.load(RUN_B)
    payload["machine"] = {
        "before": {"sm_clock_mhz": 1980.0, "sm_clock_max_mhz": 1980.0, "power_w": 90.0, "power_limit_w": 700.0,
                   "temperature_c": 35.0},
        "after": {"error": "nvidia-smi not found"},
    }
    text = report.report_markdown(payload)
    assert "GPU state before: SM clock 1980.0 of 1980.0 MHz, 90.0 W of 700.0 W, 35.0 C; " \
           "after: unknown (nvidia-smi not found)." in text


def test_report_states_the_wall_time_when_recorded():
    payload = report.load(RUN_B)
    assert "Wall time" not in report.report_markdown(payload)
    payload["wall_s"] = 125.6
    assert "Wall time of the run: 126 s." in report.report_markdown(payload)


def test_plots_are_valid_pngs_one_per_pass(tmp_path):
    payload = report.load(RUN_B)
    written = report.plot_report(payload, tmp_path / "plots", prefix="run-")
    assert [p.name for p in written] == ["run-fwd.png"]
    data = written[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_report_prints_markdown_and_draws_plots(tmp_path, capsys):
    assert cli.main(["report", str(RUN_B), "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# flash4 benchmark: NVIDIA H200") and f"{RUN_B.stem}-fwd.png" in out
    assert (tmp_path / f"{RUN_B.stem}-fwd.png").is_file()
    assert cli.main(["report", str(tmp_path / "missing.json")]) == 2


def test_report_states_flash4s_peak_against_the_measured_ceiling():
    payload = report.load(RUN_B)
    payload["ceilings"] = {"bf16_matmul_tflops": 801.0}
    peak = max(r["results"]["flash4"]["tflops"] for r in payload["records"])
    assert f"flash4's peak: {peak:.0f} TFLOP/s, {peak / 801:.0%} of the 801 TFLOP/s" in report.report_markdown(payload)


def test_fp8_records_get_their_own_section_against_the_fp8_ceiling():
    # A real run's forward records relabelled as the fp8 pass (the new records' "pass_"
    # field): their own section, measured against the fp8 matmul ceiling, and only the
    # providers that ran in it as columns. Old records (a "backward" bool) still read.
    payload = report.load(RUN_B)
    payload["ceilings"] = {"bf16_matmul_tflops": 800.0, "fp8_matmul_tflops": 1260.0}
    fp8 = copy.deepcopy(payload["records"][:2])
    for record in fp8:
        record["shape"]["pass_"] = "fp8"
        record["results"] = {"flash4": record["results"]["flash4"], "cudnn-fp8": record["results"]["sdpa-cudnn"]}
    payload["records"] = payload["records"][:2] + fp8
    text = report.report_markdown(payload)
    forward, fp8_section = text.split("## FP8 forward")
    peak = max(r["results"]["flash4"]["tflops"] for r in fp8)
    assert "of the 1260 TFLOP/s fp8 matmul ceiling" in fp8_section and f"flash4's peak: {peak:.0f}" in fp8_section
    assert "cudnn-fp8" in fp8_section and "cudnn-fp8" not in forward and "sdpa-flash" not in fp8_section
    assert [report.key(r)[0] for r in payload["records"]] == ["fwd", "fwd", "fp8", "fp8"]
    assert "flash4 / flash4-bf16" not in text  # no bf16 baseline in these records


def test_fp8_tables_give_the_speedup_over_flash4s_own_bf16_forward():
    payload = report.load(RUN_B)
    fp8 = copy.deepcopy(payload["records"][:1])
    record = fp8[0]
    record["shape"]["pass_"] = "fp8"
    ours = record["results"]["flash4"]["tflops"]
    record["results"] = {"flash4": record["results"]["flash4"],
                         "flash4-bf16": dict(record["results"]["flash4"], tflops=ours / 1.6)}
    payload["records"] = fp8
    fp8_section = report.report_markdown(payload).split("## FP8 forward")[1]
    header = next(line for line in fp8_section.splitlines() if line.startswith("| mask"))
    row = next(line for line in fp8_section.splitlines() if line.startswith("| full") or line.startswith("| causal"))
    assert header.split(" | ")[-2] == "flash4 / flash4-bf16" and row.split(" | ")[-2] == "1.600"


def test_a_run_keeps_its_records_so_far_beside_its_report():
    from pathlib import Path

    from flash4.bench import _partial_path

    assert _partial_path(Path("out/h200.json")) == Path("out/h200.partial.json")
    assert _partial_path(Path("out")) == Path("out/report.partial.json")
