"""Layout ops: permute (tokens -> expert-contiguous rows), unpermute (rows -> weighted token sums)
per-expert token counts and the contiguous layout's routing metadata, each with a registry of
implementations.

Implementations, chosen by `impl` through `moe_jax.registry` (the same rule as every op):

- "xla": the pure-JAX references in `moe_jax.layouts`; runs everywhere.
- "pallas": the Pallas Triton kernels in `moe_jax.kernels`; NVIDIA GPUs only.
- "pallas_interpret": the same kernels in Pallas interpret mode (CPU tests; never automatic).
- "auto": "pallas" on a GPU, "xla" elsewhere (`registry.pallas_then_xla`), except for the
  routing metadata, where "auto" is "xla" everywhere (`xla_routing_metadata_first`: the one
  Pallas kernel wins at layer shape A only).

Every implementation returns bit-identical layouts; unpermute sums in float32 in slot order.

Both front functions are differentiable (`jax.custom_vjp`), whatever implementation runs forward:

- permute: d x[t] = sum over the valid slots j of d rows[inverse[t, j]] (a gather-sum: the
  unpermute of the row cotangents without weights, through `UNPERMUTES` with the same `impl`).
  FP8 rows (inference) are not differentiated.
- unpermute: d y[r] = g[t] * w[t, j] for the slot (t, j) that reads row r (slots of one token
  sharing a row, as in the masked layout, add their weights), zero on rows no slot reads; and
  d topk_weights[t, j] = <g[t], y[inverse[t, j]]> in float32, 0 where inverse is -1.
Index inputs (topk_ids, expert_map, inverse) get no cotangent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from moe_jax import layouts
from moe_jax.registry import (
    AUTO,
    FunctionImpl,
    OpProblem,
    Registry,
    current_platform,
    pallas_then_xla,
)

_KERNEL_MODULES = {
    "permute": "moe_jax.kernels.permute",
    "unpermute": "moe_jax.kernels.unpermute",
    "count": "moe_jax.kernels.count",
    "routing_metadata": "moe_jax.kernels.routing_metadata",
}


def _registry(
    op: str,
    kernel_module: str,
    preference: Callable[[OpProblem], Sequence[str]] = pallas_then_xla,
) -> Registry:
    return Registry(
        op,
        preference=preference,
        modules={"pallas": kernel_module, "pallas_interpret": kernel_module},
    )


def xla_routing_metadata_first(problem: OpProblem) -> tuple[str, ...]:
    """The routing metadata's preference: XLA on every platform; the Pallas kernel by name only.

    H200 evidence (2026-12-04, `python scripts/destinations_bench.py --metadata`, device time per
    call alone, BENCHMARKS.md "Prefill"): the kernel of `moe_jax.kernels.routing_metadata` took
    13.5 us at layer shape A (T*k = 32768, E=32) against XLA's 16.0, 25.4 at shape B (65536
    pairs, E=128) against 27.0 and 9.0 at T=128 (E=256) against 13.4, but 21.8 at T=1 against
    8.3; and inside shape B's FP8 forward it took 41.1 us against XLA's 28.4 (`kernel_gaps`).
    """
    del problem
    return ("xla",)


PERMUTES = _registry("permute", _KERNEL_MODULES["permute"])
UNPERMUTES = _registry("unpermute", _KERNEL_MODULES["unpermute"])
COUNTS = _registry("count_expert_num_tokens", _KERNEL_MODULES["count"])
ROUTING_METADATA = _registry(
    "routing_metadata", _KERNEL_MODULES["routing_metadata"], preference=xla_routing_metadata_first
)


def _xla_permute(
    x, topk_ids, *, is_scales_group_major: bool = False, is_padding_zeroed: bool = True, **kwargs
):
    """`layouts.permute_reference` under the kernels' signature: `is_scales_group_major` asks
    a kernel how to lay its scales out in memory, and XLA lays out its own arrays; its padding
    rows are zeros either way (what `is_padding_zeroed=False` leaves unspecified)."""
    del is_scales_group_major, is_padding_zeroed
    return layouts.permute_reference(x, topk_ids, **kwargs)


PERMUTES.register(FunctionImpl("xla", _xla_permute))
UNPERMUTES.register(FunctionImpl("xla", layouts.unpermute_reference))
COUNTS.register(FunctionImpl("xla", layouts.count_expert_num_tokens))
ROUTING_METADATA.register(FunctionImpl("xla", layouts.routing_metadata))


# The dtypes `permute` moves (FP8 rows carry their scales along).
_ROW_DTYPES = tuple(map(jnp.dtype, (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)))


def check_permute_args(x, topk_ids, num_experts, x_scales, expert_map, alignment) -> None:
    """`permute`'s arguments (every implementation's): raises TypeError/ValueError naming the
    one at fault."""
    if x.ndim != 2 or x.dtype not in _ROW_DTYPES:
        raise TypeError(
            f"{x.shape=} {x.dtype=} but x must be [T, H] in bf16, float16, float32 or float8_e4m3fn"
        )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape=} but {topk_ids.shape=}: topk_ids must be [T, k], T as in x")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"{topk_ids.dtype=} but an integer dtype is needed")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{num_experts=} but a positive int is needed")
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{alignment=} but a positive int is needed")
    if x_scales is not None:
        if x_scales.ndim != 2 or x_scales.shape[0] != x.shape[0]:
            raise ValueError(f"{x.shape=} but {x_scales.shape=}: x_scales must be [T, G]")
        if x_scales.dtype != jnp.float32:
            raise TypeError(f"{x_scales.dtype=} but float32 scales are needed")
    if expert_map is not None and (
        expert_map.ndim != 1 or not jnp.issubdtype(expert_map.dtype, jnp.integer)
    ):
        raise TypeError(f"{expert_map.shape=} {expert_map.dtype=} but int[E_global] is needed")


def check_unpermute_args(y, inverse, topk_weights) -> None:
    """`unpermute`'s arguments (every implementation's): raises TypeError/ValueError naming the
    one at fault."""
    if y.ndim != 2 or not jnp.issubdtype(y.dtype, jnp.floating):
        raise TypeError(f"{y.shape=} {y.dtype=} but y must be a float [M, H] array")
    if inverse.ndim != 2 or inverse.dtype != jnp.int32:
        raise TypeError(f"{inverse.shape=} {inverse.dtype=} but int32[T, k] is needed")
    if topk_weights is not None:
        if topk_weights.shape != inverse.shape:
            raise ValueError(f"{topk_weights.shape=} but {inverse.shape=}: both are [T, k]")
        if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
            raise TypeError(f"{topk_weights.dtype=} but a float dtype is needed")


def problem_for(x: jax.Array) -> OpProblem:
    """The `OpProblem` of an op whose main operand is `x`, on the default backend."""
    return OpProblem(platform=current_platform(), dtype=jnp.dtype(x.dtype).name)


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
    """Copies each token once per chosen local expert into expert-contiguous rows.

    Args:
      x: [T, H] tokens (bf16, float32 or float8_e4m3fn).
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` send that copy
        nowhere and never address memory.
      num_experts: E, the number of local experts.
      x_scales: optional float32[T, H // 128] scales of FP8 tokens, permuted with the rows.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      alignment: segment length multiple (128 for DeepGEMM).
      is_scales_group_major: have the kernel write `row_scales` as [G, M] in memory (the values
        are the same), for a GEMM1 that reads them through that transpose
        (`GroupedGemm.is_scales_group_major`), so that XLA cancels the transposes.
      is_padding_zeroed: padding rows (and their scales) are zeros; False lets an implementation
        skip writing them (they are then unspecified: the Pallas kernel leaves them as the
        buffer held them). Only for FP8 rows, which are not differentiated: a float layout feeds
        the weight gradient, which sums whole segments, padding rows included.
      impl: "auto", "xla", "pallas", "pallas_interpret" or a permute implementation object;
        the backward's unpermute is the one of the same name ("auto" where none has it).

    Returns:
      `moe_jax.layouts.ContiguousLayout`.

    Raises:
      ValueError: `is_padding_zeroed=False` with float (differentiable) rows.

    Example:
      >>> lay = permute(jnp.ones((2, 4)), jnp.array([[1], [1]]), num_experts=2, alignment=1)
      >>> lay.expert_ids.tolist()
      [1, 1]
    """
    check_permute_args(x, topk_ids, num_experts, x_scales, expert_map, alignment)
    chosen = PERMUTES.select(impl, problem_for(x))
    if x.dtype == jnp.float8_e4m3fn:
        return chosen(
            x,
            topk_ids,
            num_experts=num_experts,
            x_scales=x_scales,
            expert_map=expert_map,
            alignment=alignment,
            is_scales_group_major=is_scales_group_major,
            is_padding_zeroed=is_padding_zeroed,
        )
    if not is_padding_zeroed:
        raise ValueError(
            f"is_padding_zeroed=False with {x.dtype} rows: only FP8 rows (inference) may leave "
            "padding rows unwritten; float rows feed the weight gradient, which sums whole "
            "segments. Drop the argument."
        )
    unpermute_name = impl if isinstance(impl, str) else getattr(impl, "name", AUTO)
    if unpermute_name not in UNPERMUTES.names():
        unpermute_name = AUTO
    unpermute_impl = UNPERMUTES.select(unpermute_name, problem_for(x))
    statics = (chosen, unpermute_impl, num_experts, alignment, jnp.dtype(x.dtype))
    return _permute_vjp(statics, x, topk_ids, x_scales, expert_map)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute_vjp(statics, x, topk_ids, x_scales, expert_map):
    chosen, _, num_experts, alignment, _ = statics
    return chosen(
        x,
        topk_ids,
        num_experts=num_experts,
        x_scales=x_scales,
        expert_map=expert_map,
        alignment=alignment,
    )


def _permute_fwd(statics, x, topk_ids, x_scales, expert_map):
    lay = _permute_vjp(statics, x, topk_ids, x_scales, expert_map)
    return lay, lay.inverse


def _permute_bwd(statics, inverse, cotangent):
    _, unpermute_impl, _, _, x_dtype = statics
    dx = unpermute_impl(cotangent.rows, inverse, None, out_dtype=x_dtype)
    d_scales = None
    if cotangent.row_scales is not None:  # scales given with float rows: [M, G] -> [T, G]
        d_scales = layouts.unpermute_reference(cotangent.row_scales, inverse, None)
    return dx, None, d_scales, None


_permute_vjp.defvjp(_permute_fwd, _permute_bwd)


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
      inverse: int32[T, k] row of each (token, slot), -1 for none.
      topk_weights: float[T, k], or None when weights were applied before.
      out_dtype: output dtype (default y.dtype).
      impl: as for `permute`.

    Returns:
      [T, H] in `out_dtype`.
    """
    check_unpermute_args(y, inverse, topk_weights)
    chosen = UNPERMUTES.select(impl, problem_for(y))
    if y.dtype == jnp.float8_e4m3fn:
        return chosen(y, inverse, topk_weights, out_dtype=out_dtype)
    out_dtype = jnp.dtype(y.dtype if out_dtype is None else out_dtype)
    return _unpermute_vjp((chosen, out_dtype), y, inverse, topk_weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpermute_vjp(statics, y, inverse, topk_weights):
    chosen, out_dtype = statics
    return chosen(y, inverse, topk_weights, out_dtype=out_dtype)


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
    nowhere (see `moe_jax.layouts.count_expert_num_tokens`).

    Args:
      topk_ids: int[T, k] expert ids (global if `expert_map` is given).
      num_local_experts: E_local.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      impl: as for `permute`.

    Example:
      >>> count_expert_num_tokens(jnp.array([[0, 0], [2, 1]]), 2).tolist()
      [2, 1]
    """
    chosen = COUNTS.select(impl, problem_for(topk_ids))
    return chosen(topk_ids, num_local_experts, expert_map)


def route(
    topk_ids: jax.Array,
    *,
    num_experts: int,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    impl: str = AUTO,
) -> layouts.ContiguousLayout:
    """The contiguous layout without its rows: where each (token, slot) goes and which token
    feeds each row, for a GEMM1 that reads the rows from the tokens itself
    (`moe_jax.experts.GemmPair.gathers_rows`). Nothing is copied.

    Args:
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` go nowhere.
      num_experts, expert_map, alignment: as for `permute`.
      impl: the routing metadata's implementation (`routing_metadata`).

    Returns:
      `moe_jax.layouts.ContiguousLayout` with M = `layouts.contiguous_num_rows(T, k, E,
      alignment)` rows, `rows` and `row_scales` None and `sources` int32[M] (-1 on padding).

    Example:
      >>> lay = route(jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4)
      >>> lay.sources.tolist(), lay.expert_ids.tolist()[:8]
      ([0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1], [0, -1, -1, -1, 1, 1, 1, -1])
    """
    if topk_ids.ndim != 2 or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise TypeError(f"{topk_ids.shape=} {topk_ids.dtype=} but int[T, k] is needed")
    num_tokens, topk = topk_ids.shape
    num_rows = layouts.contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    local = layouts.map_expert_ids(topk_ids, num_experts=num_experts, expert_map=expert_map)
    if num_tokens * topk == 0:  # nothing to route: the layout has no rows
        no_experts = jnp.zeros((num_experts,), jnp.int32)
        no_rows = jnp.zeros((0,), jnp.int32)
        return layouts.ContiguousLayout(
            rows=None,
            row_scales=None,
            expert_ids=no_rows,
            inverse=jnp.full((num_tokens, topk), -1, jnp.int32),
            num_tokens_per_expert=no_experts,
            expert_ends=no_experts,
            sources=no_rows,
        )
    meta = routing_metadata(
        local, num_experts=num_experts, alignment=alignment, num_rows=num_rows, impl=impl
    )
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
    """The contiguous layout's routing metadata (see `moe_jax.layouts.routing_metadata`); every
    implementation returns the same bits.

    Args:
      local_ids: int32[T, k] local ids in [0, E), or -1 (`moe_jax.layouts.map_expert_ids`); ids
        outside [0, E) go nowhere.
      num_experts: E.
      alignment: segment length multiple (128 for DeepGEMM).
      num_rows: M, at least `moe_jax.layouts.contiguous_num_rows(T, k, E, alignment)`.
      impl: as for `permute`.

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
    chosen = ROUTING_METADATA.select(impl, problem_for(local_ids))
    return chosen(local_ids, num_experts=num_experts, alignment=alignment, num_rows=num_rows)
