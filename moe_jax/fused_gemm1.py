"""The fused GEMM1: GEMM1, act(gate) * up and the FP8 quantization for GEMM2 as one op.

    q, scales = fused_gemm1(x, w1, expert_ids, x_scales=..., w1_scales=..., alignment=...)

is `act_quant.act_and_quant(GEMM1(x))` on the contiguous layout (`moe_jax.layouts`): only the FP8
codes and their scales leave the op, never GEMM1's bf16 [M, 2I]. Each backend declares its form
(`FusedGemm1.gathers_rows`):

- contiguous: x is the layout's rows float8_e4m3fn[M, H] with x_scales float32[M, H/128];
- gathered: x is the tokens float8_e4m3fn[T, H] with x_scales float32[T, H/128], and row r of the
  layout is token `row_sources[r]` (-1 on padding rows): the layer then only routes
  (`moe_jax.permute.route`) and the rows are never copied.

Returns (float8_e4m3fn[M, I], float32[M, I/128]), quantized in groups of 128 columns; padding rows
are unspecified. FP8 inference only: differentiating raises TypeError.

Backends (`FUSED_GEMM1S`): "xla" and "xla_gathered", the reference (XLA's grouped GEMM, then
`act_quant.act_and_quant_reference`; everywhere), and "mosaic_fp8", "mosaic_fp8_gathered"
(`moe_jax.kernels.mosaic_fp8_gemm`, Hopper). "auto"'s order is `moe_jax.plan.fused_gemm1_order`.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, layouts, quant
from moe_jax.act_quant import act_and_quant_reference, without_gradient
from moe_jax.registry import AUTO, Registry

GROUP_SIZE = quant.DEFAULT_BLOCK_SHAPE[1]  # columns per scale of the output (GEMM2's K block)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedGemm1Problem:
    """What a fused GEMM1 must run, in static terms.

    Attributes:
      gemm: GEMM1's problem: [M, H] x w1 [E, 2I, H] on the contiguous layout, its `alignment`
        the layout's segment multiple.
      activation: the gated activation.
      group_size: columns per scale GEMM2 reads (the call's quantization), None off the FP8 path.
    """

    gemm: grouped_gemm.GemmProblem
    activation: str
    group_size: int | None


class FusedGemm1(abc.ABC):
    """One fused GEMM1 backend: subclasses set `name` (and `gathers_rows` for the gathered form),
    implement `run` and may refuse problems in `backend_reason`.

    Attributes:
      gathers_rows: the gathered form (module docstring): `run` takes the tokens and
        `row_sources`; else the contiguous form, which takes the layout's rows.
      is_scales_group_major: the contiguous form reads the rows' scales [M, H/128] through their
        transpose, so the permute writes them that way (`GroupedGemm.is_scales_group_major`).
    """

    name: str = ""
    gathers_rows: bool = False
    is_scales_group_major: bool = False

    def unsupported_reason(self, problem: FusedGemm1Problem) -> str | None:
        """None if this backend runs `problem`, else why not: the op's own rules (FP8 rows and
        weights on the contiguous layout, groups of 128, I a multiple of 128), then the
        backend's."""
        gemm = problem.gemm
        if gemm.layout != "contiguous":
            return f"layout {gemm.layout!r}: the fused GEMM1 runs on the contiguous layout"
        if gemm.x_dtype != "float8_e4m3fn" or not gemm.is_fp8:
            return (
                f"x {gemm.x_dtype} and w1 {gemm.w_dtype}: the fused GEMM1 runs FP8 inference "
                "only (FP8 weights with w1_scale/w2_scale, no recipe)"
            )
        if problem.group_size != GROUP_SIZE:
            return f"quantizes in groups of {GROUP_SIZE} columns, not {problem.group_size}"
        if gemm.n % (2 * GROUP_SIZE) or gemm.k % GROUP_SIZE:
            return f"needs I and H multiples of {GROUP_SIZE}, got 2I={gemm.n} H={gemm.k}"
        return self.backend_reason(problem)

    def backend_reason(self, problem: FusedGemm1Problem) -> str | None:
        """This backend's own refusal of a problem the op takes (None: it runs)."""
        del problem

    @abc.abstractmethod
    def run(
        self, x, w1, expert_ids, row_sources, *, x_scales, w1_scales, alignment, activation
    ) -> tuple[jax.Array, jax.Array]:
        """`fused_gemm1` with this backend (row_sources None in the contiguous form)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _order(problem: FusedGemm1Problem) -> tuple[str, ...]:
    from moe_jax.plan import fused_gemm1_order

    return fused_gemm1_order(problem)[0]


FUSED_GEMM1S: Registry[FusedGemm1] = Registry(
    "fused GEMM1",
    preference=_order,
    modules={
        "mosaic_fp8": "moe_jax.kernels.mosaic_fp8_gemm",
        "mosaic_fp8_gathered": "moe_jax.kernels.mosaic_fp8_gemm",
    },
)


def fused_gemm1(
    x: jax.Array,
    w1: jax.Array,
    expert_ids: jax.Array,
    *,
    x_scales: jax.Array,
    w1_scales: jax.Array,
    alignment: int,
    activation: str = "silu",
    row_sources: jax.Array | None = None,
    impl: str | FusedGemm1 = AUTO,
) -> tuple[jax.Array, jax.Array]:
    """act(gate) * up of GEMM1, quantized for GEMM2, in one op (module docstring).

    Args:
      x: float8_e4m3fn rows [M, H] of the contiguous layout, or the tokens [T, H] with
        `row_sources` (the gathered form).
      w1: float8_e4m3fn[E, 2I, H]: gate rows, then up rows.
      expert_ids: int32[M] expert of each row, -1 on padding rows.
      x_scales: float32 row-group scales of x: [M, H/128] (or [T, H/128] gathered).
      w1_scales: float32[E, 2I/128, H/128].
      alignment: the layout's segment multiple.
      activation: the gated activation.
      row_sources: int[M] the token of each row (-1 on padding), for a gathered backend.
      impl: a name of `FUSED_GEMM1S`, a `FusedGemm1`, or "auto" (a backend of the form
        `row_sources` asks for).

    Returns:
      (float8_e4m3fn[M, I], float32[M, I/128]); padding rows unspecified.
    """
    problem = FusedGemm1Problem(
        gemm=grouped_gemm.GemmProblem.of(x, w1, num_pairs=expert_ids.shape[0], alignment=alignment),
        activation=activation,
        group_size=GROUP_SIZE,
    )
    backend = FUSED_GEMM1S.select(impl, problem)
    if (row_sources is not None) != backend.gathers_rows:
        form = (
            "gathered (pass row_sources)" if backend.gathers_rows else "contiguous (no row_sources)"
        )
        raise ValueError(f"fused GEMM1 {backend.name!r} is {form}, got {row_sources=}")
    kwargs = dict(
        x_scales=x_scales, w1_scales=w1_scales, alignment=alignment, activation=activation
    )
    return without_gradient(lambda x: backend.run(x, w1, expert_ids, row_sources, **kwargs))(x)


def gather_rows(
    x_tokens: jax.Array, x_scales: jax.Array, row_sources: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The layout's rows and their scales from the tokens: row r is token `row_sources[r]`
    (padding rows, -1, read token 0; every row is zeros without tokens)."""
    num_rows = row_sources.shape[0]
    if x_tokens.shape[0] == 0:
        rows = jnp.zeros((num_rows, x_tokens.shape[1]), x_tokens.dtype)
        return rows, jnp.zeros((num_rows, x_scales.shape[1]), jnp.float32)
    sources = jnp.maximum(layouts.ids_as_int32(row_sources), 0)
    rows = jnp.take(x_tokens, sources, axis=0, mode="clip")
    return rows, jnp.take(x_scales, sources, axis=0, mode="clip")


