"""FP8 (e4m3) quantization of attention inputs: blockwise scales and the Hadamard rotation.

``quantize_fp8(x, block)`` returns e4m3 values and one float32 *descale* per (batch, head,
block of ``block`` rows): ``x ≈ values.float() * descale``, each block scaled so that its
largest magnitude lands on e4m3's largest finite value (448). A block of rows matches a
kernel tile (the query tile for Q, the key tile for K and V), so the kernel multiplies one
descale per tile into the softmax scale (Q, K) or the output (V). ``block=None`` gives one
descale for the whole tensor (per-tensor scaling, cuDNN's FP8 mode on Hopper). Each value
is x times its descale's reciprocal (both in float32, IEEE), rounded to the nearest e4m3.

``hadamard=True`` first rotates the head dim by ``H · diag(signs) / sqrt(d)``, H the
Walsh–Hadamard matrix and ``signs`` a fixed random ±1 vector (incoherent processing). The
rotation is orthogonal, so rotating Q and K with the same signs leaves Q Kᵀ unchanged while
an outlier in one coordinate is spread over all d of them, and a block's scale is no longer
set by its one largest entry. V is not rotated (that would rotate the output). The
transform runs as log2(d) butterfly stages, O(d log d) per row, never a dense matmul.

On CUDA, kernels/quantize_fp8.py does it in one kernel per tensor, the rotation in its
registers (plus a pass for the largest magnitude, per tensor); on CPU, torch. The FP8
kernel consumes what it returns.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from flash4.kernels.e4m3_codes import SMALLEST_DESCALE

FP8_DTYPE = torch.float8_e4m3fn
# e4m3's largest finite value: a block's largest magnitude is scaled onto it.
FP8_MAX = torch.finfo(FP8_DTYPE).max
# int8 codes are symmetric, within ±127 (-128 unused): the accurate mode's Q and K.
INT8_MAX = 127
# V's keys are renamed, and padded, in groups of this many: the FP8 wgmma's k-step.
FP8_KEY_GROUP = 32
# The GPU kernels read rows in 16-byte vectors (the widest load a thread issues).
KERNEL_VECTOR_BYTES = 16
# The sign vector of the rotation comes from this seed, so that Q and K quantized apart get
# the same rotation (and with it Q Kᵀ unchanged).
HADAMARD_SEED = 0x5EED


class Fp8Tensor(NamedTuple):
    """e4m3 ``values`` (batch, seqlen, heads, head_dim), or int8 ones (``quantize_int8``: Q
    and K of the FP8 kernel's accurate mode), and float32 ``descale``: (batch, heads,
    ceil(seqlen / block)) for blockwise scales, shape () for one per tensor.
    ``values.float() * descale`` (broadcast over each block's rows) approximates the input
    (rotated, if ``hadamard``)."""

    values: Tensor
    descale: Tensor
    block: int | None
    hadamard: bool
    # The magnitude each block's largest value was scaled onto: e4m3's largest, or less
    # (``quantize_fp8``'s ``fp8_max``), which bounds every |value| by it; INT8_MAX for int8.
    fp8_max: float = FP8_MAX

    def dequantize(self) -> Tensor:
        """float32 (batch, seqlen, heads, head_dim): values times their descales."""
        values = self.values.float()
        if self.block is None:
            return values * self.descale
        seqlen = values.shape[1]
        per_row = self.descale.repeat_interleave(self.block, dim=2)[:, :, :seqlen]
        return values * per_row.transpose(1, 2).unsqueeze(-1)


def hadamard_signs(head_dim: int, device: torch.device | str = "cpu") -> Tensor:
    """The fixed random ±1 vector of flash4's rotation, float32 (head_dim,)."""
    generator = torch.Generator().manual_seed(HADAMARD_SEED)
    signs = torch.randint(0, 2, (head_dim,), generator=generator) * 2 - 1
    return signs.to(device=device, dtype=torch.float32)


def hadamard_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim): the rotation's last step multiplies by it (as a float32), which
    makes it orthogonal."""
    return 1.0 / math.sqrt(head_dim)


def hadamard_rotate(x: Tensor, signs: Tensor | None = None) -> Tensor:
    """x · diag(signs) · H · (1 / sqrt(d)) over the last dim (a power of two), in float32:
    the signs, then the butterfly stages (the pairs 1 apart first), then one multiply by
    ``hadamard_scale(d)``: the definition the GPU kernels reproduce bit for bit.

    Orthogonal (and H symmetric), so rotating two tensors with the same signs keeps every
    dot product between their rows; ``hadamard_unrotate`` undoes it.
    """
    d = x.shape[-1]
    _check_rotatable(d)
    if signs is None:
        signs = hadamard_signs(d, x.device)
    y = x.float() * signs
    # One butterfly stage per bit of the index: (a, b) -> (a + b, a - b) on pairs `half` apart.
    half = 1
    while half < d:
        pairs = y.reshape(*y.shape[:-1], d // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(y.shape)
        half *= 2
    return y * hadamard_scale(d)


def _check_rotatable(head_dim: int) -> None:
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: the Hadamard rotation needs a power of two")


def hadamard_unrotate(y: Tensor, signs: Tensor | None = None) -> Tensor:
    """The inverse of ``hadamard_rotate``: y · H / sqrt(d) · diag(signs)."""
    d = y.shape[-1]
    if signs is None:
        signs = hadamard_signs(d, y.device)
    ones = torch.ones(d, device=y.device)
    return hadamard_rotate(y, ones) * signs


def quantize_fp8(x: Tensor, block: int | None = 128, hadamard: bool = False, fp8_max: float = FP8_MAX) -> Fp8Tensor:
    """e4m3 values and float32 descales of ``x`` (batch, seqlen, heads, head_dim); see the
    module docstring. ``block``: rows per descale (None: one for the whole tensor).
    ``fp8_max``: the magnitude a block's largest value is scaled onto, a power of two up to
    e4m3's largest (448, the default). Smaller ones let the FP8 kernel hold Q Kᵀ in f16
    (``flash4.fp8``), at the cost of the values below fp8_max / 2^9, e4m3's subnormals."""
    _check_quantize_args(x, block, hadamard)
    check_fp8_max(fp8_max)
    if _gpu_kernel_takes(x, hadamard):
        from flash4.devices import on_device

        with on_device(x.device):
            return quantize_on_gpu(x, block, hadamard, fp8_max)
    x = hadamard_rotate(x) if hadamard else x
    # The descales from one read (_block_descales), then one pass that multiplies by their
    # reciprocals in float32 and rounds to e4m3 as it stores: no float32 copy, no padded
    # copy of x, no |x| tensor.
    values = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    descale = _block_descales(x, block, fp8_max)
    if block is None:
        # A 1-element (not 0-dim) factor takes part in type promotion: the product is float32.
        torch.mul(x, (1.0 / descale).reshape(1), out=values)
        return Fp8Tensor(values, descale, None, hadamard, fp8_max)
    batch, seqlen, heads, head_dim = x.shape
    blocks = descale.shape[-1]
    whole = seqlen // block
    parts = [(slice(0, whole), block)] if whole else []
    if blocks > whole:  # the last, partial block on its own: no padded copy of x
        parts.append((slice(whole, blocks), seqlen - whole * block))
    for index, rows in parts:
        keys = slice(index.start * block, index.start * block + (index.stop - index.start) * rows)
        per_block = descale[:, :, index].transpose(1, 2).reshape(batch, -1, 1, heads, 1)
        torch.mul(x[:, keys].reshape(batch, -1, rows, heads, head_dim), 1.0 / per_block,
                  out=values[:, keys].view(batch, -1, rows, heads, head_dim))
    return Fp8Tensor(values, descale, block, hadamard, fp8_max)


