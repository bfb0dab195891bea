"""Every error path of flash4.checks and of the selector, on CPU.

Each failing case asserts the exception type and that the message names the argument (and,
where there is a short list, what is allowed).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from flash4 import dispatch
from flash4.checks import (
    AttentionProblem,
    check_attention_args,
    check_devices,
    describe_attention,
)

BATCH, SEQLEN_Q, SEQLEN_K, HEADS, KV_HEADS, HEAD_DIM = 2, 5, 7, 4, 2, 64


def make_qkv(
    q_shape=(BATCH, SEQLEN_Q, HEADS, HEAD_DIM),
    kv_shape=(BATCH, SEQLEN_K, KV_HEADS, HEAD_DIM),
    dtype=torch.bfloat16,
):
    return (
        torch.randn(q_shape).to(dtype),
        torch.randn(kv_shape).to(dtype),
        torch.randn(kv_shape).to(dtype),
    )


def non_contiguous_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Same values and shape, but every other element of a twice-as-wide tensor."""
    wide = torch.randn(*tensor.shape[:-1], 2 * tensor.shape[-1]).to(tensor.dtype)
    return wide[..., ::2]


def check(q, k, v, softmax_scale=None, causal=False):
    return check_attention_args(q, k, v, softmax_scale, causal)


# --- the argument checks, in the order check_attention_args runs them ----------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [None, [[1.0]], 3.0])
def test_non_tensor_argument(name, bad):
    tensors = dict(zip("qkv", make_qkv()))
    tensors[name] = bad
    with pytest.raises(TypeError, match=rf"^{name} must be a torch\.Tensor, got {type(bad).__name__}"):
        check(**tensors)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [3, 5])
def test_wrong_rank(name, rank):
    tensors = dict(zip("qkv", make_qkv()))
    tensors[name] = torch.randn((3,) * rank).bfloat16()
    layout = r"\(batch, seqlen, heads, head_dim\)"
    with pytest.raises(ValueError, match=rf"^{name} must be 4-D {layout}.*{rank}-D"):
        check(**tensors)


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype(name, dtype):
    tensors = dict(zip("qkv", make_qkv()))
    tensors[name] = tensors[name].to(dtype)
    dtype_name = str(dtype).removeprefix("torch.")
    allowed = "supported dtypes: bfloat16, float16"
    with pytest.raises(TypeError, match=rf"^{name} has dtype {dtype_name}; {allowed}"):
        check(**tensors)


@pytest.mark.parametrize("name", ["k", "v"])
def test_mixed_dtypes(name):
    tensors = dict(zip("qkv", make_qkv(dtype=torch.bfloat16)))
    tensors[name] = tensors[name].half()
    with pytest.raises(TypeError, match=rf"^{name} has dtype float16 but q has bfloat16"):
        check(**tensors)


def test_k_and_v_shapes_differ():
    q, k, _ = make_qkv()
    v = torch.randn(BATCH, SEQLEN_K + 1, KV_HEADS, HEAD_DIM).bfloat16()
    with pytest.raises(ValueError, match=r"^k and v must have the same shape"):
        check(q, k, v)


def test_batch_mismatch():
    q, k, v = make_qkv(kv_shape=(BATCH + 1, SEQLEN_K, KV_HEADS, HEAD_DIM))
    with pytest.raises(ValueError, match=rf"^k has batch {BATCH + 1} but q has batch {BATCH}"):
        check(q, k, v)


def test_head_dim_mismatch():
    q, k, v = make_qkv(kv_shape=(BATCH, SEQLEN_K, KV_HEADS, 2 * HEAD_DIM))
    with pytest.raises(ValueError, match=rf"head_dim {2 * HEAD_DIM} but q has head_dim {HEAD_DIM}"):
        check(q, k, v)


@pytest.mark.parametrize(
    "q_seqlen,k_seqlen,name",
    [(0, SEQLEN_K, "seqlen_q"), (SEQLEN_Q, 0, "seqlen_k"), (0, 0, "seqlen_q")],
)
def test_empty_sequence(q_seqlen, k_seqlen, name):
    q, k, v = make_qkv(
        q_shape=(BATCH, q_seqlen, HEADS, HEAD_DIM), kv_shape=(BATCH, k_seqlen, KV_HEADS, HEAD_DIM)
    )
    with pytest.raises(ValueError, match=rf"^{name} .* is 0; seqlen must be >= 1"):
        check(q, k, v)


