"""CPU tests of ``python -m flash4 info`` and ``bench``: table output, the FLOP model and shape
list of the performance protocol, the per-shape record, and the compile-only fallback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import types

import pytest
import torch

from flash4 import bench, cli, dispatch
from flash4.compiler import CompileReport


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the no-GPU paths run even on the GPU machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if line.startswith("sm_")]


def test_info_lists_sm90a_rows_and_head_dims(no_gpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out
    rows = _table_rows(out)
    assert len(rows) == len(dispatch.TABLE)
    assert {row[0] for row in rows} == {"sm_90a"}
    assert {int(row[2]) for row in rows} == {64, 128, 256}


def test_info_named_arch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--arch", "sm_90a"]) == 0
    rows = _table_rows(capsys.readouterr().out)
    assert len(rows) == sum(entry.arch == "sm_90a" for entry in dispatch.TABLE)


def test_info_unsupported_arch_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--arch", "sm_80"]) == 1
    out = capsys.readouterr().out
    assert "sm_80" in out and "sm_90a" in out
    assert not _table_rows(out)


def test_python_dash_m_runs_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "flash4", "info", "--arch", "sm_90a"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(_table_rows(done.stdout)) == len(dispatch.TABLE)


def test_flop_model() -> None:
    assert bench.attention_flops(1, 1, 1, 1, 1, causal=False) == 4
    assert bench.attention_flops(2, 16, 512, 1024, 128, causal=False) == 4 * 2 * 16 * 512 * 1024 * 128
    assert bench.attention_flops(2, 16, 512, 512, 128, causal=True) == 2 * 2 * 16 * 512 * 512 * 128


def test_protocol_shapes() -> None:
    shapes = bench.protocol_shapes()
    assert len(shapes) == 3 * 6 * 2
    for shape in shapes:
        assert shape.batch * shape.seqlen == 16384
        assert shape.heads * shape.head_dim == 2048
    assert bench.Shape(batch=32, seqlen=512, heads=16, head_dim=128, causal=False) in shapes
    assert bench.Shape(batch=1, seqlen=16384, heads=8, head_dim=256, causal=True) in shapes
    (one,) = bench.protocol_shapes((128,), (512,), (False,))
    assert one.flops == 4 * 32 * 16 * 512 * 512 * 128


def test_bench_options_restrict_the_sweep() -> None:
    args = cli.build_parser().parse_args(["bench", "--hdim", "64", "--seqlen", "2048", "--causal", "yes"])
    assert (args.hdim, args.seqlen, args.causal) == ([64], [2048], "yes")
    quick = bench.Options(quick=True).shapes()
    assert {shape.seqlen for shape in quick} == set(bench.QUICK_SEQLENS)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--hdim", "96"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--seqlen", "0"])


def test_grouped_query_shapes() -> None:
    """--group G: k and v get heads // G heads at every head dim; a G that does not divide
    some head dim's heads is refused before anything runs."""
    shapes = bench.Options(head_dims=(64, 128, 256), seqlens=(1024,), group=8).shapes()
    assert [(s.heads, s.kv_heads) for s in shapes if not s.causal] == [(32, 4), (16, 2), (8, 1)]
    assert "h16/2" in bench.Shape(batch=1, seqlen=64, heads=16, head_dim=128, causal=False, group=8).label()
    with pytest.raises(ValueError, match="group=3"):
        bench.Shape(batch=1, seqlen=64, heads=16, head_dim=128, causal=False, group=3)
    assert cli.main(["bench", "--hdim", "128", "--group", "32"]) == 2
    seen: list[tuple[int, ...]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return _sdpa_math(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), causal, scale)

    shape = bench.Shape(batch=1, seqlen=32, heads=4, head_dim=32, causal=False, group=2)
    bench.measure_shape(shape, bench.Timer("fake", lambda fn: 1.0), providers={"flash4": recording}, device="cpu")
    assert seen == [(4, 2, 2)]


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
    qt, kt, vt = (x.transpose(1, 2).float() for x in (q, k, v))
    return (lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale),
            lambda out: out.transpose(1, 2))


def _failing(*args: object) -> bench.Prepared:
    raise ImportError("No module named 'flash_attn'")


