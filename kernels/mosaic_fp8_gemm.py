"""GEMM backend "mosaic_fp8": a Mosaic GPU FP8 grouped GEMM with vLLM's 128x128 block scales.

Computes `y[r] = x[r] @ w[expert_ids[r]].T` on the contiguous layout (`moe_jax.layouts`) with
64-row segments, the contract of `kernels.grouped_gemm.grouped_gemm_contiguous` for FP8. Where
the Pallas Triton kernel launches one program per tile and loads with plain (cp.async) copies,
this one is built the way DeepGEMM's is, with Pallas' Mosaic GPU backend (Hopper only):
persistent, warp-specialised, block-scaled. Its parts, one module each:

- `kernels.mosaic_fp8_config`: `MosaicFp8GemmConfig` (tiles, grouping, pipeline) and the
  heuristics that choose one;
- `kernels.mosaic_fp8_tiles`: the order in which the persistent programs take the tiles;
- `kernels.mosaic_fp8_kernel`: the kernel (how it pipelines, groups, chains and overlaps);
- `kernels.mosaic_fp8_epilogue`: the fused GEMM1's act(gate) * up + FP8 quantization epilogue.

This module holds the fronts that check operands and run the kernel,
`mosaic_fp8_gemm_contiguous` and `mosaic_fp8_gemm_act_quant_contiguous` (GEMM1 with vLLM's
act(gate) * up and the FP8 requantization for GEMM2 in the epilogue: only FP8 codes and their
scales leave the chip), the latter's pure-JAX reference, the `MosaicFp8Gemm` GEMM backend and
the `MosaicFp8FusedGemm1` fused GEMM1 backends (`moe_jax.fused_gemm1`).
Interpret mode (`interpret=True`) runs the same kernel on Mosaic GPU's interpreter (CPU tests).
Padding rows of the output are unspecified, as the `GroupedGemm` contract allows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, quant
from moe_jax.act_quant import COMPILED_ACTIVATIONS
from moe_jax.activation import check_activation
from moe_jax.fused_gemm1 import FUSED_GEMM1S, FusedGemm1, FusedGemm1Problem, fused_gemm1_reference
from moe_jax.kernels import grouped_gemm as gemm_kernels
from moe_jax.kernels import mosaic_fp8_gather, mosaic_fp8_tiles
from moe_jax.kernels.mosaic_fp8_config import (
    BLOCK_M,
    SCALE_BLOCK,
    SMEM_LIMIT,
    FusedGemm1Options,
    MosaicFp8GemmConfig,
    act_quant_heuristic_config,
    heuristic_config,
)
from moe_jax.kernels.mosaic_fp8_kernel import launch
from moe_jax.routing import require_int

HOPPER = "9.0"  # the compute capability with wgmma (sm_90)


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
    padded_rows = mosaic_fp8_tiles.padded_rows(num_rows, is_dense=False)
    (y,) = launch(
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
    options: FusedGemm1Options,
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
      x: float8_e4m3fn [M, H], rows sorted by expert in segments padded to `options.alignment`
        rows, one after another from row 0 and the unused rows after them (the contiguous
        layout). On segments of 128 rows the kernel orders its tiles itself
        (`kernels.mosaic_fp8_kernel`'s `is_dense`; the heuristic's groups of 4 become pairs);
        other configs with groups of 4 build the XLA tile table.
      w1: float8_e4m3fn [E, 2I, H]: gate rows, then up rows; I a multiple of 128.
      expert_ids: int32[M] expert of each row, -1 on padding rows (ids outside [0, E) too).
      x_scales: float32[M, H/128] row-group scales.
      w1_scales: float32[E, 2I/128, H/128] block scales.
      options: alignment, activation, tiles, SM count and interpret mode (`FusedGemm1Options`).

    Returns:
      (q float8_e4m3fn[M, I], scales float32[M, I/128]); the scales are written as
      [I/128, M] in memory (what a group-major GEMM2 reads, `is_scales_group_major`) and
      returned as their transpose. Padding rows are unspecified.
    """
    config = check_act_quant_operands(x, w1, expert_ids, x_scales, w1_scales, options)
    # no tile table (the kernel's `is_dense`) for pairs or single blocks on 128-row segments
    is_dense = options.alignment % (2 * BLOCK_M) == 0 and config.group_blocks <= 2
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
            jnp.zeros((num_rows, two_i), jnp.bfloat16), activation=options.activation
        )
    padded_rows = mosaic_fp8_tiles.padded_rows(num_rows, is_dense=is_dense)
    q, scales_t = launch(
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
        num_sms=options.num_sms,
        interpret=options.interpret,
        activation=options.activation,
        is_dense=is_dense,
    )
    return q[:num_rows], scales_t[:, :num_rows].T


