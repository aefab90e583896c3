"""Layout ops: route (where each (token, slot) goes), permute (route, then copy the rows),
unpermute (rows -> weighted token sums) and per-expert token counts.

This front owns the contiguous layout's routing metadata and the choice of every implementation:
it checks each argument once, answers empty problems itself (nothing to route, copy or sum: the
XLA implementations' empty arrays, no kernel launch) and picks implementations by name through
`moe_jax.registry`, as every op does. The implementations only compute:

- `ROUTING_METADATA` (route): "xla" (`moe_jax.layouts.routing_metadata`), "pallas"
  (`moe_jax.kernels.routing_metadata`); "auto" is "xla" everywhere (`xla_routing_metadata_first`).
- `PERMUTES` (permute's row copy from the routed `sources`): "xla", "pallas"
  (`moe_jax.kernels.permute.gather_rows`).
- `UNPERMUTES`, `COUNTS`: "xla" (`moe_jax.layouts`), "pallas" (`moe_jax.kernels.unpermute`,
  `moe_jax.kernels.count`).

"auto" is "pallas" on a GPU and "xla" elsewhere (`registry.pallas_then_xla`), but for the
routing metadata. The kernels are listed by path (`registry.lazy`): none is imported until it
runs. Every implementation returns bit-identical layouts; unpermute sums in float32 in slot order.

Both permute and unpermute are differentiable (`jax.custom_vjp`), whatever implementation runs:

- permute: d x[t] = sum over the valid slots j of d rows[inverse[t, j]] (a gather-sum: the
  unpermute of the row cotangents without weights, by the `UNPERMUTES` implementation of the
  copy's name, "auto" where none has it).
- unpermute: d y[r] = g[t] * w[t, j] for the slot (t, j) that reads row r (slots of one token
  sharing a row, as in the masked layout, add their weights), zero on rows no slot reads; and
  d topk_weights[t, j] = <g[t], y[inverse[t, j]]> in float32, 0 where inverse is -1.
Index inputs (topk_ids, expert_map, inverse) get no cotangent.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax import layouts
from moe_jax.registry import (
    AUTO,
    FunctionImpl,
    OpProblem,
    Registry,
    current_platform,
    lazy,
    needs_gpu,
    pallas_then_xla,
)
from moe_jax.routing import require_int


def xla_routing_metadata_first(problem: OpProblem) -> tuple[str, ...]:
    """The routing metadata's preference: XLA on every platform; the Pallas kernel by name only
    (BENCHMARKS.md, Thresholds: `xla_routing_metadata_first`)."""
    del problem
    return ("xla",)


PERMUTES = Registry("permute", preference=pallas_then_xla)
UNPERMUTES = Registry("unpermute", preference=pallas_then_xla)
COUNTS = Registry("count_expert_num_tokens", preference=pallas_then_xla)
ROUTING_METADATA = Registry("routing_metadata", preference=xla_routing_metadata_first)


def _xla_gather_rows(
    x, x_scales, sources, *, is_scales_group_major: bool = False, is_padding_zeroed: bool = True
):
    """(x[sources[r]], x_scales[sources[r]]), zeros where sources[r] < 0. XLA lays out its own
    arrays and writes the padding rows either way, so neither flag changes anything here."""
    del is_scales_group_major, is_padding_zeroed
    return layouts.gather_rows(x, sources), (
        None if x_scales is None else layouts.gather_rows(x_scales, sources)
    )


def _kernel(path: str, refuse=needs_gpu) -> FunctionImpl:
    return FunctionImpl("pallas", lazy(f"moe_jax.kernels.{path}"), refuse)


PERMUTES.register(FunctionImpl("xla", _xla_gather_rows))
PERMUTES.register(_kernel("permute:gather_rows"))
UNPERMUTES.register(FunctionImpl("xla", layouts.unpermute_reference))
UNPERMUTES.register(_kernel("unpermute:unpermute"))
COUNTS.register(FunctionImpl("xla", layouts.count_expert_num_tokens))
COUNTS.register(_kernel("count:count_expert_num_tokens"))
ROUTING_METADATA.register(FunctionImpl("xla", layouts.routing_metadata))
ROUTING_METADATA.register(_kernel("routing_metadata:routing_metadata"))


# The dtypes `permute` moves (FP8 rows carry their scales along).
_ROW_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)))


def _check_positive(name: str, value) -> None:
    if require_int(name, value) < 1:
        raise ValueError(f"{name}={value} but a positive int is needed")


def _check_ids(topk_ids, expert_map, name: str = "topk_ids") -> None:
    """Raises naming `name` or `expert_map` unless they are int[T, k] and int[E_global]."""
    if topk_ids.ndim != 2 or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(
            f"{name}.shape={topk_ids.shape} {name}.dtype={topk_ids.dtype} but int[T, k] is needed"
        )
    if expert_map is not None and (
        expert_map.ndim != 1 or not jnp.issubdtype(expert_map.dtype, jnp.integer)
    ):
        raise TypeError(f"{expert_map.shape=} {expert_map.dtype=} but int[E_global] is needed")


def problem_for(x: jax.Array) -> OpProblem:
    """The `OpProblem` of an op whose main operand is `x`, on the default backend."""
    return OpProblem(platform=current_platform(), dtype=jnp.dtype(x.dtype).name)


def _select(registry: Registry, impl, operand: jax.Array, *, is_empty: bool):
    """`registry`'s implementation `impl` for `operand` (so a refused name raises even on an
    empty problem), or its "xla" one where there is nothing to compute (`is_empty`): an empty
    axis launches no kernel, and XLA's ops give the empty or zero result."""
    chosen = registry.select(impl, problem_for(operand))
    return registry.get("xla") if is_empty else chosen


