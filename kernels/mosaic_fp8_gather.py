"""The fused GEMM1 reading its rows straight from the tokens: no permuted copy of x.

`gathered_act_quant` computes what `kernels.mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_contiguous`
computes on the contiguous layout, without the layout's rows: row r of the layout is token
`row_sources[r]` of `x_tokens` (-1 on padding rows), and the kernel loads each 64-row block from
there. The layer then only routes (`moe_jax.permute.route`): the FP8 rows and their scales are
never copied, and their [M, H] buffer never allocated.

Hopper's TMA copies boxes, not lists of rows, so the memory warpgroup gathers with per-thread
asynchronous copies (PTX `cp.async`, 16 bytes each) into the swizzled shared-memory tile the
wgmma reads, and the row scales with 4-byte ones.
Pallas has no such copy: the `inline_mgpu` blocks below emit it. Everything else is
`kernels.mosaic_fp8_kernel`'s kernel at `is_dense` (128-row segments): the same tiles in the
same order, the same wgmmas, scales and epilogue (`kernels.mosaic_fp8_epilogue.store_act_quant`),
so the codes equal the contiguous kernel's on the permuted rows bit for bit. Its pipeline is
written out here rather than taken from Pallas' `emit_pipeline_warp_specialized`, whose memory
warpgroup issues TMA copies only. With S weight slots (`MosaicFp8GemmConfig.max_concurrent_steps`),
S + `extra_x_slots` row slots and P K blocks per step (`k_blocks_per_step`):

    memory warpgroup (all 128 threads), over this SM's tiles and their K steps g = 0, 1, ...:
        wait until the compute warpgroups release row slot g % S_x (step g - S_x)
        cp.async this thread's pieces of step g's rows and scales (`_gather`), then
        `cp.async.mbarrier.arrive.noinc` on the slot's row barrier: the hardware arrives for
        the thread once its copies have landed (128 arrivals complete it), and the thread
        goes on at once
        wait until weight slot g % S is released; one thread: TMA of the [2, 128, 128 P]
        gate/up weight tile, on the slot's weight barrier
    compute warpgroups: as `kernels.mosaic_fp8_kernel` (wait for both barriers of the step,
    a proxy fence for the rows the cp.asyncs wrote, the wgmmas and their scaling, release
    both slots), then the epilogue.

Compiled only: Mosaic GPU's interpret mode runs no inline PTX. The CPU tests run its reference,
`gathered_act_quant_reference` (the rows gathered by XLA, then the contiguous kernel, which has
an interpret mode), and the GPU tests hold the kernel to that reference bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax import layouts, quant
from moe_jax.fused_gemm1 import gather_rows
from moe_jax.kernels import mosaic_fp8_tiles
from moe_jax.kernels.mosaic_fp8_config import (
    BLOCK_K,
    BLOCK_M,
    SCALE_BLOCK,
    SMEM_LIMIT,
    SWIZZLE,
    FusedGemm1Options,
    MosaicFp8GemmConfig,
)
from moe_jax.kernels.mosaic_fp8_epilogue import store_act_quant
from moe_jax.kernels.mosaic_fp8_kernel import MEMORY_REGISTERS

# Registers per thread left to the memory warpgroup, as `kernels.mosaic_fp8_kernel` leaves its
# TMA-only one (more were slower)
GATHER_REGISTERS = MEMORY_REGISTERS
# what Pallas' warp-specialised pipeline gives each of two compute warpgroups beside it: the
# register file's 512 per thread of one warpgroup, less the memory warpgroup's, halved, in 8s
COMPUTE_REGISTERS = min(256, (512 - GATHER_REGISTERS) // 2) // 8 * 8
# x tiles in flight beyond the config's pipeline slots (which the weight tiles keep), where
# shared memory has room (`extra_x_slots`): a gather is then issued a step before its weight
# tile, as the slot it fills is released a step earlier (deeper row pipelines were slower)
X_EXTRA_SLOTS = 1
CHUNK = 16  # bytes per cp.async of a row: the widest it copies
THREADS = 128  # one warpgroup
TILE_BYTES = 8 * SWIZZLE  # one (8, 128) tile of FP8 in shared memory


def has_inline_ptx() -> bool:
    """Whether this jax's Mosaic GPU emits inline PTX (`mosaic.gpu.utils.inline_ptx`, from jax
    0.11), which the compiled kernel's copies and barriers are written in."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    return hasattr(mgpu_utils, "inline_ptx")


