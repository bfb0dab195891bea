"""The FP8 forward's host side and build, on CPU: V's layout for the kernel, the key order
that lets P stay in its thread (checked against the wgmma layouts themselves), argument
checks, the selector's FP8 rows and their PTX."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import pytest
import torch

from flash4 import dispatch
from flash4.fp8 import (
    check_fp8_args, flash_attn_fp8, flash_attn_fp8_quantized, fp8_blocks, kernel_descales, tile_descales,
)
from flash4.kernels.f16_scores import F16_SCORE_BOUND, code_limits, scores_fit_f16
from flash4.kernels.mma_layouts import FP8_PV_KEY_ORDER
from flash4.kernels.online_softmax import E4M3_MAX
from flash4.quantize import FP8_MAX, fp8_value_layout, quantize_fp8, transpose_fp8_v

FP8_ROWS = [row for row in dispatch.TABLE if row.dtype == dispatch.FP8_DTYPE]


def descales_travel_with_stages(ptx: str) -> bool:
    """No global load anywhere (a consumer's load of a descale stalled a tile's start or
    its epilogue for the load's whole latency); the descales come by 4-byte cp.async, each
    batch counted on a stage's barrier."""
    copies = re.findall(r"cp\.async\.ca\.shared\.global\s+\[[^]]+\], \[[^]]+\], (\d+)", ptx)
    return (
        "ld.global" not in ptx and len(copies) > 0 and set(copies) == {"4"}
        and ptx.count("cp.async.mbarrier.arrive.noinc") > 0
    )


def test_key_order_is_a_permutation_of_each_group_and_e4m3_max_agrees():
    assert sorted(FP8_PV_KEY_ORDER) == list(range(32)) and FP8_PV_KEY_ORDER != tuple(range(32))
    assert E4M3_MAX == FP8_MAX


@pytest.mark.parametrize("seqlen", (1, 17, 32, 100))
def test_value_layout_transposes_renames_and_pads(seqlen):
    v = quantize_fp8(torch.randn(2, seqlen, 3, 16)).values
    vt = fp8_value_layout(v)
    padded = -(-seqlen // 32) * 32
    assert vt.dtype == torch.float8_e4m3fn and vt.shape == (2, 3, 16, padded) and vt.is_contiguous()
    rows = v.float().permute(0, 2, 3, 1)  # (batch, heads, head_dim, keys)
    for position in range(padded):
        key = 32 * (position // 32) + FP8_PV_KEY_ORDER[position % 32]
        want = rows[..., key] if key < seqlen else torch.zeros_like(rows[..., 0])
        assert torch.equal(vt[..., position].float(), want), f"position {position} should hold key {key}"


# The loops below run at trace time on purpose: they read layouts, nothing is compiled from them.
@pytest.mark.filterwarnings("ignore:This static loop")
def test_key_order_matches_the_wgmma_layouts():
    # For every thread: element i of the accumulator's FP8 A view sits at (row, key) of S;
    # element i of the FP8 A fragment is (row, position) of P. The view is right when the
    # rows agree and the key is the one FP8_PV_KEY_ORDER puts at that position.
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup

    from flash4.kernels.mma_layouts import acc_as_fp8_a_operand

    keys = 128
    pairs = []

    @cute.jit
    def collect():
        major_k = cute.nvgpu.OperandMajorMode.K
        e4m3 = cutlass.Float8E4M3FN
        qk = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, major_k, major_k, cutlass.Float32, (1, 1, 1), (64, keys))
        pv = sm90_utils.make_trivial_tiled_mma(
            e4m3, e4m3, major_k, major_k, cutlass.Float32, (1, 1, 1), (64, 64), a_source=warpgroup.OperandSource.RMEM
        )
        coords = cute.make_identity_tensor((64, keys))
        for t in cutlass.range_constexpr(128):
            view = acc_as_fp8_a_operand(qk.get_slice(t).partition_C(coords))
            a = pv.get_slice(t).partition_A(coords)
            for i in cutlass.range_constexpr(cute.size(a)):
                pairs.append((view[i], a[i]))

    cute.compile(collect, options="--gpu-arch=sm_90a")
    assert len(pairs) == 64 * keys
    wrong = [(s, p) for s, p in pairs if s[0] != p[0] or s[1] != 32 * (p[1] // 32) + FP8_PV_KEY_ORDER[p[1] % 32]]
    assert not wrong, f"{len(wrong)} elements land elsewhere, e.g. {wrong[:3]}"
    assert len({p for _, p in pairs}) == 64 * keys  # each (row, position) once


def test_tile_descales_repeat_a_per_tensor_descale():
    q = quantize_fp8(torch.randn(2, 300, 3, 64), None)
    d = tile_descales(q, 2, 3, 3)
    assert d.shape == (2, 3, 3) and d.is_contiguous() and torch.equal(d, q.descale.expand(2, 3, 3))
    blockwise = quantize_fp8(torch.randn(2, 300, 3, 64), 128)
    assert tile_descales(blockwise, 2, 3, 3) is blockwise.descale


def test_kernel_descales_pass_a_per_tensor_v_descale_in_place():
    # The per-tensor V kernel reads one float: no copy (a launch on every call) is made for it.
    blocks = fp8_blocks(64, False, 300)
    q = quantize_fp8(torch.randn(2, 300, 4, 64), blocks.q)
    k, v = (quantize_fp8(torch.randn(2, 300, 2, 64), block) for block in (blocks.kv, None))
    q_blocks, kv_blocks = -(-300 // blocks.q), -(-300 // blocks.kv)
    for v_given in (v, transpose_fp8_v(v)):
        dq, dk, dv = kernel_descales(q, k, v_given, 2, 4, 2, q_blocks, kv_blocks)
        assert dq is q.descale and dk is k.descale
        assert dv.shape == (1, 1, 1) and dv.data_ptr() == v.descale.data_ptr() and dv.item() == v.descale.item()
    per_tensor_k = quantize_fp8(torch.randn(2, 300, 2, 64), None)
    blockwise_v = quantize_fp8(torch.randn(2, 300, 2, 64), blocks.kv)
    _, dk, dv = kernel_descales(q, per_tensor_k, blockwise_v, 2, 4, 2, q_blocks, kv_blocks)
    assert torch.equal(dk, per_tensor_k.descale.expand(2, 2, kv_blocks)) and dv is blockwise_v.descale


def _quantized(seqlen_q=10, seqlen_k=12, heads=4, kv_heads=2, head_dim=64):
    blocks = fp8_blocks(head_dim, False, seqlen_q)
    return (
        quantize_fp8(torch.randn(1, seqlen_q, heads, head_dim), blocks.q),
        quantize_fp8(torch.randn(1, seqlen_k, kv_heads, head_dim), blocks.kv),
        quantize_fp8(torch.randn(1, seqlen_k, kv_heads, head_dim), blocks.kv),
    )


def test_fp8_checks_name_the_argument():
    q, k, v = _quantized()
    with pytest.raises(TypeError, match=r"^q must be a flash4.Fp8Tensor"):
        check_fp8_args(q.values, k, v, None, False)
    with pytest.raises(ValueError, match=r"^k.block is 64: at head_dim=64, causal=False, seqlen_q=10 the FP8 kernel reads one descale per 256 rows .*block=256"):
        check_fp8_args(q, quantize_fp8(torch.randn(1, 12, 2, 64), 64), v, None, False)
    with pytest.raises(ValueError, match=r"^q.block is 64: at head_dim=64, .*block=128"):
        check_fp8_args(quantize_fp8(torch.randn(1, 10, 4, 64), 64), k, v, None, False)
    with pytest.raises(TypeError, match=r"^v must be a flash4.Fp8Tensor .* or flash4.Fp8TransposedV"):
        check_fp8_args(q, k, v.values, None, False)
    vt = transpose_fp8_v(v)
    with pytest.raises(ValueError, match=r"^v \(transposed\) must hold k's keys: .*\(1, 2, 64, 32\) and seqlen 12"):
        check_fp8_args(q, k, vt._replace(seqlen=11), None, False)
    with pytest.raises(ValueError, match=r"^v.descale must be a contiguous float32 tensor of shape \(1, 2, 1\)"):
        check_fp8_args(q, k, vt._replace(descale=vt.descale.repeat(1, 1, 2)), None, False)
    with pytest.raises(ValueError, match=r"^v.values must be a 4-D torch.float8_e4m3fn"):
        check_fp8_args(q, k, v._replace(values=v.values.float()), None, False)
    with pytest.raises(ValueError, match=r"^q.descale must be a contiguous float32 tensor of shape \(1, 4, 1\)"):
        check_fp8_args(q._replace(descale=q.descale[..., :0]), k, v, None, False)
    with pytest.raises(ValueError, match=r"^q and k must both be rotated"):
        check_fp8_args(q._replace(hadamard=True), k, v, None, False)
    with pytest.raises(ValueError, match=r"^v must not be rotated"):
        check_fp8_args(q, k, v._replace(hadamard=True), None, False)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        check_fp8_args(q, k, _quantized(seqlen_k=13)[2], None, False)
    with pytest.raises(ValueError, match=r"softmax_scale must be a positive finite float"):
        check_fp8_args(q, k, v, -1.0, False)
    with pytest.raises(TypeError, match=r"^causal must be a bool"):
        check_fp8_args(q, k, v, None, 1)
    # Everything but the device is right: CPU tensors fail only there.
    for value in (v, vt):
        with pytest.raises(ValueError, match=r"CUDA"):
            check_fp8_args(q, k, value, None, False)
    with pytest.raises(TypeError, match=r"^return_lse must be a bool"):
        flash_attn_fp8_quantized(q, k, v, return_lse=1)


def test_flash_attn_fp8_checks_before_quantizing():
    x = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^hadamard must be a bool"):
        flash_attn_fp8(x, x, x, hadamard=1)
    with pytest.raises(TypeError, match=r"^q has dtype float32"):
        flash_attn_fp8(x.float(), x, x)


def test_fp8_blocks_are_the_tiles_of_the_row_a_problem_selects():
    # Every (head dim, mask) has FP8 rows; the descale blocks of a problem are the query and
    # key tiles of the row that serves it (tiles of whole 64-row warpgroups and 32-key
    # wgmma steps), at every length that row covers.
    assert {(r.head_dim, r.causal) for r in FP8_ROWS} == {(d, c) for d in (64, 128, 256) for c in (False, True)}
    for row in FP8_ROWS:
        config = row.config
        assert config.fp8 and config.tile_m % 64 == 0 and config.tile_n % 32 == 0
        longer = [r.min_seqlen_q for r in FP8_ROWS
                  if (r.head_dim, r.causal) == (row.head_dim, row.causal) and r.min_seqlen_q > row.min_seqlen_q]
        for seqlen in {row.min_seqlen_q, min(longer, default=100_001) - 1}:
            assert dispatch.select("sm_90a", dispatch.FP8_DTYPE, row.head_dim, row.causal, seqlen) == row
            blocks = fp8_blocks(row.head_dim, row.causal, seqlen)
            assert (blocks.q, blocks.kv) == (config.tile_m, config.tile_n)
            assert (blocks.q_max, blocks.k_max) == code_limits(row.head_dim)
    with pytest.raises(ValueError, match=r"^head_dim=96: the FP8 kernel supports head dims \[64, 128, 256\]"):
        fp8_blocks(96, False, 1)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("seqlen", (1, 17, 32, 33, 1000))
def test_quantizing_v_straight_into_the_kernel_layout_is_quantize_then_transpose(dtype, seqlen):
    from flash4.quantize import quantize_fp8_transposed_v

    v = (torch.randn(2, seqlen, 3, 64) * 4).to(dtype)
    want, got = transpose_fp8_v(quantize_fp8(v, None)), quantize_fp8_transposed_v(v)
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
    assert torch.equal(got.descale, want.descale) and got.block is None and got.seqlen == seqlen


@pytest.mark.parametrize("seqlen", (1, 17, 32, 100))
def test_transposed_v_is_the_kernel_layout_and_comes_back(seqlen):
    v8 = quantize_fp8(torch.randn(2, seqlen, 3, 64), 128)
    vt = transpose_fp8_v(v8)
    assert torch.equal(vt.values.view(torch.uint8), fp8_value_layout(v8.values).view(torch.uint8))
    assert vt.seqlen == seqlen and vt.descale is v8.descale and vt.block == 128
    back = vt.untransposed()
    assert torch.equal(back.values.view(torch.uint8), v8.values.view(torch.uint8)) and back.block == 128
    assert torch.equal(vt.dequantize(), v8.dequantize())
    with pytest.raises(ValueError, match=r"^v must not be rotated"):
        transpose_fp8_v(v8._replace(hadamard=True))
    with pytest.raises(TypeError, match=r"^v must be a flash4.Fp8Tensor"):
        transpose_fp8_v(v8.values)


@pytest.mark.parametrize("entry", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}" for r in FP8_ROWS])
def test_fp8_kernel_builds_fp8_gemms_and_converts_p_in_registers(entry):
    from flash4.compiler import compile_entry

    report = compile_entry(entry, arch="sm_90a")
    config = entry.config
    ptx = report.ptx
    gemms = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.e4m3\.e4m3", ptx)
    # S: head_dim / 32 k-steps, N = tile_n; P V: tile_n / 32, N = head_dim. S of the first
    # block, S and P V in the masked and the unmasked loop, P V of the last block.
    s_steps, pv_steps = config.head_dim // 32, config.tile_n // 32
    expected = Counter({f"m64n{config.tile_n}k32": 3 * s_steps}) + Counter({f"m64n{config.head_dim}k32": 3 * pv_steps})
    assert Counter(gemms) == expected and len(gemms) == ptx.count("wgmma.mma_async")
    # P: four e4m3 per register, two conversions per register, where a block's P is made
    # (the first block, and both loops): no shuffles, no shared memory.
    per_block = 64 * config.tile_n // 128 // 2
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 3 * per_block
    # The only butterfly shuffles are the quad reductions (2 steps over 4 threads) of each
    # thread's 2 rows: the max where a block's P is made, and the sum once at the end.
    assert ptx.count("shfl.sync.bfly") == 2 * 2 * (3 + 1)
    # V arrives transposed by TMA (no transpose in the kernel): K-major B operand.
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0
    assert descales_travel_with_stages(ptx)


ROWS_SUMMING_ON_TENSOR_CORES = [row for row in FP8_ROWS if row.config.row_sum_on_tensor_cores]


@pytest.mark.parametrize(
    "entry", ROWS_SUMMING_ON_TENSOR_CORES,
    ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}" for r in ROWS_SUMMING_ON_TENSOR_CORES],
)
def test_fp8_kernel_without_lse_sums_rows_on_the_tensor_cores(entry):
    from flash4.compiler import compile_entry

    report = compile_entry(entry, arch="sm_90a", with_lse=False)
    ptx, config = report.ptx, entry.config
    gemms = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.f32\.e4m3\.e4m3", ptx))
    # Beside each P V (both loops and the last block), P times the ones tile: N = 8.
    s_steps, pv_steps = config.head_dim // 32, config.tile_n // 32
    expected = Counter({f"m64n{config.tile_n}k32": 3 * s_steps}) + Counter({f"m64n{config.head_dim}k32": 3 * pv_steps})
    assert gemms == expected + Counter({"m64n8k32": 3 * pv_steps})
    # The row sums come whole from the GEMM: only the max's quad reductions remain.
    assert ptx.count("shfl.sync.bfly") == 2 * 2 * 3
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (300, 300), (300, 129), (129, 300), (17, 1000)))
def test_blockwise_fp8_model_is_the_fp8_model_tile_by_tile(causal, seqlen_q, seqlen_k):
    # With one descale per tensor, the kernel's algorithm (running max over key blocks walked
    # backwards, P on e4m3's range, O rescaled) rounds as the row-at-once model does: its
    # error against the exact attention of the dequantized inputs is that model's, within a
    # quarter either way. Its LSE sees no e4m3 rounding.
    from flash4 import reference

    g = torch.Generator().manual_seed(seqlen_q + 3 * seqlen_k)
    q, k, v = (torch.randn(2, s, h, 64, generator=g) for s, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2)))
    q8, k8, v8 = (quantize_fp8(t, None) for t in (q, k, v))
    exact, lse_exact = reference.attention(*(t.dequantize().double() for t in (q8, k8, v8)), causal=causal,
                                           compute_dtype=torch.float64)
    model = reference.fp8_attention(q8, k8, v8, causal=causal)
    out, lse = reference.fp8_blockwise_attention(q8, k8, v8, causal=causal)
    empty = lse_exact == -math.inf
    assert torch.equal(lse == -math.inf, empty) and torch.equal(out[empty.transpose(1, 2)], torch.zeros_like(out[empty.transpose(1, 2)]))
    # (The exact side's inputs went through dequantize's float32 products: 1e-7 relative.)
    assert (lse[~empty] - lse_exact[~empty]).abs().max() <= 1e-6
    model_err, err = ((x - exact).pow(2).mean().sqrt().item() for x in (model, out))
    if model_err == 0:  # seqlen_k 1: P = 1 is exact in e4m3
        assert err <= 1e-12
    else:
        assert 0.75 * model_err <= err <= 1.25 * model_err, (err, model_err)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_model_summing_rounded_p_normalises_by_the_weights_it_used(causal):
    # One key block of 100 keys: the kernel's algorithm is the row-at-once one, so with
    # sum_rounded_p the output is exactly (P8 V) / sum(P8) with P8 = e4m3(448 exp2(s - m)),
    # each row's weights summing to one; without it, it differs from that.
    from flash4 import reference

    q, k, v = (torch.randn(1, 100, 2, 64) for _ in range(3))
    q8, k8, v8 = (quantize_fp8(t, None) for t in (q, k, v))
    # In float64 from the e4m3 values (dequantize's float32 products would move some P
    # across an e4m3 rounding boundary).
    q_values, k_values, v_values = (t.values.double() for t in (q8, k8, v8))
    scale = 64**-0.5 * math.log2(math.e) * q8.descale.double() * k8.descale.double()
    scores = torch.einsum("bqhd,bkhd->bhqk", q_values, k_values) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(100, 100, dtype=torch.bool).triu(1), -math.inf)
    p8 = (torch.exp2(scores - scores.amax(-1, keepdim=True)) * FP8_MAX).to(torch.float8_e4m3fn).double()
    want = torch.einsum("bhqk,bkhd->bqhd", p8 / p8.sum(-1, keepdim=True), v_values) * v8.descale.double()
    out, _ = reference.fp8_blockwise_attention(q8, k8, v8, causal=causal, sum_rounded_p=True)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    out_true_sum, _ = reference.fp8_blockwise_attention(q8, k8, v8, causal=causal)
    assert (out_true_sum - want).abs().max() > 1e-6