def test_measure_shape_records_ratio_diff_and_errors() -> None:
    """Fake providers on CPU: a fixed time each, one that cannot import, one off by 0.01."""
    times = {"flash4": 2.0, "sdpa-cudnn": 4.0, "sdpa-flash": 3.0}

    def shifted(*args: object) -> bench.Prepared:
        run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]
        return run, lambda out: to_bshd(out) + 0.01

    providers = {"flash4": shifted, "sdpa-cudnn": _sdpa_math, "sdpa-flash": _sdpa_math, "fa4": _failing}
    # The first time: the heat-up of the last provider that runs (sdpa-flash), not recorded.
    calls = iter([99.0, *times.values()])
    timer = bench.Timer("fake", lambda fn: next(calls))
    shape = bench.Shape(batch=2, seqlen=64, heads=2, head_dim=32, causal=True)
    record = bench.measure_shape(shape, timer, providers=providers, device="cpu")

    assert record.results["flash4"].tflops == pytest.approx(shape.flops / 2e-3 / 1e12)
    assert record.results["fa4"].error == "ImportError: No module named 'flash_attn'"
    assert record.best_peer == "sdpa-flash"
    assert record.ratio_vs_best_peer == pytest.approx(3.0 / 2.0)
    assert record.diff_against == "sdpa-cudnn"
    assert record.max_abs_diff == pytest.approx(0.01, abs=1e-3)
    row = bench.table_row(record)
    assert "1.500" in row and "error" in row


def test_measure_shape_interleaves_rounds_and_keeps_each_median() -> None:
    """Three rounds: the providers take turns, and each keeps the median of its times."""
    order: list[str] = []
    # sdpa-cudnn's first time is the heat-up before the rounds, not recorded.
    times = {"flash4": iter([5.0, 1.0, 2.0]), "sdpa-cudnn": iter([99.0, 4.0, 9.0, 3.0])}

    def named(name: str):
        def prepare(*args: object) -> bench.Prepared:
            run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]

            def tagged():
                return run()

            tagged.provider = name  # type: ignore[attr-defined]
            return tagged, to_bshd

        return prepare

    def timer_ms(fn) -> float:
        order.append(fn.provider)
        return next(times[fn.provider])

    providers = {"flash4": named("flash4"), "sdpa-cudnn": named("sdpa-cudnn")}
    shape = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=32, causal=False)
    record = bench.measure_shape(shape, bench.Timer("fake", timer_ms), providers=providers, device="cpu", rounds=3)

    # The last provider first, untimed for the record: flash4's first round follows it under
    # load, as its later rounds do.
    assert order == ["sdpa-cudnn"] + ["flash4", "sdpa-cudnn"] * 3
    assert record.results["flash4"].ms == 2.0 and record.results["flash4"].ms_rounds == (5.0, 1.0, 2.0)
    # Each round's start, in turn order: flash4's round r before sdpa-cudnn's round r.
    starts = [record.results[name].rounds_started_s for name in ("flash4", "sdpa-cudnn")]
    assert all(len(s) == 3 for s in starts)
    in_turn = [t for pair in zip(*starts) for t in pair]
    assert all(a < b for a, b in zip(in_turn, in_turn[1:])) and 0.0 <= in_turn[0]
    assert record.results["sdpa-cudnn"].ms == 4.0
    assert record.ratio_vs_best_peer == pytest.approx(2.0)


def test_measure_shape_records_the_spread_within_rounds() -> None:
    """A timer that keeps its samples: the median is timed, the spread is the lowest low and
    the highest high over the rounds; a timer without samples records none."""
    samples = iter([(1.0, 2.0, 4.0), (0.5, 3.0, 3.5), (1.5, 2.5, 6.0)])
    timer = bench.Timer("fake", lambda fn: 0.0, lambda fn: next(samples))
    shape = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=32, causal=False)
    record = bench.measure_shape(shape, timer, providers={"flash4": _sdpa_math}, device="cpu", rounds=3)
    assert record.results["flash4"].ms == 2.5 and record.results["flash4"].ms_rounds == (2.0, 3.0, 2.5)
    assert record.results["flash4"].ms_spread == (0.5, 6.0)
    plain = bench.measure_shape(shape, bench.Timer("fake", lambda fn: 1.0), providers={"flash4": _sdpa_math},
                                device="cpu")
    assert plain.results["flash4"].ms_spread is None


def _fake_compiler(monkeypatch: pytest.MonkeyPatch, missing: dict[int, str] | None = None) -> list[tuple[object, str]]:
    """Install a fake flash4.compiler; entry number i lacks instruction missing[i]."""
    calls: list[tuple[object, str]] = []

    def compile_entry(entry: dispatch.KernelEntry, arch: str = "sm_90a") -> CompileReport:
        calls.append((entry, arch))
        counts = {name: 7 for name in bench.REQUIRED_INSTRUCTIONS}
        if missing and len(calls) - 1 in missing:
            counts[missing[len(calls) - 1]] = 0
        return CompileReport(seconds=1.5, instructions=counts, ptx="", registers=168)

    module = types.ModuleType("flash4.compiler")
    module.compile_entry = compile_entry  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash4.compiler", module)
    return calls


