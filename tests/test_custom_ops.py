"""flash_attn_func under torch.compile, on the CPU: the custom ops of flash4/custom_ops.py
with the reference maths in the kernels' place. What is checked here is the wiring: one
graph with no break, the forward op in the forward graph and the backward op in the
backward graph, the fake implementations' shapes and strides equal to the real ones', and
values and gradients equal to the same model's without compile. The kernels themselves
under compile: tests/test_autograd_gpu.py."""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

import flash4
from flash4 import custom_ops, reference


def _reference_forward(q, k, v, softmax_scale, causal, with_lse):
    out, lse = reference.attention(q, k, v, softmax_scale, causal)
    out = torch.empty_like(q, memory_format=torch.contiguous_format).copy_(out)
    return out, lse.contiguous() if with_lse else q.new_empty((0,), dtype=torch.float32)


def _reference_backward(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    grads = reference.attention_backward(q, k, v, out, dout, lse, softmax_scale, causal)
    return tuple(torch.empty_like(x).copy_(g) for x, g in zip((q, k, v), grads))


@pytest.fixture
def reference_kernels(monkeypatch):
    """The ops' work done by the reference maths, on the CPU; the calls counted."""
    calls = {"forward": 0, "backward": 0}

    def forward(*args):
        calls["forward"] += 1
        return _reference_forward(*args)

    def backward(*args):
        calls["backward"] += 1
        return _reference_backward(*args)

    monkeypatch.setattr(custom_ops, "forward_outputs", forward)
    monkeypatch.setattr(custom_ops, "backward_outputs", backward)
    return calls


def _attention_block(attention, x_q, x_kv, weights, causal):
    """Projections to q (4 heads) and k, v (2 kv heads, GQA) of head dim 64, attention, a
    weighted sum."""
    w_q, w_k, w_v = weights
    batch, seqlen_q, _ = x_q.shape
    seqlen_k = x_kv.shape[1]
    q = (x_q @ w_q).view(batch, seqlen_q, 4, 64)
    k = (x_kv @ w_k).view(batch, seqlen_k, 2, 64)
    v = (x_kv @ w_v).view(batch, seqlen_k, 2, 64)
    out = attention(q, k, v, causal)
    return (out * torch.linspace(-1.0, 2.0, 64)).sum()


def _flash4(q, k, v, causal):
    return flash4.flash_attn_func(q, k, v, causal=causal)


def _reference(q, k, v, causal):
    return reference.attention(q, k, v, None, causal)[0]


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_compiled_training_step_is_one_graph_with_flash4_ops(reference_kernels, causal):
    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = [str(node.target) for node in gm.graph.nodes if node.op == "call_function"]
            return make_boxed_func(gm.forward)

        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    x_q, x_kv = torch.randn(2, 17, 32), torch.randn(2, 23, 32)
    weights = [(torch.randn(32, n) / 8).requires_grad_(True) for n in (256, 128, 128)]
    step = torch.compile(_attention_block, backend=backend, fullgraph=True)
    loss = step(_flash4, x_q, x_kv, weights, causal)
    grads = torch.autograd.grad(loss, weights)

    assert "flash4.attention_forward.default" in graphs["forward"]
    assert "flash4.attention_backward.default" in graphs["backward"]
    assert not any("flash4" in target for target in graphs["backward"] if "backward" not in target)
    assert reference_kernels == {"forward": 1, "backward": 1}
    expected_weights = [w.detach().clone().requires_grad_(True) for w in weights]
    expected = _attention_block(_reference, x_q, x_kv, expected_weights, causal)
    expected_grads = torch.autograd.grad(expected, expected_weights)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-5)


def test_compiled_inference_returns_lse_and_skips_it_when_not_asked(reference_kernels):
    q, k, v = torch.randn(1, 9, 4, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    with_lse = torch.compile(lambda q, k, v: flash4.flash_attn_func(q, k, v, return_lse=True), fullgraph=True)
    out, lse = with_lse(q, k, v)
    want_out, want_lse = reference.attention(q, k, v)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)
    out_only = torch.compile(lambda q, k, v: flash4.flash_attn_func(q, k, v), fullgraph=True)(q, k, v)
    torch.testing.assert_close(out_only, want_out, rtol=1e-5, atol=1e-6)