def test_blockwise_fp8_model_folds_each_v_descale():
    # V scaled up 1000x in its second key block only: with descales per block, the model
    # must carry each block's descale (P's scale relative to the largest so far, O rescaled
    # when it grows); its output stays close to the exact one.
    from flash4 import reference

    q, k, v = (torch.randn(1, 256, 2, 64) for _ in range(3))
    v[:, 128:] *= 1000
    q8, k8, v8 = (quantize_fp8(t, 128) for t in (q, k, v))
    assert v8.descale[0, 0, 1] > 500 * v8.descale[0, 0, 0]
    exact, _ = reference.attention(*(t.dequantize().double() for t in (q8, k8, v8)), compute_dtype=torch.float64)
    out, _ = reference.fp8_blockwise_attention(q8, k8, v8)
    assert (out - exact).pow(2).mean().sqrt() <= 0.05 * exact.pow(2).mean().sqrt()


def test_flash_attn_func_takes_e4m3_inputs_with_descales():
    import flash4

    q, k, v = _quantized()
    # Without descales, e4m3 is no supported dtype, and the message says what is missing.
    with pytest.raises(TypeError, match=r"^q has dtype float8_e4m3fn; .*q_descale, k_descale and v_descale"):
        flash4.flash_attn_func(q.values, k.values, v.values)
    # With some but not all descales, the missing one is named.
    with pytest.raises(TypeError, match=r"^v_descale must be a float32 tensor"):
        flash4.flash_attn_func(q.values, k.values, v.values, q_descale=q.descale, k_descale=k.descale)
    # Blockwise descales of the wrong block size: their shape is checked.
    with pytest.raises(ValueError, match=r"^q.descale must be a contiguous float32 tensor of shape \(1, 4, 1\)"):
        flash4.flash_attn_func(q.values, k.values, v.values, q_descale=q.descale.repeat(1, 1, 2),
                               k_descale=k.descale, v_descale=v.descale)
    # Right arguments on CPU fail only at the device check, as the FP8 path's own do.
    with pytest.raises(ValueError, match=r"CUDA"):
        flash4.flash_attn_func(q.values, k.values, v.values, q_descale=q.descale, k_descale=k.descale,
                               v_descale=quantize_fp8(torch.randn(1, 12, 2, 64), None).descale)


