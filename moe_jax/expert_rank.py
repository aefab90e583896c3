"""Rank of each routed (token, slot) pair among the earlier pairs of its expert, in pure JAX.

`moe_jax.layouts.contiguous_destinations` places pair p at row `start[expert] + rank[p]`; both
methods here return the same bits (rank, and the pairs per expert), at different costs on a GPU:
`method_for` takes "pairwise" up to `PAIRWISE_MAX_PAIRS` and "blocked" above (BENCHMARKS.md,
Thresholds: `PAIRWISE_MAX_PAIRS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PAIRWISE_MAX_PAIRS = 4096  # up to here one [P, P] compare is fastest
BLOCK = 256  # pairs per block of the "blocked" rank (fastest of 128-1024 at P=32768 and 65536)
TRIANGULAR_PREFIX_MAX_BLOCKS = 512  # up to here blocks are prefixed by one masked sum
METHODS = ("pairwise", "blocked")


def method_for(num_pairs: int) -> str:
    """The rank method for P = T*k pairs: "pairwise" up to `PAIRWISE_MAX_PAIRS`, else "blocked".

    Example:
      >>> method_for(4096), method_for(4097)
      ('pairwise', 'blocked')
    """
    return "pairwise" if num_pairs <= PAIRWISE_MAX_PAIRS else "blocked"


def _one_hot_counts(flat: jax.Array, num_experts: int) -> jax.Array:
    """int32[E] pairs per expert of int32[P] ids; ids outside [0, E) count nowhere."""
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.sum(flat[:, None] == experts[None, :], axis=0, dtype=jnp.int32)


def rank_pairwise(flat: jax.Array, *, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(rank int32[P], counts int32[E]) of int32[P] ids by one [P, P] compare: the pairs q < p
    with p's expert.

    Rank is meaningless for ids outside [0, E) (the caller masks those).
    """
    index = jnp.arange(flat.size, dtype=jnp.int32)
    earlier = index[None, :] < index[:, None]
    rank = jnp.sum(earlier & (flat[None, :] == flat[:, None]), axis=1, dtype=jnp.int32)
    return rank, _one_hot_counts(flat, num_experts)


def rank_blocked(
    flat: jax.Array,
    *,
    num_experts: int,
    block: int = BLOCK,
    triangular_max_blocks: int = TRIANGULAR_PREFIX_MAX_BLOCKS,
) -> tuple[jax.Array, jax.Array]:
    """(rank, counts) in blocks of `block` pairs, with no scan over P.

    rank[p] = (pairs of p's expert in the blocks before p's) + (earlier pairs of p's expert in
    p's block). Three reductions, each touching a pair O(block + E) times: per-block counts
    int32[P/B, E] (one-hot sum), their exclusive prefix over the P/B blocks, and the within-block
    rank by a pairwise compare int32[P/B, B, B] (P*B compares). Worked example, B=2, E=2,
    ids [1, 0, 1, 1, 0]:

        block                        0        1        2
        ids (per pair)               [1, 0]   [1, 1]   [0, -1]   (-1 pads to a multiple of B)
        block_counts (per expert)    [1, 1]   [0, 2]   [1, 0]
        block_starts (per expert)    [0, 0]   [1, 1]   [1, 3]    (exclusive prefix over blocks)
        within (per pair)            [0, 0]   [0, 1]   [0, .]
        rank = block_starts[id] + within: [0, 0, 1, 2, 1]

    P/B blocks up to `triangular_max_blocks` are prefixed by one masked sum over an
    [P/B, P/B, E] compare (one fusion; (P/B)^2 * E adds); beyond, by a cumsum over the block
    axis, which is P/B long where the old form's was P.
    """
    num_pairs = flat.size
    block = max(1, min(block, num_pairs))  # fewer pairs than a block: one block, no padding
    num_blocks = -(-num_pairs // block)
    ids = jnp.pad(flat, (0, num_blocks * block - num_pairs), constant_values=-1)
    ids = ids.reshape(num_blocks, block)
    experts = jnp.arange(num_experts, dtype=jnp.int32)
    block_counts = jnp.sum(
        ids[:, :, None] == experts[None, None, :], axis=1, dtype=jnp.int32
    )  # [P/B, E]
    if num_blocks <= triangular_max_blocks:
        index = jnp.arange(num_blocks, dtype=jnp.int32)
        is_before = index[None, :] < index[:, None]  # [b, b']: b' < b
        block_starts = jnp.sum(
            jnp.where(is_before[:, :, None], block_counts[None, :, :], 0), axis=1, dtype=jnp.int32
        )
    else:
        block_starts = jnp.cumsum(block_counts, axis=0, dtype=jnp.int32) - block_counts
    slot = jnp.arange(block, dtype=jnp.int32)
    earlier = slot[None, :] < slot[:, None]  # [p, q]: q < p
    within = jnp.sum(
        earlier[None, :, :] & (ids[:, :, None] == ids[:, None, :]), axis=2, dtype=jnp.int32
    )
    start = jnp.take_along_axis(block_starts, jnp.clip(ids, 0, num_experts - 1), axis=1)
    rank = (start + within).reshape(-1)[:num_pairs]
    return rank, jnp.sum(block_counts, axis=0, dtype=jnp.int32)


RANKERS = {
    "pairwise": rank_pairwise,
    "blocked": rank_blocked,
}
