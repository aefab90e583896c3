"""The Mosaic GPU FP8 grouped GEMM's kernel: `launch` runs it, `kernels.mosaic_fp8_gemm` fronts it.

One Pallas Mosaic GPU kernel (Hopper only) computes `y[r] = x[r] @ w[expert_ids[r]].T` on the
contiguous layout with vLLM's 128x128 block scales, built the way DeepGEMM's is:

- persistent: one program per SM walks the output tiles of the valid row blocks (padding blocks
  are never visited), columns first, so the N tiles of a row block run on neighbouring SMs at
  once and share its x rows through L2;
- warp-specialised: a memory warpgroup issues TMA copies of the x tile [64, 128], its scales and
  the weight tile [tile_n, 128] `max_concurrent_steps` K blocks ahead, while one or two compute
  warpgroups each take `block_n` columns of the tile and run Hopper's FP8 wgmma on them;
- block-scaled as DeepGEMM and vLLM: the wgmma sums one 128-wide K block in its accumulator's
  own precision, then float32 takes over with that block's scales:

    for each of this SM's tiles (row block i of expert e, columns j*tile_n ...):
        acc[64, block_n] = 0                      float32 registers, per compute warpgroup
        for kb in range(K / 128):                 TMA: x, x scale and w[e] tiles, ahead
            part = wgmma(x_tile, w_tile.T)        one K block
            acc += part * (x_scale[rows, kb] * w_scale[e, cols // 128, kb])
        y[rows, cols] = bf16(acc)                 shared memory, then TMA

- grouped (`group_blocks`): an expert's row blocks in groups of `group_blocks` take each
  column tile one after the other, so the programs reading one weight tile run on neighbouring
  SMs at the same time and all but the first can find it in L2;
- chained (`is_chained`): consecutive tiles' pipelines run as one, so the memory warpgroup goes
  on into the next tile's K blocks while the compute warpgroups finish a tile; it needs a tile's
  pipeline steps to be a multiple of `max_concurrent_steps` (else the tiles run one pipeline
  each);
- overlapped (`is_overlapped`, the heuristic's choice where K has an even number of blocks):
  each pipeline step carries two K blocks and a compute warpgroup puts both wgmmas in flight
  (two accumulators) before it scales the first, so the scaling of one block runs beside the
  next block's wgmma instead of after it.

With `activation`, each tile is 128 gate and the same 128 up columns of GEMM1 (one per compute
warpgroup) and its epilogue, `kernels.mosaic_fp8_epilogue.store_act_quant`, writes act(gate) * up
quantized to FP8 instead of the bf16 output.

Interpret mode (`interpret=True`, CPU tests) runs all of this on Mosaic GPU's interpreter except
the wgmma itself, which its interpreter cannot take from a transposed shared-memory view: the same
FP8 products come from `dot_general` with an exact float32 sum (`_block_product`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moe_jax import layouts
from moe_jax.kernels import mosaic_fp8_tiles
from moe_jax.kernels.mosaic_fp8_config import (
    BLOCK_K,
    BLOCK_M,
    SCALE_BLOCK,
    SWIZZLE,
    MosaicFp8GemmConfig,
)
from moe_jax.kernels.mosaic_fp8_epilogue import store_act_quant

MEMORY_REGISTERS = 40  # registers per thread left to the TMA warpgroup (Mosaic GPU's H100 value)
INTERPRET_SMS = 3  # persistent programs in interpret mode: several tiles per program


def launch(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    x_scales: jax.Array,
    w_scales: jax.Array,
    *,
    n: int,
    n_tiles: int,
    out_types: tuple[jax.ShapeDtypeStruct, ...],
    out_dtype: jnp.dtype,
    config: MosaicFp8GemmConfig,
    num_sms: int | None,
    interpret: bool,
    activation: str | None,
    is_dense: bool = False,
) -> tuple[jax.Array, ...]:
    """Pads the rows to whole 64-row blocks, builds the tile order (`kernels.mosaic_fp8_tiles`:
    with `is_dense`, for groups of at most 2 blocks, the count of the valid pairs' row blocks;
    else the tile table) and runs `_kernel`. The fronts in `kernels.mosaic_fp8_gemm` check the
    operands first.

    Args:
      x: float8_e4m3fn [M, K] rows of the contiguous layout.
      w: float8_e4m3fn [E, N, K]; with `activation`, GEMM1's [E, 2I, K] seen as [2E, I, K].
      expert_ids: int [M] expert of each row (ids outside [0, E) on padding rows).
      x_scales: float32 [M, K/128]; w_scales: float32 [E, N/128, K/128] (GEMM1's [E, 2I/128,
        K/128] with `activation`).
      n: output columns (I with `activation`); n_tiles: column tiles.
      out_types: the kernel's outputs at the padded row count: (y [M', N],) or, with
        `activation`, (q float8_e4m3fn [M', I], scales float32 [I/128, M']).
      out_dtype: y's dtype (GEMM1's bf16 with `activation`).
      config, num_sms, interpret, activation: as the fronts take them (`num_sms` None: the
        device's SM count, `INTERPRET_SMS` in interpret mode).
      is_dense: the layout's segments are whole 128-row pairs; the kernel orders its tiles.

    Returns:
      The kernel's outputs, rows padded as `mosaic_fp8_tiles.padded_rows` pads them.
    """
    num_rows, k = x.shape
    num_experts = w_scales.shape[0]
    padded_rows = mosaic_fp8_tiles.padded_rows(num_rows, is_dense=is_dense)
    if padded_rows != num_rows:
        extra = padded_rows - num_rows
        x = jnp.pad(x, ((0, extra), (0, 0)))
        expert_ids = jnp.pad(expert_ids, (0, extra), constant_values=-1)
    block_experts = layouts.ids_as_int32(expert_ids)[::BLOCK_M]
    if is_dense:
        if config.group_blocks > 2:
            raise ValueError(f"{config}: the in-kernel tile order takes groups of 1 or 2 blocks")
        pair_experts = block_experts[::2]
        is_valid = (pair_experts >= 0) & (pair_experts < num_experts)
        tiles = (2 * jnp.sum(is_valid, dtype=jnp.int32)).reshape(1)
    else:
        tiles = mosaic_fp8_tiles.tile_table(
            block_experts, num_experts, n_tiles, config.group_blocks
        )
    if num_sms is None:
        num_sms = INTERPRET_SMS if interpret else jax.local_devices()[0].core_count
    from jax.experimental.pallas import mosaic_gpu as plgpu

    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            num_experts=num_experts,
            n=n,
            k=k,
            num_sms=num_sms,
            out_dtype=out_dtype,
            config=config,
            interpret=interpret,
            activation=activation,
            is_dense=is_dense,
        ),
        out_type=out_types,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else None,
    )
    # [K/128, M]: a row block's scales contiguous. The permute and act*up + quantize kernels
    # write the scales this way, so XLA cancels the transpose against theirs.
    x_scales_t = x_scales.astype(jnp.float32).T
    if padded_rows != num_rows:
        x_scales_t = jnp.pad(x_scales_t, ((0, 0), (0, padded_rows - num_rows)))
    return kernel(block_experts, tiles, x, x_scales_t, w, w_scales.astype(jnp.float32))


def _kernel(
    # inputs
    block_experts_gmem,
    tiles_gmem,
    x_gmem,
    xs_gmem,
    w_gmem,
    ws_gmem,
    # outputs: y [M, N]; with `activation`, q [M, I] and its scales [I/128, M]
    *outputs,
    num_experts: int,
    n: int,
    k: int,
    num_sms: int,
    out_dtype: jnp.dtype,
    config: MosaicFp8GemmConfig,
    interpret: bool,
    activation: str | None = None,
    is_dense: bool = False,
):
    """One persistent program: this SM's tiles of the valid row blocks (module docstring).

    With `is_dense` (a contiguous layout of 128-row segments: the valid 128-row pairs of blocks
    come first, and each pair's first block is its expert's; groups of G = `group_blocks` <= 2
    blocks), tiles_gmem is int32[1], the number of row blocks in the valid pairs, and tile t is
    column tile (t mod G n_tiles) // G of block G (t // G n_tiles) + t mod G, with its pair's
    expert: `mosaic_fp8_tiles.tile_table`'s order without building the table. A pair's second
    block may be all padding; it is computed anyway (padding rows are unspecified).

    With `activation`, w_gmem is GEMM1's weight seen as [2E, I, K] (expert e's gate rows at 2e,
    its up rows at 2e + 1) and each tile is 128 gate and the same 128 up columns: compute
    warpgroup 0 takes the gate, 1 the up columns, and the tile's epilogue (`store_act_quant`)
    writes act(gate) * up quantized to FP8 instead of the two bf16 halves."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn, tile_n = BLOCK_M, config.block_n, config.tile_n
    k_steps = k // BLOCK_K
    is_gated = activation is not None
    # gated: column tile j is gate rows [j*bn, (j+1)*bn) and the same rows of up, n = I
    n_tiles = n // bn if is_gated else n // tile_n
    steps = config.max_concurrent_steps
    per_step = config.k_blocks_per_step(k)
    is_overlapped = per_step == 2
    is_chained = config.is_chained and (k_steps // per_step) % steps == 0
    transforms = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))

    def make_pipeline(step, compute_context, state=None):
        block_k = per_step * BLOCK_K
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps // per_step,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, block_k), lambda s: (0, s), transforms=transforms),
                plgpu.BlockSpec((per_step, bm), lambda s: (s, 0)),
                (
                    plgpu.BlockSpec((2, bn, block_k), lambda s: (0, 0, s), transforms=transforms)
                    if is_gated
                    else plgpu.BlockSpec((tile_n, block_k), lambda s: (0, s), transforms=transforms)
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=config.num_compute_wgs,
            max_concurrent_steps=steps,
            compute_context=compute_context,
            pipeline_state=state,
        )

    def ignore(*args, **kwargs):
        del args, kwargs

    def weight_tile(expert, column_tile):
        """The weight rows of one tile in global memory: [tile_n, K], or [2, bn, K] gated."""
        if is_gated:
            # [2E, I, K]: the expert's gate and up halves as one slice of the leading axis (an
            # integer index there would take the TMA past its 5 strided dimensions)
            return w_gmem.at[pl.ds(2 * expert, 2), pl.ds(column_tile * bn, bn)]
        return w_gmem.at[expert, pl.ds(column_tile * tile_n, tile_n)]

    def weight_rows(w_smem, wg):
        """This compute warpgroup's bn weight rows of a pipeline slot."""
        return w_smem.at[wg] if is_gated else w_smem.at[pl.ds(wg * bn, bn)]

    allocations = make_pipeline(ignore, ignore).get_allocations(
        x_gmem.at[pl.ds(0, bm)], xs_gmem.at[:, pl.ds(0, bm)], weight_tile(0, 0)
    )
    if is_gated:
        scratch = dict(
            h_smem=plgpu.SMEM((2, bm, bn), jnp.bfloat16),  # the tile's gate and up halves
            # [0], [1]: each warpgroup's row maxima; [2]: the tile's scales
            row_smem=plgpu.SMEM((3, bm), jnp.float32),
            q_smem=plgpu.SMEM((2, bm, bn // 2), outputs[0].dtype),
            # completes twice per tile: both halves stored, both row maxima stored
            epilogue_barrier=plgpu.Barrier(num_arrivals=2),
        )
    else:
        scratch = dict(out_smem=plgpu.SMEM((config.num_compute_wgs, bm, bn), out_dtype))

    @functools.partial(pl.run_scoped, allocations=allocations, **scratch, collective_axes="wg")
    def _scope(allocations, **scratch):
        wg = jax.lax.axis_index("wg")

        def run_tile(tile, state=None):
            """The K pipeline of one output tile (entry `tile` of `mosaic_fp8_tiles.tile_table`)."""
            if is_dense:
                group = config.group_blocks
                first = jax.lax.div(tile, group * n_tiles) * group
                in_group = jax.lax.rem(tile, group * n_tiles)
                block = first + jax.lax.rem(in_group, group)
                column_tile = jax.lax.div(in_group, group)
                expert = block_experts_gmem[jax.lax.div(block, 2) * 2]
            else:
                code = tiles_gmem[tile]
                block = jax.lax.div(code, jnp.int32(n_tiles))
                expert = block_experts_gmem[block]
                column_tile = jax.lax.rem(code, jnp.int32(n_tiles))
            if is_gated:  # gate scale blocks [0, I/128), then up's
                wg_col0 = column_tile * bn  # this tile's first output (gate / up) column
                scale_col = wg * (n // SCALE_BLOCK) + jax.lax.div(wg_col0, jnp.int32(SCALE_BLOCK))
            else:
                wg_col0 = column_tile * tile_n + wg * bn  # this warpgroup's first output column
                scale_col = jax.lax.div(wg_col0, jnp.int32(SCALE_BLOCK))

            def scaled(part, row_scale):
                return part * jax.lax.broadcast_in_dim(row_scale, (bm, bn), (0,))

            def step(indices, x_smem, xs_smem, w_smem, acc):
                (kb,) = indices
                w_scale = ws_gmem[expert, scale_col, kb]
                part = _block_product(x_smem, weight_rows(w_smem, wg), interpret)
                return acc + scaled(part, xs_smem[0] * w_scale)

            def overlapped_step(indices, x_smem, xs_smem, w_smem, acc):
                """K blocks 2s and 2s + 1: both wgmmas in flight, the first scaled while the
                second runs."""
                (s,) = indices
                w_chunk = weight_rows(w_smem, wg)
                halves = [
                    (
                        x_smem.at[:, pl.ds(h * BLOCK_K, BLOCK_K)],
                        w_chunk.at[:, pl.ds(h * BLOCK_K, BLOCK_K)],
                    )
                    for h in range(2)
                ]
                scales = [xs_smem[h] * ws_gmem[expert, scale_col, 2 * s + h] for h in range(2)]
                if interpret:  # no asynchronous wgmma: the same sums in the same order
                    for h in range(2):
                        acc = acc + scaled(_block_product(*halves[h], interpret), scales[h])
                    return acc

                def products(first, second):
                    for ref, (x_half, w_half) in zip((first, second), halves, strict=True):
                        plgpu.wgmma(ref, x_half, w_half.transpose((1, 0)))
                    out = acc + scaled(plgpu.wgmma_accumulator_load(first, wait_n=1), scales[0])
                    return out + scaled(plgpu.wgmma_accumulator_load(second, wait_n=0), scales[1])

                acc_type = plgpu.ACC((bm, bn), jnp.float32)
                return pl.run_scoped(products, acc_type, acc_type)

            def compute_context(eval_pipeline):
                acc = eval_pipeline(jnp.zeros((bm, bn), jnp.float32))
                rows = pl.ds(block * bm, bm)
                if is_gated:
                    store_act_quant(
                        acc, wg, rows, column_tile, outputs, scratch, activation, interpret
                    )
                    return
                out_smem = scratch["out_smem"]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copy
                out_smem[wg] = acc.astype(out_dtype)
                plgpu.commit_smem()
                (out_gmem,) = outputs
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, pl.ds(wg_col0, bn)])

            make_pipeline(overlapped_step if is_overlapped else step, compute_context, state)(
                x_gmem.at[pl.ds(block * bm, bm)],
                xs_gmem.at[:, pl.ds(block * bm, bm)],
                weight_tile(expert, column_tile),
                allocations=allocations,
            )

        # This SM's tiles: sm, sm + num_sms, ... below the valid tiles' count.
        sm = jax.lax.axis_index("sm")
        # the last entry counts tiles, or with `is_dense` row blocks (the only entry)
        num_tiles = tiles_gmem[tiles_gmem.shape[0] - 1]
        if is_dense:
            num_tiles = num_tiles * n_tiles
        my_tiles = jax.lax.div(jnp.maximum(num_tiles - sm, 0) + num_sms - 1, jnp.int32(num_sms))
        if not is_chained:

            @pl.loop(0, my_tiles)
            def _each(i):
                run_tile(sm + i * num_sms)

            return

        @pl.when(my_tiles == 1)
        def _single():
            run_tile(sm)

        @pl.when(my_tiles > 1)
        def _chain():
            run_tile(sm, plgpu.PipelinePipeline.START)

            @pl.loop(1, my_tiles - 1)
            def _steady(i):
                run_tile(sm + i * num_sms, plgpu.PipelinePipeline.STEADY)

            run_tile(sm + (my_tiles - 1) * num_sms, plgpu.PipelinePipeline.STOP)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _block_product(x_smem, w_smem, interpret: bool) -> jax.Array:
    """float32 x_tile [64, 128] @ w_tile [block_n, 128].T of one K block: Hopper's FP8 wgmma
    (`dot_general` in interpret mode, see the module docstring)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpret:
        contract = (((1,), (1,)), ((), ()))
        return jax.lax.dot_general(
            x_smem[...], w_smem[...], contract, preferred_element_type=jnp.float32
        )

    def product(acc_ref):
        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((x_smem.shape[0], w_smem.shape[0]), jnp.float32))


def _interpret_params():
    """Mosaic GPU's interpret mode (shared memory, TMA and barriers simulated on the CPU)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params
    except ImportError as error:  # pragma: no cover - depends on the jax version
        raise NotImplementedError(
            f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode: run on a Hopper GPU"
        ) from error
    return params.InterpretGPUParams()
