"""GEMM backend "mosaic_fp8": a Mosaic GPU FP8 grouped GEMM with vLLM's 128x128 block scales.

Computes `y[r] = x[r] @ w[expert_ids[r]].T` on the contiguous layout (`moe_jax.layouts`) with
64-row segments, the contract of `kernels.grouped_gemm.grouped_gemm_contiguous` for FP8. Where
the Pallas Triton kernel launches one program per tile and loads with plain (cp.async) copies,
this one is built the way DeepGEMM's is, with Pallas' Mosaic GPU backend (Hopper only):

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
  SMs at the same time and all but the first can find it in L2 (with groups of one, a block's
  column tiles run in a row and the expert's next block reads the same weight tiles n_tiles
  tiles later, by then likely from HBM again: GEMM1 at T=2048 timed as if it did);
- chained (`is_chained`): consecutive tiles' pipelines run as one, so the memory warpgroup goes
  on into the next tile's K blocks while the compute warpgroups finish a tile; it needs a tile's
  pipeline steps to be a multiple of `max_concurrent_steps` (else the tiles run one pipeline
  each);
- overlapped (`is_overlapped`, the heuristic's choice where K has an even number of blocks):
  each pipeline step carries two K blocks and a compute warpgroup puts both wgmmas in flight
  (two accumulators) before it scales the first, so the scaling of one block runs beside the
  next block's wgmma instead of after it.
  On the H200 the kernel's time did not follow its loaded bytes (128-row tiles that load 40% fewer
  bytes per product but run two wgmma-wait-scale chains per warpgroup per K block took twice as
  long; BENCHMARKS.md, 2026-12-03 13:42-16:42 UTC): this targets that chain, and takes 1-6%
  off each GEMM at T=1024-4096 (DeepSeek-V3 experts; `heuristic_config`'s evidence).

`mosaic_fp8_gemm_act_quant_contiguous` is GEMM1 with vLLM's act(gate) * up and the FP8
requantization for GEMM2 in the epilogue: a tile is 128 gate and the same 128 up columns (one
per compute warpgroup), and only FP8 codes and their scales leave the chip (`_store_act_quant`).

Interpret mode (`interpret=True`, CPU tests) runs all of this on Mosaic GPU's interpreter except
the wgmma itself, which its interpreter cannot take from a transposed shared-memory view: the same
FP8 products come from `dot_general` with an exact float32 sum (`_block_product`).
Padding rows of the output are unspecified, as the `GroupedGemm` contract allows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.activation import check_activation, gated_activation, round_to_dtype
from moe_jax.kernels import grouped_gemm as gemm_kernels
from moe_jax.kernels.act_quant import COMPILED_ACTIVATIONS, KERNEL_ACTIVATIONS
from moe_jax.routing import require_int

SCALE_BLOCK = gemm_kernels.SCALE_BLOCK  # one scale per 128 K columns of x, 128x128 of w
BLOCK_K = 128  # K columns per pipeline step: one scale block, 128 FP8 bytes (one swizzle row)
BLOCK_M = 64  # rows per tile: one warpgroup's wgmma; the layout's segments are multiples of it
SWIZZLE = 128  # shared-memory swizzle in bytes of the FP8 tiles (one K block row)
MEMORY_REGISTERS = 40  # registers per thread left to the TMA warpgroup (Mosaic GPU's H100 value)
INTERPRET_SMS = 3  # persistent programs in interpret mode: several tiles per program
HOPPER = "9.0"  # the compute capability with wgmma (sm_90)
SMEM_LIMIT = 227 * 1024  # shared memory one Hopper program may ask for (opt-in maximum)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicFp8GemmConfig:
    """Tiles of the Mosaic GPU FP8 grouped GEMM.

    Attributes:
      block_n: output columns per compute warpgroup (64 or 128: within one weight-scale block).
      num_compute_wgs: compute warpgroups per program (1 or 2), each taking `block_n` columns
        of a tile `tile_n` = num_compute_wgs * block_n columns wide by 64 rows.
      group_blocks: order the tiles so that an expert's row blocks in groups of this many (a
        power of two) take each column tile one after the other; 1: a block's column tiles run
        in a row.
      max_concurrent_steps: pipeline steps whose TMA copies may be in flight (slots of one K
        block each, two when overlapped).
      is_chained: run consecutive tiles' pipelines as one (when a tile's steps, K / 128 or
        K / 256 when overlapped, are a multiple of max_concurrent_steps; else each tile runs
        its own).
      is_overlapped: each compute warpgroup puts the wgmmas of two K blocks in flight and
        scales the first block's products into its sum while the second runs, instead of
        waiting for each wgmma before scaling it. The pipeline then moves two K blocks per step
        (`max_concurrent_steps` counts those steps); K must be a multiple of 256 (else the tiles
        run one block per step).
      skips_padding_blocks: on 128-row segments in groups of at most 2 (the tile order the
        kernel computes itself, `_kernel`'s `is_dense`), take the tiles from a list of the
        valid row blocks (`_valid_blocks`, one XLA nonzero), so that a pair's all-padding
        second block (its expert's rows end in the first; about 5.6% of the blocks at shape
        B) is not computed; False computes every block of a valid pair and builds no list.
        Elsewhere the tile table skips padding blocks anyway. Not timed on a GPU yet (a list
        that also moved the single blocks to the end was 12 us slower per forward at B:
        BENCHMARKS.md, "Prefill", 2026-12-05).
    N must be a multiple of `tile_n`.
    """

    block_n: int = 128
    num_compute_wgs: int = 2
    group_blocks: int = 1
    max_concurrent_steps: int = 3
    is_chained: bool = False
    is_overlapped: bool = False
    skips_padding_blocks: bool = False

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise ValueError(f"MosaicFp8GemmConfig.block_n={self.block_n} but 64 or 128 is needed")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(
                f"MosaicFp8GemmConfig.num_compute_wgs={self.num_compute_wgs} but 1 or 2 is needed"
            )
        if self.group_blocks < 1 or self.group_blocks & (self.group_blocks - 1):
            raise ValueError(
                f"MosaicFp8GemmConfig.group_blocks={self.group_blocks} but a power of two is needed"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(
                f"MosaicFp8GemmConfig.max_concurrent_steps={self.max_concurrent_steps} but >= 1 "
                "is needed"
            )

    def k_blocks_per_step(self, k: int) -> int:
        """128-wide K blocks per pipeline step for K = `k`: 2 when overlapped and K holds an
        even number of blocks, else 1."""
        return 2 if self.is_overlapped and (k // BLOCK_K) % 2 == 0 else 1

    @property
    def tile_n(self) -> int:
        """Output columns per tile."""
        return self.num_compute_wgs * self.block_n

    def smem_bytes(self, out_dtype: jnp.dtype, k: int, *, is_gated: bool = False) -> int:
        """Shared memory one program asks for at K = `k`: the pipeline's slots (x, its scales
        and the weight tile per K block) and every compute warpgroup's output staging (with
        `is_gated`, the fused act + quantization epilogue's: the tile's bf16 gate and up, three
        rows of float32 and the FP8 codes)."""
        blocks = self.k_blocks_per_step(k)
        slot = blocks * (BLOCK_M * BLOCK_K + 4 * BLOCK_M + self.tile_n * BLOCK_K)
        if is_gated:
            staging = BLOCK_M * self.tile_n * 2 + 3 * BLOCK_M * 4 + BLOCK_M * self.tile_n // 2
        else:
            staging = BLOCK_M * self.tile_n * jnp.dtype(out_dtype).itemsize
        return self.max_concurrent_steps * slot + staging


# Evidence for `heuristic_config` (H200, 2026-12-03, BENCHMARKS.md "Mosaic GPU FP8 grouped GEMM",
# DeepSeek-V3 experts, us): with about two row blocks per expert (T=2048: 32512 layout rows for
# 256 experts) grouping an expert's blocks in pairs takes GEMM1 from 2350 to 2004 (4 slots) and
# GEMM2 from 1173 to 1079, the layer from 3659 to 3303; at T=4096 the layer from 5629 to 4665; at
# about 1.5 blocks per expert (T=1024, 24320 rows) pairs are slower (GEMM2 1073 against 1007).
# Overlapped steps (two K blocks, both wgmmas in flight), 2026-12-03 16:12-19:12 UTC session,
# `gemm_sweep --candidates mosaic` (GEMM1 / GEMM2, overlapped with 2 steps against the previous
# heuristic's 3 or 4 slots): T=1024 1905 / 1022 against 1986 / 1037 (one by one); T=2048,
# chained, 1946 / 1035 against 1960 / 1050 (pairs); T=4096, chained, 2887 / 1444 against
# 2936 / 1532 (pairs). The layer in one call (`fused_moe` with each config, two rounds, us):
# T=768 2987 / 3012 against 3124 / 3658, T=1024 3018 / 3027 against 3140 / 3707, T=1536
# 3039 / 3052 against 3178 / 3591, T=2048 (chained) 3278 / 3336 against 3430 / 3504, T=4096
# (chained) 4859 / 5386 against 4967 / 5047 (this T's rounds scatter by 10%).
# Groups of 4, same session, a later call: at T=4096 (48896 rows, about 3 blocks per expert)
# overlapped and chained in groups of 4 GEMM1 2643 / GEMM2 1360 against 2805 / 1398 in pairs
# (one block per step: groups of 4 2656 / 1447 against pairs 2733 / 1475); the layer 4644 / 5084
# against 4748 / 4848 (two rounds), and at T=6144 6066 / 6053 against 6247 / 6787 (DeepGEMM
# 6419 / 6630). At T=2048 (about 2 blocks per expert) pairs stay best.
GROUPED_FROM_BLOCKS_PER_EXPERT = 1.5  # layout rows / (64 * E) above which blocks go in pairs
GROUPS_OF_4_FROM_BLOCKS_PER_EXPERT = 2.5  # ... above which they go in groups of 4


def heuristic_config(*, num_rows: int, num_experts: int, k: int) -> MosaicFp8GemmConfig:
    """The config for a layout of `num_rows` rows over `num_experts` experts and K = `k`: two
    compute warpgroups of 128 columns; an expert's row blocks one by one, in pairs above
    `GROUPED_FROM_BLOCKS_PER_EXPERT` row blocks per expert on average and in groups of 4 above
    `GROUPS_OF_4_FROM_BLOCKS_PER_EXPERT`, the grouped tiles' pipelines chained. Where K holds an
    even number of 128-wide blocks, overlapped steps of two blocks with 2 pipeline slots; else
    one block per step with 3 slots (4 when grouped)."""
    blocks_per_expert = num_rows / (BLOCK_M * max(num_experts, 1))
    group = 1
    if blocks_per_expert > GROUPED_FROM_BLOCKS_PER_EXPERT:
        group = 4 if blocks_per_expert > GROUPS_OF_4_FROM_BLOCKS_PER_EXPERT else 2
    overlapped = MosaicFp8GemmConfig(
        group_blocks=group, max_concurrent_steps=2, is_chained=group > 1, is_overlapped=True
    )
    if overlapped.k_blocks_per_step(k) == 2:
        return overlapped
    if group > 1:
        return MosaicFp8GemmConfig(group_blocks=group, max_concurrent_steps=4)
    return MosaicFp8GemmConfig()


def act_quant_heuristic_config(
    *, num_rows: int, num_experts: int, k: int, alignment: int
) -> MosaicFp8GemmConfig:
    """The config `mosaic_fp8_gemm_act_quant_contiguous` takes without one: `heuristic_config`'s,
    its groups of 4 made pairs on segments of whole pairs (128 rows), where the kernel orders
    the tiles itself."""
    config = heuristic_config(num_rows=num_rows, num_experts=num_experts, k=k)
    if alignment % (2 * BLOCK_M) == 0 and config.group_blocks > 2:
        # H200, 2026-12-04, shape B: ordered in the kernel, groups of 4 that may span two
        # experts took 451.6 us and padding the rows to 256 copied x; pairs 444.5 us
        config = dataclasses.replace(config, group_blocks=2)
    return config


def mosaic_fp8_gemm_contiguous(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array,
    w_scales: jax.Array,
    alignment: int,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: MosaicFp8GemmConfig | None = None,
    num_sms: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """FP8 grouped GEMM on the contiguous layout: y[r] = x[r] @ w[expert_ids[r]].T.

    Args:
      x: float8_e4m3fn [M, K], rows sorted by expert in segments padded to `alignment` rows.
      w: float8_e4m3fn [E, N, K].
      expert_ids: int32[M] expert of each row, -1 on padding rows (ids outside [0, E) too).
      x_scales: float32[M, K/128] row-group scales.
      w_scales: float32[E, N/128, K/128] block scales.
      alignment: the segments' row multiple, a multiple of 64 (`BLOCK_M`).
      out_dtype: output dtype (bf16 on the FP8 path, or f16/float32).
      config: tiles and order; None takes `heuristic_config`'s.
      num_sms: persistent programs; None: the first local device's SM count (`INTERPRET_SMS`
        in interpret mode).
      interpret: run in Mosaic GPU's interpret mode (CPU tests).

    Returns:
      [M, N] in `out_dtype`; padding rows are unspecified.
    """
    grouped_gemm.check_contiguous_operands(x, w, expert_ids, x_scales, w_scales)  # ranks first
    if config is None:
        config = heuristic_config(num_rows=x.shape[0], num_experts=w.shape[0], k=x.shape[1])
    _check_operands(
        x, w, expert_ids, x_scales, w_scales, alignment, config, out_dtype, num_sms=num_sms
    )
    num_rows, n = x.shape[0], w.shape[1]
    if num_rows == 0 or n == 0 or x.shape[1] == 0:  # no tile to run; K = 0 sums nothing
        return jnp.zeros((num_rows, n), out_dtype)
    padded_rows = _padded_rows(num_rows, is_dense=False)
    (y,) = _launch(
        x,
        w,
        expert_ids,
        x_scales,
        w_scales,
        n=n,
        n_tiles=n // config.tile_n,
        out_types=(jax.ShapeDtypeStruct((padded_rows, n), out_dtype),),
        out_dtype=jnp.dtype(out_dtype),
        config=config,
        num_sms=num_sms,
        interpret=interpret,
        activation=None,
    )
    return y[:num_rows]


def mosaic_fp8_gemm_act_quant_contiguous(
    x: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    alignment: int,
    activation: str = "silu",
    config: MosaicFp8GemmConfig | None = None,
    num_sms: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """GEMM1, act(gate) * up and its FP8 quantization in one kernel, on the contiguous layout.

    The same result as `mosaic_fp8_gemm_contiguous(x, w1, ...)` (bf16 [M, 2I]) followed by
    `kernels.act_quant.act_and_quant(h, activation=activation, expert_ids=expert_ids)`: each
    tile's two bf16 halves (gate columns j*128.. and the same up columns) never leave the chip;
    the epilogue rounds them to bf16 as GEMM1's output, applies the activation with
    `act_and_quant`'s roundings and quantizes each row's 128 columns with one scale. On the GPU
    the activation is the compiled act + quant kernel's spelling (silu through exp2), so like that
    kernel it can move an FP8 code by one step where the activation lands on a bf16 rounding
    boundary; interpret mode is the reference's arithmetic.

    Args:
      x: float8_e4m3fn [M, H], rows sorted by expert in segments padded to `alignment` rows,
        one after another from row 0 and the unused rows after them (the contiguous layout).
        With `alignment` a multiple of 128 the kernel orders its tiles itself (`_kernel`'s
        `is_dense`; the heuristic's groups of 4 become pairs): about 30 us of XLA ops fewer at
        shape B on the H200. Other configs with groups of 4 build the XLA tile table.
      w1: float8_e4m3fn [E, 2I, H]: gate rows, then up rows; I a multiple of 128.
      expert_ids: int32[M] expert of each row, -1 on padding rows (ids outside [0, E) too).
      x_scales: float32[M, H/128] row-group scales.
      w1_scales: float32[E, 2I/128, H/128] block scales.
      alignment: the segments' row multiple, a multiple of 64 (`BLOCK_M`).
      activation: "silu" on the GPU; any of `moe_jax.activation.ACTIVATIONS` in interpret mode.
      config: tiles and order (block_n 128 and two compute warpgroups: one scale group of gate
        and of up per tile); None takes `heuristic_config`'s.
      num_sms: persistent programs; None: the first local device's SM count.
      interpret: run in Mosaic GPU's interpret mode (CPU tests).

    Returns:
      (q float8_e4m3fn[M, I], scales float32[M, I/128]); the scales are written as
      [I/128, M] in memory (what a group-major GEMM2 reads, `is_scales_group_major`) and
      returned as their transpose. Padding rows are unspecified.
    """
    check_activation(activation)
    if not interpret and activation not in COMPILED_ACTIVATIONS:
        raise NotImplementedError(
            f"activation {activation!r} has no compiled fused epilogue; use one of "
            f"{COMPILED_ACTIVATIONS} or GEMM1 and act_and_quant apart"
        )
    grouped_gemm.check_contiguous_operands(x, w1, expert_ids, x_scales, w1_scales)  # ranks first
    is_segment_of_pairs = alignment % (2 * BLOCK_M) == 0
    if config is None:
        config = act_quant_heuristic_config(
            num_rows=x.shape[0], num_experts=w1.shape[0], k=x.shape[1], alignment=alignment
        )
    # no tile table (`_kernel`'s `is_dense`) for pairs or single blocks on 128-row segments
    is_dense = is_segment_of_pairs and config.group_blocks <= 2
    _check_operands(
        x,
        w1,
        expert_ids,
        x_scales,
        w1_scales,
        alignment,
        config,
        jnp.bfloat16,
        is_gated=True,
        num_sms=num_sms,
    )
    if config.block_n != SCALE_BLOCK or config.num_compute_wgs != 2:
        raise ValueError(
            f"{config}: the fused epilogue needs block_n={SCALE_BLOCK} and num_compute_wgs=2 "
            "(one warpgroup on a quantization group's gate columns, one on its up columns)"
        )
    num_rows = x.shape[0]
    num_experts, two_i, k = w1.shape
    inter = two_i // 2  # a multiple of 128: 2I is a multiple of the 256-column tile (checked)
    num_groups = inter // SCALE_BLOCK
    if num_rows == 0 or inter == 0:
        return (
            jnp.zeros((num_rows, inter), quant.FP8_DTYPE),
            jnp.zeros((num_rows, num_groups), jnp.float32),
        )
    if k == 0:  # GEMM1 sums nothing: its output is zero, and so is act(gate) * up
        from moe_jax.act_quant import act_and_quant_reference

        return act_and_quant_reference(
            jnp.zeros((num_rows, two_i), jnp.bfloat16), activation=activation
        )
    padded_rows = _padded_rows(num_rows, is_dense=is_dense)
    q, scales_t = _launch(
        x,
        w1.reshape(2 * num_experts, inter, k),  # gate and up halves: one TMA box takes both
        expert_ids,
        x_scales,
        w1_scales,
        n=inter,
        n_tiles=num_groups,
        out_types=(
            jax.ShapeDtypeStruct((padded_rows, inter), quant.FP8_DTYPE),
            jax.ShapeDtypeStruct((num_groups, padded_rows), jnp.float32),
        ),
        out_dtype=jnp.dtype(jnp.bfloat16),
        config=config,
        num_sms=num_sms,
        interpret=interpret,
        activation=activation,
        is_dense=is_dense,
    )
    return q[:num_rows], scales_t[:, :num_rows].T


def mosaic_fp8_gemm_act_quant_reference(
    x: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    alignment: int,
    activation: str = "silu",
    config: MosaicFp8GemmConfig | None = None,
    num_sms: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX `mosaic_fp8_gemm_act_quant_contiguous` (same arguments; the tiling ones are
    ignored): XLA's grouped GEMM on the dequantized operands rounded to bf16 (GEMM1's output),
    then `moe_jax.act_quant.act_and_quant_reference`. Padding rows come out as the quantized
    zeros."""
    from moe_jax.act_quant import act_and_quant_reference

    del config, num_sms, interpret
    h = grouped_gemm.GEMMS.get("xla").contiguous(
        x,
        w1,
        expert_ids,
        None,
        x_scales=x_scales,
        w_scales=w1_scales,
        alignment=alignment,
        out_dtype=jnp.bfloat16,
    )
    return act_and_quant_reference(h, activation=activation)


def _padded_rows(num_rows: int, *, is_dense: bool) -> int:
    """Rows after padding to whole 64-row blocks (with `is_dense`, whole 128-row pairs)."""
    multiple = 2 * BLOCK_M if is_dense else BLOCK_M
    return -(-num_rows // multiple) * multiple


def _launch(
    x,
    w,
    expert_ids,
    x_scales,
    w_scales,
    *,
    n,
    n_tiles,
    out_types,
    out_dtype,
    config,
    num_sms,
    interpret,
    activation,
    is_dense=False,
):
    """Pads the rows to whole 64-row blocks, builds the tile table (with `is_dense`, for groups
    of at most 2 blocks, counts the row blocks of the valid pairs instead, or lists the valid
    blocks with `skips_padding_blocks`) and runs `_kernel`."""
    num_rows, k = x.shape
    num_experts = w_scales.shape[0]
    padded_rows = _padded_rows(num_rows, is_dense=is_dense)
    if padded_rows != num_rows:
        extra = padded_rows - num_rows
        x = jnp.pad(x, ((0, extra), (0, 0)))
        expert_ids = jnp.pad(expert_ids, (0, extra), constant_values=-1)
    block_experts = layouts.ids_as_int32(expert_ids)[::BLOCK_M]
    if is_dense:
        if config.group_blocks > 2:
            raise ValueError(f"{config}: the in-kernel tile order takes groups of 1 or 2 blocks")
        if config.skips_padding_blocks:
            tiles = _valid_blocks(block_experts, num_experts)
        else:
            pair_experts = block_experts[::2]
            is_valid = (pair_experts >= 0) & (pair_experts < num_experts)
            tiles = (2 * jnp.sum(is_valid, dtype=jnp.int32)).reshape(1)
    else:
        tiles = _tile_table(block_experts, num_experts, n_tiles, config.group_blocks)
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


def _valid_blocks(block_experts: jax.Array, num_experts: int) -> jax.Array:
    """The valid row blocks in layout order, for `MosaicFp8GemmConfig.skips_padding_blocks`.

    Args:
      block_experts: int32[B] the expert of each 64-row block (of its first row; padding blocks
        hold an id outside [0, E)).
      num_experts: E.

    Returns:
      int32[B + 1]: entries [0, V) the indices of the V valid blocks in increasing order, entry
      B the count V (entries from V to B - 1 are 0).

    Example: experts of 2, 1 and 3 blocks on 128-row segments (0 0 | 1 - | 2 2 | 2 - | - -):
      >>> _valid_blocks(jnp.array([0, 0, 1, -1, 2, 2, 2, -1, -1, -1]), 3).tolist()
      [0, 1, 2, 4, 5, 6, 0, 0, 0, 0, 6]
    """
    num_blocks = block_experts.shape[0]
    is_valid = (block_experts >= 0) & (block_experts < num_experts)
    (blocks,) = jnp.nonzero(is_valid, size=num_blocks, fill_value=0)
    count = jnp.sum(is_valid, dtype=jnp.int32)
    return jnp.append(blocks.astype(jnp.int32), count)


def _tile_table(block_experts: jax.Array, num_experts: int, n_tiles: int, group: int) -> jax.Array:
    """The output tiles in the order the persistent programs take them.

    Args:
      block_experts: int32[B] the expert of each 64-row block (ids outside [0, E) on padding).
      num_experts: E.
      n_tiles: column tiles (N / tile_n).
      group: `MosaicFp8GemmConfig.group_blocks`: an expert's blocks in groups of this many
        take each column tile in turn.

    Returns:
      int32[B * n_tiles * group + 1]: tile i is block `tiles[i] // n_tiles` at column tile
      `tiles[i] % n_tiles`; the last entry is the number of tiles S (entries from S on are 0).
    """
    num_blocks = block_experts.shape[0]
    group_sizes = _group_sizes(block_experts, num_experts, group)
    # [block starting a group (or none: size 0), column tile, block of the group]
    first = jnp.arange(num_blocks, dtype=jnp.int32)[:, None, None]
    members = jnp.arange(group, dtype=jnp.int32)[None, None, :]
    columns = jnp.arange(n_tiles, dtype=jnp.int32)[None, :, None]
    is_tile = members < group_sizes[:, None, None]
    codes = (first + members) * n_tiles + columns
    shape = (num_blocks, n_tiles, group)
    codes = jnp.broadcast_to(codes, shape).reshape(-1)
    is_tile = jnp.broadcast_to(is_tile, shape).reshape(-1)
    num_tiles = jnp.sum(is_tile, dtype=jnp.int32)
    order = jnp.nonzero(is_tile, size=is_tile.size, fill_value=0)[0]
    tiles = jnp.where(jnp.arange(is_tile.size) < num_tiles, codes[order], 0)
    return jnp.append(tiles, num_tiles).astype(jnp.int32)


def _group_sizes(block_experts: jax.Array, num_experts: int, group: int) -> jax.Array:
    """The size of the group of `group` blocks of one expert that each row block starts.

    Args:
      block_experts: int32[B] the expert of each 64-row block (of its first row; padding
        blocks hold an id outside [0, E)).
      num_experts: E.
      group: blocks per group: each expert's blocks 0, group, 2 * group, ... start one.

    Returns:
      int32[B]: at a block starting a group, the group's size (1 to `group`: the expert's blocks
      from there, capped); 0 at every other block and at padding blocks.
    """
    num_blocks = block_experts.shape[0]
    index = jnp.arange(num_blocks, dtype=jnp.int32)
    is_valid = (block_experts >= 0) & (block_experts < num_experts)
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), block_experts[:-1]])
    following = jnp.concatenate([block_experts[1:], jnp.full((1,), -1, jnp.int32)])
    # each valid block's segment: its first block and one past its last
    first = jax.lax.cummax(jnp.where(is_valid & (block_experts != previous), index, 0))
    is_last = is_valid & (block_experts != following)
    end = jax.lax.cummin(jnp.where(is_last, index + 1, num_blocks), reverse=True)
    is_start = is_valid & ((index - first) % group == 0)
    return jnp.where(is_start, jnp.minimum(end - index, group), 0).astype(jnp.int32)


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
    expert: `_tile_table`'s order without building the table. A pair's second block may be all
    padding; it is computed anyway (padding rows are unspecified). With
    `config.skips_padding_blocks`, tiles_gmem is `_valid_blocks`' list (V valid blocks, then
    V): tile t is at entry t // n_tiles, in its group of two consecutive full-pair blocks
    (column tiles interleaved as above) or alone (column tiles in a row), so V n_tiles tiles
    and no all-padding block.

    With `activation`, w_gmem is GEMM1's weight seen as [2E, I, K] (expert e's gate rows at 2e,
    its up rows at 2e + 1) and each tile is 128 gate and the same 128 up columns: compute
    warpgroup 0 takes the gate, 1 the up columns, and the tile's epilogue (`_store_act_quant`)
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
            """The K pipeline of one output tile (entry `tile` of `_tile_table`)."""
            if is_dense and config.skips_padding_blocks:
                entry = jax.lax.div(tile, jnp.int32(n_tiles))  # in `_valid_blocks`' list
                block = tiles_gmem[entry]
                if config.group_blocks == 1:
                    column_tile = jax.lax.rem(tile, jnp.int32(n_tiles))
                else:
                    # a pair's blocks are consecutive, the first even: an odd block is a full
                    # pair's second, an even one a full pair's first if the next entry follows
                    # it (entry + 1 <= V <= B: inside the list)
                    is_second = jax.lax.rem(block, 2) == 1
                    is_pair = is_second | (tiles_gmem[entry + 1] == block + 1)
                    offset = is_second.astype(jnp.int32)
                    in_group = tile - (entry - offset) * n_tiles
                    first_block = block - offset
                    block = jax.lax.select(is_pair, first_block + jax.lax.rem(in_group, 2), block)
                    column_tile = jax.lax.select(is_pair, jax.lax.div(in_group, 2), in_group)
                expert = block_experts_gmem[block]
            elif is_dense:
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
                    _store_act_quant(
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
        # the last entry counts tiles, or with `is_dense` row blocks (the only entry without
        # `skips_padding_blocks`)
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


def _store_act_quant(acc, wg, rows, column_tile, outputs, scratch, activation, interpret):
    """The gated tile's epilogue: act(gate) * up of the tile's bf16 GEMM1 outputs, quantized.

    Both compute warpgroups share it. Each stores its bf16 [64, 128] half (warpgroup 0 the
    gate, 1 the up columns) to shared memory; once both have (the epilogue barrier's first
    completion of the tile) warpgroup w takes columns [64w, 64w + 64) of both and computes, in
    `kernels.act_quant`'s roundings,

        a = bf16(bf16(act(gate)) * up)        float32 arithmetic
        amax_w[r] = max_c |a[r, c]|           over its 64 columns

    then, once both row maxima are in shared memory (the barrier's second completion),

        scale[r] = max(amax_0[r], amax_1[r], 1e-10) / 448
        q[r, c] = e4m3(a[r, c] / scale[r])    round to nearest even, saturating

    and stores its [64, 64] block of q at (`rows`, group `column_tile`) by TMA; warpgroup 0 also
    stores the 64 scales at scales[column_tile, rows] (group-major). A warpgroup writes the next
    tile's halves only after passing this tile's second completion, which both reach after
    loading their columns, so one buffer serves every tile.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q_gmem, scales_gmem = outputs
    h_smem, row_smem, q_smem = scratch["h_smem"], scratch["row_smem"], scratch["q_smem"]
    round_fn = round_to_dtype if interpret else (lambda value, dtype: value.astype(dtype))
    h_smem[wg] = round_fn(acc, jnp.bfloat16)  # GEMM1's output dtype
    both_wgs = scratch["epilogue_barrier"]
    plgpu.barrier_arrive(both_wgs)  # this tile's halves
    plgpu.barrier_wait(both_wgs)
    width = h_smem.shape[2] // 2
    columns = pl.ds(wg * width, width)
    gate, up = h_smem[0, :, columns], h_smem[1, :, columns]
    act_fn = None if interpret else KERNEL_ACTIVATIONS.get(activation)
    a = gated_activation(gate, up, activation, round_fn=round_fn, act_fn=act_fn)
    a = a.astype(jnp.float32)
    row_smem[wg] = jnp.max(jnp.abs(a), axis=1)
    plgpu.barrier_arrive(both_wgs)  # this tile's row maxima
    plgpu.barrier_wait(both_wgs)
    amax = jnp.maximum(row_smem[0], row_smem[1])
    # interpret mode: XLA would rewrite a / broadcast(b) as a * (1 / b), which `quant.divide`
    # prevents. Compiled, Mosaic GPU's float32 division is not correctly rounded (its scales sit
    # an ulp from the Pallas kernel's in about half the rows on the H200) and its e4m3 cast
    # saturates (cvt.satfinite), so the clip is interpret mode's only.
    divide = quant.divide if interpret else (lambda num, den: num / den)
    scale = divide(jnp.maximum(amax, quant.SCALE_EPS), jnp.float32(quant.FP8_MAX))
    quotient = divide(a, jax.lax.broadcast_in_dim(scale, a.shape, (0,)))
    if interpret:
        quotient = jnp.clip(quotient, -quant.FP8_MAX, quant.FP8_MAX)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's last tile's copies
    q_smem[wg] = quotient.astype(q_smem.dtype)

    @pl.when(wg == 0)
    def _scales():
        row_smem[2] = scale

    plgpu.commit_smem()
    q_columns = pl.ds(column_tile * 2 * width + wg * width, width)
    plgpu.copy_smem_to_gmem(q_smem.at[wg], q_gmem.at[rows, q_columns])

    @pl.when(wg == 0)
    def _store_scales():
        plgpu.copy_smem_to_gmem(row_smem.at[2], scales_gmem.at[column_tile, rows])


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


def _check_operands(
    x, w, expert_ids, x_scales, w_scales, alignment, config, out_dtype, is_gated=False, num_sms=None
):
    """The Pallas kernel's checks (`grouped_gemm.check_operands`), then FP8 only, N a multiple
    of the tile, 64-row segments, the config's shared memory within a Hopper program's and a
    positive `num_sms` (or None)."""
    if not gemm_kernels.check_operands(x, w, expert_ids, x_scales, w_scales, alignment):
        raise TypeError(f"x.dtype={x.dtype}, w.dtype={w.dtype}: both must be float8_e4m3fn")
    if num_sms is not None and require_int("num_sms", num_sms) < 1:
        raise ValueError(f"{num_sms=} but a positive int (or None: the device's) is needed")
    n = w.shape[1]
    if n % config.tile_n:
        raise ValueError(
            f"N={n} is not a multiple of the {config.tile_n}-column tile (num_compute_wgs="
            f"{config.num_compute_wgs} x block_n={config.block_n})"
        )
    if alignment % BLOCK_M:
        raise ValueError(
            f"{alignment=} but a multiple of {BLOCK_M} rows is needed: a row block would span "
            "experts"
        )
    smem = config.smem_bytes(out_dtype, x.shape[1], is_gated=is_gated)
    if smem > SMEM_LIMIT:
        raise ValueError(
            f"{config} with {jnp.dtype(out_dtype).name} output asks for {smem} bytes of shared "
            f"memory, over the {SMEM_LIMIT} a program may have: lower max_concurrent_steps"
        )


def _compute_capability() -> str | None:
    """The first local GPU's compute capability ("9.0" on an H100/H200), None if unknown."""
    try:
        return getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:  # no GPU backend
        return None


def _interpret_params():
    """Mosaic GPU's interpret mode (shared memory, TMA and barriers simulated on the CPU)."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret import params
    except ImportError as error:  # pragma: no cover - depends on the jax version
        raise NotImplementedError(
            f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode: run on a Hopper GPU"
        ) from error
    return params.InterpretGPUParams()


class MosaicFp8Gemm(grouped_gemm.GroupedGemm):
    """GEMM backend running `mosaic_fp8_gemm_contiguous` (Hopper GPUs; FP8 only).

    The contiguous layout it asks for pads each expert's segment to 64 rows (`BLOCK_M`), so
    every row block belongs to one expert. The masked layout runs on the same kernel: each
    expert's block of max_m rows, padded to 64, is a segment; blocks past the counts are skipped.
    Without a `config` each call takes `heuristic_config`'s for its layout (on the masked layout,
    for `expected_m` rows per expert when given). `interpret=True` runs the kernel in Mosaic
    GPU's interpret mode on any platform (registered as "mosaic_fp8_interpret" for CPU tests and
    the sanitizer driver's twin; "auto" never picks it).
    """

    is_scales_group_major = True  # the kernel reads them as [K/128, M]

    def __init__(self, config: MosaicFp8GemmConfig | None = None, *, interpret: bool = False):
        self.config = config  # None: `heuristic_config` per call
        self.interpret = interpret
        self.name = "mosaic_fp8_interpret" if interpret else "mosaic_fp8"

    def layout_alignment(self, problem: grouped_gemm.GemmProblem) -> int:
        return BLOCK_M

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if not self.interpret and problem.platform != "gpu":
            return f"Mosaic GPU kernels need an NVIDIA Hopper GPU, not {problem.platform!r}"
        capability = None if self.interpret else _compute_capability()
        if capability is not None and capability != HOPPER:
            return f"Hopper's wgmma needs compute capability {HOPPER}, this GPU has {capability}"
        if problem.x_dtype != "float8_e4m3fn" or problem.w_dtype != "float8_e4m3fn":
            return f"FP8 operands only, got x {problem.x_dtype} and w {problem.w_dtype}"
        if problem.layout not in grouped_gemm.LAYOUTS:
            return f"layout {problem.layout!r} is not one of {grouped_gemm.LAYOUTS}"
        # the heuristic's configs all take 256-column tiles, as the default one
        tile_n = (self.config or MosaicFp8GemmConfig()).tile_n
        if problem.n % tile_n or problem.k % SCALE_BLOCK:
            return (
                f"needs N a multiple of {tile_n} and K of {SCALE_BLOCK}, "
                f"got N={problem.n} K={problem.k}"
            )
        alignment = problem.alignment
        if problem.layout == "contiguous" and alignment is not None and alignment % BLOCK_M:
            return f"alignment {alignment} is not a multiple of {BLOCK_M} rows"
        return None

    def _run(self, x, w, expert_ids, x_scales, w_scales, alignment, out_dtype, config=None):
        if x_scales is None or w_scales is None:
            raise ValueError("FP8 operands need x_scales and w_scales")
        return mosaic_fp8_gemm_contiguous(
            x,
            w,
            expert_ids,
            x_scales=x_scales,
            w_scales=w_scales,
            alignment=alignment,
            out_dtype=out_dtype,
            config=self.config or config,
            interpret=self.interpret,
        )

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        del expert_ends  # each row block's expert comes from expert_ids
        return self._run(x, w, expert_ids, x_scales, w_scales, alignment, out_dtype)

    def contiguous_act_quant(
        self, x, w1, expert_ids, *, x_scales, w1_scales, alignment, activation
    ) -> tuple[jax.Array, jax.Array]:
        """GEMM1, act(gate) * up and its FP8 quantization as one kernel
        (`mosaic_fp8_gemm_act_quant_contiguous`): (float8_e4m3fn[M, I], float32[M, I/128]).
        Forward only: differentiating it raises TypeError (FP8 weights are an inference
        checkpoint, as for `moe_jax.act_quant.act_and_quant`)."""
        from moe_jax.act_quant import without_gradient

        return without_gradient(
            lambda rows: mosaic_fp8_gemm_act_quant_contiguous(
                rows,
                w1,
                expert_ids,
                x_scales=x_scales,
                w1_scales=w1_scales,
                alignment=alignment,
                activation=activation,
                config=self.config,
                interpret=self.interpret,
            )
        )(x)

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        num_experts, max_m, _ = x.shape
        rows, row_scales, expert_ids, rows_per_block = grouped_gemm.masked_as_contiguous(
            x, x_scales, num_rows_per_expert, BLOCK_M
        )
        # Blocks past the counts are skipped; the tile order follows the rows expected per
        # expert (the capacity max_m when not given) padded as the contiguous layout pads them.
        expected = max_m if expected_m is None else min(expected_m, max_m)
        config = heuristic_config(
            num_rows=num_experts * (expected + BLOCK_M - 1), num_experts=num_experts, k=x.shape[2]
        )
        y = self._run(rows, w, expert_ids, row_scales, w_scales, rows_per_block, out_dtype, config)
        return y.reshape(num_experts, rows_per_block, -1)[:, :max_m]


grouped_gemm.GEMMS.register(MosaicFp8Gemm())
grouped_gemm.GEMMS.register(MosaicFp8Gemm(interpret=True))