def route(
    topk_ids: jax.Array,
    *,
    num_experts: int,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    impl: str = AUTO,
) -> layouts.ContiguousLayout:
    """The contiguous layout without its rows: where each (token, slot) goes and which token
    feeds each row (the first half of `permute`, and all a GEMM1 that reads the rows from the
    tokens itself needs: `moe_jax.plan.ExpertsPlan.gathers_rows`). Nothing is copied.

    Args:
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` go nowhere.
      num_experts: E, the number of local experts.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      alignment: segment length multiple (128 for DeepGEMM).
      impl: the routing metadata's implementation (`ROUTING_METADATA`).

    Returns:
      `moe_jax.layouts.ContiguousLayout` with M = `layouts.contiguous_num_rows(T, k, E,
      alignment)` rows, `rows` and `row_scales` None and `sources` int32[M] (-1 on padding).

    Example:
      >>> lay = route(jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4)
      >>> lay.sources.tolist(), lay.expert_ids.tolist()[:8], lay.inverse.tolist()
      ([0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1], [0, -1, -1, -1, 1, 1, 1, -1], [[4, 0], [5, 6]])
    """
    _check_ids(topk_ids, expert_map)
    _check_positive("num_experts", num_experts)
    _check_positive("alignment", alignment)
    local = layouts.map_expert_ids(topk_ids, num_experts=num_experts, expert_map=expert_map)
    num_rows = layouts.contiguous_num_rows(*topk_ids.shape, num_experts, alignment)
    chosen = _select(ROUTING_METADATA, impl, local, is_empty=local.size == 0)
    meta = chosen(local, num_experts=num_experts, alignment=alignment, num_rows=num_rows)
    return layouts.ContiguousLayout(
        rows=None,
        row_scales=None,
        expert_ids=meta.expert_ids,
        inverse=meta.inverse,
        num_tokens_per_expert=meta.num_tokens_per_expert,
        expert_ends=meta.expert_ends,
        sources=meta.source,
    )


