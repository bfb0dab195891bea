"""Attention in plain torch: the exact maths, the kernel's blockwise algorithm, the
"torch in the input dtype" baseline that the accuracy rule of DESIGN.md compares against,
and the FP8 kernel's arithmetic on quantized inputs.

Everything here runs on CPU as well as CUDA. Layout is flash4's:
q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim), where
query head h reads kv head h // (heads // kv_heads). Causal masks are aligned bottom-right:
query i sees keys j <= i + seqlen_k - seqlen_q. A query row that sees no key gets output 0
and LSE -inf, never NaN. LSE is in natural log, shaped (batch, heads, seqlen_q).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flash4.kernels.e4m3_codes import CODE_OF_ONE, CODES_PER_OCTAVE, LARGEST_CODE, LINEAR_MANTISSA_BIAS
from flash4.quantize import FP8_DTYPE, FP8_MAX, Fp8Tensor

# exp(x) == exp2(x * log2(e)): the kernel folds log2(e) into the softmax scale so each score
# costs one multiply-add and one exp2 (the hardware's native exponential).
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def default_softmax_scale(head_dim: int) -> float:
    """1/sqrt(head_dim): keeps the scores' variance near 1 for unit-variance q and k."""
    return 1.0 / math.sqrt(head_dim)


def _expand_kv_heads(kv: Tensor, heads: int) -> Tensor:
    """Repeat each kv head for the query heads that share it (GQA/MQA).

    repeat_interleave keeps the copies of one kv head adjacent, so query head h lands on
    kv head h // group, the mapping flash4 promises.
    """
    kv_heads = kv.shape[2]
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not divisible by kv_heads={kv_heads}")
    return kv.repeat_interleave(heads // kv_heads, dim=2)


def causal_visible(seqlen_q: int, seqlen_k: int, device: torch.device | str = "cpu") -> Tensor:
    """Bool (seqlen_q, seqlen_k): True where query i may see key j (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return cols <= rows + (seqlen_k - seqlen_q)


def _scores(q: Tensor, k: Tensor) -> Tensor:
    """Unscaled q·kᵀ, shaped (batch, heads, seqlen_q, seqlen_k), in q's dtype."""
    return torch.einsum("bqhd,bkhd->bhqk", q, _expand_kv_heads(k, q.shape[2]))


def _probs_times_v(p: Tensor, v: Tensor) -> Tensor:
    """p (batch, heads, seqlen_q, seqlen_k) times v, back in flash4's (b, s, h, d) layout."""
    return torch.einsum("bhqk,bkhd->bqhd", p, _expand_kv_heads(v, p.shape[1]))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Exact attention in ``compute_dtype``: returns (out, lse), both in ``compute_dtype``."""
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scores = _scores(q, k) * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(q.shape[1], k.shape[1], q.device), -math.inf)
    # logsumexp of an all -inf row is -inf; softmax of it would be NaN, so normalise by
    # hand and send rows without keys to 0.
    lse = torch.logsumexp(scores, dim=-1)
    row_has_key = (lse != -math.inf).unsqueeze(-1)
    safe_lse = torch.where(row_has_key, lse.unsqueeze(-1), 0.0)
    probs = torch.where(row_has_key, torch.exp(scores - safe_lse), 0.0)
    return _probs_times_v(probs, v), lse


def blockwise_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_m: int = 128,
    block_n: int = 128,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """The forward kernel's algorithm, tile by tile: the model the kernel must match.

    Each block of ``block_m`` query rows walks the key blocks of ``block_n`` keys it can see,
    keeping per row a running max ``m`` of the raw scores, a running sum ``l`` of
    exponentials and an unnormalised output accumulator. Returns (out, lse) like
    :func:`attention`.
    """
    if block_m < 1 or block_n < 1:
        raise ValueError(f"block_m={block_m} and block_n={block_n} must be >= 1")
    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = default_softmax_scale(head_dim) if softmax_scale is None else softmax_scale
    # Scores stay unscaled; scale·log2(e) multiplies them inside exp2, as in the kernel.
    scale_log2 = scale * LOG2_E
    # Bottom-right alignment: query row i sees keys up to i + diagonal_offset.
    diagonal_offset = seqlen_k - seqlen_q

    q = q.to(compute_dtype).transpose(1, 2)  # (batch, heads, seqlen_q, head_dim)
    k = _expand_kv_heads(k.to(compute_dtype), heads).transpose(1, 2)
    v = _expand_kv_heads(v.to(compute_dtype), heads).transpose(1, 2)
    out = torch.empty(batch, heads, seqlen_q, head_dim, dtype=compute_dtype, device=q.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=compute_dtype, device=q.device)

    for m_start in range(0, seqlen_q, block_m):
        m_end = min(m_start + block_m, seqlen_q)
        q_block = q[:, :, m_start:m_end]
        row_max = torch.full((batch, heads, m_end - m_start), -math.inf, dtype=compute_dtype, device=q.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(batch, heads, m_end - m_start, head_dim, dtype=compute_dtype, device=q.device)

        # Causal: the block's last row sees keys < m_end + diagonal_offset; key blocks past
        # that are fully masked and never loaded. The bound may be <= 0 (no key blocks).
        keys_seen = min(seqlen_k, m_end + diagonal_offset) if causal else seqlen_k
        for n_start in range(0, max(keys_seen, 0), block_n):
            n_end = min(n_start + block_n, seqlen_k)
            scores = q_block @ k[:, :, n_start:n_end].transpose(-1, -2)
            # Only blocks crossing the diagonal (some key beyond the first row's reach) pay
            # for the mask; the kernel peels these off so the others run without it. The
            # sequence tail needs no mask here because slicing stops at seqlen_k.
            if causal and n_end - 1 > m_start + diagonal_offset:
                rows = torch.arange(m_start, m_end, device=q.device).unsqueeze(1)
                cols = torch.arange(n_start, n_end, device=q.device).unsqueeze(0)
                visible = cols <= rows + diagonal_offset
                scores = scores.masked_fill(~visible, -math.inf)

            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            # A row that has seen only masked keys has max -inf; exp2(-inf - -inf) would be
            # NaN, so such rows subtract 0 instead (their exponentials are all exp2(-inf) = 0).
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
            # Rescale what was accumulated under the old max to the new one.
            correction = torch.exp2((row_max - safe_max) * scale_log2)
            probs = torch.exp2(scores * scale_log2 - (safe_max * scale_log2).unsqueeze(-1))
            row_sum = row_sum * correction + probs.sum(dim=-1)
            acc = acc * correction.unsqueeze(-1) + probs @ v[:, :, n_start:n_end]
            row_max = new_max

        # Epilogue: normalise by 1/l; rows that saw no key have l = 0 and get 0, not 0/0.
        has_key = row_sum > 0
        inv_sum = torch.where(has_key, 1.0 / torch.where(has_key, row_sum, 1.0), 0.0)
        out[:, :, m_start:m_end] = acc * inv_sum.unsqueeze(-1)
        # lse = ln(sum_j exp(scale·s_j)) = scale·m + ln(l); rows that saw no key get -inf.
        lse[:, :, m_start:m_end] = torch.where(
            has_key, row_max * scale + torch.log(row_sum), -math.inf
        )

    return out.transpose(1, 2), lse


def attention_in_dtype(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """The same attention done by torch in the inputs' dtype: the baseline of the rule
    max|out - ref| <= 2·max|out_torch - ref| + 1e-5.

    Returns (out in q.dtype, lse as float32). Written as explicit matmul / softmax / matmul
    rather than ``scaled_dot_product_attention``: SDPA picks a backend per device (a fused
    one on CUDA, the math one on CPU), which would make the baseline's error depend on that
    choice, and its math backend turns rows without keys into NaN. Each step here rounds
    to the input dtype, as a naive low-precision implementation would. Memory grows as
    batch·heads·seqlen_q·seqlen_k.
    """
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = _scores(q, k) * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(q.shape[1], k.shape[1], q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # Softmax of an all -inf row is NaN; those rows have no key and must give 0. (Only
    # those: a NaN from NaN inputs must still show.)
    row_has_key = (lse != -math.inf).unsqueeze(-1)
    probs = torch.where(row_has_key, torch.softmax(scores, dim=-1), 0.0)
    return _probs_times_v(probs, v), lse.float()


def _sum_over_query_groups(grad: Tensor, kv_heads: int) -> Tensor:
    """(b, s, heads, d) gradient of the expanded kv heads -> (b, s, kv_heads, d): each kv head
    collects the gradients of the query heads that share it (GQA/MQA)."""
    batch, seqlen, heads, head_dim = grad.shape
    return grad.reshape(batch, seqlen, kv_heads, heads // kv_heads, head_dim).sum(dim=3)


def attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact gradients (dq, dk, dv) of attention, from what the forward saves: out and LSE.

    With S = scale · Q Kᵀ (masked), P = exp(S − LSE) (0 on rows without keys):
        dV = Pᵀ dO,   dP = dO Vᵀ,   D = rowsum(dO ∘ O),   dS = P ∘ (dP − D),
        dQ = scale · dS K,   dK = scale · dSᵀ Q,
    where D = rowsum(P ∘ dP) because O = P V; the backward kernel computes it from dO and O
    so that dP never needs a full row. Under GQA/MQA, dK and dV of a kv head sum over the
    query heads that share it. Returned in ``compute_dtype``, shaped like q, k and v.
    """
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else softmax_scale
    kv_heads = k.shape[2]
    q, k, v, out, dout, lse = (t.to(compute_dtype) for t in (q, k, v, out, dout, lse))
    heads = q.shape[2]
    k_full, v_full = _expand_kv_heads(k, heads), _expand_kv_heads(v, heads)
    scores = _scores(q, k) * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(q.shape[1], k.shape[1], q.device), -math.inf)
    row_has_key = (lse != -math.inf).unsqueeze(-1)
    probs = torch.where(row_has_key, torch.exp(scores - torch.where(row_has_key, lse.unsqueeze(-1), 0.0)), 0.0)
    dout_h = dout.transpose(1, 2)  # (b, h, s_q, d)
    dv = torch.einsum("bhqk,bhqd->bkhd", probs, dout_h)
    dp = torch.einsum("bhqd,bkhd->bhqk", dout_h, v_full)
    delta = (dout * out).sum(dim=-1).transpose(1, 2).unsqueeze(-1)  # (b, h, s_q, 1)
    ds = probs * (dp - delta)
    dq = scale * torch.einsum("bhqk,bkhd->bqhd", ds, k_full)
    dk = scale * torch.einsum("bhqk,bqhd->bkhd", ds, q)
    return dq, _sum_over_query_groups(dk, kv_heads), _sum_over_query_groups(dv, kv_heads)