def test_flash_attn_fp8_refuses_a_gpu_without_fp8_kernels_before_quantizing(monkeypatch):
    # On a GPU whose architecture has no FP8 rows, the selector's error comes before any
    # quantization kernel runs (CPU tensors, with the device checks and queries mocked).
    import flash4.checks
    import flash4.fp8 as fp8

    x = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    problem = flash4.checks.describe_attention(x, x, x, None, False)
    monkeypatch.setattr(fp8, "check_attention_args", lambda *args: problem)
    monkeypatch.setattr(fp8, "device_arch", lambda index: "sm_100a")

    def quantize(*args, **kwargs):
        raise AssertionError("quantized before the architecture was checked")

    for name in ("quantize_on_gpu", "quantize_fp8_transposed_v"):
        monkeypatch.setattr(fp8, name, quantize)
    with pytest.raises(dispatch.UnsupportedProblemError, match="sm_100a"):
        fp8.flash_attn_fp8(x, x, x)


def test_code_limits_keep_every_raw_score_inside_f16():
    # Q's and K's code limits: powers of two whose raw scores (head_dim products) stay
    # within F16_SCORE_BOUND, and twice either would not; fp16's largest finite value is
    # past the bound. select_fp8 takes the f16 rows only where P's codes are rounded.
    assert F16_SCORE_BOUND < torch.finfo(torch.float16).max
    for head_dim in (64, 128, 256):
        q_max, k_max = code_limits(head_dim)
        assert q_max >= k_max and all(math.frexp(x)[0] == 0.5 for x in (q_max, k_max))
        assert scores_fit_f16(head_dim, q_max, k_max)
        assert not scores_fit_f16(head_dim, 2 * q_max, k_max) and not scores_fit_f16(head_dim, q_max, 2 * k_max)
        for causal in (False, True):
            entry = dispatch.select_fp8("sm_90a", head_dim, causal, 1000, True, f16_scores=True)
            assert entry.config.scores_in_f16
            assert not dispatch.select_fp8("sm_90a", head_dim, causal, 1000, True).config.scores_in_f16
            assert not dispatch.select_fp8("sm_90a", head_dim, causal, 1000, False, f16_scores=True).config.scores_in_f16


