"""Pallas GPU grouped GEMM for few rows per expert (decode): GEMM backends "pallas" (+ interpret).

Computes `y[r] = x[r] @ w[expert_ids[r]].T` on the contiguous layout (`moe_jax.layouts`), FP8 with
vLLM's 128x128 block scales or bf16/f16, with float32 accumulation. The algorithm is that of
vLLM's Triton `fused_moe` kernel: rows are already sorted by expert in segments padded to a
multiple of `block_m`, so every block of `block_m` rows belongs to one expert (or is padding).
One program takes one row block and one `block_n`-column tile of the output and streams that
expert's weight tile once over K:

    grid = (M / block_m, N / block_n)         program (i, j): rows [i*bm, (i+1)*bm), cols [j*bn, ..)
    expert = expert_ids[i * block_m]          -1: a padding block, the program returns at once
    for kb in range(K / block_k):             acc[bm, bn] in float32
        acc += (x[rows, kb] @ w[expert, cols, kb].T) * x_scale[rows, kb*bk // 128]
                                                     * w_scale[expert, j*bn // 128, kb*bk // 128]

Worked example, block_m 16, experts 3 and 7 with 5 and 20 rows: expert_ids has 3 on rows 0-4,
-1 on 5-15, 7 on rows 16-35, -1 on 36-47; programs of row blocks 0, 1 and 2 stream w[3], w[7]
and w[7]; blocks past the last segment return. The grid launches row blocks first (an expert's
blocks share its weight tile through L2) or column tiles first (a row block's x rows stay in L2);
FP8 tiles go to the dot as they are (`GroupedGemmConfig.is_fp8_dot`, `is_fp8_wgmma`), else they
are upcast to bf16 in-kernel (exact). Padding rows of the output are unspecified, as the
`GroupedGemm` contract allows; nothing is read or written out of bounds.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.kernels import _fp8_dot, _triton, _wide_offsets

SCALE_BLOCK = 128  # vLLM's FP8 block: one scale per 128 K columns (and 128 N rows of w)
MIN_BLOCK = 16  # smallest tile side Triton's dot takes
SHORT_SEGMENT_ROWS = 16  # mean rows per expert up to which rows-first layouts take [16, 64] tiles
WGMMA_ROWS = 64  # rows of one warpgroup's Hopper wgmma: block_m from which FP8 runs untransposed
MAX_ALIGNMENT = 64  # widest segment multiple `PallasGemm` tiles (its block_m cap)
# Layout rows from which the FP8 heuristic launches column tiles first (BENCHMARKS.md "Thresholds":
# COLUMN_MAJOR_MIN_ROWS)
COLUMN_MAJOR_MIN_ROWS = 512
_FLOAT_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupedGemmConfig:
    """Tunables of the grouped GEMM kernel.

    Attributes:
      block_m: rows per program, a power of two >= 16 dividing the layout's alignment.
      block_n: output columns per program (power of two >= 16; at most 128 and dividing 128 for
        FP8, so one weight scale covers the tile).
      block_k: K columns per loop step (power of two >= 16; divides 128 for FP8).
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages of the K loop.
      is_transposed: compute the tile as w_tile @ x_tile.T ([block_n, block_m]), so the weight
        rows fill the matrix unit's large M side when block_m is small (Hopper's wgmma wants 64).
      is_fp8_dot: feed FP8 tiles to the dot as they are instead of upcasting them to bf16.
      is_column_major: launch the grid column tiles first, so the N tiles of one row block run
        together and share its x rows through L2 (else row blocks first: x is streamed once
        per column tile, from DRAM once it outgrows L2).
      is_fp8_wgmma: let Triton run the FP8 dots on Hopper's FP8 wgmma, whose accumulator sums
        each 128-wide K block with less precision than float32 before the kernel scales it and
        adds it in float32 (DeepGEMM's and vLLM's recipe; `kernels/_fp8_dot.py`). Without it
        Pallas' lowering asks for exact accumulation and Triton upcasts the FP8 tiles to half
        precision for `mma.sync`. Needs
        `is_fp8_dot` and FP8 operands. The heuristic turns it on for FP8.
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    is_transposed: bool = False
    is_fp8_dot: bool = False
    is_column_major: bool = False
    is_fp8_wgmma: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GroupedGemmConfig.{name}={value} but a power of two is needed")
        for name in ("block_m", "block_n", "block_k"):
            if getattr(self, name) < MIN_BLOCK:
                raise ValueError(
                    f"GroupedGemmConfig.{name}={getattr(self, name)} but >= {MIN_BLOCK} is needed"
                )
        if self.num_stages < 1:
            raise ValueError(f"GroupedGemmConfig.num_stages={self.num_stages} but >= 1 is needed")
        if self.is_fp8_wgmma and not self.is_fp8_dot:
            raise ValueError(
                "GroupedGemmConfig.is_fp8_wgmma=True needs is_fp8_dot=True (FP8 tiles fed to the "
                "dot as they are)"
            )


