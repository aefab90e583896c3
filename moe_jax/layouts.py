"""Token layouts for grouped expert GEMMs, in pure JAX (static shapes, no host sync).

These are the references the Pallas kernels in `moe_jax.kernels` must match bit for bit.

Contiguous layout (DeepGEMM `m_grouped_*_contiguous`, torch `_grouped_mm`): every (token, slot)
pair routed to a local expert becomes one row; rows are grouped by expert in ascending expert
order; inside an expert, rows are ordered by token, then slot (so results are reproducible); every
expert's segment is padded to a multiple of `alignment` rows. Padding rows carry expert id -1 and
zero data. Worked example, alignment 4, E=2, topk_ids = [[1, 0], [1, 1]]:

    row  0      1    2    3    4      5      6      7    8 .. 11
         (0,1)  pad  pad  pad  (0,0)  (1,0)  (1,1)  pad  pad     <- (token, slot) feeding the row
    expert_ids = [0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1]     inverse = [[4, 0], [5, 6]]

The row count is static: `contiguous_num_rows(T, k, E, alignment)` is the worst case over all
routings (here round_up(4 + 2 * 3, 4) = 12), and rows past the last used segment are padding too.

Masked layout (DeepGEMM `m_grouped_*_masked`, DeepEP low-latency): `[E, max_m, H]` with the first
`num_tokens_per_expert[e]` rows of expert e valid, in (token, slot) order; the rest are zero.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax import expert_rank
from moe_jax._pytree import pytree_dataclass

DEFAULT_ALIGNMENT = 128


def round_up(value: int, multiple: int) -> int:
    """The smallest multiple of `multiple` (> 0) that is >= `value` (a segment's padded length)."""
    return -(-value // multiple) * multiple


def ids_as_int32(ids: jax.Array) -> jax.Array:
    """`ids` (any integer dtype: expert ids or an expert map) as int32, where a value int32 cannot
    hold becomes -1 ("no expert") instead of wrapping: with `jax_enable_x64`, the int64 id
    2**32 + 1 would otherwise become expert 1.

    Example:
      >>> ids_as_int32(jnp.array([3, -1], jnp.int16)).tolist()
      [3, -1]
    """
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"ids.dtype={ids.dtype} but an integer dtype is needed")
    info = jnp.iinfo(ids.dtype)
    int32 = jnp.iinfo(jnp.int32)
    if info.min < int32.min or info.max > int32.max:
        ids = jnp.where((ids >= int32.min) & (ids <= int32.max), ids, -1)
    return ids.astype(jnp.int32)


def map_expert_ids(
    topk_ids: jax.Array, *, num_experts: int, expert_map: jax.Array | None = None
) -> jax.Array:
    """Maps routed ids to local expert indices, -1 where the slot goes nowhere on this shard.

    Args:
      topk_ids: int[T, k] global expert ids; any value is allowed.
      num_experts: E_local, the number of experts held here.
      expert_map: optional int[E_global]: local index of each global expert, or -1. Ids outside
        [0, E_global) map to -1 without reading out of bounds.

    Returns:
      int32[T, k] local ids in [0, num_experts) or -1.

    Example:
      >>> map_expert_ids(jnp.array([[0, 3, 7]]), num_experts=2,
      ...                expert_map=jnp.array([-1, -1, -1, 1])).tolist()
      [[-1, 1, -1]]
    """
    ids = ids_as_int32(topk_ids)
    if expert_map is not None:
        num_global = expert_map.shape[0]
        if num_global == 0:  # no global expert: every slot goes nowhere (nothing to index)
            return jnp.full(ids.shape, -1, jnp.int32)
        in_range = (ids >= 0) & (ids < num_global)
        ids = jnp.where(in_range, ids_as_int32(expert_map)[jnp.clip(ids, 0, num_global - 1)], -1)
    return jnp.where((ids >= 0) & (ids < num_experts), ids, -1)


def count_expert_num_tokens(
    topk_ids: jax.Array, num_local_experts: int, expert_map: jax.Array | None = None
) -> jax.Array:
    """`moe_jax.permute.count_expert_num_tokens` (its contract and example) in pure JAX,
    unchecked: the reference of `moe_jax.kernels.count`."""
    local = map_expert_ids(topk_ids, num_experts=num_local_experts, expert_map=expert_map)
    one_hot = local.reshape(-1)[:, None] == jnp.arange(num_local_experts, dtype=jnp.int32)[None]
    return jnp.sum(one_hot, axis=0, dtype=jnp.int32)


def contiguous_num_rows(num_tokens: int, topk: int, num_experts: int, alignment: int) -> int:
    """Static worst-case row count of the contiguous layout.

    At most min(T*k, E) segments are non-empty, and each wastes at most alignment-1 rows.
    """
    pairs = num_tokens * topk
    return round_up(pairs + min(pairs, num_experts) * (alignment - 1), alignment)


@pytree_dataclass
class ContiguousLayout:
    """Rows grouped by expert, each segment padded to the alignment (see module docstring).

    Attributes:
      rows: [M, H] token copies (bf16, float32 or float8_e4m3fn); padding rows are zero
        (unspecified where `moe_jax.permute.permute` ran with `is_padding_zeroed=False`, as on
        the FP8 inference path). None in the layout `moe_jax.permute.route` returns, whose
        rows are never copied (a GEMM1 that gathers them reads `sources` instead).
      row_scales: float32[M, H // 128] activation scales travelling with FP8 rows (zero on
        padding, or unspecified as the rows), or None.
      expert_ids: int32[M] local expert of each row, -1 on padding.
      inverse: int32[T, k] row holding each (token, slot), -1 for slots routed nowhere.
      num_tokens_per_expert: int32[E] valid rows per expert.
      expert_ends: int32[E] one past the last (padded) row of each expert's segment; segment e
        spans [expert_ends[e-1], expert_ends[e]) (torch `_grouped_mm`'s `offs`).
      sources: int32[M] the token of each row, -1 on padding, where `rows` is None; else None.
    """

    rows: jax.Array | None
    row_scales: jax.Array | None
    expert_ids: jax.Array
    inverse: jax.Array
    num_tokens_per_expert: jax.Array
    expert_ends: jax.Array
    sources: jax.Array | None = None


def contiguous_destinations(
    local_ids: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    method: str | Callable[..., tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each (token, slot) lands in the contiguous layout.

    The XLA part of `routing_metadata` (the reference of `moe_jax.kernels.routing_metadata`).

    Args:
      local_ids: int32[T, k] local ids in [0, E) or -1 (from `map_expert_ids`); any other id
        goes nowhere too.
      num_experts: E.
      alignment: segment length multiple.
      method: how pairs are ranked within their expert: a name in `expert_rank.METHODS`, or a
        ranker `f(flat_ids, *, num_experts) -> (rank, counts)` (`expert_rank.RANKERS` values,
        with tunables bound); every method gives the same bits. None picks
        `expert_rank.method_for(T * k)`.

    Returns:
      (inverse int32[T, k] with -1 for invalid slots, num_tokens_per_expert int32[E],
      expert_ends int32[E]).

    Example:
      >>> inverse, counts, ends = contiguous_destinations(
      ...     jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4, method="blocked")
      >>> inverse.tolist(), counts.tolist(), ends.tolist()
      ([[4, 0], [5, 6]], [1, 3], [4, 8])
    """
    local_ids = ids_as_int32(local_ids)  # int8 ids with E > 127 compare as int32
    method = expert_rank.method_for(local_ids.size) if method is None else method
    if callable(method):
        ranker = method
    elif method in expert_rank.RANKERS:
        ranker = expert_rank.RANKERS[method]
    else:
        raise ValueError(f"unknown rank {method=}; choose from {expert_rank.METHODS} or None")
    flat = local_ids.reshape(-1)
    # Rank of each pair among earlier pairs of the same expert: (token, slot) order.
    rank, counts = ranker(flat, num_experts=num_experts)
    is_valid = (flat >= 0) & (flat < num_experts)
    padded = (counts + alignment - 1) // alignment * alignment
    ends = jnp.cumsum(padded, dtype=jnp.int32)
    starts = ends - padded
    dest = starts[jnp.clip(flat, 0, num_experts - 1)] + rank
    inverse = jnp.where(is_valid, dest, -1).astype(jnp.int32).reshape(local_ids.shape)
    return inverse, counts, ends


@pytree_dataclass
class RoutingMetadata:
    """Where a routing's pairs go in the contiguous layout, and what feeds each row.

    Attributes:
      inverse: int32[T, k] row of each (token, slot), -1 for slots routed nowhere.
      num_tokens_per_expert: int32[E] valid rows per expert.
      expert_ends: int32[E] one past the last (padded) row of each expert's segment.
      source: int32[M] token copied into each row, -1 on padding.
      expert_ids: int32[M] local expert of each row, -1 on padding.
    """

    inverse: jax.Array
    num_tokens_per_expert: jax.Array
    expert_ends: jax.Array
    source: jax.Array
    expert_ids: jax.Array


def routing_metadata(
    local_ids: jax.Array, *, num_experts: int, alignment: int, num_rows: int
) -> RoutingMetadata:
    """`moe_jax.permute.routing_metadata` (arguments and `RoutingMetadata` as there) in pure
    JAX, unchecked: the reference of `moe_jax.kernels.routing_metadata`.

    Example:
      >>> meta = routing_metadata(jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4,
      ...                         num_rows=12)
      >>> meta.source.tolist(), meta.expert_ids.tolist()
      ([0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1], [0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1])
    """
    local_ids = ids_as_int32(local_ids)
    topk = local_ids.shape[1]
    inverse, counts, ends = contiguous_destinations(
        local_ids, num_experts=num_experts, alignment=alignment
    )
    flat = local_ids.astype(jnp.int32).reshape(-1)
    dest = inverse.reshape(-1)
    scatter_to = jnp.where(dest >= 0, dest, num_rows)  # out of range -> dropped
    # One scatter of each row's pair; its token and expert follow from the pair.
    pair_of_row = (
        jnp.full((num_rows,), -1, jnp.int32)
        .at[scatter_to]
        .set(jnp.arange(flat.size, dtype=jnp.int32), mode="drop")
    )
    has_pair = pair_of_row >= 0
    return RoutingMetadata(
        inverse=inverse,
        num_tokens_per_expert=counts,
        expert_ends=ends,
        source=jnp.where(has_pair, pair_of_row // topk, -1),
        expert_ids=jnp.where(has_pair, flat[jnp.maximum(pair_of_row, 0)], -1),
    )


def gather_rows(a: jax.Array, sources: jax.Array) -> jax.Array:
    """[M, ...] rows `a[sources[r]]`, zeros where sources[r] < 0 (padding), from a [T, ...] `a`.

    Example:
      >>> gather_rows(jnp.array([[1.0], [2.0]]), jnp.array([1, -1, 0])).tolist()
      [[2.0], [0.0], [1.0]]
    """
    taken = a[jnp.clip(sources, 0, max(a.shape[0] - 1, 0))]
    return jnp.where((sources >= 0)[:, None], taken, jnp.zeros((), a.dtype))


def permute_reference(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> ContiguousLayout:
    """`moe_jax.permute.permute` (arguments and `ContiguousLayout` as there, less the tuning
    ones) in pure JAX, unchecked: routing metadata, then `gather_rows`; padding rows are zero.

    Example:
      >>> lay = permute_reference(jnp.arange(4.0).reshape(2, 2), jnp.array([[1, 0], [1, 1]]),
      ...                         num_experts=2, alignment=4)
      >>> lay.expert_ids.tolist(), lay.inverse.tolist()
      ([0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1], [[4, 0], [5, 6]])
    """
    num_tokens, topk = topk_ids.shape
    num_rows = contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    local = map_expert_ids(topk_ids, num_experts=num_experts, expert_map=expert_map)
    meta = routing_metadata(local, num_experts=num_experts, alignment=alignment, num_rows=num_rows)
    return ContiguousLayout(
        rows=gather_rows(x, meta.source),
        row_scales=None if x_scales is None else gather_rows(x_scales, meta.source),
        expert_ids=meta.expert_ids,
        inverse=meta.inverse,
        num_tokens_per_expert=meta.num_tokens_per_expert,
        expert_ends=meta.expert_ends,
    )


def unpermute_reference(
    y: jax.Array,
    inverse: jax.Array,
    topk_weights: jax.Array | None,
    *,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """`moe_jax.permute.unpermute` (its contract) in pure JAX, unchecked: the reference of
    `moe_jax.kernels.unpermute`. y may be contiguous rows or a flattened masked layout."""
    out_dtype = y.dtype if out_dtype is None else out_dtype
    num_tokens, topk = inverse.shape
    if y.shape[0] == 0:
        return jnp.zeros((num_tokens, y.shape[1]), out_dtype)
    is_valid = inverse >= 0
    weights = jnp.ones(inverse.shape, jnp.float32) if topk_weights is None else topk_weights
    weights = jnp.where(is_valid, weights.astype(jnp.float32), 0.0)
    acc = jnp.zeros((num_tokens, y.shape[1]), jnp.float32)
    for j in range(topk):  # fixed slot order, as vLLM's ep_gather
        rows = y[jnp.clip(inverse[:, j], 0, y.shape[0] - 1)].astype(jnp.float32)
        acc = acc + jnp.where(is_valid[:, j, None], rows * weights[:, j, None], 0.0)
    return acc.astype(out_dtype)


@pytree_dataclass
class MaskedLayout:
    """Per-expert padded blocks `[E, max_m, H]` (DeepEP low-latency / DeepGEMM masked layout).

    A token that picks one expert in several slots takes one row there; each of those slots points
    at that row, so the weighted sum applies every slot's weight to the one expert output.

    Attributes:
      rows: [E, max_m, H] token copies; rows at or past the expert's count are zero.
      row_scales: float32[E, max_m, G] scales for FP8 rows, or None.
      num_tokens_per_expert: int32[E] valid rows (distinct tokens) per expert (DeepGEMM
        `masked_m`), capped at max_m.
      inverse: int32[T, k] flat row `e * max_m + r` of each (token, slot), -1 when routed nowhere
        or dropped for lack of capacity.
      num_dropped: int32[] (token, expert) rows that did not fit in max_m (0 when max_m >= T).
    """

    rows: jax.Array
    row_scales: jax.Array | None
    num_tokens_per_expert: jax.Array
    inverse: jax.Array
    num_dropped: jax.Array


def first_slot_of_expert(local_ids: jax.Array) -> jax.Array:
    """int32[T, k]: for each slot, the first slot of its row with the same expert id (itself when
    there is none before it).

    Example:
      >>> first_slot_of_expert(jnp.array([[3, 1, 3, -1]])).tolist()
      [[0, 1, 0, 3]]
    """
    same = local_ids[:, :, None] == local_ids[:, None, :]
    return jnp.argmax(same, axis=-1).astype(jnp.int32)


def masked_layout_reference(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    max_m: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
) -> MaskedLayout:
    """Builds the masked layout; tokens beyond `max_m` per expert are dropped and counted.

    Args:
      x: [T, H] tokens.
      topk_ids: int[T, k] expert per slot.
      num_experts: E_local.
      max_m: rows per expert (static); T never drops, since a token takes at most one row of
        an expert.
      x_scales: optional float32[T, G], laid out with the rows.
      expert_map: optional int[E_global] global-to-local map.
    """
    num_tokens, topk = topk_ids.shape
    local = map_expert_ids(topk_ids, num_experts=num_experts, expert_map=expert_map)
    first = first_slot_of_expert(local)
    is_first = first == jnp.arange(topk, dtype=jnp.int32)[None, :]
    unique = jnp.where(is_first, local, -1)
    # Alignment 1 gives each (token, expert) its rank within its expert: dest - start.
    dest, counts, ends = contiguous_destinations(unique, num_experts=num_experts, alignment=1)
    rank = dest - (ends - counts)[jnp.clip(unique, 0, num_experts - 1)]
    fits = (unique >= 0) & (rank < max_m)
    own_row = jnp.where(fits, unique * max_m + rank, -1).astype(jnp.int32)
    inverse = jnp.take_along_axis(own_row, first, axis=1)  # repeats share the first slot's row
    num_slots = num_experts * max_m
    flat_rows = own_row.reshape(-1)
    scatter_to = jnp.where(flat_rows >= 0, flat_rows, num_slots)
    token_of_pair = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), topk)
    source = jnp.full((num_slots,), -1, jnp.int32).at[scatter_to].set(token_of_pair, mode="drop")

    def gather(a: jax.Array) -> jax.Array:
        if num_tokens == 0:
            return jnp.zeros((num_experts, max_m, *a.shape[1:]), a.dtype)
        taken = a[jnp.clip(source, 0, num_tokens - 1)]
        taken = jnp.where((source >= 0)[:, None], taken, jnp.zeros((), a.dtype))
        return taken.reshape(num_experts, max_m, *a.shape[1:])

    return MaskedLayout(
        rows=gather(x),
        row_scales=None if x_scales is None else gather(x_scales),
        num_tokens_per_expert=jnp.minimum(counts, max_m).astype(jnp.int32),
        inverse=inverse,
        num_dropped=jnp.sum((unique >= 0) & ~fits, dtype=jnp.int32),
    )
