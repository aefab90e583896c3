"""GEMM backend "mosaic_fp8": a Mosaic GPU FP8 grouped GEMM with vLLM's 128x128 block scales.

Computes `y[r] = x[r] @ w[expert_ids[r]].T` on the contiguous layout (`moe_jax.layouts`) with
64-row segments, the contract of `kernels.grouped_gemm.grouped_gemm_contiguous` for FP8. Where
the Pallas Triton kernel launches one program per tile and loads with plain (cp.async) copies,
this one is built the way DeepGEMM's is, with Pallas' Mosaic GPU backend (Hopper only):

- persistent: one program per SM walks the output tiles of the valid row blocks (padding blocks
  are never visited), columns first, so the N tiles of a row block run on neighbouring SMs at
  once and share its x rows through L2, and the row blocks of one expert stream the same weight
  tiles at about the same time;
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

- chained (`is_chained`): consecutive tiles' pipelines run as one, so the memory warpgroup goes
  on into the next tile's K blocks while the compute warpgroups finish a tile; it needs K / 128
  to be a multiple of `max_concurrent_steps` (else the tiles run one pipeline each).

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

from moe_jax import grouped_gemm
from moe_jax.kernels import grouped_gemm as gemm_kernels

SCALE_BLOCK = gemm_kernels.SCALE_BLOCK  # one scale per 128 K columns of x, 128x128 of w
BLOCK_K = 128  # K columns per pipeline step: one scale block, 128 FP8 bytes (one swizzle row)
BLOCK_M = 64  # rows per tile: one warpgroup's wgmma; the layout's segments are multiples of it
SWIZZLE = 128  # shared-memory swizzle in bytes of the FP8 tiles (one K block row)
MEMORY_REGISTERS = 40  # registers per thread left to the TMA warpgroup (Mosaic GPU's H100 value)
INTERPRET_SMS = 3  # persistent programs in interpret mode: several tiles per program
HOPPER = "9.0"  # the compute capability with wgmma (sm_90)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicFp8GemmConfig:
    """Tiles of the Mosaic GPU FP8 grouped GEMM.

    Attributes:
      block_n: output columns per compute warpgroup (64 or 128: within one weight-scale block).
      num_compute_wgs: compute warpgroups per program (1 or 2); a tile is `tile_n` =
        num_compute_wgs * block_n columns wide, and N must be a multiple of it.
      max_concurrent_steps: K blocks whose TMA copies may be in flight (pipeline slots).
      is_chained: run consecutive tiles' pipelines as one (when K / 128 is a multiple of
        max_concurrent_steps; else each tile runs its own).
    """

    block_n: int = 128
    num_compute_wgs: int = 2
    max_concurrent_steps: int = 3
    is_chained: bool = False

    def __post_init__(self):
        if self.block_n not in (64, 128):
            raise ValueError(f"MosaicFp8GemmConfig.block_n={self.block_n} but 64 or 128 is needed")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(
                f"MosaicFp8GemmConfig.num_compute_wgs={self.num_compute_wgs} but 1 or 2 is needed"
            )
        if self.max_concurrent_steps < 1:
            raise ValueError(
                f"MosaicFp8GemmConfig.max_concurrent_steps={self.max_concurrent_steps} but >= 1 "
                "is needed"
            )

    @property
    def tile_n(self) -> int:
        return self.num_compute_wgs * self.block_n


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
      config: tiles; None takes `MosaicFp8GemmConfig()`.
      num_sms: persistent programs; None: the first local device's SM count (`INTERPRET_SMS`
        in interpret mode).
      interpret: run in Mosaic GPU's interpret mode (CPU tests).

    Returns:
      [M, N] in `out_dtype`; padding rows are unspecified.
    """
    config = MosaicFp8GemmConfig() if config is None else config
    _check_operands(x, w, expert_ids, x_scales, w_scales, alignment, config)
    num_rows, k = x.shape
    num_experts, n, _ = w.shape
    if num_rows == 0:
        return jnp.zeros((0, n), out_dtype)
    padded_rows = -(-num_rows // BLOCK_M) * BLOCK_M
    if padded_rows != num_rows:
        extra = padded_rows - num_rows
        x = jnp.pad(x, ((0, extra), (0, 0)))
        x_scales = jnp.pad(x_scales, ((0, extra), (0, 0)))
        expert_ids = jnp.pad(expert_ids, (0, extra), constant_values=-1)
    # Each row block's expert, and the valid blocks in order with their count appended.
    block_experts = expert_ids.astype(jnp.int32)[::BLOCK_M]
    num_blocks = block_experts.shape[0]
    is_valid = (block_experts >= 0) & (block_experts < num_experts)
    valid_blocks = jnp.nonzero(is_valid, size=num_blocks, fill_value=0)[0].astype(jnp.int32)
    valid_blocks = jnp.append(valid_blocks, jnp.sum(is_valid, dtype=jnp.int32))
    if num_sms is None:
        num_sms = INTERPRET_SMS if interpret else jax.local_devices()[0].core_count
    from jax.experimental.pallas import mosaic_gpu as plgpu

    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            num_blocks=num_blocks,
            num_experts=num_experts,
            n=n,
            k=k,
            num_sms=num_sms,
            out_dtype=jnp.dtype(out_dtype),
            config=config,
            interpret=interpret,
        ),
        out_type=jax.ShapeDtypeStruct((padded_rows, n), out_dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params() if interpret else None,
    )
    x_scales_t = x_scales.astype(jnp.float32).T  # [K/128, M]: a row block's scales contiguous
    y = kernel(block_experts, valid_blocks, x, x_scales_t, w, w_scales.astype(jnp.float32))
    return y[:num_rows]