def routing_metadata(
    local_ids: jax.Array, *, num_experts: int, alignment: int, num_rows: int, impl: str = AUTO
) -> layouts.RoutingMetadata:
    """The contiguous layout's routing metadata for local ids and any number of rows; every
    implementation returns the same bits.

    Args:
      local_ids: int[T, k] local ids in [0, E), or -1 (`moe_jax.layouts.map_expert_ids`); ids
        outside [0, E) go nowhere.
      num_experts: E.
      alignment: segment length multiple (128 for DeepGEMM).
      num_rows: M, at least `moe_jax.layouts.contiguous_num_rows(T, k, E, alignment)`.
      impl: "auto", "xla", "pallas" or an implementation object (`ROUTING_METADATA`).

    Returns:
      `moe_jax.layouts.RoutingMetadata`: inverse int32[T, k] (-1 for slots routed nowhere),
      num_tokens_per_expert and expert_ends int32[E], source and expert_ids int32[M] (-1 on
      padding rows).

    Example:
      >>> meta = routing_metadata(jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4,
      ...                         num_rows=12)
      >>> meta.inverse.tolist(), meta.num_tokens_per_expert.tolist(), meta.expert_ends.tolist()
      ([[4, 0], [5, 6]], [1, 3], [4, 8])
    """
    _check_ids(local_ids, None, "local_ids")
    _check_positive("num_experts", num_experts)
    _check_positive("alignment", alignment)
    needed = layouts.contiguous_num_rows(*local_ids.shape, num_experts, alignment)
    if require_int("num_rows", num_rows) < needed:
        raise ValueError(
            f"{num_rows=} but the layout of {local_ids.shape} ids over {num_experts} experts "
            f"(alignment {alignment}) can need {needed} rows: pass contiguous_num_rows(...)"
        )
    chosen = _select(ROUTING_METADATA, impl, local_ids, is_empty=local_ids.size == 0)
    return chosen(local_ids, num_experts=num_experts, alignment=alignment, num_rows=num_rows)