def test_compiled_call_with_dynamic_lengths_compiles_once(reference_kernels):
    # Lengths as symbols: the fake implementations shape the outputs from them, and each
    # call's kernel is still chosen by its real lengths, inside the op.
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm

    call = torch.compile(lambda q, k, v: flash4.flash_attn_func(q, k, v, causal=True), backend=backend,
                         dynamic=True, fullgraph=True)
    for seqlen_q, seqlen_k in ((5, 9), (17, 1000), (64, 33)):
        q, k, v = torch.randn(2, seqlen_q, 4, 64), torch.randn(2, seqlen_k, 1, 64), torch.randn(2, seqlen_k, 1, 64)
        torch.testing.assert_close(call(q, k, v), reference.attention(q, k, v, causal=True)[0], rtol=1e-5, atol=1e-6)
    assert len(compiles) == 1
    assert reference_kernels["forward"] == 3


@pytest.mark.parametrize("with_lse", (False, True))
def test_fake_outputs_are_shaped_and_strided_like_the_real_ones(with_lse):
    # q as a transposed view (batch, heads, seqlen, head_dim) storage: out is contiguous
    # whatever q's strides, and the gradients take their inputs' strides (empty_like).
    q = torch.randn(2, 4, 7, 16).transpose(1, 2)
    k, v = torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16)
    real = _reference_forward(q, k, v, 0.25, False, with_lse)
    real_grads = _reference_backward(real[0], q, k, v, real[0], real[1], 0.25, False, False) if with_lse else None
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = torch.ops.flash4.attention_forward(fq, fk, fv, 0.25, False, with_lse, False)
        fake_grads = torch.ops.flash4.attention_backward(fake[0], fq, fk, fv, fake[0], fake[1], 0.25, False, False)
    for want, got in zip(real, fake):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    if real_grads is not None:
        for want, got in zip(real_grads, fake_grads):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


# A check that fails while tracing a whole graph surfaces as dynamo's error carrying ours.
_TRACE_ERRORS = (TypeError, NotImplementedError, torch._dynamo.exc.Unsupported)


def test_flags_and_head_dim_are_checked_while_tracing(reference_kernels):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(_TRACE_ERRORS, match="causal must be a bool, got int"):
        torch.compile(lambda q: flash4.flash_attn_func(q, q, q, causal=1), fullgraph=True)(q)
    # Head dim 96 has a forward but no backward: refused before anything runs.
    x = torch.randn(1, 8, 2, 96, requires_grad=True)
    with pytest.raises(_TRACE_ERRORS, match=r"head_dim=96: flash4's backward supports head dims \(64, 128, 256\)"):
        torch.compile(lambda x: flash4.flash_attn_func(x, x, x), fullgraph=True)(x)
    assert reference_kernels == {"forward": 0, "backward": 0}


def test_eager_calls_do_not_take_the_custom_ops(reference_kernels):
    # Eagerly, a CPU tensor fails flash4's own device check, not inside an op.
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="flash4 needs CUDA tensors"):
        flash4.flash_attn_func(q, q, q)
    assert reference_kernels == {"forward": 0, "backward": 0}


