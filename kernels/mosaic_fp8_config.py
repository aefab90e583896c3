"""Tiles and tile order of the Mosaic GPU FP8 grouped GEMM (`kernels.mosaic_fp8_gemm`), and the
heuristics that choose them from a layout's shape.

`MosaicFp8GemmConfig` holds the tunables (columns per compute warpgroup, how an expert's row
blocks are grouped, pipeline slots, chained and overlapped pipelines); `heuristic_config`
picks one for a GEMM from its layout's rows, experts and K, and
`act_quant_heuristic_config` the fused GEMM1 + act * up + quantization kernel's. The constants
are the kernel's fixed tiling (64-row blocks, 128-wide K blocks, one FP8 swizzle row).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from moe_jax.kernels import grouped_gemm as gemm_kernels

SCALE_BLOCK = gemm_kernels.SCALE_BLOCK  # one scale per 128 K columns of x, 128x128 of w
BLOCK_K = 128  # K columns per pipeline step: one scale block, 128 FP8 bytes (one swizzle row)
BLOCK_M = 64  # rows per tile: one warpgroup's wgmma; the layout's segments are multiples of it
SWIZZLE = 128  # shared-memory swizzle in bytes of the FP8 tiles (one K block row)
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
    N must be a multiple of `tile_n`.
    """

    block_n: int = 128
    num_compute_wgs: int = 2
    group_blocks: int = 1
    max_concurrent_steps: int = 3
    is_chained: bool = False
    is_overlapped: bool = False

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


# The row blocks per expert from which an expert's blocks go in pairs, then in groups of 4
# (BENCHMARKS.md "Thresholds": GROUPED_FROM_BLOCKS_PER_EXPERT, GROUPS_OF_4_FROM_BLOCKS_PER_EXPERT).
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
        # groups of 4 there would span two experts (or need 256-row segments, a copy of x)
        config = dataclasses.replace(config, group_blocks=2)
    return config


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedGemm1Options:
    """The static arguments of the fused GEMM1 kernels (GEMM1 + act(gate) * up + FP8
    quantization: `mosaic_fp8_gemm.mosaic_fp8_gemm_act_quant_contiguous`,
    `mosaic_fp8_gather.gathered_act_quant`) and of their references.

    Attributes:
      alignment: the layout's segment multiple: of 64 rows (`BLOCK_M`), of 128 for the gathered
        kernel (whole pairs of row blocks).
      activation: "silu" compiled; any of `moe_jax.activation.ACTIVATIONS` in interpret mode.
      config: tiles and order (block_n 128 and two compute warpgroups: one scale group of gate
        and of up per tile); None: `act_quant_heuristic_config`'s.
      num_sms: persistent programs; None: the first local device's SM count.
      interpret: run in Mosaic GPU's interpret mode (CPU tests).
    """

    alignment: int
    activation: str = "silu"
    config: MosaicFp8GemmConfig | None = None
    num_sms: int | None = None
    interpret: bool = False