@pytest.mark.parametrize(
    "q_shape,kv_shape,name",
    [
        ((0, SEQLEN_Q, HEADS, HEAD_DIM), (0, SEQLEN_K, KV_HEADS, HEAD_DIM), "batch"),
        ((BATCH, SEQLEN_Q, 0, HEAD_DIM), (BATCH, SEQLEN_K, KV_HEADS, HEAD_DIM), "heads"),
        ((BATCH, SEQLEN_Q, HEADS, HEAD_DIM), (BATCH, SEQLEN_K, 0, HEAD_DIM), "kv_heads"),
    ],
)
def test_empty_batch_or_heads(q_shape, kv_shape, name):
    q, k, v = make_qkv(q_shape=q_shape, kv_shape=kv_shape)
    with pytest.raises(ValueError, match=rf"^{name} .* is 0; it must be >= 1"):
        check(q, k, v)


@pytest.mark.parametrize("heads,kv_heads", [(6, 4), (3, 2), (1, 2)])
def test_heads_not_divisible_by_kv_heads(heads, kv_heads):
    q, k, v = make_qkv(
        q_shape=(BATCH, SEQLEN_Q, heads, HEAD_DIM), kv_shape=(BATCH, SEQLEN_K, kv_heads, HEAD_DIM)
    )
    with pytest.raises(ValueError, match=rf"^heads={heads} .* not divisible by kv_heads={kv_heads}"):
        check(q, k, v)