def heuristic_config(
    *, num_rows: int, num_experts: int, n: int, k: int, alignment: int, is_fp8: bool
) -> GroupedGemmConfig:
    """Tiles for an [M, K] x [E, N, K] call whose segments are `alignment`-row multiples.

    block_m is the largest power of two <= `MAX_ALIGNMENT` dividing the alignment and at most the
    mean segment length (M / E rounded up to a power of two, at least 16). FP8 feeds the dot
    directly on Hopper's FP8 wgmma (`is_fp8_wgmma`). Short segments launched rows first (T=1,
    and bf16) take [16, 64] tiles (more programs to stream the weights); FP8 short segments
    launched columns first and longer ones take [., 128] tiles, computed transposed while
    block_m < 64 so the weight rows fill the large side of Hopper's wgmma. FP8 launches the
    grid column tiles first from `COLUMN_MAJOR_MIN_ROWS` layout rows, where x outgrows L2
    (`benchmarks/gemm_sweep.py` times the alternatives; BENCHMARKS.md).
    """
    mean_rows = max(MIN_BLOCK, _triton.next_power_of_2(-(-num_rows // max(num_experts, 1))))
    block_cap = min(MAX_ALIGNMENT, mean_rows)
    block_m = max(MIN_BLOCK, _triton.largest_power_of_2_divisor(alignment, block_cap))
    is_column_major = is_fp8 and num_rows >= COLUMN_MAJOR_MIN_ROWS
    # FP8 short segments launched columns first take the wide transposed tile too (T=8, T=32).
    is_wide = mean_rows > SHORT_SEGMENT_ROWS or is_column_major
    fills_wgmma = block_m >= WGMMA_ROWS
    block_n = max(MIN_BLOCK, _triton.largest_power_of_2_divisor(n, 128 if is_wide else 64))
    block_k = max(MIN_BLOCK, _triton.largest_power_of_2_divisor(k, 128))
    return GroupedGemmConfig(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_stages=_stages(mean_rows, block_m, is_fp8=is_fp8, is_wide=is_wide),
        is_transposed=(is_wide and not fills_wgmma) or not is_fp8,
        is_fp8_dot=is_fp8,
        is_column_major=is_column_major,
        is_fp8_wgmma=is_fp8,
    )


def _stages(mean_rows: int, block_m: int, *, is_fp8: bool, is_wide: bool) -> int:
    """Pipeline stages of the K loop by mean segment rows, row block and tile width (FP8 swept;
    bf16 not)."""
    if is_fp8 and block_m >= WGMMA_ROWS:
        return 4
    if not is_wide:  # short segments launched rows first
        return 6 if is_fp8 else 4
    return 5 if is_fp8 and mean_rows <= 2 * SHORT_SEGMENT_ROWS else 3


def _grouped_gemm_kernel(
    # inputs
    expert_ids_ref,
    x_ref,
    x_scales_ref,
    w_ref,
    w_scales_ref,
    # outputs
    out_ref,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_k_blocks: int,
    num_experts: int,
    is_transposed: bool,
    is_fp8_dot: bool,
    is_packed: bool,
    is_column_major: bool,
):
    """One [block_m, block_n] output tile of one expert's rows (see the module docstring).

    With `is_packed`, w_ref holds the FP8 weights as uint16 byte pairs [E, N, K/2] (see
    `_needs_packing`): the low bytes are the even K columns, the high bytes the odd ones, so
    the tile's dot is split into those two halves, each against x's matching strided columns.
    """
    row_axis, col_axis = (1, 0) if is_column_major else (0, 1)
    row0 = pl.program_id(row_axis) * block_m
    col0 = pl.program_id(col_axis) * block_n
    expert = expert_ids_ref[row0]

    @pl.when((expert >= 0) & (expert < num_experts))
    def _compute():
        def step(i, acc):
            k0 = pl.multiple_of(i * block_k, block_k)
            rows = pl.ds(row0, block_m)
            if is_packed:
                pairs = w_ref[expert, pl.ds(col0, block_n), pl.ds(k0 // 2, block_k // 2)]
                halves = [
                    (x_ref[rows, pl.ds(k0 + odd, block_k // 2, stride=2)], _byte(pairs, odd))
                    for odd in (0, 1)
                ]
            else:
                halves = [
                    (
                        x_ref[rows, pl.ds(k0, block_k)],
                        w_ref[expert, pl.ds(col0, block_n), pl.ds(k0, block_k)],
                    )
                ]
            part = None
            for x, w in halves:
                if not (is_fp8_dot and x.dtype == quant.FP8_DTYPE):
                    x, w = x.astype(_compute_dtype(x.dtype)), w.astype(_compute_dtype(w.dtype))
                contract = (((1,), (1,)), ((), ()))
                a, b = (w, x) if is_transposed else (x, w)
                dot = jax.lax.dot_general(a, b, contract, preferred_element_type=jnp.float32)
                part = dot if part is None else part + dot
            if x_scales_ref is None:
                return acc + part
            # One scale per output element ([1, bm] or [bm, 1] times the tile's weight scale), so
            # the tile takes one multiply-add rather than part * x_scale * w_scale.
            group = k0 // SCALE_BLOCK
            x_scale = x_scales_ref[pl.ds(row0, block_m), group]
            w_scale = w_scales_ref[expert, col0 // SCALE_BLOCK, group]
            scale = (x_scale[None, :] if is_transposed else x_scale[:, None]) * w_scale
            return acc + part * scale

        shape = (block_n, block_m) if is_transposed else (block_m, block_n)
        acc = jax.lax.fori_loop(0, num_k_blocks, step, jnp.zeros(shape, jnp.float32))
        if is_transposed:
            acc = acc.T
        out_ref[pl.ds(row0, block_m), pl.ds(col0, block_n)] = acc.astype(out_ref.dtype)


def _grouped_gemm_unscaled_kernel(expert_ids_ref, x_ref, w_ref, out_ref, **kwargs):
    _grouped_gemm_kernel(expert_ids_ref, x_ref, None, w_ref, None, out_ref, **kwargs)


def _byte(pairs: jax.Array, odd: int) -> jax.Array:
    """FP8 values of the low (odd=0) or high (odd=1) bytes of uint16 pairs."""
    byte = ((pairs >> (8 * odd)) & 0xFF).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(byte, quant.FP8_DTYPE)


def _needs_packing(w: jax.Array) -> bool:
    """True for 1-byte weights of 2**31 to 2**32 elements when JAX would address them wrongly.

    Pallas Triton computes pointer offsets in int32 unless an operand exceeds 2**32 *bytes*, so
    element offsets of 1-byte arrays past 2**31 elements wrap (DeepSeek-V3's w2: 3.8e9 elements).
    `moe_jax.kernels._wide_offsets` patches that before lowering; only where it cannot apply
    (`_triton.wide_byte_offsets()` False) do such weights travel as uint16 byte pairs (half the
    elements; a free bitcast, but the unpacking halves GEMM2's bandwidth).
    """
    if _triton.wide_byte_offsets():
        return False
    return _wide_offsets.needs_wide_offsets(w.shape, w.dtype) and w.size <= 2**32


def _compute_dtype(dtype) -> jnp.dtype:
    """bf16 for FP8 (exact upcast) and bf16; f16 stays f16."""
    return jnp.float16 if dtype == jnp.float16 else jnp.bfloat16


def check_operands(x, w, expert_ids, x_scales, w_scales, alignment) -> bool:
    """Checks a contiguous-layout GEMM's operands (shapes, dtypes, scales, a 16-row multiple
    alignment), naming the one at fault; True for FP8 operands with block scales."""
    pair = (jnp.dtype(x.dtype).name, jnp.dtype(w.dtype).name)
    grouped_gemm.check_contiguous_operands(x, w, expert_ids, x_scales, w_scales)
    if not isinstance(alignment, int) or alignment < MIN_BLOCK or alignment % MIN_BLOCK:
        raise ValueError(f"{alignment=} but a positive multiple of {MIN_BLOCK} rows is needed")
    is_fp8 = pair == ("float8_e4m3fn", "float8_e4m3fn")
    if not is_fp8 and not (pair[0] == pair[1] and pair[0] in _FLOAT_DTYPES):
        raise TypeError(f"x.dtype, w.dtype = {pair}: pass both float8_e4m3fn, bf16 or f16")
    if not is_fp8:
        if x_scales is not None or w_scales is not None:
            raise ValueError(f"x_scales/w_scales are for FP8 operands, not {pair}")
        return False
    if x_scales is None or w_scales is None:
        raise ValueError("FP8 operands need x_scales and w_scales")
    if w.shape[1] % SCALE_BLOCK or w.shape[2] % SCALE_BLOCK:  # the scales' shapes are checked
        raise ValueError(f"{w.shape=}: FP8 needs N and K multiples of {SCALE_BLOCK}")
    return True


def grouped_gemm_contiguous(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array | None = None,
    w_scales: jax.Array | None = None,
    alignment: int,
    out_dtype: jnp.dtype = jnp.bfloat16,
    config: GroupedGemmConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped GEMM on the contiguous layout: y[r] = x[r] @ w[expert_ids[r]].T.

    Args:
      x: [M, K] rows sorted by expert in segments padded to a multiple of `alignment` rows;
        float8_e4m3fn (with `x_scales`), bf16 or f16.
      w: [E, N, K] weights in x's dtype.
      expert_ids: int32[M] expert of each row, -1 on padding rows.
      x_scales: float32[M, K/128] FP8 row-group scales, else None.
      w_scales: float32[E, N/128, K/128] FP8 block scales, else None.
      alignment: the segments' row multiple (a multiple of 16); `config.block_m` must divide it.
      out_dtype: output dtype (bf16 on the FP8 path).
      config: tiles; None picks `heuristic_config(...)`.
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
      [M, N] in `out_dtype`; padding rows are unspecified.

    Example:
      >>> x = jnp.ones((16, 32), jnp.bfloat16); w = jnp.ones((2, 16, 32), jnp.bfloat16)
      >>> ids = jnp.array([1] * 3 + [-1] * 13, jnp.int32)
      >>> y = grouped_gemm_contiguous(x, w, ids, alignment=16, interpret=True)
      >>> y.shape, float(y[0, 0])
      ((16, 16), 32.0)
    """
    has_scales = check_operands(x, w, expert_ids, x_scales, w_scales, alignment)
    num_rows, k = x.shape
    num_experts, n, _ = w.shape
    if config is None:
        config = heuristic_config(
            num_rows=num_rows,
            num_experts=num_experts,
            n=n,
            k=k,
            alignment=alignment,
            is_fp8=has_scales,
        )
    _check_config(config, n=n, k=k, alignment=alignment, is_fp8=has_scales)
    if num_rows == 0 or n == 0 or k == 0 or num_experts == 0:
        # No grid to launch: K = 0 sums nothing (zeros); with E = 0 every row is padding.
        return jnp.zeros((num_rows, n), out_dtype)
    # Segments are alignment multiples but M need not be: pad it to whole row blocks.
    padded_rows = -(-num_rows // config.block_m) * config.block_m
    expert_ids = layouts.ids_as_int32(expert_ids)  # 2**32 + 1 is padding, not expert 1
    if padded_rows != num_rows:
        extra = padded_rows - num_rows
        x = jnp.pad(x, ((0, extra), (0, 0)))
        expert_ids = jnp.pad(expert_ids, (0, extra), constant_values=-1)
        x_scales = None if x_scales is None else jnp.pad(x_scales, ((0, extra), (0, 0)))
    is_packed = _needs_packing(w)
    if is_packed:  # [E, N, K] FP8 -> [E, N, K/2] uint16 pairs: same bytes, half the elements
        w = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(w, jnp.uint8).reshape(num_experts, n, k // 2, 2),
            jnp.uint16,
        )
    kernel = functools.partial(
        _grouped_gemm_kernel if has_scales else _grouped_gemm_unscaled_kernel,
        block_m=config.block_m,
        block_n=config.block_n,
        block_k=config.block_k,
        num_k_blocks=k // config.block_k,
        num_experts=num_experts,
        is_transposed=config.is_transposed,
        is_fp8_dot=config.is_fp8_dot,
        is_packed=is_packed,
        is_column_major=config.is_column_major,
    )
    grid = (padded_rows // config.block_m, n // config.block_n)
    operands = (expert_ids, x, x_scales, w, w_scales) if has_scales else (expert_ids, x, w)
    name = (
        f"grouped_gemm_{config.block_m=}_{config.block_n=}_{config.block_k=}"
        f"_{config.num_warps=}_{config.num_stages=}_{config.is_transposed=}"
        f"_{config.is_fp8_dot=}_{is_packed=}_{config.is_column_major=}_{config.is_fp8_wgmma=}"
    )
    if config.is_fp8_wgmma and not interpret:
        # Each dot is one block_k-wide K block, scaled and summed in float32 right after.
        _fp8_dot.allow_imprecise_accumulation(name, config.block_k)
    with _triton.quiet_triton_deprecation():
        y = pl.pallas_call(
            kernel,
            grid=grid[::-1] if config.is_column_major else grid,
            out_shape=jax.ShapeDtypeStruct((padded_rows, n), out_dtype),
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=name,
        )(*operands)
    return y[:num_rows]


def _check_config(config: GroupedGemmConfig, *, n: int, k: int, alignment: int, is_fp8: bool):
    if alignment % config.block_m:
        raise ValueError(
            f"{config.block_m=} does not divide {alignment=}: a row block would span experts"
        )
    if n % config.block_n or k % config.block_k:
        raise ValueError(f"{config.block_n=} and {config.block_k=} must divide N={n} and K={k}")
    if is_fp8 and (SCALE_BLOCK % config.block_n or SCALE_BLOCK % config.block_k):
        raise ValueError(
            f"{config.block_n=} and {config.block_k=} must divide {SCALE_BLOCK} (FP8 block scales)"
        )
    if config.is_fp8_wgmma and not is_fp8:
        raise ValueError(f"{config.is_fp8_wgmma=} but the operands are not FP8 with block scales")


class PallasGemm(grouped_gemm.GroupedGemm):
    """GEMM backend running `grouped_gemm_contiguous` (compiled, or in interpret mode).

    It takes segments of 16 to 64 rows (`alignment`, `max_alignment`; `moe_jax.plan` chooses
    by the mean routed pairs per expert), and the heuristic's row blocks grow with them. The
    masked layout runs on the same kernel: each expert's block of max_m rows (padded to a
    multiple of block_m) is a segment, rows past the expert's count padding.
    """

    alignment = MIN_BLOCK
    max_alignment = MAX_ALIGNMENT

    def __init__(
        self, *, name: str, interpret: bool, config: GroupedGemmConfig | None = None
    ) -> None:
        self.name = name
        self.interpret = interpret
        self.config = config

    def unsupported_reason(self, problem: grouped_gemm.GemmProblem) -> str | None:
        if not self.interpret and problem.platform != "gpu":
            return (
                f"the compiled Pallas Triton kernel needs an NVIDIA GPU, not {problem.platform!r}"
            )
        if problem.layout not in grouped_gemm.LAYOUTS:
            return f"layout {problem.layout!r} is not one of {grouped_gemm.LAYOUTS}"
        pair = (problem.x_dtype, problem.w_dtype)
        if problem.is_fp8:
            if problem.x_dtype != "float8_e4m3fn":
                return f"FP8 weights need FP8 activations, got x {problem.x_dtype}"
            if problem.n % SCALE_BLOCK or problem.k % SCALE_BLOCK:
                return (
                    f"FP8 needs N and K multiples of {SCALE_BLOCK}, got N={problem.n} K={problem.k}"
                )
        elif not (pair[0] == pair[1] and pair[0] in _FLOAT_DTYPES):
            return f"runs FP8, bf16 or f16 operands of one dtype, not x {pair[0]} with w {pair[1]}"
        elif problem.n % MIN_BLOCK or problem.k % MIN_BLOCK:
            return f"needs N and K multiples of {MIN_BLOCK}, got N={problem.n} K={problem.k}"
        if problem.layout == "contiguous":
            align = problem.alignment or self.alignment
            if align % MIN_BLOCK:
                return f"alignment {align} is not a multiple of {MIN_BLOCK} rows (one row block)"
        return None

    def _config(self, num_rows, w, alignment, is_fp8):
        if self.config is not None:
            return self.config
        num_experts, n, k = w.shape
        return heuristic_config(
            num_rows=num_rows, num_experts=num_experts, n=n, k=k, alignment=alignment, is_fp8=is_fp8
        )

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        del expert_ends  # each row block's expert comes from expert_ids
        config = self._config(x.shape[0], w, alignment, x_scales is not None)
        return grouped_gemm_contiguous(
            x,
            w,
            expert_ids,
            x_scales=x_scales,
            w_scales=w_scales,
            alignment=alignment,
            out_dtype=out_dtype,
            config=config,
            interpret=self.interpret,
        )

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        num_experts, max_m, _ = x.shape
        del expected_m  # the grid covers every block; blocks past the counts return at once
        if num_experts == 0 or max_m == 0:  # no rows: no segment to view as contiguous
            return jnp.zeros((num_experts, max_m, w.shape[1]), out_dtype)
        config = self._config(num_experts * max_m, w, MIN_BLOCK, x_scales is not None)
        rows, row_scales, expert_ids, rows_per_block = grouped_gemm.masked_as_contiguous(
            x, x_scales, num_rows_per_expert, config.block_m
        )
        y = grouped_gemm_contiguous(
            rows,
            w,
            expert_ids,
            x_scales=row_scales,
            w_scales=w_scales,
            alignment=rows_per_block,
            out_dtype=out_dtype,
            config=config,
            interpret=self.interpret,
        )
        return y.reshape(num_experts, rows_per_block, -1)[:, :max_m]


grouped_gemm.GEMMS.register(PallasGemm(name="pallas", interpret=False))