def quantize_int8(x: Tensor, block: int | None = 128, hadamard: bool = True) -> Fp8Tensor:
    """int8 values and float32 descales of ``x`` (batch, seqlen, heads, head_dim), for Q and
    K of the FP8 kernel's accurate mode (``flash_attn_fp8(..., qk_int8=True)``): as
    ``quantize_fp8``, but each block's largest magnitude scaled onto INT8_MAX and every
    value rounded to the nearest integer (ties to even), symmetric within ±INT8_MAX. After
    the rotation (on by default here: int8's even steps are set by a block's largest value,
    which the rotation spreads) the values are near-Gaussian, and int8 rounds them about 3x
    finer than e4m3's three mantissa bits. On CUDA by kernels/quantize_fp8.py (16- and
    32-bit inputs), bit for bit this torch definition, which runs elsewhere."""
    _check_quantize_args(x, block, hadamard)
    if x.dtype != FP8_DTYPE and _gpu_kernel_takes(x, hadamard):
        from flash4.devices import on_device

        with on_device(x.device):
            return quantize_on_gpu(x, block, hadamard, int8=True)
    x = hadamard_rotate(x) if hadamard else x.float()
    descale = _block_descales(x, block, INT8_MAX)
    per_row = descale
    if block is not None:
        per_row = descale.repeat_interleave(block, dim=2)[:, :, : x.shape[1]].transpose(1, 2).unsqueeze(-1)
    # The float32 product with the reciprocal, as quantize_fp8 takes it, then rounded: the
    # largest magnitude lands on INT8_MAX (up to the product's rounding), so the clamp only
    # keeps that last half step in range.
    codes = torch.round(x * (1.0 / per_row)).clamp_(-INT8_MAX, INT8_MAX)
    return Fp8Tensor(codes.to(torch.int8), descale, block, hadamard, INT8_MAX)


