"""flash4.quantize's Hadamard rotation (each row times diag(signs), then H, then a scale)
in registers, for the quantization kernels: the rotation fused into the pass that reads
the row, instead of torch's float32 passes over the tensor (two for the signs, three per
butterfly stage).

A row's ``head_dim`` values are dealt to ``lanes`` consecutive lanes of one warp, a *piece*
of PIECE_ELEMENTS each: the lane's ``loads`` 16-byte vectors at columns ``lane, lane +
lanes, lane + 2 lanes, ...`` (columns counted in vectors). The bits of a value's index in
the row are then, from the lowest: its place in its vector, its lane, its vector in the
piece. A butterfly stage pairs values whose indices differ in one bit: for the bits of
the vector and of the piece both values are in the lane (two FADDs per pair), for the
bits of the lane they are in two lanes (a shuffle and one add each).

Bit for bit the torch definition (flash4.quantize.hadamard_rotate): the same float32
additions in the same stage order (the lowest bit's stage first), signs applied by
flipping sign bits (x · -1 is exact), then one multiply by the scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..pipelines.warp_roles import THREADS_PER_WARP

# Values of a row one lane holds: 32 float32 registers, so that two pieces in flight (eight
# 16-byte loads of 16-bit values) take 64, and a head dim of 128 needs two shuffle stages
# of its seven.
PIECE_ELEMENTS = 32
# A float32's sign bit, as an Int32.
SIGN_BIT = -(1 << 31)


@dataclass(frozen=True)
class HadamardSigns:
    """What the host hands a kernel that rotates: the ±1 ``signs`` of the rotation (one per
    index of a row) and the ``scale`` (1 / sqrt(head_dim)) that makes it orthogonal."""

    signs: tuple[int, ...]
    scale: float


class RowRotation:
    """The rotation of rows of ``head_dim`` values loaded as ``vector``-element vectors."""

    def __init__(self, head_dim: int, vector: int, hadamard: HadamardSigns):
        if head_dim & (head_dim - 1) or len(hadamard.signs) != head_dim:
            raise ValueError(f"head_dim={head_dim}: the rotation needs a power of two and one sign per index")
        self.head_dim = head_dim
        self.vector = vector
        self.scale = hadamard.scale
        self.piece = min(PIECE_ELEMENTS, head_dim)
        if self.piece % vector:
            raise ValueError(f"a piece of {self.piece} values must hold whole {vector}-element vectors")
        self.loads = self.piece // vector
        self.lanes = head_dim // self.piece
        if self.lanes > THREADS_PER_WARP:
            raise ValueError(f"head_dim={head_dim}: a row must fit in one warp's lanes, {self.piece} values each")
        # The butterfly stages, the lowest index bit first: (True, lane step) across lanes,
        # (False, step within the piece) in a lane.
        self.stages = tuple(
            (False, stride) if stride < vector
            else (True, stride // vector) if stride < vector * self.lanes
            else (False, stride // (vector * self.lanes) * vector)
            for stride in (1 << bit for bit in range(head_dim.bit_length() - 1))
        )
        # Bit p of lane l's word: whether value p of its piece takes a minus sign.
        self.negative_words = tuple(
            _as_int32(sum(1 << p for p in range(self.piece) if hadamard.signs[self.index(lane, p)] < 0))
            for lane in range(self.lanes)
        )

    def index(self, lane: int, p: int) -> int:
        """The index in the row of value ``p`` of lane ``lane``'s piece."""
        j, e = divmod(p, self.vector)
        return (lane + self.lanes * j) * self.vector + e

    @cute.jit
    def negatives(self, lane: Int32) -> Int32:
        """This lane's word of minus signs (computed once per thread: a lane keeps its place
        in every row it takes)."""
        word = Int32(self.negative_words[0])
        for other in cutlass.range_constexpr(1, self.lanes):
            if lane == other:
                word = Int32(self.negative_words[other])
        return word

    @cute.jit
    def rotate(self, piece: list, lane: Int32, negatives: Int32):
        """Rotate, in place, the float32 ``piece`` (``loads`` register tensors of ``vector``
        values) of a lane whose place in its row is ``lane``; every lane of the warp takes
        part (the shuffles)."""
        for p in cutlass.range_constexpr(self.piece):
            bits = cute.recast_tensor(piece[p // self.vector], Int32)
            bits[p % self.vector] = bits[p % self.vector] ^ ((negatives << (31 - p)) & SIGN_BIT)
        for across_lanes, step in self.stages:
            if cutlass.const_expr(across_lanes):
                self._stage_across_lanes(piece, lane, step)
            else:
                self._stage_in_lane(piece, step)
        for x in piece:
            x.store(x.load() * Float32(self.scale))

    @cute.jit
    def _stage_in_lane(self, piece: list, step: cutlass.Constexpr[int]):
        """(a, b) -> (a + b, a - b) for the pairs of values ``step`` apart in the piece."""
        for p in cutlass.range_constexpr(self.piece):
            if cutlass.const_expr((p & step) == 0):
                low, high = piece[p // self.vector], piece[(p + step) // self.vector]
                a, b = low[p % self.vector], high[(p + step) % self.vector]
                low[p % self.vector] = a + b
                high[(p + step) % self.vector] = a - b

    @cute.jit
    def _stage_across_lanes(self, piece: list, lane: Int32, lane_step: cutlass.Constexpr[int]):
        """The same for pairs ``lane_step`` lanes apart: the lower lane keeps a + b, the upper
        a - b (its own value subtracted from its partner's)."""
        own_sign = Float32(1.0)
        if lane & lane_step:
            own_sign = Float32(-1.0)
        for x in piece:
            for e in cutlass.range_constexpr(self.vector):
                partner = cute.arch.shuffle_sync_bfly(x[e], offset=lane_step)
                x[e] = partner + own_sign * x[e]


def _as_int32(word: int) -> int:
    """A 32-bit pattern as the signed value an Int32 holds."""
    return word - (1 << 32) if word >= 1 << 31 else word