def test_bench_without_gpu_compiles_every_table_entry(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    calls = _fake_compiler(monkeypatch)
    out_file = tmp_path / "compile.json"
    assert cli.main(["bench", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "No supported GPU found" in out and "no CUDA device" in out
    assert [entry for entry, _ in calls] == list(dispatch.TABLE)
    assert {arch for _, arch in calls} == {"sm_90a"}
    lines = [line for line in out.splitlines() if "1.5 s" in line]
    assert len(lines) == len(dispatch.TABLE)
    assert all("wgmma.mma_async=7" in line and "MISSING" not in line for line in lines)
    payload = json.loads(out_file.read_text())
    assert len(payload["compiles"]) == len(dispatch.TABLE)


def test_bench_without_gpu_flags_missing_instruction_and_filters(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake_compiler(monkeypatch, missing={0: "setmaxnreg"})
    assert cli.main(["bench", "--hdim", "128", "--causal", "no"]) == 1
    out = capsys.readouterr().out
    assert all(entry.head_dim == 128 and not entry.causal for entry, _ in calls)
    assert len(calls) == sum(e.head_dim == 128 and not e.causal for e in dispatch.TABLE)
    assert "MISSING setmaxnreg" in out


def test_peers_outside_torch_come_from_the_checkout(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # From a checkout, flash-attn-4's adapter is perf/peer_providers.py, not flash4 code,
    # found from flash4's own location: a script in perf/ (sys.path[0] = perf/) or another
    # working directory finds it too.
    monkeypatch.chdir(tmp_path)
    fa4 = bench._checkout_peers()["fa4"]
    assert fa4.__code__.co_filename == str(bench.PEER_PROVIDERS_FILE)
    assert bench.PEER_PROVIDERS_FILE.parent.name == "perf"
    # Elsewhere the peer is recorded as not available, with the reason.
    monkeypatch.setattr(bench, "PEER_PROVIDERS_FILE", tmp_path / "no_such_file.py")
    prepare = bench._checkout_peers()["fa4"]
    with pytest.raises(ImportError, match="measured from a flash4 checkout"):
        prepare()


def test_backward_shapes_count_two_and_a_half_forward_flops() -> None:
    shapes = bench.protocol_shapes((128,), (1024,), (False, True), passes=("fwd", "bwd"))
    assert [(s.backward, s.causal) for s in shapes] == [(False, False), (False, True), (True, False), (True, True)]
    for forward, backward in zip(shapes[:2], shapes[2:]):
        assert backward.flops * 2 == forward.flops * 5
        assert backward.label().startswith("bwd") and forward.label().startswith("fwd")


def test_cli_pass_option_selects_backward_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bench.Options] = []
    monkeypatch.setattr(bench, "run", lambda options: seen.append(options) or 0)
    assert cli.main(["bench", "--pass", "fwd", "bwd", "--hdim", "64", "--seqlen", "512"]) == 0
    assert seen[0].passes == ("fwd", "bwd")
    assert sum(s.backward for s in seen[0].shapes()) == 2


def test_autograd_backward_gives_the_gradients_for_the_shared_dout() -> None:
    # The peers' backward adapter, on CPU with torch's math attention in the peer's own
    # (b, h, s, d) layout: the timed call returns dq, dk, dv for the seeded dout.
    from flash4 import reference

    q, k, v = (torch.randn(2, 40, 3, 16, dtype=torch.float64) for _ in range(3))

    def forward(q_, k_, v_):
        return torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q_, k_, v_)))

    run, first = bench.autograd_backward(forward, q, k, v, layout=lambda x: x.transpose(1, 2))
    grads = run()
    out, lse = reference.attention(q, k, v, compute_dtype=torch.float64)
    dout = bench.dout_like(out)
    expected = reference.attention_backward(q, k, v, out, dout, lse, compute_dtype=torch.float64)
    for got, want in zip(grads, expected):
        assert (got - want).abs().max().item() < 1e-10
    assert first(grads) is grads[0]
    # Timed again on the kept graph: the same gradients.
    assert all(torch.equal(a, b) for a, b in zip(run(), grads))


def test_a_wrong_provider_is_reported_and_not_timed() -> None:
    """Outputs off by a quarter of the reference's range, or NaN, are wrong: never timed."""
    timed: list[str] = []

    def off_by(delta: float):
        def prepare(*args: object) -> bench.Prepared:
            run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]
            return run, lambda out: to_bshd(out) + delta * to_bshd(out).abs().max()

        return prepare

    def named(name, prepare):
        def wrapped(*args: object) -> bench.Prepared:
            run, to_bshd = prepare(*args)

            def tagged():
                timed.append(name)
                return run()

            return tagged, to_bshd

        return wrapped

    providers = {
        "flash4": named("flash4", off_by(0.25)),
        "sdpa-cudnn": named("sdpa-cudnn", _sdpa_math),
        "fa4": named("fa4", off_by(math.nan)),
    }
    shape = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=16, causal=False)
    record = bench.measure_shape(shape, bench.Timer("fake", lambda fn: (fn(), 1.0)[1]), providers=providers,
                                 device="cpu")
    assert record.results["flash4"].error.startswith("wrong output: max|diff|")
    assert "not timed" in record.results["fa4"].error
    assert record.results["sdpa-cudnn"].tflops is not None
    # Each ran once for the check; only the reference was timed afterwards (twice: the
    # heat-up before the rounds, as the last provider that runs, then its round).
    assert timed.count("flash4") == timed.count("fa4") == 1 and timed.count("sdpa-cudnn") == 3
    assert record.ratio_vs_best_peer is None


