"""Expert parallelism on JAX collectives: `AllToAllPrepareFinalize`, used inside `jax.shard_map`.

R ranks along one mesh axis each hold T tokens (their own routing, global expert ids) and E // R
experts: rank r owns global experts [r * E_local, (r + 1) * E_local) (vLLM's `expert_map` with
E % R == 0). One forward:

    prepare   every (token, slot) pair whose id is in [0, E) goes to rank id // E_local, as one
              row (FP8 rows + scales when the weights are FP8: quantized before the exchange).
              The send buffer is [R, C, H]: block d holds the pairs for rank d in (token, slot)
              order, C = `capacity_per_rank` rows; pairs beyond C are dropped and counted.
    experts   the received [R * C, H] rows, each with its local expert id (top-1, weight 1;
              empty rows carry id -1), run through any `Experts` object with the local weights.
    finalize  the outputs travel back into the sender's [R, C, H] slots; each token sums its
              slots in slot order in float32 with its router weights (vLLM's `ep_gather`).

Worked example, R=2, E=4 (E_local=2), C=2, on rank 0 with topk_ids [[3, 0], [2, 2]]:

    pair (t, j)   (0,0)  (0,1)  (1,0)  (1,1)
    rank, local   1, 1   0, 0   1, 0   1, 0
    slot          2      0      3      -1 (rank 1's block is full: dropped, num_dropped = 1)

Transports, chosen by `EPConfig.transport` through the registry `TRANSPORTS` (both exchange the
same [R, C, ...] buffers):
- "padded": `jax.lax.all_to_all` of the whole buffers. Runs everywhere (XLA:CPU included); what
  "auto" picks (`transport_preference` gives the measurement).
- "ragged": `jax.lax.ragged_all_to_all` moving only the used rows of each block. Only when named
  (BENCHMARKS.md, EP); XLA:CPU does not implement it (jax #34755).

Static shapes: C defaults to T * k, the worst case, so nothing can be dropped; the receive buffer
is then R * T * k rows. A smaller C bounds memory and traffic; `EPStats` then reports, per rank,
the pairs routed to each rank and the pairs dropped. `ModularMoE.__call__` returns only the
output: use `moe_jax.ep_moe`, `moe_jax.ep_fused_moe` (module `moe_jax.ep_api`) or
`ModularMoE.forward` to see the statistics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_jax import layouts, quant
from moe_jax._pytree import pytree_dataclass
from moe_jax.prepare_finalize import (
    PreparedTokens,
    PrepareFinalize,
    WeightAndReduce,
    scale_by_router_weight,
)
from moe_jax.registry import AUTO, FunctionImpl, OpProblem, Registry, current_platform
from moe_jax.routing import require_int


def transport_preference(problem: OpProblem) -> tuple[str, ...]:
    """The transport "auto" picks: "padded" on every platform. On GPUs "ragged" moves fewer bytes
    but XLA's ragged all-to-all was slower (BENCHMARKS.md, EP); XLA:CPU lacks it (jax #34755).
    """
    del problem
    return ("padded",)


TRANSPORTS: Registry[FunctionImpl] = Registry("EP transport", preference=transport_preference)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EPConfig:
    """How tokens cross ranks.

    Attributes:
      axis_name: the mesh axis the experts and tokens are split over.
      capacity_per_rank: rows one rank may send to each rank per forward (C); None means
        T * k, which never drops.
      transport: "auto" (the registry's choice: "padded"), "padded" or "ragged"
        (`TRANSPORTS`).
    """

    axis_name: str
    capacity_per_rank: int | None = None
    transport: str = AUTO

    def __post_init__(self):
        if self.transport != AUTO:
            TRANSPORTS.get(self.transport)  # an unknown name raises, listing the valid ones
        if (
            self.capacity_per_rank is not None
            and require_int("capacity_per_rank", self.capacity_per_rank) <= 0
        ):
            raise ValueError(f"capacity_per_rank={self.capacity_per_rank} must be positive or None")

    def resolved_transport(self, dtype=jnp.bfloat16) -> FunctionImpl:
        """The transport that runs here (`TRANSPORTS.select`), for buffers of `dtype`."""
        problem = OpProblem(platform=current_platform(), dtype=jnp.dtype(dtype).name)
        return TRANSPORTS.select(self.transport, problem)

    def exchange(self, buffer: jax.Array, fill, **sizes) -> jax.Array:
        """[R * C, ...] blocks by destination -> blocks by source (and back), by the transport;
        `sizes`: num_ranks, capacity, send_sizes, recv_sizes (`padded_exchange`)."""
        return self.resolved_transport(buffer.dtype)(
            buffer, fill, axis_name=self.axis_name, **sizes
        )

    def capacity(self, num_tokens: int, topk: int) -> int:
        """C, the rows one rank sends to each rank for `num_tokens` tokens of top-`topk` routing:
        `capacity_per_rank`, or T * k (nothing dropped) where it is None."""
        return num_tokens * topk if self.capacity_per_rank is None else self.capacity_per_rank


@pytree_dataclass
class EPStats:
    """What one rank's dispatch did (per rank inside `shard_map`; stacked over ranks outside).

    Attributes:
      num_routed_per_rank: int32[R] pairs this rank routed to each rank, before the capacity.
      num_dropped: int32[] pairs that did not fit (sum of max(routed - C, 0)); their expert
        output is missing from the result.
    """

    num_routed_per_rank: jax.Array
    num_dropped: jax.Array


@pytree_dataclass
class EPHandle:
    """What finalize needs to bring the expert outputs home.

    Attributes:
      slot: int32[T, k] send-buffer row (dest * C + position) of each pair, -1 when routed
        nowhere or dropped.
      topk_weights: float32[T, k] router weights still to apply.
      num_sent_per_rank: int32[R] rows sent to each rank (min(routed, C)).
      num_recv_per_rank: int32[R] rows received from each rank.
      stats: `EPStats`.
    """

    slot: jax.Array
    topk_weights: jax.Array
    num_sent_per_rank: jax.Array
    num_recv_per_rank: jax.Array
    stats: EPStats


@pytree_dataclass
class EPPreparedTokens(PreparedTokens):
    """`PreparedTokens` of the received rows ([R * C] tokens, top-1 local ids) plus the handle."""

    handle: EPHandle


def expert_map_for_rank(num_experts: int, num_ranks: int, rank: int) -> jax.Array:
    """vLLM's `determine_expert_map`: int32[E] local index of each global expert, -1 elsewhere.

    Rank r owns [r * (E // R), (r + 1) * (E // R)); the last rank also takes the remainder.

    Example:
      >>> expert_map_for_rank(5, 2, 1).tolist()
      [-1, -1, 0, 1, 2]
    """
    if not 0 <= rank < num_ranks or num_experts < num_ranks:
        raise ValueError(f"{rank=} must be in [0, {num_ranks=}) with {num_experts=} >= num_ranks")
    base = num_experts // num_ranks
    start = rank * base
    count = base + (num_experts % num_ranks if rank == num_ranks - 1 else 0)
    ids = jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.where((ids >= start) & (ids < start + count), ids - start, -1)


def send_slots(
    topk_ids: jax.Array, *, num_experts: int, num_ranks: int, capacity: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each pair goes (the module docstring's worked example).

    Args:
      topk_ids: int[T, k] global expert ids; ids outside [0, num_experts) go nowhere.
      num_experts: E, global; a multiple of num_ranks.
      num_ranks: R.
      capacity: C, rows per destination rank.

    Returns:
      (slot int32[T, k]: dest * C + position or -1; local_ids int32[T, k]: the expert's index on
      its rank, -1 when routed nowhere; num_routed_per_rank int32[R], before the capacity).

    Example:
      >>> slot, local, routed = send_slots(jnp.array([[3, 0], [2, 2]]), num_experts=4,
      ...                                  num_ranks=2, capacity=2)
      >>> slot.tolist(), local.tolist(), routed.tolist()
      ([[2, 0], [3, -1]], [[1, 0], [0, 0]], [1, 3])
    """
    experts_per_rank = num_experts // num_ranks
    ids = layouts.ids_as_int32(topk_ids)
    is_valid = (ids >= 0) & (ids < num_experts)
    dest = jnp.where(is_valid, ids // experts_per_rank, -1)
    one_hot = (dest.reshape(-1)[:, None] == jnp.arange(num_ranks, dtype=jnp.int32)[None, :]).astype(
        jnp.int32
    )
    routed = jnp.sum(one_hot, axis=0, dtype=jnp.int32)
    # Position among earlier pairs for the same rank, in (token, slot) order.
    position = jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)
    position = position.reshape(ids.shape)
    fits = is_valid & (position < capacity)
    slot = jnp.where(fits, dest * capacity + position, -1).astype(jnp.int32)
    local = jnp.where(is_valid, ids - dest * experts_per_rank, -1).astype(jnp.int32)
    return slot, local, routed


def _scatter_rows(
    values: jax.Array, slot: jax.Array, num_rows: int, fill, *, is_per_pair: bool
) -> jax.Array:
    """[T, ...] per-token (or, `is_per_pair`, [T, k, ...]) values -> [num_rows, ...] at `slot`
    rows. Said, not guessed from the shape: a token's [H / 128] scales with H / 128 == k look
    per-pair."""
    num_tokens, topk = slot.shape
    flat = slot.reshape(-1)
    target = jnp.where(flat >= 0, flat, num_rows)  # out of range -> dropped by the scatter
    if is_per_pair:
        per_pair = values.reshape(num_tokens * topk, *values.shape[2:])
    else:
        per_pair = jnp.repeat(values, topk, axis=0)
    buffer = jnp.full((num_rows, *per_pair.shape[1:]), fill, values.dtype)
    return buffer.at[target].set(per_pair, mode="drop")


def padded_exchange(buffer, fill, *, axis_name, num_ranks, capacity, send_sizes, recv_sizes):
    """The "padded" transport: `all_to_all` of the whole [R * C, ...] buffer."""
    del fill, num_ranks, capacity, send_sizes, recv_sizes  # every row travels
    return jax.lax.all_to_all(buffer, axis_name, 0, 0, tiled=True)


def ragged_exchange(buffer, fill, *, axis_name, num_ranks, capacity, send_sizes, recv_sizes):
    """The "ragged" transport: `ragged_all_to_all` of the first send_sizes[d] rows of each block
    (`EPConfig.exchange`); rows not received hold `fill`."""
    axis = axis_name
    wire = buffer
    is_fp8 = buffer.dtype == quant.FP8_DTYPE
    if is_fp8:  # collectives move bytes; keep the op on a plain integer type
        wire = jax.lax.bitcast_convert_type(buffer, jnp.uint8)
        fill = 0
    starts = jnp.arange(num_ranks, dtype=jnp.int32) * capacity
    # Each receiver keeps blocks by source at stride C, so this rank's rows land at rank * C.
    here = jnp.full((num_ranks,), jax.lax.axis_index(axis) * capacity, jnp.int32)
    out = jax.lax.ragged_all_to_all(
        wire,
        jnp.full_like(wire, fill),
        starts,
        send_sizes.astype(jnp.int32),
        here,
        recv_sizes.astype(jnp.int32),
        axis_name=axis,
    )
    return jax.lax.bitcast_convert_type(out, quant.FP8_DTYPE) if is_fp8 else out


TRANSPORTS.register(FunctionImpl("padded", padded_exchange))
TRANSPORTS.register(FunctionImpl("ragged", ragged_exchange))


@dataclasses.dataclass(frozen=True)
class AllToAllPrepareFinalize(PrepareFinalize):
    """Expert-parallel prepare/finalize on JAX all-to-all collectives (module docstring).

    Call inside `jax.shard_map` over `config.axis_name`, with this rank's tokens, their global
    routing, and this rank's E_local experts' weights.

    Attributes:
      config: `EPConfig`.
      num_experts: E, global; must be a multiple of the axis size.
    """

    config: EPConfig
    num_experts: int

    def prepare(
        self, hidden_states, topk_weights, topk_ids, *, quant_config, apply_router_weight_on_input
    ):
        num_ranks = jax.lax.axis_size(self.config.axis_name)
        if self.num_experts % num_ranks:
            raise ValueError(
                f"num_experts={self.num_experts} is not a multiple of the "
                f"{num_ranks} ranks on axis {self.config.axis_name!r}: give every rank E // R "
                "experts (pad the expert set with unused experts if needed)"
            )
        num_tokens, topk = topk_ids.shape
        capacity = self.config.capacity(num_tokens, topk)
        num_rows = num_ranks * capacity
        weights = topk_weights.astype(jnp.float32)
        x = hidden_states
        if apply_router_weight_on_input:
            x = scale_by_router_weight(x, weights)
            weights = jnp.ones_like(weights)
        x_scales = None
        if quant_config is not None:  # quantize before the exchange: FP8 rows + scales travel
            x, x_scales = quant_config.quantize_activations(x)
        slot, local, routed = send_slots(
            topk_ids, num_experts=self.num_experts, num_ranks=num_ranks, capacity=capacity
        )
        sent = jnp.minimum(routed, capacity)
        received = jax.lax.all_to_all(sent, self.config.axis_name, 0, 0, tiled=True)
        sizes = dict(num_ranks=num_ranks, capacity=capacity, send_sizes=sent, recv_sizes=received)
        exchange = self.config.exchange
        rows = exchange(_scatter_rows(x, slot, num_rows, 0, is_per_pair=False), 0, **sizes)
        scales = None
        if x_scales is not None:
            scatter = _scatter_rows(x_scales, slot, num_rows, 0, is_per_pair=False)
            scales = exchange(scatter, 0, **sizes)
        ids = exchange(_scatter_rows(local, slot, num_rows, -1, is_per_pair=True), -1, **sizes)
        stats = EPStats(
            num_routed_per_rank=routed,
            num_dropped=jnp.sum(routed - sent, dtype=jnp.int32),
        )
        handle = EPHandle(
            slot=slot,
            topk_weights=weights,
            num_sent_per_rank=sent,
            num_recv_per_rank=received,
            stats=stats,
        )
        return EPPreparedTokens(
            x=rows,
            x_scales=scales,
            topk_ids=ids[:, None],
            topk_weights=jnp.ones((num_rows, 1), jnp.float32),
            handle=handle,
        )

    def finalize(self, expert_output, prepared, weight_and_reduce: WeightAndReduce, *, out_dtype):
        handle = prepared.handle
        num_ranks = handle.num_sent_per_rank.shape[0]
        capacity = prepared.x.shape[0] // num_ranks
        # Weight 1 per received row: the outputs return unweighted, in the output dtype (exact
        # for bf16/float32 layers: the experts' GEMM2 output is already in that precision).
        per_row = weight_and_reduce.apply(expert_output, prepared.topk_weights, out_dtype=out_dtype)
        back = self.config.exchange(
            per_row,
            0,
            num_ranks=num_ranks,
            capacity=capacity,
            send_sizes=handle.num_recv_per_rank,
            recv_sizes=handle.num_sent_per_rank,
        )
        return layouts.unpermute_reference(
            back, handle.slot, handle.topk_weights, out_dtype=out_dtype
        )
