"""Time candidate configurations of the Hopper kernels on protocol shapes.

A development tool for choosing the selector's rows (flash4/dispatch.py) and the backward's
configurations (flash4/backward.py): each candidate is a change to the configuration the
selector picks for the shape; the candidates, flash-attn-4 and cuDNN are timed on the same
tensors, taking turns over ``--rounds`` rounds (the bench's measure_shape), and each keeps
its median. Two rounds of one kernel differed by up to 10% on the H200, so a single round
decides nothing below that. Each candidate's largest distance to torch SDPA's output (dq
for the backward) is printed beside its time: a fast wrong kernel is no candidate.

    python perf/sweep_configs.py [--pass bwd] [--hdim 128] [--seqlen 2048 8192] [--rounds 5] [--group 8]
                                 [--candidates '[{"kv_stages": 3}]']
                                 [--out perf/results/h200/DATE-sweep.json]

With ``--out``, the records (each candidate's rounds and distance, the versions, the
command) go to that JSON after every shape, so a run cut short keeps what it measured.

``--control`` times the selector's configuration once more, after the candidates ("...
again"): the two copies differ only by their place in the turn, so their gap is the
smallest difference a candidate must beat. In every two-candidate backward sweep of
2026-11-30 at seqlen 16k, one provider's second round ran 10-20% slower than its first,
whichever configuration stood there: the first provider on unmasked shapes, the second on
causal ones (where each call takes half as long), i.e. at about the same time into the
shape. With two rounds the median is their mean and carries half of that; keep three,
and read each provider's fastest round (perf/read_rounds.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

import torch

from flash4 import bench
from flash4.compiler import compiled_forward, tile_counter
from flash4.dispatch import KernelEntry, select
from flash4.devices import device_sms
from flash4.forward import LOG2_E

# Each list: the selector's row ({}) and changes to it; a change that does not apply to a
# shape is left out there. Add a candidate here with its GPU test, run the sweep, keep the
# winner as the row and delete the rest. What was swept, taken or not, with its numbers:
# perf/h200-findings.md, "The candidates" (the forward's).
CANDIDATES: dict[int, list[dict[str, Any]]] = {h: [dict()] for h in (64, 128, 256)}
# The backward's candidates: the selector's configuration ({}) and changes to it, as above
# (what was swept: perf/h200-findings.md, "The candidates", the backward's).
BACKWARD_CANDIDATES: dict[int, list[dict[str, Any]]] = {
    hdim: [dict(), dict(dq_first_stores=True), dict(dq_first_stores=False)] for hdim in (64, 128, 256)
}
# Head dim 128: the other query tile, 64 rows where the selector takes 80 (unmasked), 80 with
# dQ transposed where it takes 64 (causal: 2k 759 -> 774 us, 16k 4370 -> 4247 on the H100,
# two rounds; not taken, and it spills 8 bytes there).
BACKWARD_CANDIDATES[128] += [dict(dq_transposed=False, tile_m=64), dict(dq_transposed=True, tile_m=80)]
# With --group G > 1 (GQA/MQA) these join them: the ways to write a group's dK and dV
# (shared fp32 accumulators, a CTA per kv head, and that CTA in mirrored pairs of key
# blocks; flash4/backward.py picks among them, perf/h200-findings.md has the sweeps).
GROUPED_BACKWARD_CANDIDATES: list[dict[str, Any]] = [
    dict(kv_accumulate=True, kv_group_in_cta=False, mirror_pairs=False),
    dict(kv_accumulate=False, kv_group_in_cta=True, mirror_pairs=False),
    dict(kv_accumulate=False, kv_group_in_cta=True, mirror_pairs=True),
]
# FP8: the kernel alone on inputs quantized (and V laid out) beforehand, Q in blocks of
# tile_m rows and K of tile_n, V per tensor as flash_attn_fp8 quantizes it; beside it
# flash4's FP8 call (the selector's tiles) and cuDNN's FP8 attention (what was swept:
# perf/h200-findings.md). The table's rows score in fp32 and flash_attn_fp8 runs them with
# f16 scores (select_fp8), so the candidates stand beside that.
FP8_CANDIDATES: dict[int, list[dict[str, Any]]] = {h: [dict(), dict(scores_in_f16=True)] for h in (64, 128, 256)}
PEERS = ("sdpa-cudnn", "fa4")
FP8_PEERS = (bench.FLASH4, "cudnn-fp8")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """torch SDPA on flash4's (batch, seqlen, heads, head_dim) layout, k and v with fewer
    heads under GQA: what a candidate's output is measured against."""
    return torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2]
    ).transpose(1, 2)