def test_cli_peers_option_restricts_the_providers(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bench.Options] = []
    monkeypatch.setattr(bench, "run", lambda options: seen.append(options) or 0)
    assert cli.main(["bench", "--peers", "sdpa-cudnn", "fa4"]) == 0
    assert seen[0].peers == ("sdpa-cudnn", "fa4")
    assert bench.Options().peers == bench.PEERS
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--peers", "xformers"])


def test_measure_ceilings_arithmetic_and_fp8_error_recorded() -> None:
    # On CPU with a timer that says 1 ms: 2 n^3 FLOPs per ms, 2 x bytes per ms. CPU has no
    # fp8 GEMM here, which is recorded, not raised.
    ceilings = bench.measure_ceilings(bench.Timer("fake", lambda fn: (fn(), 1.0)[1]), device="cpu",
                                      gemm_size=64, copy_bytes=1024)
    assert ceilings["bf16_matmul_tflops"] == pytest.approx(2 * 64**3 / 1e-3 / 1e12)
    assert ceilings["copy_gb_per_s"] == pytest.approx(2 * 1024 / 1e-3 / 1e9)
    assert ceilings["fp8_matmul_tflops"] is None or ceilings["fp8_matmul_tflops"] > 0
    if ceilings["fp8_matmul_tflops"] is None:
        assert ceilings["fp8_error"]


def test_ceilings_keep_the_fastest_timing() -> None:
    # The first timings run while the clock ramps up from idle: each ceiling is the best of
    # CEILING_ROUNDS timings, here 3, 2 and 1 ms of the bf16 GEMM.
    times = iter([3.0, 2.0, 1.0] + [1.0] * 3 * bench.CEILING_ROUNDS)
    ceilings = bench.measure_ceilings(bench.Timer("ramp", lambda fn: next(times)), device="cpu",
                                      gemm_size=64, copy_bytes=1024)
    assert bench.CEILING_ROUNDS == 3
    assert ceilings["bf16_matmul_tflops"] == pytest.approx(2 * 64**3 / 1e-3 / 1e12)