class Fp8TransposedV(NamedTuple):
    """V quantized and laid out as the FP8 kernel reads it (``transpose_fp8_v``), for V
    that is quantized once and read by many calls, as a KV cache is: ``values`` (batch,
    kv_heads, head_dim, keys) with the keys contiguous, zero-padded to whole groups of 32
    and renamed within each group (``fp8_value_layout``); ``descale``, ``block`` as in the
    Fp8Tensor it came from; ``seqlen`` the keys before padding."""

    values: Tensor
    descale: Tensor
    block: int | None
    seqlen: int

    def dequantize(self) -> Tensor:
        """float32 (batch, seqlen, heads, head_dim), as the Fp8Tensor's dequantize gives it."""
        return self.untransposed().dequantize()

    def untransposed(self) -> Fp8Tensor:
        """The Fp8Tensor it was made from: V in (batch, seqlen, heads, head_dim)."""
        batch, heads, head_dim, padded = self.values.shape
        raw = torch.empty(batch, padded, heads, head_dim, dtype=torch.uint8, device=self.values.device)
        _keys_by_position(raw).copy_(_kernel_layout_view(self.values.view(torch.uint8)))
        values = raw[:, : self.seqlen].contiguous().view(FP8_DTYPE)
        return Fp8Tensor(values, self.descale, self.block, False)


def transpose_fp8_v(v: Fp8Tensor) -> Fp8TransposedV:
    """V (from ``quantize_fp8``, not rotated) in the FP8 kernel's layout: one pass over V,
    which ``flash_attn_fp8_quantized`` otherwise makes on every call."""
    if not isinstance(v, Fp8Tensor):
        raise TypeError(f"v must be a flash4.Fp8Tensor (from flash4.quantize_fp8), got {type(v).__name__}")
    if v.hadamard:
        raise ValueError("v must not be rotated (hadamard=False): rotating V would rotate the output")
    return Fp8TransposedV(fp8_value_layout(v.values), v.descale, v.block, v.values.shape[1])


def quantize_fp8_transposed_v(v: Tensor) -> Fp8TransposedV:
    """``transpose_fp8_v(quantize_fp8(v, None))``, bit for bit, in two passes over v: its
    largest magnitude, then a multiply by the descale's reciprocal in float32 whose e4m3
    results are stored straight into the kernel's layout (no e4m3 copy of v in its own
    layout first)."""
    if v.dim() != 4:
        raise ValueError(f"v must be (batch, seqlen, heads, head_dim), got shape {tuple(v.shape)}")
    batch, seqlen, heads, head_dim = v.shape
    if _gpu_kernel_takes(v):
        values, descale = _value_layout_on_gpu(v)
        return Fp8TransposedV(values, descale, None, seqlen)
    descale = _descale(_tensor_amax(v))
    out = torch.empty(batch, heads, head_dim, _padded_keys(seqlen), dtype=FP8_DTYPE, device=v.device)
    # A 1-element (not 0-dim) factor takes part in type promotion: the product is float32.
    _store_in_kernel_layout(v, out, lambda dst, src: torch.mul(src, (1.0 / descale).reshape(1), out=dst))
    return Fp8TransposedV(out, descale, None, seqlen)


