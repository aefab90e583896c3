"""Entry points of expert parallelism on JAX collectives: `ep_moe` (inside `shard_map`) and
`ep_fused_moe` (global arrays in, the `shard_map` done here). The exchange itself is
`moe_jax.expert_parallel.AllToAllPrepareFinalize`; its module docstring describes the dispatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from moe_jax.expert_parallel import AllToAllPrepareFinalize, EPConfig, EPStats
from moe_jax.experts import Experts
from moe_jax.experts_by_name import resolve_experts
from moe_jax.modular import ModularMoE
from moe_jax.moe_inputs import check_moe_inputs


def ep_moe(
    hidden_states: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    config: EPConfig,
    num_experts: int | None = None,
    experts: str | Experts = "auto",
    activation: str = "silu",
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
    chunk_size: int | None = None,
) -> tuple[jax.Array, EPStats]:
    """One rank's expert-parallel MoE forward; call inside `jax.shard_map` over `config.axis_name`.

    Args:
      hidden_states: [T, H] this rank's tokens.
      w1: [E_local, 2I, H] this rank's experts (global ids [rank * E_local, (rank+1) * E_local)).
      w2: [E_local, H, I].
      topk_weights: float[T, k] router weights of this rank's tokens.
      topk_ids: int[T, k] global expert ids; ids outside [0, E) go nowhere.
      config: `EPConfig` (axis, capacity, transport).
      num_experts: E, global; None means E_local * R.
      experts: runs the local experts: a name (`moe_jax.experts_by_name.experts_names`) or an
        `Experts` object; "auto" is `ContiguousExperts()`, every stage chosen by its registry
        (as `fused_moe`).
      activation, w1_scale, w2_scale, apply_router_weight_on_input: as `moe_jax.fused_moe`.
      chunk_size: run the experts over chunks of at most this many received rows.

    Returns:
      (out [T, H] in hidden_states.dtype, `EPStats` of this rank).

    Example (2 CPU devices needed, so not run as a doctest)::

      mesh = jax.make_mesh((2,), ("ep",))
      f = jax.shard_map(functools.partial(ep_moe, config=EPConfig(axis_name="ep")), mesh=mesh,
                        in_specs=P("ep"), out_specs=(P("ep"), P()), check_vma=False)
    """
    num_ranks = jax.lax.axis_size(config.axis_name)
    num_experts = w1.shape[0] * num_ranks if num_experts is None else num_experts
    if w1.shape[0] * num_ranks != num_experts:
        raise ValueError(
            f"w1.shape={w1.shape} holds E_local={w1.shape[0]} experts but "
            f"{num_experts=} over {num_ranks} ranks needs E_local = E // R"
        )
    layer = ModularMoE(
        AllToAllPrepareFinalize(config, num_experts),
        resolve_experts(experts),
        chunk_size=chunk_size,
    )
    out, prepared = layer.forward(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation=activation,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )
    if prepared is None:  # no tokens: no exchange happened
        return out, EPStats(
            num_routed_per_rank=jnp.zeros((num_ranks,), jnp.int32),
            num_dropped=jnp.zeros((), jnp.int32),
        )
    return out, prepared.handle.stats


def ep_fused_moe(
    mesh: jax.sharding.Mesh,
    hidden_states: jax.Array,
    w1: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    *,
    axis_name: str,
    capacity_per_rank: int | None = None,
    transport: str = "auto",
    experts: str | Experts = "auto",
    activation: str = "silu",
    w1_scale: jax.Array | None = None,
    w2_scale: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
    chunk_size: int | None = None,
) -> tuple[jax.Array, EPStats]:
    """`fused_moe` with tokens and experts split over `mesh` axis `axis_name` (R ranks).

    Args:
      mesh: a mesh with axis `axis_name`.
      hidden_states: [R * T, H] tokens; rank r holds rows [r * T, (r + 1) * T).
      w1, w2 (, w1_scale, w2_scale): all E experts, [E, ...]; rank r holds experts
        [r * E // R, (r + 1) * E // R). E must be a multiple of R.
      topk_weights, topk_ids: [R * T, k] routing with global ids.
      capacity_per_rank, transport: see `EPConfig`.
      experts, activation, apply_router_weight_on_input, chunk_size: as `ep_moe`.

    Returns:
      (out [R * T, H], `EPStats` stacked over ranks: num_routed_per_rank int32[R, R]
      (row = sender), num_dropped int32[R]).

    Example:
      >>> mesh = jax.make_mesh((1,), ("ep",))
      >>> x = jnp.ones((2, 8)); w1 = jnp.ones((2, 4, 8)) / 8; w2 = jnp.ones((2, 8, 2))
      >>> out, stats = ep_fused_moe(mesh, x, w1, w2, jnp.array([[1.0], [-1.0]]),
      ...                           jnp.array([[0], [5]]), axis_name="ep")
      >>> [round(v, 4) for v in out[:, 0].tolist()], stats.num_dropped.tolist()
      ([1.4621, 0.0], [0])
    """
    config = EPConfig(axis_name=axis_name, capacity_per_rank=capacity_per_rank, transport=transport)
    # The global arguments, as `fused_moe` checks them: a rank's slice would name its own shapes.
    check_moe_inputs(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        w1_scale=w1_scale,
        w2_scale=w2_scale,
        expert_map=None,
        global_num_experts=None,
        apply_router_weight_on_input=apply_router_weight_on_input,
        activation=activation,
    )
    num_experts = w1.shape[0]
    if axis_name not in mesh.shape:
        raise ValueError(f"{axis_name=} is not an axis of the mesh; it has {mesh.axis_names}")
    num_ranks = mesh.shape[axis_name]
    if num_experts % num_ranks or hidden_states.shape[0] % num_ranks:
        raise ValueError(
            f"w1.shape={w1.shape} and hidden_states.shape={hidden_states.shape}: the experts (E) "
            f"and the tokens must split evenly over the {num_ranks} ranks of axis {axis_name!r}"
        )

    def local(x, w1, w2, weights, ids, w1_scale, w2_scale):
        out, stats = ep_moe(
            x,
            w1,
            w2,
            weights,
            ids,
            config=config,
            num_experts=num_experts,
            experts=experts,
            activation=activation,
            w1_scale=w1_scale,
            w2_scale=w2_scale,
            apply_router_weight_on_input=apply_router_weight_on_input,
            chunk_size=chunk_size,
        )
        return out, jax.tree.map(lambda a: a[None], stats)

    if jax.sharding.get_abstract_mesh().empty:  # no `jax.set_mesh`: Auto axes, whose results
        # are plain global arrays (an Explicit mesh's sharded types make `jax.grad` need one)
        mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)
    spec = PartitionSpec(axis_name)
    scale_spec = None if w1_scale is None else spec
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(spec, spec, spec, spec, spec, scale_spec, scale_spec),
        out_specs=(spec, EPStats(num_routed_per_rank=spec, num_dropped=spec)),
        check_vma=False,
    )
    args = (hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale)
    sharded = [None if a is None else jax.device_put(a, NamedSharding(mesh, spec)) for a in args]
    return jax.jit(mapped)(*sharded)