def check_act_quant_operands(
    x, w1, expert_ids, x_scales, w1_scales, options: FusedGemm1Options
) -> MosaicFp8GemmConfig:
    """`mosaic_fp8_gemm_act_quant_contiguous`'s checks (x and x_scales may be shapes only),
    naming the argument at fault; returns the config to run (`act_quant_heuristic_config`'s
    where `options.config` is None)."""
    check_activation(options.activation)
    if not options.interpret and options.activation not in COMPILED_ACTIVATIONS:
        raise NotImplementedError(
            f"activation {options.activation!r} has no compiled fused epilogue; use one of "
            f"{COMPILED_ACTIVATIONS} or GEMM1 and act_and_quant apart"
        )
    grouped_gemm.check_contiguous_operands(x, w1, expert_ids, x_scales, w1_scales)  # ranks first
    config = options.config or act_quant_heuristic_config(
        num_rows=x.shape[0], num_experts=w1.shape[0], k=x.shape[1], alignment=options.alignment
    )
    _check_operands(
        x,
        w1,
        expert_ids,
        x_scales,
        w1_scales,
        options.alignment,
        config,
        jnp.bfloat16,
        is_gated=True,
        num_sms=options.num_sms,
    )
    if config.block_n != SCALE_BLOCK or config.num_compute_wgs != 2:
        raise ValueError(
            f"{config}: the fused epilogue needs block_n={SCALE_BLOCK} and num_compute_wgs=2 "
            "(one warpgroup on a quantization group's gate columns, one on its up columns)"
        )
    return config