def fp8_value_layout(values: Tensor) -> Tensor:
    """V's e4m3 values as the FP8 kernel reads them: (batch, kv_heads, head_dim, keys) with
    the keys contiguous (FP8 wgmma reads its B operand K-major), padded with zeros to whole
    groups of 32 keys, and within each group in the order FP8_PV_KEY_ORDER (position p
    holds key FP8_PV_KEY_ORDER[p]), so that P never leaves its thread in the kernel.

    On CUDA, the V layout kernel, which moves the e4m3 bytes as they are; elsewhere one
    strided copy: the order only permutes the bits of a key's index within its group, so the
    whole layout is a view of V (``_kernel_layout_view``); only a last partial group is
    padded, apart."""
    if values.dim() != 4 or values.dtype != FP8_DTYPE:
        raise ValueError(f"values must be e4m3 (batch, seqlen, heads, head_dim), got {values.dtype} {tuple(values.shape)}")
    batch, seqlen, heads, head_dim = values.shape
    if _gpu_kernel_takes(values):
        return _value_layout_on_gpu(values)[0]
    # Through uint8: the same bits, and copy and pad work on it everywhere.
    out = torch.empty(batch, heads, head_dim, _padded_keys(seqlen), dtype=torch.uint8, device=values.device)
    _store_in_kernel_layout(values.view(torch.uint8), out, lambda dst, src: dst.copy_(src))
    return out.view(FP8_DTYPE)


def _gpu_kernel_takes(x: Tensor, hadamard: bool = False) -> bool:
    """Whether the GPU kernels (kernels/quantize_fp8.py) take ``x``: a non-empty CUDA
    tensor of a dtype they read, rows of whole 16-byte vectors, and, to rotate them, rows
    that fit in one warp's registers. Others (CPU tensors, odd head dims) take the torch
    path, to the same definition."""
    from flash4.compiler import QUANTIZE_INPUT_DTYPES

    return (
        x.is_cuda and _dtype_name(x) in QUANTIZE_INPUT_DTYPES
        and x.shape[-1] * x.element_size() % KERNEL_VECTOR_BYTES == 0 and x.numel() > 0
        and (not hadamard or _rotation_fits_a_warp(x.shape[-1]))
    )


def _rotation_fits_a_warp(head_dim: int) -> bool:
    """Whether the kernels' rotation takes rows of ``head_dim`` values: one warp's lanes,
    PIECE_ELEMENTS values each, hold a row."""
    from flash4.kernels.hadamard_rotation import PIECE_ELEMENTS
    from flash4.pipelines.warp_roles import THREADS_PER_WARP

    return head_dim <= PIECE_ELEMENTS * THREADS_PER_WARP


def _kernel_input(x: Tensor) -> Tensor:
    """``x`` as the kernels read it: unit innermost stride, the others and the address
    multiples of 16 bytes (a contiguous copy where they are not)."""
    size = x.element_size()
    aligned = (
        x.stride(-1) == 1 and x.data_ptr() % KERNEL_VECTOR_BYTES == 0
        and all(stride * size % KERNEL_VECTOR_BYTES == 0 for stride in x.stride()[:-1])
    )
    return x if aligned else x.contiguous()