def _kernel(
    # inputs
    block_experts_gmem,
    valid_blocks_gmem,
    x_gmem,
    xs_gmem,
    w_gmem,
    ws_gmem,
    # output
    out_gmem,
    *,
    num_blocks: int,
    num_experts: int,
    n: int,
    k: int,
    num_sms: int,
    out_dtype: jnp.dtype,
    config: MosaicFp8GemmConfig,
    interpret: bool,
):
    """One persistent program: this SM's tiles of the valid row blocks (module docstring)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bm, bn, tile_n = BLOCK_M, config.block_n, config.tile_n
    k_steps, n_tiles = k // BLOCK_K, n // tile_n
    steps = config.max_concurrent_steps
    is_chained = config.is_chained and k_steps % steps == 0
    transforms = (plgpu.TilingTransform((8, SWIZZLE)), plgpu.SwizzleTransform(SWIZZLE))

    def make_pipeline(step, compute_context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps,),
            memory_registers=MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, BLOCK_K), lambda kb: (0, kb), transforms=transforms),
                plgpu.BlockSpec((1, bm), lambda kb: (kb, 0)),
                plgpu.BlockSpec((tile_n, BLOCK_K), lambda kb: (0, kb), transforms=transforms),
            ],
            wg_axis="wg",
            num_compute_wgs=config.num_compute_wgs,
            max_concurrent_steps=steps,
            compute_context=compute_context,
            pipeline_state=state,
        )

    def ignore(*args, **kwargs):
        del args, kwargs

    allocations = make_pipeline(ignore, ignore).get_allocations(
        x_gmem.at[pl.ds(0, bm)], xs_gmem.at[:, pl.ds(0, bm)], w_gmem.at[0, pl.ds(0, tile_n)]
    )

    @functools.partial(
        pl.run_scoped,
        allocations=allocations,
        out_smem=plgpu.SMEM((config.num_compute_wgs, bm, bn), out_dtype),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = jax.lax.axis_index("wg")

        def run_tile(tile, state=None):
            """The K pipeline of one output tile (valid row block tile // n_tiles)."""
            block = valid_blocks_gmem[jax.lax.div(tile, jnp.int32(n_tiles))]
            expert = block_experts_gmem[block]
            col0 = jax.lax.rem(tile, jnp.int32(n_tiles)) * tile_n
            wg_col0 = col0 + wg * bn  # this compute warpgroup's first output column
            scale_col = jax.lax.div(wg_col0, jnp.int32(SCALE_BLOCK))

            def step(indices, x_smem, xs_smem, w_smem, acc):
                (kb,) = indices
                w_scale = ws_gmem[expert, scale_col, kb]
                part = _block_product(x_smem, w_smem.at[pl.ds(wg * bn, bn)], interpret)
                row_scale = xs_smem[0] * w_scale
                return acc + part * jax.lax.broadcast_in_dim(row_scale, (bm, bn), (0,))

            def compute_context(eval_pipeline):
                acc = eval_pipeline(jnp.zeros((bm, bn), jnp.float32))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's copy
                out_smem[wg] = acc.astype(out_dtype)
                plgpu.commit_smem()
                rows = pl.ds(block * bm, bm)
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[rows, pl.ds(wg_col0, bn)])

            make_pipeline(step, compute_context, state)(
                x_gmem.at[pl.ds(block * bm, bm)],
                xs_gmem.at[:, pl.ds(block * bm, bm)],
                w_gmem.at[expert, pl.ds(col0, tile_n)],
                allocations=allocations,
            )

        # This SM's tiles: sm, sm + num_sms, ... below the valid tiles' count.
        sm = jax.lax.axis_index("sm")
        num_tiles = valid_blocks_gmem[num_blocks] * n_tiles
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
        plgpu.wgmma(acc_ref, x_smem, plgpu.transpose_ref(w_smem, (1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((x_smem.shape[0], w_smem.shape[0]), jnp.float32))


def _check_operands(x, w, expert_ids, x_scales, w_scales, alignment, config):
    """The Pallas kernel's checks (`grouped_gemm.check_operands`), then FP8 only, N a multiple
    of the tile and 64-row segments."""
    if not gemm_kernels.check_operands(x, w, expert_ids, x_scales, w_scales, alignment):
        raise TypeError(f"x.dtype={x.dtype}, w.dtype={w.dtype}: both must be float8_e4m3fn")
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
    `interpret=True` runs the kernel in Mosaic GPU's interpret mode on any platform (registered
    as "mosaic_fp8_interpret" for CPU tests and the sanitizer driver's twin; "auto" never picks
    it).
    """

    def __init__(self, config: MosaicFp8GemmConfig | None = None, *, interpret: bool = False):
        self.config = MosaicFp8GemmConfig() if config is None else config
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
        tile_n = self.config.tile_n
        if problem.n % tile_n or problem.k % SCALE_BLOCK:
            return (
                f"needs N a multiple of {tile_n} and K of {SCALE_BLOCK}, "
                f"got N={problem.n} K={problem.k}"
            )
        alignment = problem.alignment
        if problem.layout == "contiguous" and alignment is not None and alignment % BLOCK_M:
            return f"alignment {alignment} is not a multiple of {BLOCK_M} rows"
        return None

    def _run(self, x, w, expert_ids, x_scales, w_scales, alignment, out_dtype):
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
            config=self.config,
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
        del expected_m  # blocks past the counts are skipped
        num_experts, max_m, _ = x.shape
        rows, row_scales, expert_ids, rows_per_block = grouped_gemm.masked_as_contiguous(
            x, x_scales, num_rows_per_expert, BLOCK_M
        )
        y = self._run(rows, w, expert_ids, row_scales, w_scales, rows_per_block, out_dtype)
        return y.reshape(num_experts, rows_per_block, -1)[:, :max_m]


grouped_gemm.GEMMS.register(MosaicFp8Gemm())
grouped_gemm.GEMMS.register(MosaicFp8Gemm(interpret=True))
