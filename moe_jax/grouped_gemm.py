"""Grouped expert GEMMs: the contract, the backend registry, and the XLA reference backend.

Both layouts compute `y[row] = x[row] @ w[expert(row)].T` (NT, as DeepGEMM and vLLM):

- contiguous: x [M, K] in expert-major rows (see `moe_jax.layouts`), expert_ids int32[M] with -1 on
  padding rows, expert_ends int32[E] segment ends; y [M, N]. Rows of padding are unspecified (a
  backend may skip them; DeepGEMM does) and must not be read.
- masked: x [E, max_m, K] with `num_rows_per_expert[e]` valid rows; y [E, max_m, N], rows past the
  count unspecified.

FP8 operands carry vLLM's block scales: x_scales float32 per row per 128 columns, w_scales
float32 [E, ceil(N/128), ceil(K/128)]. The product is
`sum_kb (xq . wq)[kb] * x_scale[kb] * w_scale[n // 128, kb]`, accumulated in float32.

Backends are chosen through the `GEMMS` registry (`moe_jax.registry`): a name, a `GroupedGemm`, or
"auto" (in `moe_jax.plan.gemm_order`'s order). Names map to modules that are imported only when
asked for, so a backend whose library is missing stays listed and says why it cannot run.
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import layouts, quant
from moe_jax.registry import Registry, current_platform

LAYOUTS = ("contiguous", "masked")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmProblem:
    """What a backend must run, in static terms.

    Attributes:
      layout: "contiguous" or "masked".
      n: output columns N (w.shape[1]).
      k: reduction size K (w.shape[2]).
      num_experts: E, experts in w.
      num_pairs: routed (token, slot) pairs the rows hold at most (T * k); with num_experts it
        gives the rows per expert that "auto" weighs (decode-size calls want small row blocks).
      x_dtype: name of the activation dtype ("bfloat16", "float32", "float8_e4m3fn").
      w_dtype: name of the weight dtype.
      platform: "cpu", "gpu", ... as `moe_jax.registry.current_platform()` gives it.
      alignment: contiguous layout: rows per expert segment multiple the caller will use, or None
        to take the backend's own (`moe_jax.plan.segment_alignment`).
      max_m: masked layout: rows per expert block.
    """

    layout: str
    n: int
    k: int
    num_experts: int
    num_pairs: int
    x_dtype: str
    w_dtype: str
    platform: str = "cpu"
    alignment: int | None = None
    max_m: int | None = None

    @property
    def is_fp8(self) -> bool:
        return self.w_dtype == "float8_e4m3fn"

    @classmethod
    def of(cls, x, w, *, layout: str = "contiguous", **fields) -> GemmProblem:
        """The problem of rows x ([M, K]; masked: [E, max_m, K]) times w [E, N, K] on this
        platform; `fields` (num_pairs, dtype names, alignment) replace what the arrays give."""
        is_masked = layout == "masked"
        given = dict(
            layout=layout,
            n=w.shape[1],
            k=w.shape[2],
            num_experts=w.shape[0],
            num_pairs=x.shape[0] * x.shape[1] if is_masked else x.shape[-2],
            x_dtype=jnp.dtype(x.dtype).name,
            w_dtype=jnp.dtype(w.dtype).name,
            platform=current_platform(),
            max_m=x.shape[1] if is_masked else None,
        )
        return cls(**(given | fields))


class GroupedGemm(abc.ABC):
    """One grouped-GEMM backend. Subclasses set `name` and implement the three methods.

    Attributes:
      name: registry name.
      alignment: the contiguous layout's segment multiple this backend takes (the smallest,
        where it takes a range).
      max_alignment: the widest segment multiple it tiles, for a backend whose row tiles grow
        with the segments (`moe_jax.plan.segment_alignment` chooses); None: `alignment` only.
      is_scales_group_major: the backend reads FP8 activation scales [M, K/128] through their
        transpose [K/128, M] (DeepGEMM's MN-major scales, the Mosaic kernel's row-block
        loads). The contiguous layout's producers (permute, act*up + quantize) then write them
        that way, so XLA cancels the transposes and no copy runs between the kernels.
    """

    name: str = ""
    alignment: int = layouts.DEFAULT_ALIGNMENT
    max_alignment: int | None = None
    is_scales_group_major: bool = False

    @abc.abstractmethod
    def unsupported_reason(self, problem: GemmProblem) -> str | None:
        """None if this backend runs `problem`, else why not (shown to the user)."""

    @abc.abstractmethod
    def contiguous(
        self,
        x: jax.Array,
        w: jax.Array,
        expert_ids: jax.Array,
        expert_ends: jax.Array,
        *,
        x_scales: jax.Array | None = None,
        w_scales: jax.Array | None = None,
        alignment: int,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """[M, K] x [E, N, K] -> [M, N] on the contiguous layout (module docstring)."""

    @abc.abstractmethod
    def masked(
        self,
        x: jax.Array,
        w: jax.Array,
        num_rows_per_expert: jax.Array,
        *,
        x_scales: jax.Array | None = None,
        w_scales: jax.Array | None = None,
        expected_m: int | None = None,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """[E, max_m, K] x [E, N, K] -> [E, max_m, N] on the masked layout."""

    def contiguous_dgrad(
        self,
        dy: jax.Array,
        w: jax.Array,
        expert_ids: jax.Array,
        expert_ends: jax.Array,
        *,
        alignment: int,
        out_dtype: jnp.dtype,
    ) -> jax.Array:
        """dx[row] = dy[row] @ w[expert(row)]: [M, N] x [E, N, K] -> [M, K] (NN, the backward of
        `contiguous`). Default: `contiguous` against `jnp.swapaxes(w, 1, 2)` (a physical
        transpose in XLA); backends with an NN kernel override it. Float weights only."""
        return self.contiguous(
            dy,
            jnp.swapaxes(w, 1, 2),
            expert_ids,
            expert_ends,
            alignment=alignment,
            out_dtype=out_dtype,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _preference(problem: GemmProblem) -> tuple[str, ...]:
    from moe_jax.plan import gemm_order  # the one place "auto" is decided

    return gemm_order(problem)[0]


GEMMS: Registry[GroupedGemm] = Registry(
    "grouped GEMM",
    preference=_preference,
    modules={
        "deep_gemm": "moe_jax.interop.deep_gemm",
        "torch": "moe_jax.interop.torch_gemm",
        "mosaic": "moe_jax.kernels.mosaic_gemm",
        "mosaic_fp8": "moe_jax.kernels.mosaic_fp8_gemm",
        "pallas": "moe_jax.kernels.grouped_gemm",
    },
)


def check_contiguous_operands(x, w, expert_ids, x_scales, w_scales) -> None:
    """The shapes every backend's `contiguous` takes, naming the argument at fault: x [M, K],
    w [E, N, K], expert_ids int[M], and scales where given: x_scales [M, ceil(K/128)], w_scales
    [E, ceil(N/128), ceil(K/128)]. Backends add their own rules (dtypes, multiples)."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"{x.shape=} {w.shape=}: need x [M, K] and w [E, N, K] with one K")
    if expert_ids.shape != (x.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"{x.shape=} but {expert_ids.shape=} {expert_ids.dtype=}: need int[M]")
    w_groups = quant.block_scale_shape(w.shape)  # [E, ceil(N/128), ceil(K/128)]
    if x_scales is not None and x_scales.shape != (x.shape[0], w_groups[-1]):
        raise ValueError(
            f"{x_scales.shape=} but [M, ceil(K/128)] = {(x.shape[0], w_groups[-1])} is needed "
            f"for {x.shape=}"
        )
    if w_scales is not None and w_scales.shape != w_groups:
        raise ValueError(
            f"{w_scales.shape=} but [E, ceil(N/128), ceil(K/128)] = {w_groups} is needed for "
            f"{w.shape=}"
        )