def permute(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    is_scales_group_major: bool = False,
    is_padding_zeroed: bool = True,
    impl: str = AUTO,
) -> layouts.ContiguousLayout:
    """Copies each token once per chosen local expert into expert-contiguous rows: `route`,
    then the row copy of `impl`.

    Args:
      x: [T, H] tokens (bf16, float16, float32 or float8_e4m3fn).
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` send that copy
        nowhere and never address memory.
      num_experts: E, the number of local experts.
      x_scales: optional float32[T, G] scales of FP8 tokens (G = H // 128), permuted with the
        rows.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      alignment: segment length multiple (128 for DeepGEMM).
      is_scales_group_major: have the kernel write `row_scales` as [G, M] in memory (the values
        are the same), for a GEMM1 that reads them through that transpose
        (`GroupedGemm.is_scales_group_major`), so that XLA cancels the transposes.
      is_padding_zeroed: padding rows (and their scales) are zeros; False lets an implementation
        skip writing them (they are then unspecified: the Pallas kernel leaves them as the
        buffer held them). Only for FP8 rows, which are not differentiated: a float layout feeds
        the weight gradient, which sums whole segments, padding rows included.
      impl: "auto", "xla", "pallas" or an implementation object of the row copy (`PERMUTES`);
        the routing metadata is `route`'s "auto".

    Returns:
      `moe_jax.layouts.ContiguousLayout` (`sources` None).

    Raises:
      ValueError: `is_padding_zeroed=False` with float (differentiable) rows.

    Example:
      >>> lay = permute(jnp.arange(4.0).reshape(2, 2), jnp.array([[1, 0], [1, 1]]),
      ...               num_experts=2, alignment=4)
      >>> lay.expert_ids.tolist(), lay.rows[4].tolist()
      ([0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1], [0.0, 1.0])
    """
    if x.ndim != 2 or x.dtype not in _ROW_DTYPES:
        raise TypeError(
            f"{x.shape=} {x.dtype=} but x must be [T, H] in bf16, float16, float32 or float8_e4m3fn"
        )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape=} but {topk_ids.shape=}: topk_ids must be [T, k], T as in x")
    if x_scales is not None:
        if x_scales.ndim != 2 or x_scales.shape[0] != x.shape[0]:
            raise ValueError(f"{x.shape=} but {x_scales.shape=}: x_scales must be [T, G]")
        if x_scales.dtype != jnp.float32:
            raise TypeError(f"{x_scales.dtype=} but float32 scales are needed")
    if not is_padding_zeroed and x.dtype != jnp.float8_e4m3fn:
        raise ValueError(
            f"is_padding_zeroed=False with {x.dtype} rows: only FP8 rows (inference) may leave "
            "padding rows unwritten; float rows feed the weight gradient, which sums whole "
            "segments. Drop the argument."
        )
    lay = route(topk_ids, num_experts=num_experts, expert_map=expert_map, alignment=alignment)
    is_empty = lay.sources.size == 0 or x.shape[1] == 0
    if x_scales is not None:
        is_empty |= x_scales.shape[1] == 0
    copy = _select(PERMUTES, impl, x, is_empty=is_empty)
    named = copy.name if copy.name in UNPERMUTES.names() else AUTO
    statics = (
        copy,
        UNPERMUTES.select(named, problem_for(x)),
        is_scales_group_major,
        is_padding_zeroed,
        jnp.dtype(x.dtype),
    )
    rows, row_scales = _copy_rows(statics, x, x_scales, lay.sources, lay.inverse)
    return dataclasses.replace(lay, rows=rows, row_scales=row_scales, sources=None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _copy_rows(statics, x, x_scales, sources, inverse):
    copy, _, is_scales_group_major, is_padding_zeroed, _ = statics
    del inverse  # the backward's
    return copy(
        x,
        x_scales,
        sources,
        is_scales_group_major=is_scales_group_major,
        is_padding_zeroed=is_padding_zeroed,
    )


def _copy_rows_fwd(statics, x, x_scales, sources, inverse):
    return _copy_rows(statics, x, x_scales, sources, inverse), inverse


def _copy_rows_bwd(statics, inverse, cotangent):
    _, unpermute_impl, _, _, x_dtype = statics
    d_rows, d_row_scales = cotangent
    dx = _sum_rows(unpermute_impl, d_rows, inverse, None, x_dtype)
    d_scales = None
    if d_row_scales is not None:  # scales given with float rows: [M, G] -> [T, G]
        d_scales = _sum_rows(UNPERMUTES.get("xla"), d_row_scales, inverse, None, jnp.float32)
    return dx, d_scales, None, None


_copy_rows.defvjp(_copy_rows_fwd, _copy_rows_bwd)


def _sum_rows(chosen, y, inverse, topk_weights, out_dtype):
    """`chosen`'s weighted gather-sum, or XLA's where an axis is empty (zeros, no launch)."""
    if 0 in (*y.shape, *inverse.shape):
        chosen = UNPERMUTES.get("xla")
    return chosen(y, inverse, topk_weights, out_dtype=out_dtype)


def unpermute(
    y: jax.Array,
    inverse: jax.Array,
    topk_weights: jax.Array | None,
    *,
    out_dtype: jnp.dtype | None = None,
    impl: str = AUTO,
) -> jax.Array:
    """out[t] = sum over valid slots j of w[t, j] * y[inverse[t, j]], in float32, slot order.

    Args:
      y: [M, H] expert outputs in row layout.
      inverse: int32[T, k] row of each (token, slot), -1 for none; rows must lie in [-1, M).
      topk_weights: float[T, k], or None when weights were applied before.
      out_dtype: output dtype (default y.dtype).
      impl: "auto", "xla", "pallas" or an implementation object (`UNPERMUTES`).

    Returns:
      [T, H] in `out_dtype`; a token without a valid slot gets zeros.

    Example:
      >>> unpermute(jnp.arange(6.0).reshape(3, 2), jnp.array([[2, 0], [-1, 1]], jnp.int32),
      ...           jnp.array([[0.5, 2.0], [1.0, -1.0]])).tolist()
      [[2.0, 4.5], [-2.0, -3.0]]
    """
    if y.ndim != 2 or not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"{y.shape=} {y.dtype=} but y must be a float [M, H] array")
    if inverse.ndim != 2 or inverse.dtype != jnp.int32:
        raise TypeError(f"{inverse.shape=} {inverse.dtype=} but int32[T, k] is needed")
    if topk_weights is not None:
        if topk_weights.shape != inverse.shape:
            raise ValueError(f"{topk_weights.shape=} but {inverse.shape=}: both are [T, k]")
        if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
            raise TypeError(f"{topk_weights.dtype=} but a float dtype is needed")
    chosen = UNPERMUTES.select(impl, problem_for(y))
    out_dtype = jnp.dtype(y.dtype if out_dtype is None else out_dtype)
    return _unpermute_vjp((chosen, out_dtype), y, inverse, topk_weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute_vjp(statics, y, inverse, topk_weights):
    chosen, out_dtype = statics
    return _sum_rows(chosen, y, inverse, topk_weights, out_dtype)


def _unpermute_fwd(statics, y, inverse, topk_weights):
    return _unpermute_vjp(statics, y, inverse, topk_weights), (y, inverse, topk_weights)


def _unpermute_bwd(statics, residuals, g):
    y, inverse, topk_weights = residuals
    dy, d_weights = unpermute_backward(g, y, inverse, topk_weights)
    return dy, None, d_weights


_unpermute_vjp.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute_backward(
    g: jax.Array, y: jax.Array, inverse: jax.Array, topk_weights: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """The VJP of `unpermute` in plain XLA: a row gather and k fused dot products.

    Args:
      g: [T, H] cotangent of the output.
      y: [M, H] the forward's expert rows.
      inverse: int32[T, k] row of each (token, slot), -1 for none; slots of one token may share a
        row (masked layout), rows of different tokens never do.
      topk_weights: float[T, k] or None.

    Returns:
      (dy [M, H] in y.dtype, zero on rows no slot reads; d topk_weights [T, k] in its dtype, or
      None).

    Example:
      >>> dy, dw = unpermute_backward(jnp.ones((1, 2)), jnp.arange(4.0).reshape(2, 2),
      ...                             jnp.array([[1, -1]]), jnp.array([[0.5, 2.0]]))
      >>> dy.tolist(), dw.tolist()
      ([[0.0, 0.0], [0.5, 0.5]], [[5.0, 0.0]])
    """
    num_tokens, topk = inverse.shape
    num_rows = y.shape[0]
    is_valid = inverse >= 0
    w = jnp.ones(inverse.shape, jnp.float32) if topk_weights is None else topk_weights
    w = jnp.where(is_valid, w.astype(jnp.float32), 0.0)
    if num_rows == 0 or num_tokens == 0:
        d_weights = None if topk_weights is None else jnp.zeros_like(topk_weights)
        return jnp.zeros_like(y), d_weights
    # Slots of a token that share a row add their weights on the row's first slot.
    same = inverse[:, :, None] == inverse[:, None, :]
    is_first = jnp.argmax(same, axis=-1) == jnp.arange(topk, dtype=jnp.int32)[None, :]
    row_weight = jnp.sum(jnp.where(same, w[:, None, :], 0.0), axis=-1)
    owner = jnp.where(is_valid & is_first, inverse, num_rows).reshape(-1)
    pair = jnp.arange(num_tokens * topk, dtype=jnp.int32)
    source = (
        jnp.full((num_rows,), -1, jnp.int32).at[owner].set(pair, mode="drop", unique_indices=True)
    )
    has_source = source >= 0
    safe = jnp.maximum(source, 0)
    g32 = g.astype(jnp.float32)
    taken = g32[safe // topk] * row_weight.reshape(-1)[safe][:, None]
    dy = jnp.where(has_source[:, None], taken, 0.0).astype(y.dtype)
    if topk_weights is None:
        return dy, None
    columns = []
    for j in range(topk):  # one fused gather + dot per slot; no [T, k, H] temporary
        rows = y[jnp.clip(inverse[:, j], 0, num_rows - 1)].astype(jnp.float32)
        columns.append(jnp.where(is_valid[:, j], jnp.sum(g32 * rows, axis=-1), 0.0))
    return dy, jnp.stack(columns, axis=1).astype(topk_weights.dtype)


def count_expert_num_tokens(
    topk_ids: jax.Array,
    num_local_experts: int,
    expert_map: jax.Array | None = None,
    *,
    impl: str = AUTO,
) -> jax.Array:
    """int32[E_local] (token, slot) pairs per local expert; duplicates count twice, invalid ids
    nowhere.

    Args:
      topk_ids: int[T, k] expert ids (global if `expert_map` is given); any value is allowed.
      num_local_experts: E_local.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      impl: "auto", "xla", "pallas" or an implementation object (`COUNTS`).

    Example:
      >>> count_expert_num_tokens(jnp.array([[0, 0], [2, 1]]), 2).tolist()
      [2, 1]
    """
    _check_ids(topk_ids, expert_map)
    _check_positive("num_local_experts", num_local_experts)
    is_empty = topk_ids.size == 0 or (expert_map is not None and expert_map.size == 0)
    chosen = _select(COUNTS, impl, topk_ids, is_empty=is_empty)
    return chosen(topk_ids, num_local_experts, expert_map)