def candidate(entry: KernelEntry, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench provider running ``entry``'s kernel; its distance to SDPA goes to ``diffs``
    (a fast wrong kernel is no candidate)."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        kernel = compiled_forward(entry)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
        expected = sdpa(q, k, v, causal, scale)
        sms = device_sms(q.device.index or 0)

        def run() -> torch.Tensor:
            kernel(q, k, v, out, lse, scale * LOG2_E, sms, tile_counter(entry.config, q.device))
            return out

        def check(result: torch.Tensor) -> torch.Tensor:
            diffs[label] = float((result - expected).abs().max())
            return result

        return run, check

    return prepare


def fp8_candidate(entry: KernelEntry, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench provider running ``entry``'s FP8 kernel alone: quantization and V's layout
    are done beforehand; its distance to SDPA's bf16 output goes to ``diffs``."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        from flash4.fp8 import OUT_DTYPE, tile_descales
        from flash4.quantize import fp8_value_layout, quantize_fp8, quantize_int8

        config = entry.config
        # Without an LSE, as flash_attn_fp8 runs by default (and as the bench times it).
        kernel = compiled_forward(entry, with_lse=False)
        q8, k8, v8 = quantize_fp8(q, config.tile_m), quantize_fp8(k, config.tile_n), quantize_fp8(v, None)
        if config.scores_in_f16:
            q8, k8 = bounded_codes(q8, k8, q.shape[-1])
        if config.fp8_qk_int8:
            # The accurate mode's inputs: int8 Q and K, rotated.
            q8, k8 = quantize_int8(q, config.tile_m), quantize_int8(k, config.tile_n)
        batch, seqlen_q, heads, _ = q.shape
        kv_heads, blocks_q, blocks_k = k.shape[2], -(-seqlen_q // config.tile_m), -(-k.shape[1] // config.tile_n)
        vt = fp8_value_layout(v8.values)
        descales = (
            tile_descales(q8, batch, heads, blocks_q),
            tile_descales(k8, batch, kv_heads, blocks_k),
            tile_descales(v8, batch, kv_heads, blocks_k),
        )
        out = torch.empty(q.shape, dtype=OUT_DTYPE, device=q.device)
        expected = sdpa(q, k, v, causal, scale)
        sms = device_sms(q.device.index or 0)

        def run() -> torch.Tensor:
            kernel(q8.values, k8.values, vt, out, None, *descales, scale * LOG2_E, sms, tile_counter(config, q.device))
            return out

        def check(result: torch.Tensor) -> torch.Tensor:
            diffs[label] = float((result.float() - expected.float()).pow(2).mean().sqrt())
            return result

        return run, check

    return prepare


def bounded_codes(q8: Any, k8: Any, head_dim: int) -> tuple[Any, Any]:
    """Q's and K's codes scaled down to the f16 scores' limits (kernels/f16_scores.py), by
    rounding their values again: for timing and comparing the kernel, not for accuracy
    studies (the codes are rounded twice)."""
    from flash4.quantize import FP8_MAX
    from flash4.kernels.f16_scores import code_limits

    return tuple(
        t._replace(values=(t.values.float() * (limit / FP8_MAX)).to(t.values.dtype), descale=t.descale * (FP8_MAX / limit))
        for t, limit in zip((q8, k8), code_limits(head_dim))
    )


def backward_candidate(config: Any, diffs: dict[str, float], label: str) -> Callable[..., bench.Prepared]:
    """A bench backward provider running the backward kernels with ``config``."""

    def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> bench.Prepared:
        from flash4 import flash_attn_func
        from flash4.backward import attention_backward

        out, lse = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)
        dout = bench.dout_like(out)
        leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
        expected = sdpa(*leaves, causal, scale)
        expected_grads = torch.autograd.grad(expected, leaves, dout)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))

        def run() -> Any:
            return attention_backward(
                q, k, v, out, dout, lse, scale, causal, grads=grads, deterministic=config.deterministic, config=config
            )

        def check(result: Any) -> torch.Tensor:
            # The largest distance over dq, dk and dv (dk and dv: what GQA's schemes change).
            diffs[label] = max(float((got - want).abs().max()) for got, want in zip(result, expected_grads))
            return result[0]

        return run, check

    return prepare


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--hdim", type=int, nargs="+", default=sorted(CANDIDATES))
    parser.add_argument("--causal", choices=("no", "yes", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pass", dest="pass_", choices=("fwd", "bwd", "fp8"), default="fwd")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the records, written after every shape")
    parser.add_argument("--group", type=int, default=1,
                        help="query heads per kv head (GQA/MQA when > 1), as `python -m flash4 bench --group`")
    parser.add_argument("--control", action="store_true",
                        help="time the selector's configuration a second time, after the candidates")
    parser.add_argument("--candidates", type=json.loads, default=None,
                        help="a JSON list of changes timed in place of the pass's CANDIDATES at every --hdim, "
                             "for a one-off probe that should not be committed as the next candidates")
    args = parser.parse_args()
    timer = bench.make_timer(quick=False)
    payload = {
        **bench.environment(), "mode": "sweep", "command": shlex.join(["python3", *sys.argv]),
        "timer": timer.description, "rounds": args.rounds, "records": [],
    }
    causal_modes = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    backward = args.pass_ == "bwd"
    for shape in bench.protocol_shapes(args.hdim, args.seqlen, causal_modes, passes=(args.pass_,), group=args.group):
        diffs: dict[str, float] = {}
        providers: dict[str, Callable[..., bench.Prepared]] = {}
        if backward:
            from flash4.backward import backward_config

            grouped = args.group > 1
            base_config = backward_config(
                shape.head_dim, shape.causal, grouped, seqlen_k=shape.seqlen,
                kv_units=shape.batch * shape.heads // shape.group, sms=device_sms(torch.cuda.current_device()),
            )
            changes = args.candidates or (
                BACKWARD_CANDIDATES[shape.head_dim] + (GROUPED_BACKWARD_CANDIDATES if grouped else []))
            for change in changes:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "selector"
                try:
                    config = dataclasses.replace(base_config, **change)
                except ValueError:
                    continue  # the change does not apply to this shape
                if change and config == base_config:
                    continue  # the selector's own
                providers[label] = backward_candidate(config, diffs, label)
            if args.control:
                providers["selector again"] = backward_candidate(base_config, diffs, "selector again")
        elif args.pass_ == "fp8":
            from flash4.dispatch import FP8_DTYPE

            base = select("sm_90a", FP8_DTYPE, shape.head_dim, shape.causal, shape.seqlen, group=args.group)
            for change in args.candidates or FP8_CANDIDATES[shape.head_dim]:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "table"
                try:
                    config = dataclasses.replace(base.config, **change)
                except ValueError:
                    continue  # the change does not apply to this shape
                if change and config == base.config:
                    continue  # the row has it already
                providers[label] = fp8_candidate(dataclasses.replace(base, config=config), diffs, label)
            if args.control:
                providers["table again"] = fp8_candidate(base, diffs, "table again")
        else:
            base = select("sm_90a", "bfloat16", shape.head_dim, shape.causal, shape.seqlen, group=args.group)
            for change in args.candidates or CANDIDATES[shape.head_dim]:
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "table"
                try:
                    config = dataclasses.replace(base.config, **change)
                except ValueError:
                    continue
                if change and config == base.config:
                    continue  # the row has it already
                providers[label] = candidate(dataclasses.replace(base, config=config), diffs, label)
            if args.control:
                providers["table again"] = candidate(base, diffs, "table again")
        peers = bench.PASS_PROVIDERS[args.pass_]
        providers.update({name: peers[name] for name in (FP8_PEERS if args.pass_ == "fp8" else PEERS)})
        record = bench.measure_shape(shape, timer, providers=providers, rounds=args.rounds)
        cells = []
        for name, m in record.results.items():
            if m.tflops is None:
                cells.append(f"{name}: {m.error}")
                continue
            low, high = (shape.flops / (ms * 1e-3) / 1e12 for ms in (max(m.ms_rounds), min(m.ms_rounds)))
            diff = f" diff {diffs[name]:.1e}" if name in diffs else ""
            cells.append(f"{name}: {m.tflops:.0f} [{low:.0f}-{high:.0f}]{diff}")
        print(f"{args.pass_} d{shape.head_dim} {'causal' if shape.causal else 'full'} s{shape.seqlen}: "
              + " | ".join(cells),
              flush=True)
        if args.out is not None:
            payload["records"].append({**dataclasses.asdict(record), "diffs": dict(diffs)})
            bench.write_json(args.out, payload, quiet=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