def dequant_rows(x: jax.Array, x_scales: jax.Array | None) -> jax.Array:
    """float32 view of GEMM activations (FP8 rows times their per-group scales)."""
    if x.dtype == quant.FP8_DTYPE:
        if x_scales is None:
            raise ValueError(f"{x.dtype=} needs x_scales")
        return quant.dequant_per_token_group(x, x_scales)
    return x


def masked_as_contiguous(
    x: jax.Array, x_scales: jax.Array | None, num_rows_per_expert: jax.Array, block_m: int
) -> tuple[jax.Array, jax.Array | None, jax.Array, int]:
    """The masked layout viewed as a contiguous one, for backends with a contiguous kernel.

    Each expert's block of max_m rows, padded to a multiple of `block_m`, becomes one segment;
    rows at or past the expert's count are padding (expert id -1).

    Args:
      x: [E, max_m, K] rows; x_scales: float32[E, max_m, K/128] or None.
      num_rows_per_expert: int[E] valid rows per expert.
      block_m: the kernel's row block.

    Returns:
      (rows [E * R, K], row scales [E * R, K/128] or None, expert_ids int32[E * R], R) with R the
      padded rows per expert; the kernel's [E * R, N] output reshapes to [E, R, N].
    """
    num_experts, max_m, k = x.shape
    rows_per_block = -(-max_m // block_m) * block_m
    pad = ((0, 0), (0, rows_per_block - max_m), (0, 0))
    rows = jnp.arange(rows_per_block, dtype=jnp.int32)
    is_valid = rows[None, :] < num_rows_per_expert.astype(jnp.int32)[:, None]
    expert_ids = jnp.where(is_valid, jnp.arange(num_experts, dtype=jnp.int32)[:, None], -1)
    flat_rows = jnp.pad(x, pad).reshape(num_experts * rows_per_block, k)
    flat_scales = None
    if x_scales is not None:
        flat_scales = jnp.pad(x_scales, pad).reshape(num_experts * rows_per_block, -1)
    return flat_rows, flat_scales, expert_ids.reshape(-1), rows_per_block


def dequant_weights(w: jax.Array, w_scales: jax.Array | None) -> jax.Array:
    """float32 view of FP8 block-quantized weights; other dtypes pass through."""
    if w.dtype == quant.FP8_DTYPE:
        if w_scales is None:
            raise ValueError(f"{w.dtype=} needs w_scales")
        return quant.dequant_per_block(w, w_scales)
    return w


class XlaGemm(GroupedGemm):
    """Reference backend in plain XLA; FP8 operands are dequantized to float32 first.

    The contiguous GEMM is a loop over `alignment`-row blocks, each against its one expert's
    weights (`jax.lax.ragged_dot` would be a masked dense product, E times the work). Its own
    segment multiple is 16 rows, so decode-size calls pad each routed expert to 16 rows, not 128.
    """

    name = "xla"
    alignment = 16

    def unsupported_reason(self, problem: GemmProblem) -> str | None:
        if problem.layout not in LAYOUTS:
            return f"layout {problem.layout!r} is not one of {LAYOUTS}"
        return None

    def contiguous(
        self, x, w, expert_ids, expert_ends, *, x_scales=None, w_scales=None, alignment, out_dtype
    ):
        check_contiguous_operands(x, w, expert_ids, x_scales, w_scales)
        if not isinstance(alignment, int) or alignment < 1 or x.shape[0] % alignment:
            raise ValueError(
                f"{alignment=} but x.shape={x.shape}: the layout's rows M must be a multiple of "
                "a positive alignment (its segments' multiple)"
            )
        a, b = dequant_rows(x, x_scales), dequant_weights(w, w_scales)
        compute = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(compute), b.astype(compute)
        if x.shape[0] == 0:
            return jnp.zeros((0, w.shape[1]), out_dtype)
        y = _blockwise_gemm(a, b, expert_ids, alignment)
        return jnp.where((expert_ids >= 0)[:, None], y, 0).astype(out_dtype)

    def masked(
        self, x, w, num_rows_per_expert, *, x_scales=None, w_scales=None, expected_m=None, out_dtype
    ):
        del expected_m  # a scheduling hint for tuned kernels; the reference needs none
        a, b = dequant_rows(x, x_scales), dequant_weights(w, w_scales)
        compute = jnp.promote_types(a.dtype, b.dtype)
        y = jnp.einsum(
            "emk,enk->emn",
            a.astype(compute),
            b.astype(compute),
            preferred_element_type=jnp.float32,
        )  # default precision: float32 follows jax.default_matmul_precision (TF32 on GPUs)
        is_valid = jnp.arange(x.shape[1])[None, :] < num_rows_per_expert[:, None]
        return jnp.where(is_valid[..., None], y, 0).astype(out_dtype)


def _blockwise_gemm(a: jax.Array, b: jax.Array, expert_ids: jax.Array, block: int) -> jax.Array:
    """y[M, N] for rows whose every `block`-row block belongs to one expert (or is padding)."""
    num_rows, k = a.shape
    blocks = a.reshape(num_rows // block, block, k)
    block_experts = expert_ids.reshape(-1, block)[:, 0]

    def one_block(args):
        rows, expert = args
        y = jnp.dot(rows, b[jnp.maximum(expert, 0)].T, preferred_element_type=jnp.float32)
        return jnp.where(expert >= 0, y, 0.0)

    return jax.lax.map(one_block, (blocks, block_experts)).reshape(num_rows, -1)


GEMMS.register(XlaGemm())
