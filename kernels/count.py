"""Pallas GPU token counting: how many (token, slot) pairs each local expert receives.

One program per block of `block_e` experts streams all T*k ids in blocks of `block_p`, maps them
through the optional expert_map, and adds a one-hot histogram [block_p, block_e] reduced over the
pairs. No atomics: each program owns its experts' counts, so interpret mode matches the GPU.
A token that picks an expert twice counts twice; ids that map outside [0, E_local) count nowhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax import layouts
from moe_jax.kernels import _triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class CountConfig:
    """Tunables of the histogram kernel.

    Attributes:
      block_p: (token, slot) pairs per loop step (power of two).
      block_e: experts per program (power of two).
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages of the pair loop.
    """

    block_p: int = 256
    block_e: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_p", "block_e", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"CountConfig.{name}={value} but a power of two is needed")
        if self.num_stages < 1:
            raise ValueError(f"CountConfig.num_stages={self.num_stages} but >= 1 is needed")


def heuristic_config(num_pairs: int, num_local_experts: int) -> CountConfig:
    """Blocks for counting `num_pairs` ids into `num_local_experts` bins (<= 8K one-hot lanes)."""
    block_e = min(32, _triton.next_power_of_2(num_local_experts))
    block_p = min(256, _triton.next_power_of_2(num_pairs))
    return CountConfig(block_p=block_p, block_e=block_e, num_warps=4, num_stages=2)


def _count_kernel(
    # inputs
    ids_ref,
    expert_map_ref,
    # outputs
    counts_ref,
    *,
    block_p: int,
    block_e: int,
    num_pairs: int,
    num_local_experts: int,
    num_global_experts: int,
):
    """counts[e] for e in this program's block of experts; ids_ref is the flat int32[T*k]."""
    experts = pl.program_id(0) * block_e + jnp.arange(block_e, dtype=jnp.int32)
    lanes = jnp.arange(block_p, dtype=jnp.int32)

    def step(i, acc):
        pairs = i * block_p + lanes
        pair_ok = pairs < num_pairs
        ids = plt.load(ids_ref.at[jnp.where(pair_ok, pairs, 0)], mask=pair_ok, other=-1)
        if expert_map_ref is not None:  # global -> local, -1 for ids outside the map
            in_map = (ids >= 0) & (ids < num_global_experts)
            ids = plt.load(
                expert_map_ref.at[jnp.clip(ids, 0, num_global_experts - 1)], mask=in_map, other=-1
            )
        # Experts past num_local_experts are never stored; ids there must not count.
        ids = jnp.where((ids >= 0) & (ids < num_local_experts), ids, -1)
        hits = (ids[:, None] == experts[None, :]).astype(jnp.int32)
        return acc + jnp.sum(hits, axis=0, dtype=jnp.int32)

    counts = jax.lax.fori_loop(
        0, pl.cdiv(num_pairs, block_p), step, jnp.zeros((block_e,), jnp.int32)
    )
    plt.store(counts_ref.at[experts], counts, mask=experts < num_local_experts)


def _mapless_kernel(ids_ref, counts_ref, **kwargs):
    _count_kernel(ids_ref, None, counts_ref, **kwargs)


@functools.partial(jax.jit, static_argnames=("num_local_experts", "config", "interpret"))
def count_expert_num_tokens(
    topk_ids: jax.Array,
    num_local_experts: int,
    expert_map: jax.Array | None = None,
    *,
    config: CountConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`moe_jax.permute.count_expert_num_tokens` (arguments and int32[E_local] result as there)
    in one Pallas kernel, equal to `moe_jax.layouts.count_expert_num_tokens`. Needs T * k >= 1
    and E_global >= 1: the front checks the arguments and answers empty ones itself.

    Args:
      config: block sizes; None picks `heuristic_config(T * k, E_local)`.
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Example:
      >>> count_expert_num_tokens(jnp.array([[0, 0], [2, 1]]), 2, interpret=True).tolist()
      [2, 1]
    """
    num_pairs = topk_ids.size
    if config is None:
        config = heuristic_config(num_pairs, num_local_experts)
    static = dict(
        block_p=config.block_p,
        block_e=config.block_e,
        num_pairs=num_pairs,
        num_local_experts=num_local_experts,
        num_global_experts=0 if expert_map is None else expert_map.shape[0],
    )
    operands = [layouts.ids_as_int32(topk_ids).reshape(-1)]
    if expert_map is None:
        kernel = functools.partial(_mapless_kernel, **static)
    else:
        kernel = functools.partial(_count_kernel, **static)
        operands.append(layouts.ids_as_int32(expert_map))
    with _triton.quiet_triton_deprecation():
        return pl.pallas_call(
            kernel,
            grid=(pl.cdiv(num_local_experts, config.block_e),),
            out_shape=jax.ShapeDtypeStruct((num_local_experts,), jnp.int32),
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=f"count_{config.block_p=}_{config.block_e=}",
        )(*operands)
