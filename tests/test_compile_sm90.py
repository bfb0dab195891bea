"""Every kernel in the selector's table compiles for sm_90a without a GPU, and its PTX holds
the instructions the design depends on (TMA, wgmma, setmaxnreg, mbarrier)."""

from __future__ import annotations

import re

import pytest

from flash4.compiler import KEY_INSTRUCTIONS, compile_entry
from flash4.dispatch import FP8_HEAD_CLUSTER_MIN_SEQLEN, HEAD_CLUSTER_MIN_SEQLEN, TABLE, select, select_fp8
from flash4.pipelines.named_barriers import NamedBarrier
from flash4.pipelines.warp_roles import launch_registers, register_budget

SM90_ROWS = [row for row in TABLE if row.arch == "sm_90a"]


@pytest.mark.parametrize(
    "entry", SM90_ROWS,
    ids=[f"{r.dtype}-d{r.head_dim}-{'causal' if r.causal else 'full'}-s{r.min_seqlen_q}" for r in SM90_ROWS],
)
def test_kernel_compiles_with_hopper_instructions(entry):
    report = compile_entry(entry, arch="sm_90a")
    assert ".target sm_90a" in report.ptx
    for name in KEY_INSTRUCTIONS:
        assert report.instructions[name] > 0, f"{name} missing from the PTX of {entry}"
    # Producer gives registers away, consumers take them, by the configured budget.
    budget = register_budget(entry.config.consumer_warpgroups)
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{budget.producer}\b", report.ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{budget.consumer}\b", report.ptx)
    # The CTA launches with the pool the budget splits (setmaxnreg only moves registers in it).
    assert report.registers == launch_registers(budget.threads)
    # O leaves through shared memory: stmatrix from the accumulators, then a TMA store.
    assert "stmatrix" in report.ptx, "the epilogue should write O to shared memory with stmatrix"
    # ptxas reported on the kernel, and the GEMMs run pipelined without spills: a serialised
    # wgmma cost 10% at head dim 256 and 2x at tile_n 160 before P was packed in pairs.
    assert report.registers > 0, "ptxas's remarks were not captured"
    assert report.spill_bytes == 0, f"{entry} spills {report.spill_bytes} bytes"
    assert report.serialized_wgmma == 0, f"ptxas serialised {report.serialized_wgmma} wgmma groups in {entry}"
    # Rows whose clusters share K and V load them by multicast, and only those.
    multicasts = report.ptx.count(".multicast::cluster")
    assert (multicasts > 0) == entry.config.kv_multicast, f"{multicasts} multicast loads in {entry}"


# The rows' kernels with clusters of two query heads, as select() picks them for causal
# grouped-query attention with an even group.
HEAD_CLUSTER_ROWS = sorted(
    {select("sm_90a", r.dtype, r.head_dim, True, max(r.min_seqlen_q, HEAD_CLUSTER_MIN_SEQLEN[r.head_dim]), group=2)
     for r in SM90_ROWS if r.causal and r.dtype == "bfloat16"}
    | {select_fp8("sm_90a", head_dim, True, start, v_per_tensor=True, group=2)
       for head_dim, start in FP8_HEAD_CLUSTER_MIN_SEQLEN.items()},
    key=lambda r: (r.dtype, r.head_dim, r.min_seqlen_q),
)


@pytest.mark.parametrize(
    "entry", HEAD_CLUSTER_ROWS, ids=[f"{r.dtype}-d{r.head_dim}-s{r.min_seqlen_q}" for r in HEAD_CLUSTER_ROWS]
)
def test_head_cluster_kernels_compile_clean(entry):
    assert entry.config.cluster_heads
    report = compile_entry(entry, arch="sm_90a")
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0, entry
    assert report.ptx.count(".multicast::cluster") > 0