def test_fp8_pass_shapes_count_forward_flops_and_measure_against_peers_only() -> None:
    # The fp8 pass: forward FLOPs; flash4's own bf16 forward, its FP8 call with V's layout
    # pass, its quantizing FP8 paths (with and without the rotation) and its accurate mode
    # (int8 Q and K) are timed beside the kernel but are no peers, and the bf16 forward is
    # the output's reference. FP8 output is judged wrong only beyond a quarter of the
    # largest value.
    (fp8,) = bench.protocol_shapes((128,), (1024,), (False,), passes=("fp8",))
    (fwd,) = bench.protocol_shapes((128,), (1024,), (False,), passes=("fwd",))
    assert fp8.pass_ == "fp8" and not fp8.backward and fp8.flops == fwd.flops and fp8.label().startswith("fp8")
    assert set(bench.PASS_PROVIDERS["fp8"]) == {
        "flash4", "flash4-v-per-call", "flash4-quantizing", "flash4-hadamard", "flash4-int8-qk", "flash4-bf16",
        "cudnn-fp8",
    }

    def off_by(delta: float):
        def prepare(*args: object) -> bench.Prepared:
            run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]
            return run, lambda out: to_bshd(out) + delta * to_bshd(out).abs().max()

        return prepare

    def rounded(relative_rms: float):
        # FP8-like rounding: every value off by a random share of itself, of this RMS. Bounded,
        # as rounding is (uniform on [-a, a] has RMS a / sqrt(3)): Gaussian shares passed the
        # max|diff| limit now and then, at the largest value, as no rounding would.
        def prepare(*args: object) -> bench.Prepared:
            run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]
            g = torch.Generator().manual_seed(0)

            def noisy(out):
                x = to_bshd(out)
                share = (2 * torch.rand(x.shape, generator=g, dtype=x.dtype) - 1) * math.sqrt(3)
                return x * (1 + relative_rms * share)

            return run, noisy

        return prepare

    def scaled(factor: float):
        def prepare(*args: object) -> bench.Prepared:
            run, to_bshd = _sdpa_math(*args)  # type: ignore[arg-type]
            return run, lambda out: to_bshd(out) * factor

        return prepare

    times = iter([9.0, 2.0, 4.0, 1.0, 3.0])  # the first: cudnn-fp8's heat-up, not recorded
    providers = {"flash4": rounded(0.06), "flash4-quantizing": rounded(0.06), "flash4-bf16": _sdpa_math,
                 "cudnn-fp8": rounded(0.08), "flash4-v-per-call": scaled(0.8)}
    shape = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=32, causal=False, pass_="fp8")
    record = bench.measure_shape(shape, bench.Timer("fake", lambda fn: next(times)), providers=providers, device="cpu")
    # Rounding of FP8's size passes; every value a fifth too small (max|diff| within 25% of
    # the largest value) is wrong by its RMS error, and not timed.
    assert record.results["flash4-v-per-call"].error.startswith("wrong output: RMS error")
    assert all(m.error is None for name, m in record.results.items() if name != "flash4-v-per-call")
    assert record.best_peer == "cudnn-fp8" and record.ratio_vs_best_peer == pytest.approx(3.0 / 2.0)
    assert record.diff_against == "flash4-bf16"
    # A 10% error in the forward pass is a wrong output.
    forward = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=32, causal=False)
    wrong = bench.measure_shape(forward, bench.Timer("fake", lambda fn: 1.0),
                                providers={"flash4": off_by(0.1), "sdpa-cudnn": _sdpa_math}, device="cpu")
    assert wrong.results["flash4"].error.startswith("wrong output")


def test_cli_accepts_the_fp8_pass_and_its_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bench.Options] = []
    monkeypatch.setattr(bench, "run", lambda options: seen.append(options) or 0)
    assert cli.main(["bench", "--pass", "fp8", "--hdim", "128", "--seqlen", "1024"]) == 0
    assert [s.pass_ for s in seen[0].shapes()] == ["fp8", "fp8"] and "cudnn-fp8" in seen[0].peers


def test_cli_dtype_option_times_the_inputs_in_that_type(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dtype fp16 reaches every provider's inputs; the fp8 pass, which quantizes bf16
    inputs, is refused with fp16 before anything runs, and an unknown type by argparse."""
    seen: list[bench.Options] = []
    monkeypatch.setattr(bench, "run", lambda options: seen.append(options) or 0)
    assert cli.main(["bench", "--pass", "fwd", "bwd", "--dtype", "fp16", "--hdim", "64", "--seqlen", "512"]) == 0
    assert seen[0].dtype == "fp16" and bench.Options().dtype == "bf16"
    for name in bench.DTYPES:
        assert cli.build_parser().parse_args(["bench", "--dtype", name]).dtype == name
    assert cli.main(["bench", "--pass", "fwd", "fp8", "--dtype", "fp16"]) == 2
    assert "dtype='fp16'" in capsys.readouterr().out and len(seen) == 1
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--dtype", "fp32"])

    dtypes: list[torch.dtype] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        dtypes.extend(x.dtype for x in (q, k, v))
        return _sdpa_math(q, k, v, causal, scale)

    shape = bench.Shape(batch=1, seqlen=32, heads=2, head_dim=32, causal=True)
    for name, dtype in bench.DTYPES.items():
        dtypes.clear()
        bench.measure_shape(shape, bench.Timer("fake", lambda fn: 1.0), providers={"flash4": recording},
                            device="cpu", dtype=dtype)
        assert dtypes == [dtype] * 3, name
