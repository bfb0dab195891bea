"""Views of Hopper wgmma accumulators, shared by every sm_90 kernel.

A warpgroup's fp32 accumulator for a 64 x N tile is, per thread, the layout
``((2, 2, N/8), M_tiles, N_tiles)``: two adjacent columns, two rows eight apart, and N/8
column groups. Softmax wants it as (rows, columns); the second GEMM wants P as its
register A operand, ``((2, 2, 2), M_tiles, (N/16, N_tiles))``: k-slices of 16 columns.
Both are views of the same registers, so no data moves. The views are built as index
permutations of a compact layout of the shape and composed with the tensor's own layout,
so they also work on coordinate tensors (a partitioned identity tensor).
"""

from __future__ import annotations

import cutlass.cute as cute


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """(rows, cols) view of an accumulator: ``((2, M), (2, N/8, N_tiles))``."""
    compact = cute.make_layout(acc.layout.shape)
    (c2, r2, *v), m, n = compact.shape
    (sc, sr, *sv), sm, sn = compact.stride
    if not v:
        # N = 8: one column group, a mode the fragment leaves out.
        v, sv = [1], [0]
    view = cute.make_layout(((r2, m), (c2, v[0], n)), stride=((sr, sm), (sc, sv[0], sn)))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def leading_columns(rows_cols: cute.Tensor, cols: int) -> cute.Tensor:
    """The first ``cols`` columns of an ``acc_rows_cols`` view, as a (rows, cols) tensor.
    Column j of that view is key 8 * (j // 2) + j % 2 of thread 0, so whole 8-key groups
    when ``cols`` is even."""
    rows = cute.size(rows_cols, mode=[0])
    return cute.make_tensor(rows_cols.iterator, cute.composition(rows_cols.layout, cute.make_layout((rows, cols))))


def acc_as_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """View of a 16-bit accumulator as the register A operand of the next wgmma.

    wgmma's k-step for 16-bit inputs is 16 columns, i.e. two of the accumulator's
    8-column groups, so the N/8 groups pair up into N/16 k-slices.
    """
    compact = cute.make_layout(acc.layout.shape)
    (c2, r2, v), m, n = compact.shape
    (sc, sr, sv), sm, sn = compact.stride
    if v % 2:
        raise ValueError(f"accumulator has {v} column groups of 8; the A operand needs pairs")
    view = cute.make_layout(
        ((c2, r2, 2), m, (v // 2, n)), stride=((sc, sr, sv), sm, (2 * sv, sn))
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def a_operand_as_acc(a: cute.Tensor, acc: cute.Tensor) -> cute.Tensor:
    """The accumulator-shaped view of ``a``, a compact A-operand fragment that
    ``convert_packed(acc_as_a_operand(acc), a)`` filled from the compact accumulator ``acc``.

    For one 64-row tile the two orders coincide (element i of ``a`` is element i of
    ``acc``), so the packed registers can also feed what reads accumulators (stmatrix)
    instead of a second conversion. Checked here, at trace time, element by element.
    """
    compact = cute.make_layout(acc.layout.shape)
    # Element i of the A view sits at view(i) of the accumulator; of ``a``, at a_layout(i).
    view = acc_as_a_operand(cute.make_tensor(acc.iterator, compact)).layout
    a_layout = cute.make_layout(a.layout.shape)
    if cute.size(a_layout) != cute.size(compact) or any(
        view(i) != a_layout(i) or acc.layout(i) != i for i in range(cute.size(compact))
    ):
        raise ValueError(f"A fragment {a.layout} and accumulator {acc.layout} order their elements differently")
    return cute.make_tensor(a.iterator, compact)


# FP8's register A operand holds, per thread, four consecutive k-indices per register
# (4t..4t+3 and 16+4t..16+4t+3 of each 32-wide k-step, t = lane % 4), while the fp32
# accumulator holds two adjacent columns per 8-column group (2t, 2t+1, 2t+8, 2t+9, ...).
# Rather than move bytes between threads, flash4 renames the keys of each 32-key group:
# position p of the A operand (and of V's rows in the second GEMM) is key
# FP8_PV_KEY_ORDER[p], so every thread's accumulator values are already its A values.
# V must then be stored with its keys in this order (flash4.quantize.fp8_value_layout).
FP8_PV_KEY_ORDER = tuple(
    16 * half + 2 * t + (0, 1, 8, 9)[q] for half in range(2) for t in range(4) for q in range(4)
)


def acc_as_fp8_a_operand(acc: cute.Tensor) -> cute.Tensor:
    """View of an accumulator as the register A operand of an FP8 wgmma whose B operand
    lists the keys in ``FP8_PV_KEY_ORDER``: ``(((2, 2), 2, 2), M_tiles, (N/32, N_tiles))``.

    A's value (v0, v1, v2) of k-step kb is the accumulator's column pair element v0 % 2,
    row v1, of 8-column group 4 kb + 2 v2 + v0 // 2: the two column pairs a thread holds
    in groups 2 v2 and 2 v2 + 1 of the step fill one 4-byte register.
    """
    compact = cute.make_layout(acc.layout.shape)
    (c2, r2, v), m, n = compact.shape
    (sc, sr, sv), sm, sn = compact.stride
    if v % 4:
        raise ValueError(f"accumulator has {v} column groups of 8; an FP8 k-step needs 4")
    view = cute.make_layout(
        (((c2, 2), r2, 2), m, (v // 4, n)), stride=(((sc, sv), sr, 2 * sv), sm, (4 * sv, sn))
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))