@pytest.mark.parametrize("block", (None, 128))
@pytest.mark.parametrize("fp8_max", (16.0, 32.0))
def test_quantize_fp8_scales_each_block_onto_fp8_max(block, fp8_max):
    # Each block's largest magnitude lands on fp8_max (a power of two: exactly), the rest
    # stays below, and the values still approximate x; fp8_max travels with the tensor.
    x = torch.randn(2, 300, 3, 64) * 3
    q = quantize_fp8(x, block, fp8_max=fp8_max)
    assert q.fp8_max == fp8_max and q.values.float().abs().max() == fp8_max
    assert (q.dequantize() - x).abs().max() <= 2.0**-4 * x.abs().max() * 1.01
    assert quantize_fp8(x, block).fp8_max == 448.0


@pytest.mark.parametrize("fp8_max", (0.0, -16.0, 24.0, 512.0, True, "16"))
def test_quantize_fp8_refuses_other_fp8_max(fp8_max):
    with pytest.raises(ValueError, match=r"^fp8_max must be 448 or a power of two below it"):
        quantize_fp8(torch.randn(1, 4, 1, 64), 128, fp8_max=fp8_max)


F16_SCORE_ROWS = [dispatch.select_fp8("sm_90a", r.head_dim, r.causal, r.min_seqlen_q, True, f16_scores=True)
                  for r in FP8_ROWS if r.config.fp8_p_by_rounding]