def _dtype_name(x: Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def quantize_on_gpu(
    x: Tensor, block: int | None, hadamard: bool, fp8_max: float = FP8_MAX, int8: bool = False
) -> Fp8Tensor:
    """``quantize_fp8`` (with ``int8``, ``quantize_int8``) of a CUDA tensor the kernels take
    (``_gpu_kernel_takes``), without its argument checks, by kernels/quantize_fp8.py, which
    rotates it too. Launches on the current device: the caller makes it x's (``on_device``),
    once for all its launches."""
    from flash4.compiler import compiled_quantize_fp8

    x = _kernel_input(x)
    batch, seqlen, heads, head_dim = x.shape
    largest = INT8_MAX if int8 else fp8_max
    # empty_like: the cheapest allocation torch offers (see flash4.interface).
    values = torch.empty_like(x, dtype=torch.int8 if int8 else FP8_DTYPE, memory_format=torch.contiguous_format)
    dtype = _dtype_name(x)
    if block is None:
        descale = torch.empty((), dtype=torch.float32, device=x.device)
        compiled_quantize_fp8(dtype, head_dim, None, hadamard, fp8_max=largest, int8=int8)(
            x, values, descale.reshape(1), _partial_maxima(x, hadamard)
        )
    else:
        descale = torch.empty(batch, heads, -(-seqlen // block), dtype=torch.float32, device=x.device)
        compiled_quantize_fp8(dtype, head_dim, block, hadamard, fp8_max=largest, int8=int8)(x, values, descale, None)
    return Fp8Tensor(values, descale, block, hadamard, largest)


def _value_layout_on_gpu(v: Tensor) -> tuple[Tensor, Tensor | None]:
    """v in the FP8 kernel's V layout by kernels/quantize_fp8.py: 16-bit or float32 v
    rounded to e4m3 over its per-tensor descale, returned beside it; e4m3 v as it is (None)."""
    from flash4.compiler import compiled_quantize_fp8_transposed_v
    from flash4.devices import on_device

    v = _kernel_input(v)
    batch, seqlen, heads, head_dim = v.shape
    out = torch.empty(batch, heads, head_dim, _padded_keys(seqlen), dtype=torch.uint8, device=v.device)
    quantizes = v.dtype != FP8_DTYPE
    descale = torch.empty((), dtype=torch.float32, device=v.device) if quantizes else None
    with on_device(v.device):
        amax = _partial_maxima(v) if quantizes else None
        compiled_quantize_fp8_transposed_v(_dtype_name(v), head_dim)(
            v, out, amax, None if descale is None else descale.reshape(1)
        )
    return out.view(FP8_DTYPE), descale


def _partial_maxima(x: Tensor, hadamard: bool = False) -> Tensor:
    """The largest magnitudes of blocks of ``x`` (a kernel input, on its device; its rows
    rotated, with ``hadamard``), flat: their largest is the tensor's (kernels/quantize_fp8.py,
    TensorAmax)."""
    from flash4.compiler import compiled_tensor_amax
    from flash4.kernels.quantize_fp8 import amax_block_rows

    batch, seqlen, heads, head_dim = x.shape
    rows = amax_block_rows(head_dim, x.element_size())
    amax = torch.empty(batch, heads, -(-seqlen // rows), dtype=torch.float32, device=x.device)
    compiled_tensor_amax(_dtype_name(x), head_dim, hadamard)(x, amax)
    return amax.view(-1)


def _padded_keys(seqlen: int) -> int:
    return -(-seqlen // FP8_KEY_GROUP) * FP8_KEY_GROUP


def _store_in_kernel_layout(x: Tensor, out: Tensor, store: Callable[[Tensor, Tensor], object]) -> None:
    """``store(destination, source)`` of x (batch, keys, heads, head_dim) into out (batch,
    heads, head_dim, padded keys) through the layout's views, the whole key groups in one
    call; only a last partial group is padded (with zeros), apart."""
    seqlen = x.shape[1]
    whole = seqlen // FP8_KEY_GROUP * FP8_KEY_GROUP
    if whole:
        store(_kernel_layout_view(out[..., :whole]), _keys_by_position(x[:, :whole]))
    if out.shape[-1] > whole:
        tail = torch.nn.functional.pad(x[:, whole:], (0, 0, 0, 0, 0, out.shape[-1] - seqlen))
        store(_kernel_layout_view(out[..., whole:]), _keys_by_position(tail))


def _keys_by_position(x: Tensor) -> Tensor:
    """x (batch, keys, heads, head_dim), keys a multiple of the group, as a view indexed
    (batch, heads, head_dim, group, position bits from the highest): position p of a group
    reads key FP8_PV_KEY_ORDER[p]."""
    bits = _key_bit_order()
    batch, keys, heads, head_dim = x.shape
    # Dims 2 .. 2 + len(bits) - 1: the key's bits, the highest first.
    split = x.reshape(batch, keys >> len(bits), *(2,) * len(bits), heads, head_dim)
    top = len(bits) - 1
    key_dims = [2 + top - bits[position_bit] for position_bit in reversed(range(len(bits)))]
    return split.permute(0, 2 + len(bits), 3 + len(bits), 1, *key_dims)


def _kernel_layout_view(out: Tensor) -> Tensor:
    """out (batch, heads, head_dim, keys) viewed as (batch, heads, head_dim, group,
    position bits from the highest), to receive ``_keys_by_position``."""
    bits = len(_key_bit_order())
    batch, heads, head_dim, keys = out.shape
    return out.view(batch, heads, head_dim, keys >> bits, *(2,) * bits)


@functools.lru_cache(maxsize=None)
def _key_bit_order() -> tuple[int, ...]:
    """For each bit i of a position within a group, the bit of the key it holds:
    FP8_PV_KEY_ORDER[p] = sum over i of bit i of p moved to bit ``[i]``."""
    from flash4.kernels.mma_layouts import FP8_PV_KEY_ORDER

    size = len(FP8_PV_KEY_ORDER)
    if size != FP8_KEY_GROUP:
        raise AssertionError(f"FP8_PV_KEY_ORDER renames groups of {size} keys, not FP8_KEY_GROUP={FP8_KEY_GROUP}")
    bits = tuple(FP8_PV_KEY_ORDER[1 << i].bit_length() - 1 for i in range(size.bit_length() - 1))
    moved = [sum(((p >> i) & 1) << bit for i, bit in enumerate(bits)) for p in range(size)]
    if size & (size - 1) or list(FP8_PV_KEY_ORDER) != moved:
        raise AssertionError("FP8_PV_KEY_ORDER must permute the bits of a key's index within its group")
    return bits


def _tensor_amax(x: Tensor) -> Tensor:
    """The largest magnitude of ``x`` as a float32 0-dim tensor, in one reduction (exact:
    every 16-bit value is a float32)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def _check_quantize_args(x: Tensor, block: object, hadamard: object) -> None:
    """The checks quantize_fp8 and quantize_int8 share, naming the argument."""
    if x.dim() != 4:
        raise ValueError(f"x must be (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a positive int or None (one scale per tensor), got {block!r}")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be a bool, got {type(hadamard).__name__}")
    if hadamard:
        _check_rotatable(x.shape[-1])


def _block_descales(x: Tensor, block: int | None, largest: float) -> Tensor:
    """Each block's descale, (batch, heads, blocks) float32 (block None: the tensor's, 0-dim):
    its largest magnitude over ``largest``. One read of ``x`` for each row's largest
    magnitude (aminmax over the contiguous head dim); the blocks then reduce that
    1/head_dim-sized tensor, padded (small: no head dim)."""
    low, high = torch.aminmax(x, dim=-1)
    row_amax = torch.maximum(high, -low).float()  # (b, s, h)
    if block is None:
        return _descale(row_amax.amax(), largest)
    batch, seqlen, heads, _ = x.shape
    blocks = -(-seqlen // block)
    padded = torch.nn.functional.pad(row_amax, (0, 0, 0, blocks * block - seqlen))
    return _descale(padded.view(batch, blocks, block, heads).amax(dim=2), largest).transpose(1, 2).contiguous()


def _descale(amax: Tensor, fp8_max: float = FP8_MAX) -> Tensor:
    """amax (float32) / fp8_max, at least SMALLEST_DESCALE; an all-zero block gets 1 (its
    values are 0 either way)."""
    return torch.where(amax > 0, (amax / fp8_max).clamp_min(SMALLEST_DESCALE), 1.0).float()


def check_fp8_max(fp8_max: object) -> None:
    """Raise unless ``fp8_max`` is a power of two up to FP8_MAX, or FP8_MAX itself."""
    valid = isinstance(fp8_max, (int, float)) and not isinstance(fp8_max, bool) and (
        fp8_max == FP8_MAX or (0 < fp8_max < FP8_MAX and math.frexp(fp8_max)[0] == 0.5)
    )
    if not valid:
        raise ValueError(f"fp8_max must be {FP8_MAX:g} or a power of two below it, got {fp8_max!r}")
