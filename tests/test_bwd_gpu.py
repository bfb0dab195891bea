"""The Hopper backward (flash4/backward.py) against the float32 reference, on the GPU.

Rule of DESIGN.md for every gradient: max|g - ref| <= 2 * max|g_torch - ref| + 1e-5, where
ref is flash4.reference.attention_backward in float32 and g_torch is torch's autograd in
the input dtype. Gradients are poisoned with NaN before the launch; inputs are fresh draws.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash4 import reference

pytestmark = pytest.mark.gpu

ABS_SLACK = 1e-5
# The forward tests' grid (ragged, equal and unequal both ways, up to 4096), plus two
# lengths that are no multiple of any tile.
SEQLEN_PAIRS = (
    (1, 1), (17, 17), (128, 128), (1000, 1000), (4096, 4096),
    (1, 1000), (17, 1000), (1000, 17), (128, 4096), (4096, 128), (333, 777), (777, 333),
)


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _check_against_reference(q, k, v, dout, causal, grads) -> None:
    """DESIGN.md's rule for each of dq, dk, dv, and no element left unwritten (NaN)."""
    out_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    expected = reference.attention_backward(q, k, v, out_ref, dout, lse_ref, causal=causal)
    baseline = reference.attention_backward_in_dtype(q, k, v, dout, causal=causal)
    for name, got, want, torch_grad in zip(("dq", "dk", "dv"), grads, expected, baseline):
        assert not got.isnan().any(), f"{name}: some element was never written"
        bound = 2 * _max_err(torch_grad, want) + ABS_SLACK
        assert _max_err(got, want) <= bound, f"{name}: error {_max_err(got, want):.3g} > {bound:.3g}"


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
@pytest.mark.parametrize("heads,kv_heads", ((3, 3), (4, 2), (4, 1)), ids=("mha", "gqa", "mqa"))
def test_backward_matches_reference(head_dim, causal, dtype, seqlen_q, seqlen_k, heads, kv_heads):
    from flash4 import flash_attn_func
    from flash4.backward import attention_backward

    batch = 2
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads)
    torch.cuda.synchronize()

    _check_against_reference(q, k, v, dout, causal, (dq, dk, dv))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (8, 2)), ids=("mha", "gqa"))
def test_deterministic_backward_is_bit_identical(head_dim, causal, heads, kv_heads):
    # Many key blocks add into each query block's dQ (1000 keys), and under GQA four query
    # heads into each dK, dV: the orders that deterministic mode fixes.
    from flash4 import flash_attn_func
    from flash4.backward import attention_backward

    dtype = torch.bfloat16
    q = torch.randn(2, 777, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, 1000, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(2, 1000, kv_heads, head_dim, device="cuda", dtype=dtype)
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    runs = []
    for _ in range(2):
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        runs.append(attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads, deterministic=True))
    torch.cuda.synchronize()
    for name, first, second in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{name} differs between two deterministic runs"

    out_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    expected = reference.attention_backward(q, k, v, out_ref, dout, lse_ref, causal=causal)
    baseline = reference.attention_backward_in_dtype(q, k, v, dout, causal=causal)
    for name, got, want, torch_grad in zip(("dq", "dk", "dv"), runs[0], expected, baseline):
        bound = 2 * _max_err(torch_grad, want) + ABS_SLACK
        assert _max_err(got, want) <= bound, f"{name}: error {_max_err(got, want):.3g} > {bound:.3g}"


CANDIDATES = {
    "dq_convert_kernel": dict(dq_convert_kernel=True),
    "preprocess_loads_first": dict(preprocess_loads_first=True),
    "kv_on_first_stages": dict(kv_on_first_stages=True),
    "dq_store_warp": dict(dq_store_warp=True),
}


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((17, 1000), (1000, 777), (4096, 128)))
@pytest.mark.parametrize("candidate", sorted(CANDIDATES))
def test_backward_candidates_give_the_same_bits(head_dim, causal, seqlen_q, seqlen_k, candidate):
    # The sweep's candidates change where work happens, not the arithmetic: dQ converted
    # out of its fp32 accumulator by a CuTe kernel (the same product rounded once to nearest
    # even as torch's multiply), the preprocess with all its loads first (the same sums),
    # K and V counted on the first Q and dO stages' barriers (the same GEMMs), dQ's TMA
    # reductions issued by a warp of the producer warpgroup (the same additions). So the same
    # bits, on ragged lengths (partial blocks of rows, accumulator padding never read) and
    # with query blocks that see no key. Deterministic, so that the fp32 additions into dQ
    # (and GQA's dK, dV) come in one order in both runs.
    import dataclasses

    from flash4 import flash_attn_func
    from flash4.backward import attention_backward, backward_config

    q = torch.randn(2, seqlen_q, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, 2, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    config = backward_config(head_dim, causal, grouped=True, deterministic=True)
    runs = []
    for chosen in (config, dataclasses.replace(config, **CANDIDATES[candidate])):
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        runs.append(attention_backward(
            q, k, v, out, dout, lse, causal=causal, grads=grads, deterministic=True, config=chosen
        ))
    torch.cuda.synchronize()
    assert not any(g.isnan().any() for g in runs[0])
    for name, want, got in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(got, want), f"{name} differs with {candidate}"


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (17, 1000), (1000, 17), (4096, 4096)))
@pytest.mark.parametrize("heads,kv_heads", ((3, 3), (4, 1)), ids=("mha", "mqa"))
def test_dq_store_warp_candidate_matches_reference(head_dim, causal, seqlen_q, seqlen_k, heads, kv_heads):
    # The candidate without deterministic mode (the bit test above needs it): the store warp
    # and the consumers hand the dQ tile back and forth through named barriers for every
    # query block, 64 of them at 4096, and key blocks that see no query block never start.
    import dataclasses

    from flash4 import flash_attn_func
    from flash4.backward import attention_backward, backward_config

    q = torch.randn(2, seqlen_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, seqlen_k, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    config = dataclasses.replace(backward_config(head_dim, causal, grouped=heads != kv_heads), dq_store_warp=True)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=causal, grads=grads, config=config)
    torch.cuda.synchronize()

    _check_against_reference(q, k, v, dout, causal, (dq, dk, dv))