@pytest.mark.parametrize("entry", F16_SCORE_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}"
                                                      for r in F16_SCORE_ROWS])
def test_f16_scores_make_p_codes_in_pairs(entry):
    # Without an LSE: the S GEMM accumulates in f16; each block's P comes from one fma and
    # one clamp per pair of scores and one prmt per four, with no fp32 score conversion;
    # the row max starts with max.f16x2 over half a row. No spill, no serialised wgmma
    # (an f16 read of the accumulator before its wait would serialise them). With an LSE
    # the same configuration compiles the fp32-score kernel.
    from flash4.compiler import compile_entry

    report = compile_entry(entry, arch="sm_90a", with_lse=False)
    ptx, config = report.ptx, entry.config
    s_steps = config.head_dim // 32
    s_gemms = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f16\.e4m3\.e4m3", ptx)
    assert s_gemms == [str(config.tile_n)] * (3 * s_steps)
    pairs = 64 * config.tile_n // 128 // 2  # per thread, per block
    # The first block, the masked loop and the unmasked loop each make one block's P.
    assert ptx.count("fma.rn.f16x2") == 3 * pairs
    assert ptx.count("prmt.b32") == 3 * pairs // 2
    assert ptx.count("cvt.rn.f16x2.f32") == 3 * (1 + 2)  # the code scale, and each row's offset
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0
    assert descales_travel_with_stages(ptx)
    with_lse = compile_entry(entry, arch="sm_90a", with_lse=True).ptx
    assert ".f16.e4m3.e4m3" not in with_lse and "fma.rn.f16x2" not in with_lse
    assert descales_travel_with_stages(with_lse)


