"""``flash4.flash_attn_func`` under autograd, on the GPU: gradients against the float32
reference (the rule of DESIGN.md, as in tests/test_bwd_gpu.py), the autograd contract
(which inputs get gradients, the LSE output, any upstream gradient layout), and a short
training run against torch SDPA from the same seed.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import poison_allocator

import flash4
from flash4 import reference

pytestmark = pytest.mark.gpu

ABS_SLACK = 1e-5


def _max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def _leaves(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, seqlen_q, heads, head_dim), (batch, seqlen_k, kv_heads, head_dim), (batch, seqlen_k, kv_heads, head_dim))
    return tuple(torch.randn(s, device="cuda", dtype=dtype, generator=g).requires_grad_(True) for s in shapes)


def _check_grads(q, k, v, dout, causal, grads):
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out_ref, lse_ref = reference.attention(qd, kd, vd, causal=causal)
    expected = reference.attention_backward(qd, kd, vd, out_ref, dout, lse_ref, causal=causal)
    baseline = reference.attention_backward_in_dtype(qd, kd, vd, dout, causal=causal)
    for name, got, want, torch_grad in zip(("dq", "dk", "dv"), grads, expected, baseline):
        assert got is not None and got.shape == want.shape and got.dtype == qd.dtype, name
        assert not got.isnan().any(), f"{name}: some element was never written"
        bound = 2 * _max_err(torch_grad, want) + ABS_SLACK
        assert _max_err(got, want) <= bound, f"{name}: error {_max_err(got, want):.3g} > {bound:.3g}"


def _backward_and_check(q, k, v, out, causal):
    """Gradients of ``out`` for a fresh random dout, from a NaN-poisoned allocator."""
    dout = torch.randn_like(out)
    poison_allocator()
    _check_grads(q, k, v, dout, causal, torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seqlen_q,seqlen_k", ((1, 1), (17, 1000), (1000, 17), (1000, 1000)))
@pytest.mark.parametrize("heads,kv_heads", ((4, 4), (4, 1)), ids=("mha", "mqa"))
def test_gradients_match_reference(head_dim, causal, dtype, seqlen_q, seqlen_k, heads, kv_heads):
    q, k, v = _leaves(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype, seed=seqlen_q + 7 * seqlen_k)
    _backward_and_check(q, k, v, flash4.flash_attn_func(q, k, v, causal=causal), causal)


def test_grad_accumulates_into_leaves_and_skips_inputs_without_grad():
    q, k, v = _leaves(1, 200, 300, 4, 2, 64, torch.bfloat16, seed=3)
    q.requires_grad_(False)
    dout = torch.randn(1, 200, 4, 64, device="cuda", dtype=torch.bfloat16)
    flash4.flash_attn_func(q, k, v, causal=True).backward(dout)
    assert q.grad is None
    first = (k.grad.clone(), v.grad.clone())
    # A second backward adds into .grad, as for any torch op.
    flash4.flash_attn_func(q, k, v, causal=True).backward(dout)
    torch.testing.assert_close(k.grad, 2 * first[0], rtol=0, atol=0)
    torch.testing.assert_close(v.grad, 2 * first[1], rtol=0, atol=0)


def test_deterministic_gradients_through_autograd():
    q, k, v = _leaves(1, 500, 900, 8, 2, 128, torch.bfloat16, seed=13)
    dout = torch.randn(1, 500, 8, 128, device="cuda", dtype=torch.bfloat16)
    runs = [
        torch.autograd.grad(flash4.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
        for _ in range(2)
    ]
    for name, first, second in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{name} differs between two deterministic runs"
    _check_grads(q, k, v, dout, True, runs[0])


@pytest.mark.parametrize("flag", ("return_lse", "deterministic"))
def test_flags_must_be_bools(flag):
    q, k, v = _leaves(1, 8, 8, 2, 2, 64, torch.bfloat16, seed=2)
    with pytest.raises(TypeError, match=rf"^{flag} must be a bool, got int"):
        flash4.flash_attn_func(q, k, v, **{flag: 1})


def test_return_lse_under_autograd():
    q, k, v = _leaves(2, 130, 257, 4, 4, 128, torch.float16, seed=11)
    out, lse = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    with torch.no_grad():
        out_plain, lse_plain = flash4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out.detach(), out_plain) and torch.equal(lse, lse_plain)
    _backward_and_check(q, k, v, out, True)


def test_upstream_gradient_of_any_layout():
    # out.sum() sends back an expanded scalar (stride 0); a transposed view is not dense in
    # q's layout either. Both reach the kernels as copies, with the same gradients.
    q, k, v = _leaves(2, 100, 100, 2, 2, 64, torch.bfloat16, seed=5)
    out = flash4.flash_attn_func(q, k, v)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    _check_grads(q, k, v, torch.ones_like(out), False, grads)
    out = flash4.flash_attn_func(q, k, v)
    dout_t = torch.randn(2, 2, 100, 64, device="cuda", dtype=torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout_t.transpose(1, 2))
    _check_grads(q, k, v, dout_t.transpose(1, 2).contiguous(), False, grads)


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_compiled_call_runs_the_same_kernels(causal):
    # Under torch.compile (inductor, one graph) the call is flash4's custom ops: the same
    # forward and, deterministic, the same backward kernels, so the same bits as eagerly.
    q, k, v = _leaves(2, 300, 517, 8, 2, 128, torch.bfloat16, seed=17)
    dout = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)

    def call(q, k, v):
        return flash4.flash_attn_func(q, k, v, causal=causal, return_lse=True, deterministic=True)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    poison_allocator()
    out, lse = compiled(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    eager_out, eager_lse = call(q, k, v)
    eager_grads = torch.autograd.grad(eager_out, (q, k, v), dout)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
    assert out.requires_grad and not lse.requires_grad
    for name, got, want in zip(("dq", "dk", "dv"), grads, eager_grads):
        assert torch.equal(got, want), f"{name} differs between the compiled and the eager call"
    _check_grads(q, k, v, dout, causal, grads)


@pytest.mark.parametrize("with_lse", (False, True), ids=("out", "lse"))
def test_compiled_forward_into_writes_what_the_eager_call_writes(with_lse):
    # flash_attn_forward_into under torch.compile (inductor, one graph) is a custom op that
    # mutates the caller's buffers: after the compiled call they hold the eager call's bits.
    q = torch.randn(2, 1000, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 17, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def buffers():
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 8, 1000), float("nan"), device="cuda") if with_lse else None
        return out, lse

    def call(q, k, v, out, lse):
        flash4.flash_attn_forward_into(q, k, v, out, lse, causal=True)
        return out.float().sum(dim=-1)

    torch._dynamo.reset()
    out, lse = buffers()
    row_sums = torch.compile(call, fullgraph=True)(q, k, v, out, lse)
    eager_out, eager_lse = buffers()
    eager_row_sums = call(q, k, v, eager_out, eager_lse)
    assert torch.equal(out, eager_out) and torch.equal(row_sums, eager_row_sums)
    assert not out.isnan().any()
    if with_lse:
        assert torch.equal(lse, eager_lse)


# ---------------------------------------------------------------------------- training check
# A small causal language model on sequences of a fixed random Markov chain: learnable (its
# entropy rate is well below log(vocab)), generated from a seed, no files.
VOCAB, SEQLEN, WIDTH, LAYERS, STEPS, BATCH = 64, 256, 256, 3, 300, 16
# Final losses (mean of the last 50 steps) of the two runs may differ by this much: the
# runs share every random draw, so only rounding (bf16 attention) separates them.
FINAL_LOSS_RTOL = 0.02


def _markov_batches(seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Each token has 4 likely successors: entropy rate about log(4) nats.
    logits = torch.randn(VOCAB, VOCAB, device="cuda", generator=g)
    top = logits.topk(4, dim=-1).indices
    transition = torch.full((VOCAB, VOCAB), 1e-3, device="cuda").scatter_(1, top, 1.0)
    transition /= transition.sum(-1, keepdim=True)
    tokens = torch.empty(STEPS, BATCH, SEQLEN + 1, dtype=torch.long, device="cuda")
    tokens[:, :, 0] = torch.randint(VOCAB, (STEPS, BATCH), device="cuda", generator=g)
    for i in range(SEQLEN):
        tokens[:, :, i + 1] = torch.multinomial(transition[tokens[:, :, i].flatten()], 1, generator=g).view(STEPS, BATCH)
    return tokens


class _Block(torch.nn.Module):
    def __init__(self, heads: int, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = torch.nn.LayerNorm(WIDTH), torch.nn.LayerNorm(WIDTH)
        self.qkv, self.proj = torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).to(torch.bfloat16).view(b, s, 3, self.heads, -1).unbind(2)
        x = x + self.proj(self.attention(q, k, v).reshape(b, s, WIDTH).float())
        return x + self.mlp(self.norm2(x))


def _train(attention, heads: int) -> list[float]:
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(VOCAB, WIDTH).cuda(), torch.nn.Linear(WIDTH, VOCAB).cuda()
    blocks = torch.nn.ModuleList(_Block(heads, attention) for _ in range(LAYERS)).cuda()
    params = [*embed.parameters(), *head.parameters(), *blocks.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for tokens in _markov_batches(seed=1):
        x = embed(tokens[:, :-1])
        for block in blocks:
            x = block(x)
        loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


@pytest.mark.parametrize("heads", (4, 2, 1), ids=("hdim64", "hdim128", "hdim256"))
def test_training_matches_sdpa(heads):
    flash = _train(lambda q, k, v: flash4.flash_attn_func(q, k, v, causal=True), heads)
    torch_sdpa = _train(_sdpa, heads)
    final_flash, final_sdpa = (sum(c[-50:]) / 50 for c in (flash, torch_sdpa))
    print(f"\nheads {heads}: final loss flash4 {final_flash:.4f}, SDPA {final_sdpa:.4f} "
          f"(first {flash[0]:.4f} / {torch_sdpa[0]:.4f})")
    # It learned: from about log(64) = 4.16 to near the chain's entropy rate.
    assert final_sdpa < 0.5 * torch_sdpa[0]
    assert abs(final_flash - final_sdpa) <= FINAL_LOSS_RTOL * final_sdpa
    # The curves agree step by step early, before rounding differences compound.
    assert max(abs(a - b) for a, b in zip(flash[:20], torch_sdpa[:20])) <= 0.02
