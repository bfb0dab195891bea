"""Benchmark results as markdown: the report of one run, and the comparison of two.

Both read the JSON that ``python -m flash4 bench --out`` writes: a header (GPU, versions,
command, timer) and one record per shape, each with every provider's TFLOP/s and flash4's
ratio to the best peer. Records written before the backward pass existed count as forward.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FLASH4 = "flash4"
# How many shapes the summary names at each end of the ratio range.
SUMMARY_SHAPES = 3
# A provider's rounds of one shape further apart than this are named in the report: at its
# 700 W limit the H200 ran flash4's two rounds of a shape up to 19% apart, and with two
# rounds the median is their mean (2026-12-02's FP8 run: flash4 1.086 and 1.229 ms at head
# dim 128 unmasked 8k, cuDNN 1.212 and 1.212).
UNEVEN_ROUNDS = 0.05

Key = tuple[str, int, bool, int]  # (pass, head dim, causal, seqlen)
# The passes in report order, their titles, and the matmul ceiling each is measured against.
PASS_TITLES = {"fwd": "Forward", "bwd": "Backward", "fp8": "FP8 forward"}
PASS_CEILINGS = {"fwd": "bf16_matmul_tflops", "bwd": "bf16_matmul_tflops", "fp8": "fp8_matmul_tflops"}
# flash4's own kernel that a pass is also measured against (FP8 must pay for its rounding
# with speed over the bf16 forward on the same shapes).
OWN_BASELINES = {"fp8": "flash4-bf16"}


def load(path: Path) -> dict[str, Any]:
    """A benchmark JSON, or a ValueError that names the file and what is wrong with it."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
        raise ValueError(f"{path}: no 'records' list; not the output of `python -m flash4 bench --out`")
    return payload


def key(record: dict[str, Any]) -> Key:
    shape = record["shape"]
    # Records written before the FP8 pass existed say backward (a bool) instead of pass_.
    pass_ = shape.get("pass_") or ("bwd" if shape.get("backward") else "fwd")
    return (pass_, shape["head_dim"], shape["causal"], shape["seqlen"])


def _providers(rows: list[dict[str, Any]]) -> list[str]:
    """The providers of these records, in the order they were timed."""
    return list(dict.fromkeys(name for r in rows for name in r["results"]))


def is_peer(name: str) -> bool:
    """Whether a provider is a peer; flash4's own variants (flash4-bf16, ...) are not."""
    return not name.startswith(FLASH4)


def _rounds(record: dict[str, Any], provider: str) -> list[float]:
    return list((record["results"].get(provider) or {}).get("ms_rounds") or [])


def fastest_round_ratio(record: dict[str, Any]) -> float | None:
    """flash4's ratio to the best peer with each provider timed by its fastest round (None
    unless flash4 and a peer have rounds)."""
    ours = _rounds(record, FLASH4)
    peers = [min(_rounds(record, name)) for name in record["results"] if is_peer(name) and _rounds(record, name)]
    return min(peers) / min(ours) if ours and peers else None


def _uneven(record: dict[str, Any]) -> str | None:
    """flash4's and the best peer's rounds, in ms, where either's spread passes UNEVEN_ROUNDS."""
    names = [FLASH4, *([record["best_peer"]] if record.get("best_peer") else [])]
    rounds = {name: _rounds(record, name) for name in names}
    if not any(r and max(r) > min(r) * (1 + UNEVEN_ROUNDS) for r in rounds.values()):
        return None
    return "; ".join(f"{name} {' / '.join(f'{ms:.3f}' for ms in r)}" for name, r in rounds.items() if r)


def tflops(record: dict[str, Any], provider: str) -> float | None:
    return (record["results"].get(provider) or {}).get("tflops")


def _label(k: Key) -> str:
    pass_, head_dim, causal, seqlen = k
    return f"{pass_} d{head_dim} {'causal' if causal else 'full'} s{seqlen}"