def extra_x_slots(config: MosaicFp8GemmConfig, k: int) -> int:
    """`X_EXTRA_SLOTS`, or 0 where the kernel's shared memory would then exceed a Hopper
    program's (`SMEM_LIMIT`)."""
    per_step = config.k_blocks_per_step(k)
    x_slot = per_step * (BLOCK_M * BLOCK_K + 4 * BLOCK_M)  # the rows and their scales
    base = config.smem_bytes(jnp.bfloat16, k, is_gated=True)
    return X_EXTRA_SLOTS if base + X_EXTRA_SLOTS * x_slot <= SMEM_LIMIT else 0


def launch_gathered(
    x_tokens: jax.Array,
    x_scales: jax.Array,
    row_sources: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    w_scales: jax.Array,
    *,
    n: int,
    config: MosaicFp8GemmConfig,
    num_sms: int | None,
    activation: str,
) -> tuple[jax.Array, jax.Array]:
    """Runs `_kernel` on the layout's M rows (padded to whole 128-row pairs).

    Args:
      x_tokens: float8_e4m3fn [T, K]; x_scales: float32 [T, K/128] their row-group scales.
      row_sources: int32 [M] the token of each row of the layout, -1 on padding rows.
      w: float8_e4m3fn GEMM1's [E, 2I, K] seen as [2E, I, K]; w_scales: float32 [E, 2I/128,
        K/128].
      expert_ids: int32 [M] expert of each row (-1, or any id outside [0, E), on padding).
      n: I; config: the fused kernel's (`act_quant_heuristic_config`), groups of at most 2.
      num_sms: persistent programs (None: the device's SM count); activation: as the front's.

    Returns:
      (q float8_e4m3fn [M', I], scales float32 [I/128, M']) at the padded row count M'.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_rows = row_sources.shape[0]
    k = x_tokens.shape[1]
    num_experts = w_scales.shape[0]
    padded_rows = mosaic_fp8_tiles.padded_rows(num_rows, is_dense=True)
    extra = padded_rows - num_rows
    row_sources = jnp.pad(layouts.ids_as_int32(row_sources), (0, extra), constant_values=-1)
    expert_ids = jnp.pad(layouts.ids_as_int32(expert_ids), (0, extra), constant_values=-1)
    block_experts = expert_ids[::BLOCK_M]
    pair_experts = block_experts[::2]
    is_valid = (pair_experts >= 0) & (pair_experts < num_experts)
    num_blocks = (2 * jnp.sum(is_valid, dtype=jnp.int32)).reshape(1)
    if num_sms is None:
        num_sms = jax.local_devices()[0].core_count
    num_groups = n // SCALE_BLOCK
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            n=n,
            k=k,
            num_sms=num_sms,
            config=config,
            activation=activation,
        ),
        out_type=(
            jax.ShapeDtypeStruct((padded_rows, n), quant.FP8_DTYPE),
            jax.ShapeDtypeStruct((num_groups, padded_rows), jnp.float32),
        ),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(
        block_experts,
        num_blocks,
        row_sources,
        x_tokens,
        x_scales.astype(jnp.float32),
        w,
        w_scales.astype(jnp.float32),
    )


def _kernel(
    block_experts_gmem,
    num_blocks_gmem,
    sources_gmem,
    x_gmem,
    xs_gmem,
    w_gmem,
    ws_gmem,
    q_gmem,
    scales_gmem,
    *,
    n: int,
    k: int,
    num_sms: int,
    config: MosaicFp8GemmConfig,
    activation: str,
):
    """One persistent program: this SM's tiles in `kernels.mosaic_fp8_kernel`'s `is_dense`
    order (module docstring of this module for the pipeline)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn = BLOCK_M, config.block_n
    per_step = config.k_blocks_per_step(k)
    block_k = per_step * BLOCK_K
    steps = k // block_k  # pipeline steps per tile
    slots = config.max_concurrent_steps
    n_tiles = n // bn
    group = config.group_blocks
    num_compute_wgs = config.num_compute_wgs
    transforms = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))

    x_slots = slots + extra_x_slots(config, k)
    scratch = dict(
        x_smem=plgpu.SMEM((x_slots, bm, block_k), jnp.float8_e4m3fn, transforms=transforms),
        xs_smem=plgpu.SMEM((x_slots, per_step, bm), jnp.float32),
        w_smem=plgpu.SMEM((slots, 2, bn, block_k), jnp.float8_e4m3fn, transforms=transforms),
        # the row slots' mbarriers (8 bytes each; `_init_row_barriers`): each of the memory
        # warpgroup's 128 threads arrives through its cp.asyncs. Pallas' barriers cannot be
        # handed to inline PTX, which that arrival is
        rows_landed=plgpu.SMEM((x_slots, 2), jnp.uint32),
        w_full=plgpu.Barrier(num_arrivals=1, num_barriers=slots),
        x_consumed=plgpu.Barrier(num_arrivals=num_compute_wgs, num_barriers=x_slots),
        w_consumed=plgpu.Barrier(num_arrivals=num_compute_wgs, num_barriers=slots),
        h_smem=plgpu.SMEM((2, bm, bn), jnp.bfloat16),
        row_smem=plgpu.SMEM((3, bm), jnp.float32),
        q_smem=plgpu.SMEM((2, bm, bn // 2), jnp.float8_e4m3fn),
        epilogue_barrier=plgpu.Barrier(num_arrivals=2),
    )

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(
        x_smem,
        xs_smem,
        w_smem,
        rows_landed,
        w_full,
        x_consumed,
        w_consumed,
        **epilogue_scratch,
    ):
        _init_row_barriers(rows_landed)
        wg = jax.lax.axis_index("wg")
        sm = jax.lax.axis_index("sm")
        num_tiles = num_blocks_gmem[0] * n_tiles
        my_tiles = jax.lax.div(jnp.maximum(num_tiles - sm, 0) + num_sms - 1, jnp.int32(num_sms))
        total = my_tiles * steps  # this SM's pipeline steps

        def tile_of(i):
            """(row block, column tile, expert) of this SM's i-th tile (`is_dense` order)."""
            tile = sm + i * num_sms
            first = jax.lax.div(tile, group * n_tiles) * group
            in_group = jax.lax.rem(tile, group * n_tiles)
            block = first + jax.lax.rem(in_group, group)
            column_tile = jax.lax.div(in_group, group)
            expert = block_experts_gmem[jax.lax.div(block, 2) * 2]
            return block, column_tile, expert

        @pl.when(wg == num_compute_wgs)
        def _memory():
            plgpu.set_max_registers(GATHER_REGISTERS, action="decrease")

            @pl.loop(0, my_tiles)
            def _tile(i):
                block, column_tile, expert = tile_of(i)
                sources = sources_gmem.at[pl.ds(block * bm, bm)]

                @pl.loop(0, steps)
                def _step(s):
                    g = i * steps + s
                    x_slot = jax.lax.rem(g, x_slots)
                    w_slot = jax.lax.rem(g, slots)

                    @pl.when(g >= x_slots)
                    def _x_slot_released():
                        plgpu.barrier_wait(x_consumed.at[x_slot])

                    _gather(
                        x_gmem,
                        xs_gmem,
                        sources,
                        x_smem.at[x_slot],
                        xs_smem.at[x_slot],
                        s * per_step,
                    )

                    _arrive_when_own_copies_land(rows_landed.at[x_slot])

                    @pl.when(g >= slots)
                    def _w_slot_released():
                        plgpu.barrier_wait(w_consumed.at[w_slot])

                    plgpu.copy_gmem_to_smem(
                        w_gmem.at[
                            pl.ds(2 * expert, 2),
                            pl.ds(column_tile * bn, bn),
                            pl.ds(s * block_k, block_k),
                        ],
                        w_smem.at[w_slot],
                        w_full.at[w_slot],
                    )

            # the compute warpgroups' last releases, so that no barrier is left mid-phase
            @pl.loop(jnp.maximum(total - x_slots, 0), total)
            def _drain_x(g):
                plgpu.barrier_wait(x_consumed.at[jax.lax.rem(g, x_slots)])

            @pl.loop(jnp.maximum(total - slots, 0), total)
            def _drain_w(g):
                plgpu.barrier_wait(w_consumed.at[jax.lax.rem(g, slots)])

        @pl.when(wg < num_compute_wgs)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

            @pl.loop(0, my_tiles)
            def _tile(i):
                block, column_tile, expert = tile_of(i)
                # gate scale blocks [0, I/128), then up's
                scale_col = wg * (n // SCALE_BLOCK) + jax.lax.div(
                    column_tile * bn, jnp.int32(SCALE_BLOCK)
                )

                def scaled(part, row_scale):
                    return part * jax.lax.broadcast_in_dim(row_scale, (bm, bn), (0,))

                def step(s, acc):
                    g = i * steps + s
                    x_slot = jax.lax.rem(g, x_slots)
                    w_slot = jax.lax.rem(g, slots)
                    _wait_for_rows(rows_landed.at[x_slot], jax.lax.rem(g // x_slots, 2))
                    _fence_rows_for_async_proxy(x_smem.at[x_slot])
                    plgpu.barrier_wait(w_full.at[w_slot])
                    w_chunk = w_smem.at[w_slot, wg]
                    x_chunk = x_smem.at[x_slot]

                    def products(*accs):
                        for h, ref in enumerate(accs):
                            x_half = x_chunk.at[:, pl.ds(h * BLOCK_K, BLOCK_K)]
                            w_half = w_chunk.at[:, pl.ds(h * BLOCK_K, BLOCK_K)]
                            plgpu.wgmma(ref, x_half, w_half.transpose((1, 0)))
                        out = acc
                        for h, ref in enumerate(accs):
                            scale = (
                                xs_smem[x_slot, h] * ws_gmem[expert, scale_col, s * per_step + h]
                            )
                            part = plgpu.wgmma_accumulator_load(ref, wait_n=per_step - 1 - h)
                            out = out + scaled(part, scale)
                        return out

                    acc_type = plgpu.ACC((bm, bn), jnp.float32)
                    out = pl.run_scoped(products, *([acc_type] * per_step))
                    plgpu.barrier_arrive(x_consumed.at[x_slot])
                    plgpu.barrier_arrive(w_consumed.at[w_slot])
                    return out

                acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), jnp.float32))
                store_act_quant(
                    acc,
                    wg,
                    pl.ds(block * bm, bm),
                    column_tile,
                    (q_gmem, scales_gmem),
                    epilogue_scratch,
                    activation,
                    False,
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _gather(x_gmem, xs_gmem, sources, x_slot, xs_slot, first_k_block):
    """This memory-warpgroup thread's cp.async copies of one pipeline step (module docstring).

    A step holds P K blocks (`MosaicFp8GemmConfig.k_blocks_per_step`: 2 wherever K has an even
    number of them, else 1) of the block's 64 rows: 64 P pieces of 128 bytes, each one row's K
    block. Each copy instruction of the warpgroup takes 16 pieces, 8 threads a piece, thread t
    its 16-byte chunk t % 8, so that a warp reads four whole 128-byte lines (one chunk per
    thread and row read each line in halves at twice the traffic). The chunk lands where
    the (8, 128)-tiled, 128-byte-swizzled tile keeps it. Thread t also copies the scale of row
    t % 64 in K block t // 64. Rows whose source is -1 (padding) are left as they are.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    transforms = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))

    @plgpu.inline_mgpu(
        arg_types=(
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(),
            plgpu.RefType(transforms),
            plgpu.RefType(),
            plgpu.Layout.WG_SPLAT,
        ),
    )
    def _copies(ctx, x_ref, xs_ref, sources_ref, x_smem_ref, xs_smem_ref, k_block):
        del ctx
        _emit_row_copies(
            x_ref, xs_ref, sources_ref, x_smem_ref, xs_smem_ref, k_block.registers.item()
        )

    _copies(x_gmem, xs_gmem, sources, x_slot, xs_slot, first_k_block)


def _emit_row_copies(x_ref, xs_ref, sources_ref, x_smem_ref, xs_smem_ref, first_k_block):
    """Mosaic GPU (lane-level) body of `_gather`: the addresses and the cp.asyncs."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, gpu, llvm, memref

    c = mgpu_utils.c
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    k = ir.MemRefType(x_ref.type).shape[1]
    num_k_blocks = ir.MemRefType(xs_ref.type).shape[1]
    per_step, bm = ir.MemRefType(xs_smem_ref.type).shape
    chunks = SWIZZLE // CHUNK  # 8 threads per piece
    pieces_per_copy = THREADS // chunks
    thread = arith.remui(arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)), c(THREADS, i32))
    chunk = arith.remui(thread, c(chunks, i32))
    piece_in_copy = arith.divui(thread, c(chunks, i32))
    x_base = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(x_ref))
    x_smem_base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(x_smem_ref))
    global_ptr = llvm.PointerType.get(1)
    shared_ptr = llvm.PointerType.get(3)

    def source_of(row):
        """(is a token row, token index as i64) of a row of the block."""
        source = memref.load(sources_ref, [arith.index_cast(index, row)])
        is_row = arith.cmpi(arith.CmpIPredicate.sge, source, c(0, i32))
        return is_row, arith.extui(i64, arith.maxsi(source, c(0, i32)))

    for copy in range(bm * per_step // pieces_per_copy):
        # piece p: row p % 64 of K block p // 64 (a copy's 16 pieces share one K block)
        piece = copy * pieces_per_copy
        h, row0 = divmod(piece, bm)
        row = arith.addi(piece_in_copy, c(row0, i32))
        is_row, source = source_of(row)
        k_block = arith.addi(first_k_block, c(h, i32))
        src = arith.addi(
            x_base,
            arith.addi(
                arith.muli(source, c(k, i64)),
                arith.addi(
                    arith.muli(arith.extui(i64, k_block), c(BLOCK_K, i64)),
                    arith.extui(i64, arith.muli(chunk, c(CHUNK, i32))),
                ),
            ),
        )
        # shared: tiles of (8 rows, 128 bytes), row-major over (row tile, K block); the
        # 128-byte swizzle moves 16-byte chunk j of a tile's row i to chunk j ^ i
        in_tile = arith.remui(row, c(8, i32))
        tile = arith.addi(arith.muli(arith.divui(row, c(8, i32)), c(per_step, i32)), c(h, i32))
        dst = arith.addi(
            x_smem_base,
            arith.addi(
                arith.addi(
                    arith.muli(tile, c(TILE_BYTES, i32)), arith.muli(in_tile, c(SWIZZLE, i32))
                ),
                arith.muli(arith.xori(chunk, in_tile), c(CHUNK, i32)),
            ),
        )
        mgpu_utils.inline_ptx(
            f"cp.async.cg.shared.global [$0], [$1], {CHUNK};",
            llvm.inttoptr(shared_ptr, dst),
            llvm.inttoptr(global_ptr, src),
            predicate=is_row,
            has_side_effects=True,
        )
    # the scales: thread t takes row t % 64 of K block t // 64
    row = arith.remui(thread, c(bm, i32))
    h = arith.divui(thread, c(bm, i32))
    is_row, source = source_of(row)
    is_scale = arith.andi(is_row, arith.cmpi(arith.CmpIPredicate.ult, h, c(per_step, i32)))
    xs_src = arith.addi(
        llvm.ptrtoint(i64, mgpu_utils.memref_ptr(xs_ref)),
        arith.muli(
            arith.addi(
                arith.muli(source, c(num_k_blocks, i64)),
                arith.extui(i64, arith.addi(first_k_block, h)),
            ),
            c(4, i64),
        ),
    )
    xs_dst = arith.addi(
        llvm.ptrtoint(i32, mgpu_utils.memref_ptr(xs_smem_ref)),
        arith.muli(arith.addi(arith.muli(h, c(bm, i32)), row), c(4, i32)),
    )
    mgpu_utils.inline_ptx(
        "cp.async.ca.shared.global [$0], [$1], 4;",
        llvm.inttoptr(shared_ptr, xs_dst),
        llvm.inttoptr(global_ptr, xs_src),
        predicate=is_scale,
        has_side_effects=True,
    )


def gathered_act_quant(
    x_tokens: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    row_sources: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    options: FusedGemm1Options,
) -> tuple[jax.Array, jax.Array]:
    """GEMM1, act(gate) * up and its FP8 quantization on the contiguous layout's rows, read
    from the tokens (module docstring): `mosaic_fp8_gemm_act_quant_contiguous` of the rows
    `x_tokens[row_sources]`, without them.

    Args:
      x_tokens: float8_e4m3fn [T, H] the tokens.
      w1: float8_e4m3fn [E, 2I, H]: gate rows, then up rows; I a multiple of 128.
      expert_ids: int32[M] expert of each row of the layout, -1 on padding rows.
      row_sources: int[M] the token of each row, -1 on padding rows
        (`moe_jax.layouts.RoutingMetadata.source`).
      x_scales: float32[T, H/128] the tokens' row-group scales.
      w1_scales: float32[E, 2I/128, H/128] block scales.
      options: as `mosaic_fp8_gemm_act_quant_contiguous` takes them, with `alignment` a multiple
        of 128 (whole pairs of row blocks) and a `config` of groups of at most 2 blocks; with
        `interpret` it runs `gathered_act_quant_reference` (this kernel has no interpret mode).

    Returns:
      (q float8_e4m3fn[M, I], scales float32[M, I/128]), the scales written as [I/128, M] in
      memory; padding rows unspecified.
    """
    from moe_jax.kernels import mosaic_fp8_gemm

    _check_gathered(x_tokens, expert_ids, row_sources, x_scales, options.alignment)
    num_rows = row_sources.shape[0]
    rows_type = jax.ShapeDtypeStruct((num_rows, x_tokens.shape[1]), x_tokens.dtype)
    scales_type = jax.ShapeDtypeStruct((num_rows, x_scales.shape[1]), x_scales.dtype)
    config = mosaic_fp8_gemm.check_act_quant_operands(
        rows_type, w1, expert_ids, scales_type, w1_scales, options
    )
    if config.group_blocks > 2:
        raise ValueError(
            f"{config}: the gathered kernel takes the in-kernel tile order (groups of 1 or 2)"
        )
    num_experts, two_i, k = w1.shape
    inter = two_i // 2
    if options.interpret or min(num_rows, inter, k, x_tokens.shape[0]) == 0:
        # interpret mode runs no inline PTX; with nothing to gather or sum, no kernel is needed
        options = dataclasses.replace(options, config=config)
        return gathered_act_quant_reference(
            x_tokens,
            w1,
            expert_ids,
            row_sources,
            x_scales=x_scales,
            w1_scales=w1_scales,
            options=options,
        )
    q, scales_t = launch_gathered(
        x_tokens,
        x_scales,
        row_sources,
        w1.reshape(2 * num_experts, inter, k),  # gate and up halves: one TMA box takes both
        expert_ids,
        w1_scales,
        n=inter,
        config=config,
        num_sms=options.num_sms,
        activation=options.activation,
    )
    return q[:num_rows], scales_t[:, :num_rows].T


def gathered_act_quant_reference(
    x_tokens: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    row_sources: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    options: FusedGemm1Options,
) -> tuple[jax.Array, jax.Array]:
    """`gathered_act_quant` (same arguments) as XLA's gather of the rows
    (`moe_jax.fused_gemm1.gather_rows`) followed by `mosaic_fp8_gemm_act_quant_contiguous`
    (in interpret mode with `options.interpret`), which returns without a kernel where there is
    nothing to compute."""
    from moe_jax.kernels import mosaic_fp8_gemm

    rows, row_scales = gather_rows(x_tokens, x_scales, row_sources)
    return mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_contiguous(
        rows, w1, expert_ids, x_scales=row_scales, w1_scales=w1_scales, options=options
    )


def _check_gathered(x_tokens, expert_ids, row_sources, x_scales, alignment) -> None:
    """The gathered operands' own rules, naming the argument at fault."""
    if x_tokens.ndim != 2:
        raise ValueError(f"{x_tokens.shape=}: need x_tokens [T, H]")
    if row_sources.shape != expert_ids.shape or not jnp.issubdtype(row_sources.dtype, jnp.integer):
        raise ValueError(
            f"{row_sources.shape=} {row_sources.dtype=} but int[M] with {expert_ids.shape=} is "
            "needed (the token of each row of the layout)"
        )
    if x_scales.shape != (x_tokens.shape[0], -(-x_tokens.shape[1] // SCALE_BLOCK)):
        raise ValueError(f"{x_scales.shape=} but [T, ceil(H/128)] is needed for {x_tokens.shape=}")
    if alignment % (2 * BLOCK_M):
        raise ValueError(
            f"{alignment=}: the gathered kernel needs segments of whole {2 * BLOCK_M}-row pairs"
        )


def _init_row_barriers(barriers_ref) -> None:
    """Thread 0 makes each 8-byte row of `barriers_ref` (uint32 [slots, 2] in shared memory) an
    mbarrier that completes after 128 arrivals, then the whole program syncs (every thread of the
    program must call this, before any of them uses the barriers)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _init(ctx, ref):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, gpu, llvm

        del ctx
        i32 = ir.IntegerType.get_signless(32)
        base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(ref))
        is_first = arith.cmpi(
            arith.CmpIPredicate.eq,
            arith.index_cast(i32, gpu.thread_id(gpu.Dimension.x)),
            mgpu_utils.c(0, i32),
        )
        for slot in range(ir.MemRefType(ref.type).shape[0]):
            address = arith.addi(base, mgpu_utils.c(8 * slot, i32))
            mgpu_utils.inline_ptx(
                f"mbarrier.init.shared::cta.b64 [$0], {THREADS};",
                address,
                predicate=is_first,
                has_side_effects=True,
            )
        mgpu_utils.inline_ptx("bar.sync 0;", has_side_effects=True, convergent=True)

    _init(barriers_ref)


def _wait_for_rows(barrier_ref, parity) -> None:
    """Waits until the mbarrier `barrier_ref` (uint32 [2] in shared memory) completes its phase
    of parity `parity` (int32, 0 or 1)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
    def _wait(ctx, ref, phase):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        del ctx
        i32 = ir.IntegerType.get_signless(32)
        mgpu_utils.inline_ptx(
            "{\n.reg .pred landed;\nwait_for_rows:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 landed, [$0], $1;\n"
            "@!landed bra wait_for_rows;\n}",
            llvm.ptrtoint(i32, mgpu_utils.memref_ptr(ref)),
            phase.registers.item(),
            has_side_effects=True,
        )

    _wait(barrier_ref, parity)


def _arrive_when_own_copies_land(barrier_ref) -> None:
    """This thread's arrival on `barrier_ref` (one of the 128 a warpgroup barrier counts), made
    by the hardware once every cp.async this thread issued so far has landed
    (`cp.async.mbarrier.arrive.noinc`): the thread goes on without waiting."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _arrive(ctx, barrier):
        from jax.experimental.mosaic.gpu import utils as mgpu_utils
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm

        del ctx
        mgpu_utils.inline_ptx(
            "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];",
            llvm.ptrtoint(ir.IntegerType.get_signless(32), mgpu_utils.memref_ptr(barrier)),
            has_side_effects=True,
        )

    _arrive(barrier_ref)


def _fence_rows_for_async_proxy(smem_ref) -> None:
    """A proxy fence after the wait for a row slot: the cp.async copies wrote it through the
    generic proxy, the wgmma reads it through the async one. `smem_ref` only anchors the op:
    an `inline_mgpu` block without operands was dropped from the kernel (the earlier wait for
    the copies: the wgmma then raced them), so every block here takes a ref."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    transforms = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),))
    def _fence(ctx, ref):
        from jaxlib.mlir.dialects import nvvm

        del ctx, ref
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    _fence(smem_ref)