# ------------------------------------------------------------ flash_attn_forward_into
@pytest.mark.parametrize("with_lse", (False, True), ids=("out", "lse"))
def test_compiled_forward_into_is_one_node_writing_the_callers_buffers(monkeypatch, with_lse):
    calls = []

    def forward_into(q, k, v, out, lse, softmax_scale, causal):
        calls.append((softmax_scale, causal, lse is None))
        want_out, want_lse = reference.attention(q, k, v, softmax_scale, causal)
        out.copy_(want_out)
        if lse is not None:
            lse.copy_(want_lse)

    monkeypatch.setattr(custom_ops, "forward_into", forward_into)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    def step(q, k, v, out, lse):
        flash4.flash_attn_forward_into(q, k, v, out, lse, causal=True)
        return out * 2.0

    q, k, v = torch.randn(2, 17, 4, 64), torch.randn(2, 33, 2, 64), torch.randn(2, 33, 2, 64)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 4, 17), float("nan")) if with_lse else None
    doubled = torch.compile(step, backend=backend, fullgraph=True)(q, k, v, out, lse)
    # One node, and the caller's buffers hold its results after the compiled call (the
    # op declares them mutated, so the graph reads out after it).
    assert [t for t in targets if "mul" not in t] == ["flash4.attention_forward_into.default"]
    assert calls == [(64**-0.5, True, not with_lse)]
    want_out, want_lse = reference.attention(q, k, v, None, True)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(doubled, 2.0 * want_out, rtol=0, atol=0)
    if with_lse:
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_compiled_forward_into_refuses_grad_while_tracing(monkeypatch):
    monkeypatch.setattr(custom_ops, "forward_into", lambda *args: pytest.fail("the op ran"))
    q = torch.randn(1, 8, 2, 64, requires_grad=True)
    out = torch.empty(1, 8, 2, 64)
    with pytest.raises(_TRACE_ERRORS, match="q requires grad, but flash_attn_forward_into is forward only"):
        torch.compile(lambda q, out: flash4.flash_attn_forward_into(q, q.detach(), q.detach(), out, None),
                      fullgraph=True)(q, out)


def test_forward_into_fake_accepts_what_the_real_op_writes():
    q, k, v = torch.randn(1, 7, 4, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 7)
    with FakeTensorMode() as mode:
        fq, fk, fv, fout, flse = (mode.from_tensor(t) for t in (q, k, v, out, lse))
        assert torch.ops.flash4.attention_forward_into(fq, fk, fv, fout, flse, 0.25, False) is None
        assert torch.ops.flash4.attention_forward_into(fq, fk, fv, fout, None, 0.25, True) is None


# ---------------------------------------------------------------------------- FP8
def _reference_fp8(q, k, v, softmax_scale, causal, hadamard, return_lse, qk_int8):
    # The FP8 call's shapes and dtypes: bf16 out (contiguous), float32 LSE or an empty one.
    out, lse = reference.attention(q, k, v, softmax_scale, causal)
    out = torch.empty_like(q, dtype=torch.bfloat16, memory_format=torch.contiguous_format).copy_(out)
    return out, lse.contiguous() if return_lse else q.new_empty((0,), dtype=torch.float32)