# ---------------------------------------------------------------------------- int8 Q and K
@pytest.mark.parametrize("f16_scores", (False, True))
@pytest.mark.parametrize("v_per_tensor", (True, False), ids=("v-per-tensor", "v-blockwise"))
def test_int8_qk_selects_the_rows_kernel_with_s32_scores(v_per_tensor, f16_scores):
    for row in FP8_ROWS:
        seqlen = row.min_seqlen_q
        plain = dispatch.select_fp8("sm_90a", row.head_dim, row.causal, seqlen, v_per_tensor, f16_scores=f16_scores)
        int8 = dispatch.select_fp8(
            "sm_90a", row.head_dim, row.causal, seqlen, v_per_tensor, f16_scores=f16_scores, qk_int8=True
        )
        assert int8.config == dataclasses.replace(
            plain.config, fp8_qk_int8=True, scores_in_f16=False, fp8_int8_shift_in_softmax=True
        )


def test_int8_qk_checks_name_the_argument():
    from flash4.quantize import quantize_int8

    q, k, v = _quantized()
    blocks = fp8_blocks(64, False, 10)
    q_int8, k_int8 = quantize_int8(torch.randn(1, 10, 4, 64), blocks.q), quantize_int8(torch.randn(1, 12, 2, 64), blocks.kv)
    with pytest.raises(ValueError, match=r"^q.values is torch.int8 but k.values is torch.float8_e4m3fn: .*both int8"):
        check_fp8_args(q_int8._replace(hadamard=False), k, v, None, False)
    with pytest.raises(ValueError, match=r"^v.values must be a 4-D torch.float8_e4m3fn tensor"):
        check_fp8_args(q_int8, k_int8, v._replace(values=v.values.view(torch.int8)), None, False)
    # Both int8, V e4m3: everything but the device is right.
    with pytest.raises(ValueError, match=r"CUDA"):
        check_fp8_args(q_int8, k_int8, v, None, False)
    with pytest.raises(TypeError, match=r"^qk_int8 must be a bool"):
        flash_attn_fp8(*(torch.randn(1, 8, 2, 64, dtype=torch.bfloat16) for _ in range(3)), qk_int8=1)