def fused_gemm1_reference(
    x, w1, expert_ids, *, x_scales, w1_scales, alignment, activation="silu"
) -> tuple[jax.Array, jax.Array]:
    """The contiguous form in XLA: the grouped GEMM on the dequantized operands rounded to bf16
    (GEMM1's output), then `act_and_quant_reference`; padding rows are the quantized zeros."""
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
    return act_and_quant_reference(h, activation=activation, group_size=GROUP_SIZE)


class XlaFusedGemm1(FusedGemm1):
    """The reference backend, either form (the gathered one gathers the rows in XLA first)."""

    def __init__(self, *, gathers_rows: bool = False):
        self.gathers_rows = gathers_rows
        self.name = "xla_gathered" if gathers_rows else "xla"

    def run(self, x, w1, expert_ids, row_sources, *, x_scales, w1_scales, alignment, activation):
        if self.gathers_rows:
            x, x_scales = gather_rows(x, x_scales, row_sources)
        return fused_gemm1_reference(
            x,
            w1,
            expert_ids,
            x_scales=x_scales,
            w1_scales=w1_scales,
            alignment=alignment,
            activation=activation,
        )


FUSED_GEMM1S.register(XlaFusedGemm1())
FUSED_GEMM1S.register(XlaFusedGemm1(gathers_rows=True))