@pytest.mark.parametrize("return_lse", (False, True), ids=("out", "lse"))
def test_compiled_fp8_call_is_one_node(monkeypatch, return_lse):
    calls = []

    def fp8(*args):
        calls.append(args[4:])
        return _reference_fp8(*args)

    monkeypatch.setattr(custom_ops, "fp8_outputs", fp8)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    call = torch.compile(
        lambda q, k, v: flash4.flash_attn_fp8(q, k, v, causal=True, hadamard=True, return_lse=return_lse,
                                              qk_int8=True),
        backend=backend, fullgraph=True,
    )
    q, k, v = (torch.randn(1, 33, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    result = call(q, k, v)
    # One node, and the picks of its outputs: nothing of the quantization in the graph.
    assert [t for t in targets if "getitem" not in t] == ["flash4.fp8_attention"]
    assert calls == [(True, True, return_lse, True)]
    want = _reference_fp8(q, k, v, 64**-0.5, True, True, return_lse, True)
    got = result if return_lse else (result,)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_fake_outputs_are_shaped_like_the_real_ones():
    q = torch.randn(2, 4, 7, 64, dtype=torch.bfloat16).transpose(1, 2)
    k, v = torch.randn(2, 5, 2, 64, dtype=torch.bfloat16), torch.randn(2, 5, 2, 64, dtype=torch.bfloat16)
    for return_lse in (False, True):
        real = _reference_fp8(q, k, v, 0.125, False, False, return_lse, False)
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            fake = torch.ops.flash4.fp8_attention(fq, fk, fv, 0.125, False, False, return_lse, False)
        for want, got in zip(real, fake):
            assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)


def test_compiled_fp8_call_refuses_grad_while_tracing(monkeypatch):
    monkeypatch.setattr(custom_ops, "fp8_outputs", _reference_fp8)
    x = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(_TRACE_ERRORS, match="flash_attn_fp8 is forward only"):
        torch.compile(lambda x: flash4.flash_attn_fp8(x, x, x), fullgraph=True)(x)


def _quantized_op_in_reference(monkeypatch):
    """The quantized FP8 op's work done by the reference maths on what it reassembled, which
    is kept; and a backend that keeps the graph's call targets: (received, backend, targets)."""
    received, targets = [], []

    def quantized(q, k, v, softmax_scale, causal, return_lse):
        received.append((q, k, v, softmax_scale, causal, return_lse))
        out = reference.attention(q.dequantize(), k.dequantize(), v.dequantize(), softmax_scale, causal)[0]
        return out.to(torch.bfloat16).contiguous(), q.values.new_empty((0,), dtype=torch.float32)

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    monkeypatch.setattr(custom_ops, "fp8_quantized_outputs", quantized)
    return received, backend, targets


def _compute_nodes(targets: list[str]) -> list[str]:
    """The graph's calls but the picks of an op's outputs and scalars the tracer keeps
    symbolic."""
    return [t for t in targets if "getitem" not in t and "sym_" not in t]


@pytest.mark.parametrize("qk_int8", (False, True), ids=("e4m3", "int8-qk"))
@pytest.mark.parametrize("transposed_v", (False, True), ids=("v", "v-laid-out"))
def test_compiled_quantized_fp8_call_is_one_node_of_the_parts(monkeypatch, qk_int8, transposed_v):
    # flash_attn_fp8_quantized takes NamedTuples; its op takes their parts and reassembles
    # them for the eager call: the same values, descales, blocks, rotation, codes, V layout.
    from flash4.fp8 import fp8_blocks

    received, backend, targets = _quantized_op_in_reference(monkeypatch)
    q, k, v = (torch.randn(1, 40, h, 64) for h in (4, 2, 2))
    blocks = fp8_blocks(64, True, 40)
    quantize = flash4.quantize_int8 if qk_int8 else (lambda x, block: flash4.quantize_fp8(x, block, True))
    q8, k8 = quantize(q, blocks.q), quantize(k, blocks.kv)
    v8 = flash4.quantize_fp8(v, None)
    v8 = flash4.transpose_fp8_v(v8) if transposed_v else v8
    call = torch.compile(lambda q8, k8, v8: flash4.flash_attn_fp8_quantized(q8, k8, v8, causal=True),
                         backend=backend, fullgraph=True)
    out = call(q8, k8, v8)
    assert _compute_nodes(targets) == ["flash4.fp8_attention_quantized"]
    ((got_q, got_k, got_v, scale, causal, return_lse),) = received
    assert (scale, causal, return_lse) == (64**-0.5, True, False)
    for got, want in ((got_q, q8), (got_k, k8), (got_v, v8)):
        assert type(got) is type(want)
        assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
        assert torch.equal(got.descale, want.descale)
        assert got._replace(values=None, descale=None) == want._replace(values=None, descale=None)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_compiled_call_with_descales_reaches_the_quantized_op(monkeypatch):
    # flash_attn_func with e4m3 tensors and descales goes through flash_attn_fp8_quantized,
    # whose op it becomes under torch.compile: one node, the descales passed through.
    from flash4.fp8 import fp8_blocks

    received, backend, targets = _quantized_op_in_reference(monkeypatch)
    q, k, v = (torch.randn(1, 40, h, 64) for h in (4, 2, 2))
    blocks = fp8_blocks(64, True, 40)
    q8, k8, v8 = flash4.quantize_fp8(q, blocks.q), flash4.quantize_fp8(k, blocks.kv), flash4.quantize_fp8(v, blocks.kv)
    call = torch.compile(
        lambda q, k, v, qd, kd, vd: flash4.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                                           v_descale=vd),
        backend=backend, fullgraph=True,
    )
    out = call(q8.values, k8.values, v8.values, q8.descale, k8.descale, v8.descale)
    assert _compute_nodes(targets) == ["flash4.fp8_attention_quantized"]
    ((got_q, got_k, got_v, *_),) = received
    assert (got_q.block, got_k.block, got_v.block) == (blocks.q, blocks.kv, blocks.kv)
    assert torch.equal(got_v.descale, v8.descale) and out.dtype == torch.bfloat16