@pytest.mark.parametrize("head_dim", [0, 4, 12, 60, 264, 512])
def test_head_dim_not_allowed(head_dim):
    q, k, v = make_qkv(
        q_shape=(BATCH, SEQLEN_Q, HEADS, head_dim), kv_shape=(BATCH, SEQLEN_K, KV_HEADS, head_dim)
    )
    with pytest.raises(ValueError, match=rf"^head_dim={head_dim} .* must be a multiple of 8 in \[8, 256\]"):
        check(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_last_dim_not_contiguous(name):
    tensors = dict(zip("qkv", make_qkv()))
    tensors[name] = non_contiguous_last_dim(tensors[name])
    with pytest.raises(ValueError, match=rf"^{name} has stride 2 in its last dim"):
        check(**tensors)


def test_other_dims_may_be_strided():
    # Only the last dim must be dense: a (batch, heads, seqlen, dim) tensor seen as
    # (batch, seqlen, heads, dim) passes every check but the device one.
    q, k, v = make_qkv()
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q.is_contiguous()
    assert describe_attention(q, k, v, None, False).seqlen_q == SEQLEN_Q


@pytest.mark.parametrize("scale", ["0.5", True, torch.tensor(0.5), [0.5]])
def test_softmax_scale_wrong_type(scale):
    with pytest.raises(TypeError, match=r"^softmax_scale must be a positive finite float or None"):
        check(*make_qkv(), softmax_scale=scale)


@pytest.mark.parametrize("scale", [0.0, -0.125, -1, math.inf, -math.inf, math.nan])
def test_softmax_scale_not_positive_finite(scale):
    with pytest.raises(ValueError, match=r"^softmax_scale must be a positive finite float or None"):
        check(*make_qkv(), softmax_scale=scale)


@pytest.mark.parametrize("causal", [1, 0, "True", None])
def test_causal_not_bool(causal):
    with pytest.raises(TypeError, match=rf"^causal must be a bool, got {type(causal).__name__}"):
        check(*make_qkv(), causal=causal)


def test_cpu_tensors_rejected_last():
    # Valid in every other way, so only the device check can fail.
    with pytest.raises(ValueError, match=r"^q is on cpu; flash4 needs CUDA tensors"):
        check(*make_qkv())


def test_first_failing_check_wins():
    # float32 CPU tensors fail the dtype check before the device check.
    with pytest.raises(TypeError, match=r"^q has dtype float32"):
        check(*make_qkv(dtype=torch.float32))


@pytest.mark.parametrize(
    "devices,message",
    [
        ({"q": "cuda:0", "k": "cpu", "v": "cuda:0"}, r"^k is on cpu; flash4 needs CUDA tensors"),
        ({"q": "meta", "k": "cuda:0", "v": "cuda:0"}, r"^q is on meta; flash4 needs CUDA tensors"),
        ({"q": "cuda:0", "k": "cuda:0", "v": "cuda:1"}, r"^v is on cuda:1 but q is on cuda:0"),
        ({"q": "cuda:1", "k": "cuda:0", "v": "cuda:1"}, r"^k is on cuda:0 but q is on cuda:1"),
    ],
)
def test_devices_must_be_one_cuda_device(devices, message):
    with pytest.raises(ValueError, match=message):
        check_devices({name: torch.device(device) for name, device in devices.items()})


def test_one_cuda_device_passes():
    check_devices({name: torch.device("cuda:1") for name in "qkv"})


# --- what a valid call describes ------------------------------------------------------------


@pytest.mark.parametrize("dtype,dtype_name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_problem_of_valid_arguments(dtype, dtype_name):
    q, k, v = make_qkv(dtype=dtype)
    problem = describe_attention(q, k, v, None, True)
    assert problem == AttentionProblem(
        batch=BATCH, seqlen_q=SEQLEN_Q, seqlen_k=SEQLEN_K, heads=HEADS, kv_heads=KV_HEADS,
        head_dim=HEAD_DIM, dtype=dtype_name, softmax_scale=1 / math.sqrt(HEAD_DIM), causal=True,
    )
    assert problem.group_size == HEADS // KV_HEADS
    with pytest.raises(AttributeError):
        problem.causal = False  # type: ignore[misc]


@pytest.mark.parametrize("scale", [0.25, 2, 1e-3])
def test_explicit_scale_kept_as_float(scale):
    problem = describe_attention(*make_qkv(), scale, False)
    assert isinstance(problem.softmax_scale, float) and problem.softmax_scale == scale


def test_mqa_and_extreme_head_dims_accepted():
    for head_dim in (8, 72, 256):
        q, k, v = make_qkv(
            q_shape=(1, 3, 8, head_dim), kv_shape=(1, 300, 1, head_dim), dtype=torch.float16
        )
        problem = describe_attention(q, k, v, None, False)
        assert (problem.kv_heads, problem.group_size, problem.head_dim) == (1, 8, head_dim)


# --- the selector ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100a", "sm_120"])
def test_select_unknown_arch_names_it_and_lists_supported(arch):
    with pytest.raises(dispatch.UnsupportedProblemError, match=rf"architecture {arch}\b.*sm_90a"):
        dispatch.select(arch, "bfloat16", 128, False)


def test_unsupported_problem_error_is_a_value_error():
    assert issubclass(dispatch.UnsupportedProblemError, ValueError)


@pytest.mark.parametrize("head_dim", [72, 96, 32, 512])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_select_unsupported_head_dim_lists_supported(head_dim, dtype):
    with pytest.raises(dispatch.UnsupportedProblemError,
                       match=rf"head_dim={head_dim} .*sm_90a.*{re.escape('[64, 128, 256]')}"):
        dispatch.select("sm_90a", dtype, head_dim, False)


def test_select_unsupported_dtype_lists_supported():
    with pytest.raises(dispatch.UnsupportedProblemError, match=r"dtype float32 .*sm_90a.*bfloat16.*float16"):
        dispatch.select("sm_90a", "float32", 128, False)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_select_finds_the_matching_row(head_dim, dtype, causal):
    row = dispatch.select("sm_90a", dtype, head_dim, causal)
    assert (row.arch, row.dtype, row.head_dim, row.causal) == ("sm_90a", dtype, head_dim, causal)
    assert (row.config.head_dim, row.config.causal) == (head_dim, causal)


def test_select_by_query_length_and_every_case_starts_at_one():
    cases = {(r.arch, r.dtype, r.head_dim, r.causal) for r in dispatch.TABLE}
    keys = [(r.arch, r.dtype, r.head_dim, r.causal, r.min_seqlen_q) for r in dispatch.TABLE]
    assert len(keys) == len(set(keys)), "two rows claim the same case and query length"
    for arch, dtype, head_dim, causal in cases:
        assert dispatch.select(arch, dtype, head_dim, causal, seqlen_q=1).min_seqlen_q == 1
    long_rows = [r for r in dispatch.TABLE if r.min_seqlen_q > 1]
    assert long_rows, "the table has no query-length split to test"
    for row in long_rows:
        key = (row.arch, row.dtype, row.head_dim, row.causal)
        assert dispatch.select(*key, seqlen_q=row.min_seqlen_q) is row
        assert dispatch.select(*key, seqlen_q=row.min_seqlen_q - 1) is not row


def test_backward_refuses_deterministic_with_a_config_that_is_not():
    # A config given for a sweep or test replaces the selector's; asking for bit-identical
    # gradients with one that does not give them is an error, raised before any tensor is read.
    from flash4.backward import attention_backward, backward_config

    config = backward_config(64, False, seqlen_k=64)
    with pytest.raises(ValueError, match="deterministic=True, but the given config"):
        attention_backward(None, None, None, None, None, None, deterministic=True, config=config)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_select_pairs_heads_only_for_causal_even_groups(dtype, head_dim):
    # Clusters of two query heads need both heads on one K/V head: an even group. They pay
    # for causal from the table's length on (a pair of query blocks masks blocks whole).
    start = dispatch.HEAD_CLUSTER_MIN_SEQLEN[head_dim]
    for seqlen_q in (1, 17, start - 1, start, start + 1000, 16384, 100_000):
        for causal in (False, True):
            alone = dispatch.select("sm_90a", dtype, head_dim, causal, seqlen_q)
            assert not alone.config.cluster_heads
            for group in (1, 2, 3, 4, 8, 16):
                row = dispatch.select("sm_90a", dtype, head_dim, causal, seqlen_q, group=group)
                paired = causal and group % 2 == 0 and seqlen_q >= start
                assert row.config.cluster_heads == paired, (seqlen_q, causal, group)
                assert row.config.kv_multicast == (paired or alone.config.kv_multicast)
                # The row's other settings and its place in the table stay, but for its
                # dynamic order: clusters share out tiles in turn.
                assert row.min_seqlen_q == alone.min_seqlen_q
                assert row.config == dataclasses.replace(
                    alone.config, kv_multicast=row.config.kv_multicast, cluster_heads=paired,
                    dynamic_tiles=alone.config.dynamic_tiles and not paired,
                )


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_select_fp8_pairs_heads_only_where_measured_with_v_per_tensor(head_dim):
    # FP8 takes head clusters at head dim 128 only, and only for the kernel of V per tensor
    # (the one measured with them).
    start = dispatch.FP8_HEAD_CLUSTER_MIN_SEQLEN.get(head_dim)
    for seqlen_q in (1, 17, 4095, 4096, 5000, 16384, 100_000):
        for causal in (False, True):
            for v_per_tensor in (True, False):
                alone = dispatch.select_fp8("sm_90a", head_dim, causal, seqlen_q, v_per_tensor)
                assert not alone.config.cluster_heads
                for group in (1, 2, 3, 8):
                    row = dispatch.select_fp8("sm_90a", head_dim, causal, seqlen_q, v_per_tensor, group=group)
                    paired = v_per_tensor and causal and group % 2 == 0 and start is not None and seqlen_q >= start
                    assert row.config.cluster_heads == paired, (seqlen_q, causal, v_per_tensor, group)
                    assert row.min_seqlen_q == alone.min_seqlen_q
                    assert row.config == dataclasses.replace(
                        alone.config, kv_multicast=paired or alone.config.kv_multicast, cluster_heads=paired,
                        dynamic_tiles=alone.config.dynamic_tiles and not paired,
                    )


@pytest.mark.parametrize(
    "capability,arch",
    [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80"), ((8, 9), "sm_89"),
     ((12, 0), "sm_120"), ((10, 3), "sm_103")],
)
def test_arch_of_capability(capability, arch):
    assert dispatch.arch_of_capability(*capability) == arch


@pytest.mark.parametrize("name,q_shape,kv_shape", [
    ("batch", (65536, 1, 1, 8), (65536, 1, 1, 8)),
    ("heads", (1, 1, 65536, 8), (1, 1, 1, 8)),
])
def test_batch_and_heads_beyond_the_grid_limit(name, q_shape, kv_shape):
    # Expanded views: the sizes are real, the memory is one element.
    q = torch.zeros(1, dtype=torch.bfloat16).expand(*q_shape)
    k = torch.zeros(1, dtype=torch.bfloat16).expand(*kv_shape)
    with pytest.raises(ValueError, match=rf"^{name} \(q\.shape\[\d\]\) is 65536; at most 65535"):
        check_attention_args(q, k, k, None, False)


def test_forward_into_refuses_inputs_that_require_grad():
    # flash_attn_forward_into is outside autograd: gradients would silently stop there, so
    # the call is refused, naming the inputs; without grad mode, or detached, it is allowed.
    from flash4.interface import refuse_forward_into_grad as refuse_grad

    q, k, v = make_qkv()
    refuse_grad(q, k, v)
    k.requires_grad_(True)
    v.requires_grad_(True)
    with pytest.raises(NotImplementedError, match=r"^k, v requires grad.*flash_attn_func.*torch.no_grad\(\)"):
        refuse_grad(q, k, v)
    with torch.no_grad():
        refuse_grad(q, k, v)
    refuse_grad(q, k.detach(), v.detach())


@pytest.mark.parametrize("head_dim", (64, 96, 128, 256))
def test_backward_head_dims(head_dim):
    # Gradients at a head dim without a backward kernel are refused before the forward runs.
    from flash4.backward import check_backward_supported

    if head_dim in (64, 128, 256):
        check_backward_supported(head_dim)
    else:
        with pytest.raises(NotImplementedError, match=rf"^head_dim={head_dim}: .*\(64, 128, 256\).*torch.no_grad\(\)"):
            check_backward_supported(head_dim)


def test_launches_switch_device_only_for_another_device(monkeypatch):
    # on_device: no device switch (microseconds a call) when the tensors live on the
    # current device; torch's device guard when they live on another.
    import contextlib

    from flash4.devices import on_device

    switched = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: switched.append(device) or contextlib.nullcontext())
    with on_device(torch.device("cuda", 0)):
        pass
    assert switched == []
    with on_device(torch.device("cuda", 1)):
        pass
    assert switched == [torch.device("cuda", 1)]