def test_int8_raw_scores_stay_exact_through_the_shift():
    # 127 * 127 * head_dim within 2^22 at every FP8 head dim: the integer add of 1.5 * 2^23's
    # bits then reads as the float 1.5 * 2^23 + s, exactly.
    import struct

    from flash4.kernels.int8_scores import SHIFT_BITS, SHIFT_FLOAT, scores_fit_shift

    assert struct.unpack("<f", struct.pack("<I", SHIFT_BITS))[0] == SHIFT_FLOAT
    for head_dim in sorted({row.head_dim for row in FP8_ROWS}):
        assert scores_fit_shift(head_dim)
        for s in (0, 1, -1, 127 * 127 * head_dim, -127 * 127 * head_dim):
            shifted = struct.unpack("<f", struct.pack("<I", SHIFT_BITS + s))[0]
            assert shifted - SHIFT_FLOAT == s
    assert scores_fit_shift(260) and not scores_fit_shift(264)


@pytest.mark.parametrize("shift_in_softmax", (False, True), ids=("fadd", "folded"))
@pytest.mark.parametrize("with_lse", (False, True), ids=("no-lse", "lse"))
@pytest.mark.parametrize("entry", FP8_ROWS, ids=[f"d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in FP8_ROWS])
def test_int8_qk_kernels_build_s8_gemms_and_shift_their_scores(entry, with_lse, shift_in_softmax):
    from flash4.compiler import compile_entry

    int8 = dispatch.select_fp8("sm_90a", entry.head_dim, entry.causal, entry.min_seqlen_q, True, qk_int8=True)
    assert int8.config.fp8_qk_int8
    int8 = dataclasses.replace(int8, config=dataclasses.replace(int8.config, fp8_int8_shift_in_softmax=shift_in_softmax))
    report = compile_entry(int8, arch="sm_90a", with_lse=with_lse)
    ptx, config = report.ptx, int8.config
    # S: s8 x s8 into s32 (saturating, never reached: the raw scores stay within 2^22), N =
    # tile_n, in the first block and both loops; P V stays e4m3.
    s_gemms = Counter(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k32)\.satfinite\.s32\.s8\.s8", ptx))
    assert s_gemms == Counter({f"m64n{config.tile_n}k32": 3 * config.head_dim // 32})
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    # Each score converted by the shift, where a block's S completes (three places), never by
    # the slow conversion.
    per_thread = 64 * config.tile_n // 128
    assert len(re.findall(r"add\.s32 \S+, \S+, 1262485504;", ptx)) == 3 * per_thread
    assert "cvt.rn.f32.s32" not in ptx
    # The float shift (1.5 * 2^23) taken off each score, or (folded) only off each row's
    # max and out of its constant: a few per place, not one per score.
    float_shifts = ptx.count("0f4B400000") + ptx.count("0fCB400000")
    assert float_shifts >= 3 * per_thread if not shift_in_softmax else 0 < float_shifts < per_thread
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0
    assert descales_travel_with_stages(ptx)
