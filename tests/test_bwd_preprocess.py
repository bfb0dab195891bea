"""The backward preprocess: D = rowsum(dO ∘ O), LSE·log2(e), a zeroed dQ accumulator
padded to whole query blocks (or, for the main kernel's dq_first_stores, zeroed counters
per query block and part instead), and zeroed per-head counters. CPU: it compiles for
sm_90a with the loads and shuffles its design depends on. GPU: its outputs against torch,
poisoned before the launch."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from flash4.compiler import compile_backward_preprocess

BLOCK_ROWS = 128


# Counters per query block when the main kernel's first dQ contributions store.
PARTS = 2


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("counters", (0, PARTS))
def test_preprocess_compiles_with_vector_loads_and_row_shuffles(head_dim, counters):
    with tempfile.TemporaryDirectory() as scratch:
        compiled = compile_backward_preprocess(
            "bfloat16", head_dim, BLOCK_ROWS, "--gpu-arch=sm_90a", "--keep-ptx", f"--dump-dir={scratch}",
            dq_counters_per_block=counters,
        )
        ptx = compiled.__ptx__
    lanes_per_row = head_dim // 8
    passes = BLOCK_ROWS // (128 // lanes_per_row)
    # Two 16-byte loads (O and dO) per row pass, and 16-byte stores for the accumulator
    # unless the counters are zeroed instead (no 16-byte store at all).
    assert ptx.count("ld.global.v4") == 2 * passes
    assert ptx.count("st.global.v4") == (0 if counters else BLOCK_ROWS * head_dim // (4 * 128))
    # The lanes of one row add their partial sums: log2(lanes) shuffles per pass.
    assert ptx.count("shfl.sync.bfly") == passes * int(math.log2(lanes_per_row))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("seqlen", (1, 17, 128, 1000))
@pytest.mark.parametrize("counters", (0, PARTS))
def test_preprocess_matches_torch(head_dim, dtype, seqlen, counters):
    from flash4.compiler import compiled_backward_preprocess

    batch, heads = 3, 5
    padded = -(-seqlen // BLOCK_ROWS) * BLOCK_ROWS
    out = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(out)
    lse = torch.randn(batch, heads, seqlen, device="cuda") * 4
    lse[:, :, ::7] = -math.inf  # rows that saw no key
    d = torch.full((batch, heads, padded), math.nan, device="cuda")
    lse_log2 = torch.full_like(d, math.nan)
    dq_accum = torch.full((batch, heads, padded * head_dim), math.nan, device="cuda")
    dq_ready = torch.full((batch, heads), -7, dtype=torch.int32, device="cuda")
    dq_counters = torch.full((batch, heads, padded // BLOCK_ROWS * PARTS), -7, dtype=torch.int32, device="cuda")
    name = str(dtype).removeprefix("torch.")
    kernel = compiled_backward_preprocess(name, head_dim, BLOCK_ROWS, dq_counters_per_block=counters)
    kernel(out, dout, lse, d, lse_log2, dq_accum, dq_ready, dq_counters if counters else None)
    torch.cuda.synchronize()

    expected = (out.double() * dout.double()).sum(-1).transpose(1, 2)
    # fp32 sums of head_dim products of O(1) terms: a few ulps of sqrt(head_dim).
    assert (d[:, :, :seqlen].double() - expected).abs().max().item() <= 1e-5 * math.sqrt(head_dim) * 8
    assert torch.all(d[:, :, seqlen:] == 0)
    want = torch.where(lse == -math.inf, 0.0, lse * math.log2(math.e))
    assert torch.allclose(lse_log2[:, :, :seqlen], want, rtol=1e-6, atol=0)
    assert torch.all(lse_log2[:, :, seqlen:] == math.inf)
    if counters:
        # The accumulator is left alone (the main kernel's first contributions store).
        assert torch.all(dq_counters == 0)
        assert torch.all(dq_accum.isnan())
    else:
        assert torch.all(dq_accum == 0)
        assert torch.all(dq_counters == -7)
    assert torch.all(dq_ready == 0)