def mosaic_fp8_gemm_act_quant_reference(
    x: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    options: FusedGemm1Options,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX `mosaic_fp8_gemm_act_quant_contiguous` (the tiling options are ignored): the
    fused GEMM1's XLA reference (`moe_jax.fused_gemm1.fused_gemm1_reference`)."""
    return fused_gemm1_reference(
        x,
        w1,
        expert_ids,
        x_scales=x_scales,
        w1_scales=w1_scales,
        alignment=options.alignment,
        activation=options.activation,
    )


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


def _hopper_reason(platform: str, interpret: bool) -> str | None:
    """Why the compiled kernels cannot run on `platform` (None: interpret mode, or Hopper)."""
    if interpret:
        return None
    if platform != "gpu":
        return f"Mosaic GPU kernels need an NVIDIA Hopper GPU, not {platform!r}"
    capability = _compute_capability()
    if capability is not None and capability != HOPPER:
        return f"Hopper's wgmma needs compute capability {HOPPER}, this GPU has {capability}"
    return None


class MosaicFp8Gemm(grouped_gemm.GroupedGemm):
    """GEMM backend running `mosaic_fp8_gemm_contiguous` (Hopper GPUs; FP8 only).

    The contiguous layout it asks for pads each expert's segment to 64 rows (`BLOCK_M`), so
    every row block belongs to one expert. The masked layout runs on the same kernel: each
    expert's block of max_m rows, padded to 64, is a segment; blocks past the counts are skipped.
    Without a `config` each call takes `heuristic_config`'s for its layout (on the masked layout,
    for `expected_m` rows per expert when given). `interpret=True` runs the kernel in Mosaic
    GPU's interpret mode on any platform (the tests register it as "mosaic_fp8_interpret").
    """

    alignment = BLOCK_M
    is_scales_group_major = True  # the kernel reads them as [K/128, M]

    def __init__(self, config: MosaicFp8GemmConfig | None = None, *, interpret: bool = False):
        self.config = config  # None: `heuristic_config` per call
        self.interpret = interpret
        self.name = "mosaic_fp8" + ("_interpret" if interpret else "")

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if (why := _hopper_reason(problem.platform, self.interpret)) is not None:
            return why
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


class MosaicFp8FusedGemm1(FusedGemm1):
    """Fused GEMM1 backend (`moe_jax.fused_gemm1`): `mosaic_fp8_gemm_act_quant_contiguous`, or
    with `gathers_rows` ("mosaic_fp8_gathered") `kernels.mosaic_fp8_gather.gathered_act_quant`,
    which reads the layout's rows from the tokens (segments of whole 128-row pairs; compiled
    from jax 0.11). Hopper GPUs, FP8; `interpret=True` runs on any platform (the tests register
    those as "..._interpret")."""

    is_scales_group_major = True  # the contiguous kernel reads the rows' scales as [H/128, M]

    def __init__(
        self,
        config: MosaicFp8GemmConfig | None = None,
        *,
        interpret: bool = False,
        gathers_rows: bool = False,
    ):
        self.config = config  # None: `act_quant_heuristic_config` per call
        self.interpret = interpret
        self.gathers_rows = gathers_rows
        self.name = "mosaic_fp8" + ("_gathered" if gathers_rows else "")
        self.name += "_interpret" if interpret else ""

    def backend_reason(self, problem: FusedGemm1Problem) -> str | None:
        gemm = problem.gemm
        if (why := _hopper_reason(gemm.platform, self.interpret)) is not None:
            return why
        if not self.interpret and problem.activation not in COMPILED_ACTIVATIONS:
            return (
                f"the compiled epilogue lowers {COMPILED_ACTIVATIONS}, not {problem.activation!r}"
            )
        tile_n = 2 * SCALE_BLOCK  # the epilogue's tile: 128 gate and 128 up columns
        if gemm.n % tile_n:
            return f"needs 2I a multiple of {tile_n}, got {gemm.n}"
        multiple = 2 * BLOCK_M if self.gathers_rows else BLOCK_M
        if gemm.alignment is None or gemm.alignment % multiple:
            return f"takes segments of whole {multiple}-row blocks, not alignment {gemm.alignment}"
        if self.gathers_rows and not self.interpret and not mosaic_fp8_gather.has_inline_ptx():
            return (
                f"the gathered GEMM1 is written in inline PTX, which Mosaic GPU emits from jax "
                f"0.11 (this is jax {jax.__version__}): upgrade jax, or take the contiguous "
                "fused GEMM1 (fused_act_quant='mosaic_fp8')"
            )
        return None

    def run(self, x, w1, expert_ids, row_sources, *, x_scales, w1_scales, alignment, activation):
        options = FusedGemm1Options(
            alignment=alignment,
            activation=activation,
            config=self.config,
            interpret=self.interpret,
        )
        if self.gathers_rows:
            return mosaic_fp8_gather.gathered_act_quant(
                x,
                w1,
                expert_ids,
                row_sources,
                x_scales=x_scales,
                w1_scales=w1_scales,
                options=options,
            )
        return mosaic_fp8_gemm_act_quant_contiguous(
            x, w1, expert_ids, x_scales=x_scales, w1_scales=w1_scales, options=options
        )


grouped_gemm.GEMMS.register(MosaicFp8Gemm())
FUSED_GEMM1S.register(MosaicFp8FusedGemm1())
FUSED_GEMM1S.register(MosaicFp8FusedGemm1(gathers_rows=True))