def _cell(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _state(state: dict[str, Any] | None) -> str:
    """A GPU state record (flash4.machine.gpu_state) in words."""
    if not state or "error" in state:
        return f"unknown ({(state or {}).get('error', 'not recorded')})"
    return (f"SM clock {state.get('sm_clock_mhz')} of {state.get('sm_clock_max_mhz')} MHz, "
            f"{state.get('power_w')} W of {state.get('power_limit_w')} W, {state.get('temperature_c')} C")


def report_markdown(payload: dict[str, Any]) -> str:
    """One run: its provenance, a summary of flash4's ratios (worst and best shapes first),
    then a table per pass and head dim."""
    records = payload["records"]
    lines = [
        f"# flash4 benchmark: {payload.get('gpu')}",
        "",
        f"{payload.get('date')}; torch {payload.get('torch')}, cutlass-dsl {payload.get('cutlass_dsl')}, "
        f"flash-attn-4 {payload.get('flash_attn_4')}, cuDNN {payload.get('cudnn')}.",
        f"Command: `{payload.get('command')}`. Timing: {payload.get('timer')}, "
        f"{payload.get('rounds', 1)} round(s) per provider; {payload.get('dtype', 'bf16')} inputs. TFLOP/s; "
        "the backward counts 2.5x the forward's FLOPs."
        + (f" Wall time of the run: {payload['wall_s']:.0f} s." if payload.get("wall_s") is not None else ""),
    ]
    groups = sorted({r["shape"].get("group", 1) for r in records})
    if groups != [1]:
        lines.append(f"Grouped-query attention: {' / '.join(map(str, groups))} query heads per kv head.")
    machine = payload.get("machine")
    if machine:
        lines.append(f"GPU state before: {_state(machine.get('before'))}; after: {_state(machine.get('after'))}.")
    lines.append("")
    for pass_, title in PASS_TITLES.items():
        rows = [r for r in records if key(r)[0] == pass_]
        ratios = sorted((r["ratio_vs_best_peer"], key(r)) for r in rows if r.get("ratio_vs_best_peer") is not None)
        if not rows:
            continue
        providers = _providers(rows)
        lines.append(f"## {title}")
        lines.append("")
        ceiling_name = PASS_CEILINGS[pass_]
        ceiling = (payload.get("ceilings") or {}).get(ceiling_name)
        peak = max((tflops(r, FLASH4) or 0.0 for r in rows), default=0.0)
        if ceiling and peak:
            lines += [f"flash4's peak: {peak:.0f} TFLOP/s, {peak / ceiling:.0%} of the {ceiling:.0f} TFLOP/s "
                      f"{ceiling_name.split('_')[0]} matmul ceiling measured in the same run.", ""]
        if ratios:
            ahead = sum(ratio >= 1.0 for ratio, _ in ratios)
            worst = ", ".join(f"{_label(k)} {ratio:.2f}" for ratio, k in ratios[:SUMMARY_SHAPES])
            best = ", ".join(f"{_label(k)} {ratio:.2f}" for ratio, k in ratios[::-1][:SUMMARY_SHAPES])
            lines += [
                f"flash4 / best peer: {ratios[0][0]:.2f}–{ratios[-1][0]:.2f} over {len(ratios)} shapes, "
                f"ahead (>= 1.00) on {ahead}.",
                f"Worst: {worst}. Best: {best}.",
                "",
            ]
            lines += _rounds_summary(rows)
        baseline = OWN_BASELINES.get(pass_) if OWN_BASELINES.get(pass_) in providers else None
        for head_dim in sorted({key(r)[1] for r in rows}):
            lines += [f"### head dim {head_dim}", ""]
            extra = [f"flash4 / {baseline}"] if baseline else []
            lines.append("| mask | seqlen | " + " | ".join(providers + ["flash4 / best", *extra, "flash4 / ceiling"]) + " |")
            lines.append("|---|---|" + "---|" * (len(providers) + 2 + len(extra)))
            for r in sorted((r for r in rows if key(r)[1] == head_dim), key=key):
                _, _, causal, seqlen = key(r)
                cells = " | ".join(_cell(tflops(r, p)) for p in providers)
                ours = tflops(r, FLASH4)
                of_ceiling = f"{ours / ceiling:.0%}" if ours and ceiling else "-"
                own = []
                if baseline:
                    base = tflops(r, baseline)
                    own = [_cell(ours / base if ours and base else None, 3)]
                lines.append(f"| {'causal' if causal else 'full'} | {seqlen} | "
                             + " | ".join([cells, _cell(r.get('ratio_vs_best_peer'), 3), *own, of_ceiling]) + " |")
            lines.append("")
    return "\n".join(lines)


def _rounds_summary(rows: list[dict[str, Any]]) -> list[str]:
    """With several rounds: the ratios by each provider's fastest round, and the shapes whose
    rounds spread (the medians above are the protocol's figure; these show how far a slow
    round moved them)."""
    fastest = sorted((ratio, key(r)) for r in rows if (ratio := fastest_round_ratio(r)) is not None)
    if not fastest or max(len(_rounds(r, FLASH4)) for r in rows) < 2:
        return []
    lines = [f"By each provider's fastest round: flash4 / best peer {fastest[0][0]:.2f}–{fastest[-1][0]:.2f}, "
             f"ahead on {sum(ratio >= 1.0 for ratio, _ in fastest)}; worst "
             + ", ".join(f"{_label(k)} {ratio:.2f}" for ratio, k in fastest[:SUMMARY_SHAPES]) + "."]
    uneven = [(key(r), text) for r in rows if (text := _uneven(r))]
    if uneven:
        lines.append(f"Rounds more than {UNEVEN_ROUNDS:.0%} apart (ms): "
                     + "; ".join(f"{_label(k)}: {text}" for k, text in sorted(uneven)) + ".")
    return lines + [""]


def plot_report(payload: dict[str, Any], folder: Path, prefix: str = "") -> list[Path]:
    """TFLOP/s against seqlen, one PNG per pass (``<prefix><pass>.png``) with a panel per
    head dim; a line per provider, solid without a mask and dashed with the causal one.
    Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install matplotlib") from exc
    records = payload["records"]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for pass_ in PASS_TITLES:
        rows = [r for r in records if key(r)[0] == pass_]
        head_dims = sorted({key(r)[1] for r in rows})
        if not rows:
            continue
        providers = _providers(rows)
        fig, axes = plt.subplots(1, len(head_dims), figsize=(5 * len(head_dims), 4), squeeze=False)
        for ax, head_dim in zip(axes[0], head_dims):
            for index, provider in enumerate(providers):
                for causal, style in ((False, "-"), (True, "--")):
                    points = sorted((key(r)[3], tflops(r, provider)) for r in rows
                                    if key(r)[1] == head_dim and key(r)[2] == causal and tflops(r, provider))
                    if points:
                        ax.plot(*zip(*points), style, marker="o", color=f"C{index}",
                                label=f"{provider}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{pass_} head dim {head_dim}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"{payload.get('gpu')}, {str(payload.get('date'))[:10]}")
        fig.tight_layout()
        path = folder / f"{prefix}{pass_}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def compare_markdown(a: dict[str, Any], b: dict[str, Any], a_name: str = "A", b_name: str = "B") -> str:
    """Two runs (two GPUs, or two versions), shape by shape: flash4's TFLOP/s in each and
    their ratio B/A, and flash4's ratio to the best peer in each."""
    by_key_a = {key(r): r for r in a["records"]}
    by_key_b = {key(r): r for r in b["records"]}
    common = sorted(by_key_a.keys() & by_key_b.keys())
    lines = [
        f"# {b_name} against {a_name}",
        "",
        f"{a_name}: {a.get('gpu')}, {a.get('date')}, `{a.get('command')}`",
        f"{b_name}: {b.get('gpu')}, {b.get('date')}, `{b.get('command')}`",
        "",
        f"| shape | flash4 {a_name} | flash4 {b_name} | {b_name} / {a_name} | "
        f"flash4/best {a_name} | flash4/best {b_name} |",
        "|---|---|---|---|---|---|",
    ]
    speedups = []
    for k in common:
        ra, rb = by_key_a[k], by_key_b[k]
        ta, tb = tflops(ra, FLASH4), tflops(rb, FLASH4)
        speedup = tb / ta if ta and tb else None
        if speedup is not None:
            speedups.append(speedup)
        lines.append(f"| {_label(k)} | {_cell(ta)} | {_cell(tb)} | {_cell(speedup, 3)} | "
                     f"{_cell(ra.get('ratio_vs_best_peer'), 3)} | {_cell(rb.get('ratio_vs_best_peer'), 3)} |")
    lines.append("")
    if speedups:
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        lines.append(f"flash4 {b_name} / {a_name}: geometric mean {geomean:.3f} over {len(speedups)} shapes "
                     f"(range {min(speedups):.3f}–{max(speedups):.3f}).")
    only = sorted(by_key_a.keys() ^ by_key_b.keys())
    if only:
        lines.append(f"In one run only: {', '.join(_label(k) for k in only)}.")
    return "\n".join(lines) + "\n"