def attention_backward_in_dtype(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`attention_in_dtype` by torch autograd, in the inputs' dtype: the
    baseline of the accuracy rule for dq, dk and dv."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out, _ = attention_in_dtype(q, k, v, softmax_scale=softmax_scale, causal=causal)
    out.backward(dout.to(out.dtype))
    return q.grad, k.grad, v.grad


def blockwise_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    block_m: int = 64,
    block_n: int = 128,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernels' algorithm (kernels/sm90_bwd*.py) tile by tile, in float32: the
    model the kernels must match. Returns (dq, dk, dv) like :func:`attention_backward`.

    Preprocess: D = rowsum(dO ∘ O) and lse_log2 = LSE · log2(e) per query row, padded to
    whole query blocks with D = 0 and lse_log2 = +inf (0 where LSE = -inf); Q and dO rows
    past seqlen_q, and K and V rows past seqlen_k, are zeros (what TMA loads there). Then
    each key block walks the query blocks the kernel walks, masking only those the kernel
    masks, and adds dS K into an fp32 dQ accumulator.
    """
    from flash4.kernels.sm90_bwd import masked_block_end, query_block_range

    batch, seqlen_q, heads, head_dim = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    scale = default_softmax_scale(head_dim) if softmax_scale is None else softmax_scale
    scale_log2 = scale * LOG2_E
    padded_q = -(-seqlen_q // block_m) * block_m
    padded_k = -(-seqlen_k // block_n) * block_n

    def rows_first(t: Tensor, padded: int) -> Tensor:
        """(b, s, h, d) -> float32 (b, h, padded, d), zero rows past s."""
        t = t.float().transpose(1, 2)
        return torch.nn.functional.pad(t, (0, 0, 0, padded - t.shape[2]))

    q_, do_ = rows_first(q, padded_q), rows_first(dout, padded_q)
    k_ = rows_first(_expand_kv_heads(k, heads), padded_k)
    v_ = rows_first(_expand_kv_heads(v, heads), padded_k)
    delta = torch.zeros(batch, heads, padded_q, device=q.device)
    delta[:, :, :seqlen_q] = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    lse_log2 = torch.full((batch, heads, padded_q), math.inf, device=q.device)
    lse_log2[:, :, :seqlen_q] = torch.where(lse == -math.inf, 0.0, lse.float() * LOG2_E)

    dq_accum = torch.zeros(batch, heads, padded_q, head_dim, device=q.device)
    dk = torch.zeros(batch, heads, padded_k, head_dim, device=q.device)
    dv = torch.zeros_like(dk)
    for n_block in range(padded_k // block_n):
        keys = slice(n_block * block_n, (n_block + 1) * block_n)
        m_begin, m_end = query_block_range(n_block, seqlen_q, seqlen_k, block_m, block_n, causal)
        masked_end = masked_block_end(n_block, m_begin, m_end, seqlen_q, seqlen_k, block_m, block_n, causal)
        for m_block in range(m_begin, m_end):
            queries = slice(m_block * block_m, (m_block + 1) * block_m)
            st = k_[:, :, keys] @ q_[:, :, queries].transpose(-1, -2)  # (b, h, keys, queries)
            if m_block < masked_end:
                key_idx = torch.arange(keys.start, keys.stop, device=q.device).unsqueeze(1)
                query_idx = torch.arange(queries.start, queries.stop, device=q.device).unsqueeze(0)
                visible = key_idx < seqlen_k
                if causal:
                    visible = visible & (key_idx <= query_idx + seqlen_k - seqlen_q)
                st = st.masked_fill(~visible, -math.inf)
            pt = torch.exp2(st * scale_log2 - lse_log2[:, :, queries].unsqueeze(-2))
            dpt = v_[:, :, keys] @ do_[:, :, queries].transpose(-1, -2)
            dst = pt * (dpt - delta[:, :, queries].unsqueeze(-2))
            dv[:, :, keys] += pt @ do_[:, :, queries]
            dk[:, :, keys] += dst @ q_[:, :, queries]
            dq_accum[:, :, queries] += dst.transpose(-1, -2) @ k_[:, :, keys]

    dq = (dq_accum[:, :, :seqlen_q] * scale).transpose(1, 2)
    dk = (dk[:, :, :seqlen_k] * scale).transpose(1, 2)
    dv = dv[:, :, :seqlen_k].transpose(1, 2)
    return dq, _sum_over_query_groups(dk, kv_heads), _sum_over_query_groups(dv, kv_heads)


def fp8_attention(
    q: Fp8Tensor, k: Fp8Tensor, v: Fp8Tensor, softmax_scale: float | None = None, causal: bool = False
) -> Tensor:
    """The FP8 kernel's arithmetic, in float64 on the dequantized inputs: exact attention
    except that the probabilities are rounded to e4m3 for the P V product, as the kernel's
    second FP8 GEMM needs. Per row, P = exp(s - max) lies in (0, 1]; it is scaled by FP8_MAX
    onto e4m3's full range before rounding (e4m3's relative precision down to 2^-9 · 448 ≈ 1,
    instead of subnormals below 2^-6) and divided by it after, and the row sum uses P before
    rounding. (The kernel's running max makes its P differ per key block; the rounding
    error per element is the same.) Returns float64 (batch, seqlen_q, heads, head_dim)."""
    if q.hadamard != k.hadamard:
        raise ValueError("q and k must both be rotated (hadamard=True) or neither")
    if v.hadamard:
        raise ValueError("v must not be rotated: that would rotate the output")
    qd, kd, vd = (t.dequantize().double() for t in (q, k, v))
    scale = default_softmax_scale(qd.shape[-1]) if softmax_scale is None else softmax_scale
    scores = _scores(qd, kd) * scale
    if causal:
        scores = scores.masked_fill(~causal_visible(qd.shape[1], kd.shape[1], qd.device), -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_has_key = row_max != -math.inf
    p = torch.where(row_has_key, torch.exp(scores - torch.where(row_has_key, row_max, 0.0)), 0.0)
    row_sum = p.sum(dim=-1, keepdim=True)
    p_fp8 = (p * FP8_MAX).to(FP8_DTYPE).double() / FP8_MAX
    return _probs_times_v(torch.where(row_has_key, p_fp8 / torch.where(row_has_key, row_sum, 1.0), 0.0), vd)


def fp8_blockwise_attention(
    q: Fp8Tensor, k: Fp8Tensor, v: Fp8Tensor, softmax_scale: float | None = None, causal: bool = False,
    block_m: int = 128, block_n: int = 128, sum_rounded_p: bool = False, p_by_rounding: bool = False,
) -> tuple[Tensor, Tensor]:
    """The FP8 kernel's algorithm (kernels/sm90_fwd_fp8.py with BlockScaledSoftmax) tile by
    tile, in float64: the model the kernel must match. Returns (out, lse) like
    :func:`attention`; the tiles are ``block_m`` queries by ``block_n`` keys, and descales
    are per tile (Q's per block_m rows, K's and V's per block_n) or per tensor.

    Each block of query rows walks its key blocks from the last to the first, as the kernel
    does. Scores are e4m3 products (exact here) times scale·log2(e) and the two descales;
    the running max ``m`` is in those log2 units. P is scaled by 448 · v_descale[j] / v_ref,
    v_ref the largest V descale so far, and rounded to e4m3 (saturating) before P V; the
    row sum adds P divided by that scale; with ``sum_rounded_p``, P after its rounding (as
    the kernels compiled without an LSE, whose row sums run on the tensor cores). O is
    rescaled when the max or v_ref grows. With ``p_by_rounding`` (and ``sum_rounded_p``),
    P's e4m3 codes are rounded from its log2 instead (kernels/e4m3_codes.py).
    """
    if p_by_rounding and not sum_rounded_p:
        raise ValueError("p_by_rounding=True: the kernels sum that P on the tensor cores, so sum_rounded_p=True")
    q8, k8, v8 = (t.values.double() for t in (q, k, v))
    batch, seqlen_q, heads, head_dim = q8.shape
    seqlen_k = k8.shape[1]
    scale = default_softmax_scale(head_dim) if softmax_scale is None else softmax_scale
    diagonal_offset = seqlen_k - seqlen_q

    def per_block(t: Fp8Tensor, seqlen: int, nheads: int, block: int) -> Tensor:
        blocks = -(-seqlen // block)
        if t.block is None:
            return t.descale.double().reshape(1, 1, 1).expand(batch, nheads, blocks)
        if t.block != block:
            raise ValueError(f"descales per {t.block} rows; this model reads one per {block} rows or per tensor")
        return t.descale.double()

    kv_heads = k8.shape[2]
    q_descale = per_block(q, seqlen_q, heads, block_m)
    k_descale, v_descale = (
        _expand_kv_heads(per_block(t, seqlen_k, kv_heads, block_n).transpose(1, 2), heads).transpose(1, 2)
        for t in (k, v)
    )
    q8 = q8.transpose(1, 2)
    k8, v8 = (_expand_kv_heads(t, heads).transpose(1, 2) for t in (k8, v8))
    out = torch.empty(batch, heads, seqlen_q, head_dim, dtype=torch.float64, device=q8.device)
    lse = torch.empty(batch, heads, seqlen_q, dtype=torch.float64, device=q8.device)
    for m_block, m_start in enumerate(range(0, seqlen_q, block_m)):
        m_end = min(m_start + block_m, seqlen_q)
        rows = m_end - m_start
        row_max = torch.full((batch, heads, rows), -math.inf, dtype=torch.float64, device=q8.device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros(batch, heads, rows, head_dim, dtype=torch.float64, device=q8.device)
        v_ref = None
        keys_seen = min(seqlen_k, m_end + diagonal_offset) if causal else seqlen_k
        for n_block in reversed(range(-(-max(keys_seen, 0) // block_n))):
            n_start = n_block * block_n
            n_end = min(n_start + block_n, seqlen_k)
            block_scale = (scale * LOG2_E * q_descale[:, :, m_block] * k_descale[:, :, n_block])[..., None, None]
            scores = (q8[:, :, m_start:m_end] @ k8[:, :, n_start:n_end].transpose(-1, -2)) * block_scale
            if causal:
                query = torch.arange(m_start, m_end, device=q8.device).unsqueeze(1)
                key = torch.arange(n_start, n_end, device=q8.device).unsqueeze(0)
                scores = scores.masked_fill(key > query + diagonal_offset, -math.inf)
            v_block = v_descale[:, :, n_block]
            v_new = v_block if v_ref is None else torch.maximum(v_ref, v_block)
            p_scale = (FP8_MAX * v_block / v_new)[..., None]
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            safe_max = torch.where(new_max == -math.inf, 0.0, new_max)
            probs = torch.exp2(scores - safe_max.unsqueeze(-1)) * p_scale.unsqueeze(-1)
            correction = torch.exp2(row_max - safe_max)
            growth = 1.0 if v_ref is None else (v_ref / v_new)[..., None]
            if p_by_rounding:
                p_fp8 = _e4m3_by_rounding(scores - safe_max.unsqueeze(-1) + torch.log2(p_scale.unsqueeze(-1)))
            else:
                p_fp8 = probs.clamp(max=FP8_MAX).to(FP8_DTYPE).double()
            row_sum = row_sum * correction + (p_fp8 if sum_rounded_p else probs).sum(dim=-1) / p_scale
            acc = acc * (correction * growth).unsqueeze(-1) + p_fp8 @ v8[:, :, n_start:n_end]
            row_max, v_ref = new_max, v_new
        has_key = row_sum > 0
        factor = 0.0 if v_ref is None else (v_ref / FP8_MAX)[..., None]
        inv_sum = torch.where(has_key, factor / torch.where(has_key, row_sum, 1.0), 0.0)
        out[:, :, m_start:m_end] = acc * inv_sum.unsqueeze(-1)
        lse[:, :, m_start:m_end] = torch.where(has_key, row_max * math.log(2.0) + torch.log(row_sum), -math.inf)
    return out.transpose(1, 2), lse


def _e4m3_by_rounding(log2_p: Tensor) -> Tensor:
    """The e4m3 values whose codes are 8 log2(p) + 56 less the linear mantissa's bias,
    rounded (half to even, as the kernel's f16 conversion), 0 below code 0."""
    codes = torch.round(CODES_PER_OCTAVE * log2_p + (CODE_OF_ONE - LINEAR_MANTISSA_BIAS))
    codes = codes.nan_to_num(neginf=0.0).clamp(0, LARGEST_CODE).to(torch.uint8)
    return codes.view(FP8_DTYPE).double()