@pytest.mark.parametrize("entry", SM90_ROWS[:2], ids=["full", "causal"])
def test_variant_without_lse_stores_nothing_but_o(entry, tmp_path, monkeypatch):
    # O leaves through TMA; the only plain global stores are LSE's, one per row.
    monkeypatch.chdir(tmp_path)
    with_lse = compile_entry(entry, arch="sm_90a")
    without = compile_entry(entry, arch="sm_90a", with_lse=False, keep_cubin=True)
    assert not list(tmp_path.iterdir()), "compiling must not leave PTX dumps in the working directory"
    # The machine code comes back only when asked for (perf/sass_local.py reads it).
    assert without.cubin[:4] == b"\x7fELF" and with_lse.cubin == b""
    assert with_lse.ptx.count("st.global") > 0
    assert without.ptx.count("st.global") == 0
    assert without.instructions["cp.async.bulk.tensor"] == with_lse.instructions["cp.async.bulk.tensor"]


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("grouped", (False, True, "in-cta"), ids=("mha", "gqa", "gqa-group-in-cta"))
def test_backward_kernel_compiles_with_hopper_instructions(head_dim, causal, grouped):
    # It must build for sm_90a with the instructions its design depends on, every wgmma
    # pipelined. "gqa": fp32 dK and dV shared by a group; "in-cta": a CTA walking a kv
    # head's query heads, whose instructions are the multi-head kernel's (its loops run
    # once per query head); causal at head dims 64 and 128 the selector pairs each key
    # block with its mirror there (mirror_pairs), and the walk of each is its own copy of
    # the producer's and the consumers' code: every count below but the launch's doubles.
    import dataclasses

    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_report

    config = backward_config(head_dim, causal, bool(grouped), seqlen_k=1024)
    if grouped:
        # Each scheme whatever the selector picks for this mask.
        in_cta = grouped == "in-cta"
        config = dataclasses.replace(
            config, kv_accumulate=not in_cta, kv_group_in_cta=in_cta, mirror_pairs=in_cta and config.mirror_pairs
        )
    grouped = config.kv_accumulate
    walks = 2 if config.mirror_pairs else 1
    report = compile_backward_report(config)
    assert report.serialized_wgmma == 0, f"ptxas serialised wgmmas in {config}"
    assert report.spill_bytes == 0, f"{config} spills {report.spill_bytes} bytes"
    ptx = report.ptx
    # Per query block, masked and mask-free: Sᵀ and dPᵀ (head_dim / 16 k-slices each), dV
    # and dK (tile_m / 16), dQ (tile_n / 16 for each 64 query rows a warpgroup computes: all
    # of them when the warpgroups split the columns, its own 64 when they split the rows).
    dq_row_blocks = 1 if config.dq_rows else config.tile_m // 64
    dq_gemm = dq_row_blocks * config.tile_n // 16
    per_block = 2 * head_dim // 16 + 2 * config.tile_m // 16 + dq_gemm
    # Staggered (the selector's multi-head kernels at head dims 64 and 128): warpgroup 0's
    # last dQ of a walk after it, one more GEMM and its stores.
    staggered = int(config.staggered_warpgroups)
    assert ptx.count("wgmma.mma_async") == (2 * per_block + staggered * dq_gemm) * walks
    assert "stmatrix" in ptx and "setmaxnreg" in ptx
    # The CTA launches with the pool the register budget splits.
    assert report.registers == launch_registers(register_budget(config.consumer_warpgroups).threads)
    # LSE and D arrive by TMA with Q and dO (one 3-D load each in the producer's loop).
    assert ptx.count("cp.async.bulk.tensor.3d.shared::cta.global") == 2 * walks
    # dQ leaves by linear bulk reduction, each warpgroup's part (half of the columns, or
    # its rows) as one, issued by the store warp for both parts; its 8-byte stores into
    # shared memory stay 8 bytes wide. A part is handed over through two
    # 160-thread barriers (its warpgroup and the store warp): the warpgroup arrives on
    # DQ_FULL and syncs on DQ_EMPTY (ids by register: its own pair), the store warp the
    # other way round (ids as constants, both parts; staggered, warpgroup 1's first). The
    # warpgroups meet once per block, at the 256-thread barrier before the dQ GEMM reads
    # dSᵀ, or (staggered) wait for each other's rows of it (test_staggered_...).
    parts = config.consumer_warpgroups
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == parts * walks
    assert "cp.reduce.async.bulk.tensor" not in ptx
    # dq_first_stores: beside each reduction, the store of a part's first contribution.
    first_stores = parts if config.dq_first_stores else 0
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == first_stores * walks
    # Two values per store (transposed, four: the registers in their order), a
    # warpgroup's part over 128 threads, in the masked and the mask-free loop.
    part = config.dq_tile_geometry
    width = 4 if part.transposed else 2
    assert len(re.findall(rf"st\.shared\.v{width}\.[bf]32", ptx)) == (
        (2 + staggered) * part.part_rows * part.part_cols // (width * 128) * walks
    )
    full, empty = ([str(int(first) + i) for i in range(parts)] for first in (NamedBarrier.DQ_FULL_0, NamedBarrier.DQ_EMPTY_0))
    handoff = [(op, b) for op, b in re.findall(r"bar\.(sync|arrive)\s+(\S+), 160;", ptx)]
    # A staggered walk's last dQ, warpgroup 0's alone, names its pair by constants.
    order = full[::-1] if staggered else full
    drains = [empty[0]] * staggered * walks
    assert [b for op, b in handoff if op == "sync" and not b.startswith("%")] == order * walks + drains
    assert sorted(b for op, b in handoff if op == "arrive" and not b.startswith("%")) == sorted(empty * 2 * walks)
    # Masked and mask-free loops: one sync, one arrive (and the staggered walk's last arrive).
    assert sum(b.startswith("%") for _, b in handoff) == (4 + staggered) * walks
    epilogue = [] if grouped else [NamedBarrier.EPILOGUE] * 2
    if not staggered:
        meetings = [str(int(b)) for b in [NamedBarrier.DS_TILE] * 2 + epilogue] * walks
        assert re.findall(r"bar\.sync\s+(\S+), 256;", ptx) == meetings
    # Grouped: dK and dV are added in fp32 by every thread, two adjacent values per 8-byte
    # reduction; otherwise they leave by TMA store.
    reductions = ptx.count("red.relaxed.gpu.global.add.v2.f32")
    assert reductions == (2 * config.tile_n * head_dim // (2 * 256) if grouped else 0)
    assert ("cp.async.bulk.tensor.4d.global.shared::cta.tile" in ptx) != grouped
    # Not deterministic: in the loops the bulk copies are only waited for until shared
    # memory is read, unless this CTA stored the block first (one full wait, then a
    # release of the block's ticket counter). Once, after the last, the store warp waits for them to land and
    # counts this key block for its head's postprocess (release), which this grid lets
    # launch early (overlap_postprocess).
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", ptx)) == (1 + (1 if first_stores else 0)) * walks
    assert ptx.count("red.release.gpu.global.add.s32") == (1 + (1 if first_stores else 0)) * walks
    assert ptx.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in ptx



@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_staggered_backward_meets_by_arrivals(head_dim, causal):
    # Staggered warpgroups (staggered_warpgroups) never meet all at once in the loops: per
    # step warpgroup 1 syncs on warpgroup 0's DS_WRITTEN (before its Sᵀ) and warpgroup 0
    # on warpgroup 1's (before writing dSᵀ), each arriving on its own once written (id by
    # register); warpgroup 0's last dQ after the walk waits once more, and runs one more dQ
    # GEMM and its stores. No DS_TILE meeting; every wgmma still pipelined.
    import dataclasses

    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_report

    config = dataclasses.replace(backward_config(head_dim, causal, seqlen_k=1024), staggered_warpgroups=True)
    report = compile_backward_report(config)
    assert report.serialized_wgmma == 0 and report.spill_bytes == 0
    ptx = report.ptx
    dq_row_blocks = 1 if config.dq_rows else config.tile_m // 64
    dq_gemm = dq_row_blocks * config.tile_n // 16
    per_block = 2 * head_dim // 16 + 2 * config.tile_m // 16 + dq_gemm
    assert ptx.count("wgmma.mma_async") == 2 * per_block + dq_gemm
    written = [str(int(NamedBarrier.DS_WRITTEN_0) + i) for i in range(2)]
    loop = [("sync", written[0]), ("sync", written[1]), ("arrive", "%")]
    met = [(op, b if not b.startswith("%") else "%") for op, b in re.findall(r"bar\.(sync|arrive)\s+(\S+), 256;", ptx)]
    assert met == 2 * loop + [("sync", written[1])] + [("sync", str(int(NamedBarrier.EPILOGUE)))] * 2
    part = config.dq_tile_geometry
    width = 4 if part.transposed else 2
    assert len(re.findall(rf"st\.shared\.v{width}\.[bf]32", ptx)) == 3 * part.part_rows * part.part_cols // (width * 128)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize("grouped", (False, True), ids=("mha", "gqa"))
def test_deterministic_backward_takes_turns(head_dim, grouped):
    # dQ's reductions wait for their turn (acquire), wait until they have landed (a full
    # bulk wait, not only the read of shared memory) and pass the turn on (release); under
    # GQA the dK, dV additions of the epilogue do the same.
    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_report

    config = backward_config(head_dim, True, grouped, deterministic=True, seqlen_k=1024)
    report = compile_backward_report(config)
    assert report.serialized_wgmma == 0
    ptx = report.ptx
    # The first in turn order stores (dq_first_stores): no tickets in deterministic mode.
    assert "atom.global.add" not in ptx
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == (2 if config.dq_first_stores else 0)
    turns = 2 + (1 if grouped else 0)  # the masked and the mask-free loop, and the epilogue
    # Plus the store warp's count for the overlapping postprocess, after its last wait.
    assert ptx.count("red.release.gpu.global.add.s32") == turns + 1
    assert ptx.count("ld.acquire.gpu") == 2 * turns  # the first read, and the spin
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", ptx)) == 2 + 1


@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_dq_first_stores_take_tickets_before_the_handover(causal):
    # Per query block the store warp takes one ticket (an atomic, before it waits for the
    # first part); unless it holds the first, it spins (acquire) once the first part is
    # handed over; it stores or adds each part; the first holder then waits for its stores
    # to land and releases. One ticket for all parts: with one per part, two CTAs each first
    # on one part would each wait for the other. Only causal (queries that see no key) has
    # key block 0's store warp write zeros.
    import dataclasses

    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_report

    config = dataclasses.replace(backward_config(128, causal, seqlen_k=1024), dq_first_stores=True)
    ptx = compile_backward_report(config).ptx
    parts = config.consumer_warpgroups
    warp = ptx[ptx.index("atom.global.add.u32"):]
    warp = warp[: warp.index("cp.async.bulk.wait_group.read")]
    order = re.findall(
        r"atom\.global\.add|bar\.sync\s+\d+, 160|ld\.acquire\.gpu|cp\.reduce\.async\.bulk|"
        r"cp\.async\.bulk\.global|cp\.async\.bulk\.wait_group\s+0|red\.release",
        warp,
    )
    order = [re.sub(r"\s+", " ", o) for o in order]
    # Staggered (the selector's head dim 128), warpgroup 1 hands its part over first.
    hand_over_order = range(parts)[::-1] if config.staggered_warpgroups else range(parts)
    handover = [f"bar.sync {int(NamedBarrier.DQ_FULL_0) + p}, 160" for p in hand_over_order]
    expected = ["atom.global.add"]
    for part, barrier in enumerate(handover):
        expected += [barrier] + ["ld.acquire.gpu"] * (2 if part == 0 else 0)
        expected += ["cp.async.bulk.global", "cp.reduce.async.bulk"]
    expected += ["cp.async.bulk.wait_group 0", "red.release"]
    assert order == expected
    assert ptx.count("st.global.v4") == (1 if causal else 0)


def test_dq_rows_compiles_clean():
    # Head dim 64 (tile_m 128): each warpgroup's dQ GEMM is 64x64
    # wgmmas over its own 64 query rows, pipelined, without spills; its part of dQ leaves
    # as one linear bulk reduction, issued for both parts by the store warp.
    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_report

    config = backward_config(64, True, seqlen_k=1024)
    assert config.dq_rows
    report = compile_backward_report(config)
    assert report.serialized_wgmma == 0 and report.spill_bytes == 0
    shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", report.ptx)
    assert shapes.count("m64n32k16") == 0 and shapes.count("m64n64k16") == 2 * (8 + 8 + 8)
    assert report.ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2


@pytest.mark.parametrize("dtype", ("bfloat16", "float8_e4m3fn"))
def test_rescale_when_needed_skips_the_multiplies_by_a_warp_vote(dtype):
    # In the key loops, one warp vote per block decides whether O's rows are multiplied;
    # the multiplies stay (no spills, no serialised wgmma). Without lazy_rescale, whose
    # branches vote too.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select

    entry = select("sm_90a", dtype, 128, False, 4096)
    plain = dict(lazy_rescale=False, lazy_check_by_sums=False)
    always, when_needed = (
        compile_entry(
            dataclasses.replace(entry, config=dataclasses.replace(entry.config, rescale_when_needed=on, **plain)),
            arch="sm_90a",
        )
        for on in (False, True)
    )
    assert when_needed.spill_bytes == 0 and when_needed.serialized_wgmma == 0
    assert "vote.sync.any.pred" not in always.ptx
    # The mask-free loop and the masked one (absent without a mask here) each vote once.
    votes = when_needed.ptx.count("vote.sync.any.pred")
    assert 1 <= votes <= 2
    assert when_needed.ptx.count("mul.f32") >= always.ptx.count("mul.f32") - 2


@pytest.mark.parametrize("dtype", ("bfloat16", "float8_e4m3fn"))
def test_dynamic_tiles_take_one_ticket_a_tile(dtype):
    # A dynamic grid's producer takes each next tile by one atomic add on the counter (the
    # pairs' grid takes none), and hands positions over through its two-slot queue: three
    # more pairs of mbarriers beside the rings'. No spills, no serialised wgmma.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select

    entry = select("sm_90a", dtype, 128, True, 1024)
    assert entry.config.persistent and not entry.config.kv_multicast
    pairs = compile_entry(entry, arch="sm_90a")
    dynamic = compile_entry(dataclasses.replace(entry, config=dataclasses.replace(entry.config, dynamic_tiles=True)),
                            arch="sm_90a")
    assert dynamic.spill_bytes == 0 and dynamic.serialized_wgmma == 0
    atomics = re.findall(r"atom\.(?:relaxed\.)?(?:gpu\.)?(?:global\.)?add\.[su]32", dynamic.ptx)
    assert len(atomics) == 1 and not re.findall(r"atom\.\S*add", pairs.ptx)
    inits = [report.ptx.count("mbarrier.init") for report in (pairs, dynamic)]
    assert inits[1] - inits[0] == 4


# Four consumer warpgroups at head dim 64 (FP8): (causal, tile_n, f16 scores) that fit.
FOUR_WARPGROUP_VARIANTS = [(False, 64, False), (False, 64, True), (True, 64, False), (True, 64, True), (True, 96, True)]


@pytest.mark.parametrize("causal,tile_n,f16_scores", FOUR_WARPGROUP_VARIANTS,
                         ids=[f"{'causal' if c else 'full'}-{n}-{'f16' if f else 'fp32'}" for c, n, f in FOUR_WARPGROUP_VARIANTS])
def test_four_warpgroups_at_head_dim_64_compile_clean(causal, tile_n, f16_scores):
    # Head dim 64's FP8 rows on four consumer warpgroups (256-row tiles) and the blocks
    # that fit their 112 registers: no spills, the budget's setmaxnreg, turns met by two
    # warpgroups and O slabs by one (their ids are the warpgroup's, in a register; the CPU
    # test of the ids is tests/test_configs.py's). 96-key blocks spill unmasked (8 bytes
    # with f16 scores) and with fp32 scores (160-256), 128-key ones everywhere.
    import dataclasses

    entry = select_fp8("sm_90a", 64, causal, 512, True, f16_scores=f16_scores)
    config = dataclasses.replace(entry.config, consumer_warpgroups=4, tile_n=tile_n)
    report = compile_entry(dataclasses.replace(entry, config=config), arch="sm_90a", with_lse=False)
    assert report.spill_bytes == 0 and report.serialized_wgmma == 0
    budget = register_budget(4)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{budget.consumer}\b", report.ptx)
    assert report.registers == launch_registers(budget.threads)
    met_by = set(re.findall(r"bar\.sync\s+%r\d+,\s*(\d+)", report.ptx))
    assert {"256", "128"} <= met_by, sorted(met_by)


def test_fp8_blockwise_v_kernel_keeps_the_divisions_the_table_drops():
    # The table's FP8 rows take V per tensor: no IEEE division is left (the blockwise-V
    # kernel, select_fp8's other answer, divides by the running V descale in every block)
    # and V's descales are read once, not per block.
    import cutlass

    from flash4.compiler import compile_entry
    from flash4.kernels.sm90_fwd_fp8 import Sm90Fp8ForwardKernel

    entries = [select_fp8("sm_90a", 128, True, 4096, v_per_tensor=per_tensor) for per_tensor in (True, False)]
    table, blockwise = (compile_entry(entry, arch="sm_90a") for entry in entries)
    for report in (table, blockwise):
        assert report.spill_bytes == 0 and report.serialized_wgmma == 0
    assert "div.rn.f32" in blockwise.ptx and "div.rn.f32" not in table.ptx
    # V's descale travels once a tile with Q's stage, or with each key block's K.
    kernels = [Sm90Fp8ForwardKernel(entry.config, cutlass.BFloat16) for entry in entries]
    assert [(k.q_scalar_count, k.k_scalar_count) for k in kernels] == [(2, 1), (1, 2)]


@pytest.mark.parametrize(
    "dtype,head_dim,block",
    [("bfloat16", 64, 192), ("float16", 128, None), ("float32", 256, 128), ("bfloat16", 256, 128), ("float32", 256, 192)],
)
def test_quantize_kernel_reads_16_byte_vectors_and_multiplies_by_the_reciprocal(dtype, head_dim, block):
    # kernels/quantize_fp8.py: 16-byte loads, one reciprocal of the descale per thread and a
    # float32 multiply per value (no division per value: a dozen instructions each), e4m3
    # conversions four to a register, one store per vector; nothing spilled. The descale
    # itself is the one IEEE division (amax / 448), after one CTA reduction (warp shuffles)
    # of the block's magnitudes or, per tensor, of the partial maxima. A blockwise CTA whose
    # block fits in its registers loads each vector once; a larger one (float32 at head dim
    # 256, 192 rows) reads it twice.
    from flash4.compiler import PER_TENSOR_BLOCK_ROWS, _quantize_dtype, compile_quantize_report
    from flash4.kernels.quantize_fp8 import QuantizeFp8Rows

    report = compile_quantize_report(dtype, head_dim, block)
    kernel = QuantizeFp8Rows(head_dim, _quantize_dtype(dtype), block or PER_TENSOR_BLOCK_ROWS, block is None)
    assert report.spill_bytes == 0
    assert report.ptx.count("rcp.approx.ftz.f32") == 1 and report.ptx.count("div.rn.f32") == 1
    assert report.ptx.count("mul.f32") == kernel.block.turns * kernel.block.vector
    assert "cvt.rn.satfinite.e4m3x2.f32" in report.ptx and "shfl.sync.bfly" in report.ptx
    # A 16-byte vector of 16-bit values is 8 e4m3 bytes; of float32, 4. One more store: the descale.
    assert report.ptx.count("st.global.") == kernel.block.turns + 1
    assert report.ptx.count("st.global.v2.b32") == (0 if dtype == "float32" else kernel.block.turns)
    loads = report.ptx.count("ld.global.v4.b32")
    assert kernel.resident == (block is not None and (dtype, block) != ("float32", 192))
    if kernel.resident:
        assert loads == kernel.block.turns
    elif block is not None:
        assert loads > kernel.block.turns


@pytest.mark.parametrize(
    "dtype,head_dim,block",
    [("bfloat16", 64, 192), ("bfloat16", 128, 128), ("float16", 256, 128), ("float32", 128, 96), ("bfloat16", 128, None),
     ("float32", 256, 192)],
)
def test_quantize_kernel_rotates_in_registers(dtype, head_dim, block):
    # With hadamard=True the rows kernel rotates each row where it loaded it
    # (kernels/hadamard_rotation.py): per value one add per stage within a lane, one shuffle
    # and one fma per stage across lanes, the scale's multiply and the reciprocal's; no
    # float32 copy of the tensor in memory (the stores are the e4m3 values and the
    # descale). Nothing spilled. A block that fits in registers is held rotated and loaded
    # once; a larger one (float32 at head dim 256, 192 rows) is read, and rotated, twice.
    from flash4.compiler import _kernel_hadamard, _quantize_dtype, compile_quantize_report
    from flash4.kernels.quantize_fp8 import QuantizeFp8Rows

    report = compile_quantize_report(dtype, head_dim, block, hadamard=True)
    kernel = QuantizeFp8Rows(head_dim, _quantize_dtype(dtype), block or 128, block is None, _kernel_hadamard(head_dim, True))
    rotation = kernel.block.rotation
    across = sum(1 for across_lanes, _ in rotation.stages if across_lanes)
    values = kernel.block.turns * rotation.piece  # rotated by each thread in its storing pass
    loads = kernel.block.turns * rotation.loads
    assert report.spill_bytes == 0
    assert report.ptx.count("st.global.") == loads + 1
    assert kernel.resident == (block is not None and (dtype, block) != ("float32", 192))
    if block is not None and not kernel.resident:
        assert report.ptx.count("ld.global.v4.b32") > loads
        return
    assert report.ptx.count("ld.global.v4.b32") == loads
    # A resident CTA deals every thread as many pieces of the block (none rotates a repeated
    # row); each rotated value's magnitude is one max of its |x| (no min beside it).
    if kernel.resident:
        assert kernel.block.turns * kernel.block.threads == block * kernel.block.lanes_per_row
        assert report.ptx.count("abs.f32") == values and "min.f32" not in report.ptx
    # The CTA's largest magnitude takes five more shuffles (a warp's reduction).
    assert report.ptx.count("shfl.sync.bfly") == across * values + 5
    assert report.ptx.count("fma.rn.f32") == across * values
    assert report.ptx.count("add.f32") + report.ptx.count("sub.f32") == (len(rotation.stages) - across) * values
    assert report.ptx.count("mul.f32") == 2 * values


@pytest.mark.parametrize(
    "dtype,head_dim,block,hadamard",
    [("bfloat16", 64, 128, True), ("float16", 128, 128, True), ("bfloat16", 256, 128, True), ("bfloat16", 128, None, True),
     ("float32", 128, 64, False)],
)
def test_int8_quantize_kernel_rounds_by_the_shift(dtype, head_dim, block, hadamard):
    # quantize_int8 on the GPU: the rows kernel with int8 codes onto 127 (the descale's one
    # division is amax / 127), each value's product with the reciprocal rounded to an
    # integer by one add.rn of 1.5 * 2^23 (never fused into an FFMA), its low byte stored:
    # no conversion instruction, no e4m3 one, nothing spilled.
    from flash4.compiler import compile_quantize_report

    report = compile_quantize_report(dtype, head_dim, block, hadamard=hadamard, int8=True)
    assert report.spill_bytes == 0
    # One shift per value multiplied by the reciprocal (rotating, half of the multiplies
    # are the rotation's scale).
    products = report.ptx.count("mul.f32") // (2 if hadamard else 1)
    assert len(re.findall(r"add\.rn\.f32 \S+, \S+, 0f4B400000;", report.ptx)) == products > 0
    assert "cvt.rn.satfinite.e4m3x2.f32" not in report.ptx and "cvt.rni" not in report.ptx
    # The descale: amax / 127 (0f42FE0000).
    assert re.search(r"div\.rn\.f32\s+\S+,\s+\S+,\s+0f42FE0000;", report.ptx)


@pytest.mark.parametrize("dtype", ("bfloat16", "float32", "float8_e4m3fn"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_transposed_v_kernel_transposes_through_shared_memory(dtype, head_dim):
    # V's layout kernel: 16-byte loads of V's rows, their e4m3 bytes into shared memory,
    # read back a 4-byte column at a time, transposed by eight prmt per 4x4 bytes, and
    # 16-byte stores of 16 keys of a head-dim row (none of the 1-byte stores of a
    # transpose without shared memory). e4m3 V moves without a conversion.
    from flash4.compiler import compile_quantize_report
    from flash4.kernels.quantize_fp8 import KEYS_PER_STORE, V_KEYS, V_THREADS

    report = compile_quantize_report(dtype, head_dim, None, transposed_v=True)
    assert report.spill_bytes == 0 and "st.global.b8" not in report.ptx
    element_bytes = {"bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
    assert report.ptx.count("ld.global.v4.b32") == V_KEYS * head_dim * element_bytes // 16 // V_THREADS
    stores = V_KEYS * head_dim // KEYS_PER_STORE // V_THREADS
    assert report.ptx.count("st.global.v4.b32") == stores
    # Two prmt per 4-byte word stored.
    assert report.ptx.count("prmt.b32") == 2 * stores * KEYS_PER_STORE // 4
    assert ("cvt.rn.satfinite.e4m3x2.f32" in report.ptx) == (dtype != "float8_e4m3fn")


@pytest.mark.parametrize("hadamard", (False, True), ids=("plain", "hadamard"))
def test_tensor_amax_reads_only(hadamard):
    # The per-tensor descales' partial maxima: 16-byte loads, LOADS_IN_FLIGHT of them
    # unrolled, one store per CTA; rotating, the loop's turns rotate what they loaded.
    from flash4.compiler import compile_quantize_report
    from flash4.kernels.memory_pass import LOADS_IN_FLIGHT

    report = compile_quantize_report("bfloat16", 128, None, amax=True, hadamard=hadamard)
    assert report.spill_bytes == 0
    assert report.ptx.count("ld.global.v4.b32") == LOADS_IN_FLIGHT and report.ptx.count("st.global") == 1
    assert ("fma.rn.f32" in report.ptx) == hadamard


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_dq_postprocess_moves_16_byte_loads_and_8_byte_stores(dtype, head_dim):
    # The backward's postprocess (kernels/sm90_bwd_postprocess.py): four fp32
    # per load, one fp32 multiply each, a paired round-to-nearest cvt, one 8-byte store.
    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_postprocess_report

    report = compile_backward_postprocess_report(dtype, backward_config(head_dim, False, seqlen_k=1024).dq_tile_geometry)
    assert report.spill_bytes == 0
    kind = {"bfloat16": "bf16x2", "float16": "f16x2"}[dtype]
    loads, stores = report.ptx.count("ld.global.v4.b32"), report.ptx.count("st.global.v2.b32")
    assert loads == stores > 0
    assert report.ptx.count(f"cvt.rn.{kind}.f32") == 2 * loads and report.ptx.count("mul.f32") == 4 * loads


@pytest.mark.parametrize("overlap", (False, True), ids=("alone", "overlap"))
def test_dq_postprocess_waits_for_its_head_only_when_overlapping(overlap):
    # Overlapping the main kernel, a CTA spins on its head's counter (acquire) before any
    # load, and the grid's last CTA waits for the main grid (so the stream's next work
    # does); alone, neither.
    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_postprocess_report

    geometry = backward_config(128, False, seqlen_k=1024).dq_tile_geometry
    ptx = compile_backward_postprocess_report("bfloat16", geometry, overlap=overlap).ptx
    assert ptx.count("griddepcontrol.wait") == int(overlap)
    assert ptx.count("ld.acquire.gpu") == 2 * int(overlap)  # the first read, and the spin
    if overlap:
        assert ptx.index("ld.acquire.gpu") < ptx.index("ld.global.v4")


@pytest.mark.parametrize("kernel", ("quantize_rows", "quantize_transposed_v", "bwd_postprocess", "bwd_postprocess_transposed"))
def test_memory_passes_issue_their_loads_ahead_of_their_stores(kernel):
    # A load-convert-store loop keeps one load in flight per thread (a load stays behind a
    # store to memory the compiler cannot tell apart): the stores of a batch come after all
    # of its LOADS_IN_FLIGHT loads. Per tensor, the rows kernel has only its storing pass.
    from flash4.backward import backward_config
    from flash4.compiler import compile_backward_postprocess_report, compile_quantize_report
    from flash4.kernels.memory_pass import LOADS_IN_FLIGHT

    report = {
        "quantize_rows": lambda: compile_quantize_report("bfloat16", 128, None),
        "quantize_transposed_v": lambda: compile_quantize_report("bfloat16", 128, None, transposed_v=True),
        "bwd_postprocess": lambda: compile_backward_postprocess_report(
            "bfloat16", backward_config(128, True, seqlen_k=1024).dq_tile_geometry
        ),
        # Head dim 128 unmasked: dQᵀ's parts in register order, staged through shared memory.
        "bwd_postprocess_transposed": lambda: compile_backward_postprocess_report(
            "bfloat16", backward_config(128, False, seqlen_k=1024).dq_tile_geometry
        ),
    }[kernel]()
    order = "".join(
        "L" if line.startswith("ld.global.v4") else "S"
        for line in (raw.strip() for raw in report.ptx.splitlines())
        if line.startswith(("ld.global.v4", "st.global"))
    )
    if kernel in ("quantize_transposed_v", "bwd_postprocess_transposed"):
        # Through shared memory: every load of the tile before any store.
        assert order == "L" * order.count("L") + "S" * order.count("S"), order
    else:
        assert order.startswith("L" * LOADS_IN_FLIGHT + "S"), order



def _accumulator_layout_offsets(rows: int, cols: int) -> tuple[list[int], str]:
    """Every (row, col) of stage 0 of accumulator_tile_layout, through its outer layout (in
    fp32 elements, before the pointer's swizzle), and the swizzle as text."""
    import cutlass.cute as cute

    from flash4.kernels.wgmma import accumulator_tile_layout

    found: dict = {}

    @cute.jit
    def evaluate():
        layout = accumulator_tile_layout(rows, cols, 2)
        found["swizzle"] = str(layout.inner)
        found["outer"] = [cute.crd2idx((r, c, 0), layout.outer) for r in range(rows) for c in range(cols)]

    evaluate()
    return found["outer"], found["swizzle"]


@pytest.mark.parametrize("rows,cols", ((64, 64), (64, 128)))
def test_dq_accumulator_tile_is_the_offsets_the_postprocess_reads(rows, cols):
    # The main kernel writes dQ through a shared-memory pointer that swizzles byte
    # addresses and copies the tile out byte for byte; the postprocess reads it back with
    # accumulator_tile_offset. Both must name the same place for every element, and the
    # places must be a permutation of the tile.
    from flash4.kernels.configs import FP32_ADDRESS_BITS, accumulator_tile_offset

    outer, swizzle = _accumulator_layout_offsets(rows, cols)
    bits, base, shift = (int(x) for x in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", swizzle).groups())
    assert base == 2 + FP32_ADDRESS_BITS  # 16-byte units, in bytes

    def byte_swizzle(address: int) -> int:
        return address ^ (((address >> (base + shift)) & ((1 << bits) - 1)) << base)

    offsets = [accumulator_tile_offset(r, c, rows) for r in range(rows) for c in range(cols)]
    assert [byte_swizzle(4 * o) for o in outer] == [4 * o for o in offsets]
    assert sorted(offsets) == list(range(rows * cols))


@pytest.mark.parametrize("cols", (64, 128))
def test_dq_accumulator_stores_have_no_bank_conflicts(cols):
    # A wgmma accumulator (m64nN): lane l of warp w holds rows 16w + l/4 (+8) and the column
    # pairs 8j + 2(l%4). One 8-byte store per (row half, j) and lane; shared memory serves
    # a half-warp per wavefront, 32 banks of 4 bytes, so the ideal is 2 wavefronts a store.
    # The tile stacked 128 bytes per row (smem_tile_layout) took 4 (ncu: 2x the ideal).
    from flash4.kernels.configs import accumulator_tile_offset

    def wavefronts(addresses: list[int]) -> int:
        total = 0
        for half in (addresses[:16], addresses[16:]):
            words_by_bank: dict[int, set[int]] = {}
            for address in half:
                for word in (address // 4, address // 4 + 1):
                    words_by_bank.setdefault(word % 32, set()).add(word)
            total += max(len(words) for words in words_by_bank.values())
        return total

    for warp in range(4):
        for half in range(2):
            for j in range(cols // 8):
                addresses = [
                    4 * accumulator_tile_offset(16 * warp + lane // 4 + 8 * half, 8 * j + 2 * (lane % 4), 64)
                    for lane in range(32)
                ]
                assert wavefronts(addresses) == 2, (warp, half, j)


@pytest.mark.parametrize("tile_m", (64, 80))
def test_transposed_dq_registers_land_where_the_postprocess_reads_them(tile_m):
    # dq_transposed: each warpgroup's dQᵀ accumulator (M = its 64 head-dim columns, N = the
    # block's queries) leaves its registers in order, register i of thread t at
    # (i // 4) * 512 + 4 t + i % 4 of the warpgroup's part. For every register of every
    # thread, CuTe's partition of the tiled MMA names (column, query); the geometry's offset
    # of dQ's (query, column) must be that place, and the postprocess's inverse map must
    # name (column, query) back. Together: a permutation of the block.
    import dataclasses

    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils

    from flash4.backward import backward_config
    from flash4.kernels.configs import THREADS_PER_WARPGROUP, accumulator_register_coords

    config = dataclasses.replace(backward_config(128, False, seqlen_k=16384), dq_transposed=True, tile_m=tile_m)
    geometry = config.dq_tile_geometry
    found: dict = {}

    @cute.jit
    def evaluate():
        mn = cute.nvgpu.OperandMajorMode.MN
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, mn, mn, cutlass.Float32, (2, 1, 1), (64, tile_m)
        )
        identity = cute.make_identity_tensor((128, tile_m))
        for thread in cutlass.range_constexpr(2 * THREADS_PER_WARPGROUP):
            coords = tiled_mma.get_slice(thread).partition_C(identity)
            found[thread] = [tuple(int(x) for x in coords[i]) for i in range(cute.size(coords))]

    cute.compile(evaluate, options="--gpu-arch=sm_90a")
    part_floats = 64 * tile_m
    places = []
    for thread, coords in found.items():
        part, t = divmod(thread, THREADS_PER_WARPGROUP)
        for i, (column, query) in enumerate(coords):
            place = part * part_floats + (i // 4) * 4 * THREADS_PER_WARPGROUP + 4 * t + i % 4
            assert geometry.offset(query, column) == place, (thread, i, column, query)
            assert accumulator_register_coords(place % part_floats) == (column % 64, query)
            places.append(place)
    assert sorted(places) == list(range(128 * tile_m))


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_other_row_sum_order_compiles_clean(head_dim):
    # sum_from_rescaled changes only the order ptxas may schedule the softmax in: either
    # setting has no spills, no serialised wgmma, and not one exponential more.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select

    entry = select("sm_90a", "bfloat16", head_dim, False, 4096)
    config = dataclasses.replace(entry.config, sum_from_rescaled=not entry.config.sum_from_rescaled)
    report = compile_entry(dataclasses.replace(entry, config=config))
    assert report.serialized_wgmma == 0 and report.spill_bytes == 0
    assert report.ptx.count("ex2.approx") == compile_entry(entry).ptx.count("ex2.approx")


def test_masked_column_slices_compute_only_their_columns():
    # The first block's softmax compiled once per count of live slices, each taking the
    # exponentials of its leading slices only: with 4, 1 + 2 + 3 + 4 slices of a row's 32
    # columns (two rows a thread) against the single whole-row copy, 6 slices' more a row.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select
    entry = select("sm_90a", "bfloat16", 64, True, 1024)
    assert entry.config.masked_column_slices
    plain = compile_entry(dataclasses.replace(entry, config=dataclasses.replace(entry.config, masked_column_slices=0)))
    sliced = compile_entry(entry)
    count = entry.config.masked_column_slices
    rows_per_thread, slice_cols = 2, entry.config.tile_n // 4 // count
    extra_slices = sum(range(1, count + 1)) - count
    assert sliced.ptx.count("ex2.approx") - plain.ptx.count("ex2.approx") == rows_per_thread * slice_cols * extra_slices
    assert sliced.instructions["wgmma.mma_async"] == plain.instructions["wgmma.mma_async"]


@pytest.mark.parametrize(
    "head_dim,causal,seqlen", ((64, False, 1024), (64, True, 4096), (128, False, 16384), (256, True, 1024))
)
def test_lazy_rescale_compiles_clean(head_dim, causal, seqlen):
    # The rows' unmasked step under lazy_rescale holds the block's softmax against the kept
    # max (one exponential per score a thread holds, tile_n / 2 of them over 64 rows)
    # beside the rebasing one. Checked by the max over the scores: no shuffle added, one
    # warp vote. By the row sums of P: no spill and no serialised GEMM from the rebasing
    # of P or the recomputed scores either.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select

    entry = select("sm_90a", "bfloat16", head_dim, causal, seqlen)
    assert entry.config.lazy_rescale
    plain = compile_entry(
        dataclasses.replace(
            entry, config=dataclasses.replace(entry.config, lazy_rescale=False, lazy_check_by_sums=False)
        )
    )
    for by_sums in (False, True):
        config = dataclasses.replace(entry.config, lazy_check_by_sums=by_sums)
        lazy = compile_entry(dataclasses.replace(entry, config=config))
        assert lazy.serialized_wgmma == 0 and lazy.spill_bytes == 0
        assert lazy.ptx.count("ex2.approx") - plain.ptx.count("ex2.approx") >= entry.config.tile_n // 2
        if not by_sums:
            assert lazy.ptx.count("ex2.approx") - plain.ptx.count("ex2.approx") == entry.config.tile_n // 2
            assert lazy.ptx.count("shfl.sync") == plain.ptx.count("shfl.sync")
            assert lazy.ptx.count("vote.sync") == plain.ptx.count("vote.sync") + 1


@pytest.mark.parametrize(
    "dtype,head_dim", (("float8_e4m3fn", 64), ("float8_e4m3fn", 128), ("float8_e4m3fn", 256), ("bfloat16", 256))
)
def test_other_p_order_compiles_clean(dtype, head_dim):
    # p_before_rescale moves P's conversion above O's rescale (a branch where
    # rescale_when_needed) or leaves it below: either way no spills, no serialised wgmma,
    # no extra exponential.
    import dataclasses

    from flash4.compiler import compile_entry
    from flash4.dispatch import select

    entry = select("sm_90a", dtype, head_dim, False, 4096)
    config = dataclasses.replace(entry.config, p_before_rescale=not entry.config.p_before_rescale)
    report = compile_entry(dataclasses.replace(entry, config=config))
    assert report.serialized_wgmma == 0 and report.spill_bytes == 0
    assert report.ptx.count("ex2.approx") == compile_entry(entry).ptx.count("ex2.approx")


@pytest.mark.parametrize(
    "head_dim,causal,seqlen", ((64, False, 1024), (64, True, 4096), (128, False, 4096), (128, True, 1024), (256, False, 512))
)
def test_fp8_rows_round_p_codes_without_lse(head_dim, causal, seqlen):
    # The FP8 rows make P's e4m3 codes by rounding where they write no LSE
    # (fp8_p_by_rounding): no e4m3 conversion and no exponential per score there, f16
    # conversions, clamps and byte permutes instead; the variant with an LSE keeps exp2 and
    # the e4m3 conversion. Both compile clean.
    from flash4.compiler import compile_entry
    from flash4.dispatch import FP8_DTYPE, select

    entry = select("sm_90a", FP8_DTYPE, head_dim, causal, seqlen)
    assert entry.config.fp8_p_by_rounding
    codes, exps = compile_entry(entry, with_lse=False), compile_entry(entry, with_lse=True)
    for report in (codes, exps):
        assert report.serialized_wgmma == 0 and report.spill_bytes == 0
    assert "cvt.rn.satfinite.e4m3x2.f32" not in codes.ptx and "cvt.rn.satfinite.e4m3x2.f32" in exps.ptx
    assert "max.f16x2" in codes.ptx and "prmt.b32" in codes.ptx and "max.f16x2" not in exps.ptx
    # What exponentials remain are O's factors, one per row and block: far fewer than P's.
    assert 8 * codes.ptx.count("ex2.approx") < exps.ptx.count("ex2.approx")
