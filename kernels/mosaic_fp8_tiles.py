"""The order in which the Mosaic GPU FP8 grouped GEMM's persistent programs take their tiles.

A tile is one 64-row block of the contiguous layout (`moe_jax.layouts`) at one column tile. The
kernel (`kernels.mosaic_fp8_kernel`) either reads its tiles from `tile_table` (an expert's row
blocks in groups that take each column tile one after the other, padding blocks left out), or,
on 128-row segments, computes the order itself from a count of row blocks. Both run as XLA ops
before the kernel; ids outside [0, E) mark padding blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moe_jax.kernels.mosaic_fp8_config import BLOCK_M


def padded_rows(num_rows: int, *, is_dense: bool) -> int:
    """Rows after padding to whole 64-row blocks (with `is_dense`, whole 128-row pairs)."""
    multiple = 2 * BLOCK_M if is_dense else BLOCK_M
    return -(-num_rows // multiple) * multiple


def tile_table(block_experts: jax.Array, num_experts: int, n_tiles: int, group: int) -> jax.Array:
    """The output tiles in the order the persistent programs take them.

    Args:
      block_experts: int32[B] the expert of each 64-row block (ids outside [0, E) on padding).
      num_experts: E.
      n_tiles: column tiles (N / tile_n).
      group: `MosaicFp8GemmConfig.group_blocks`: an expert's blocks in groups of this many
        take each column tile in turn.

    Returns:
      int32[B * n_tiles * group + 1]: tile i is block `tiles[i] // n_tiles` at column tile
      `tiles[i] % n_tiles`; the last entry is the number of tiles S (entries from S on are 0).
    """
    num_blocks = block_experts.shape[0]
    sizes = group_sizes(block_experts, num_experts, group)
    # [block starting a group (or none: size 0), column tile, block of the group]
    first = jnp.arange(num_blocks, dtype=jnp.int32)[:, None, None]
    members = jnp.arange(group, dtype=jnp.int32)[None, None, :]
    columns = jnp.arange(n_tiles, dtype=jnp.int32)[None, :, None]
    is_tile = members < sizes[:, None, None]
    codes = (first + members) * n_tiles + columns
    shape = (num_blocks, n_tiles, group)
    codes = jnp.broadcast_to(codes, shape).reshape(-1)
    is_tile = jnp.broadcast_to(is_tile, shape).reshape(-1)
    num_tiles = jnp.sum(is_tile, dtype=jnp.int32)
    order = jnp.nonzero(is_tile, size=is_tile.size, fill_value=0)[0]
    tiles = jnp.where(jnp.arange(is_tile.size) < num_tiles, codes[order], 0)
    return jnp.append(tiles, num_tiles).astype(jnp.int32)


def group_sizes(block_experts: jax.Array, num_experts: int, group: int) -> jax.Array:
    """The size of the group of `group` blocks of one expert that each row block starts.

    Args:
      block_experts: int32[B] the expert of each 64-row block (of its first row; padding
        blocks hold an id outside [0, E)).
      num_experts: E.
      group: blocks per group: each expert's blocks 0, group, 2 * group, ... start one.

    Returns:
      int32[B]: at a block starting a group, the group's size (1 to `group`: the expert's blocks
      from there, capped); 0 at every other block and at padding blocks.
    """
    num_blocks = block_experts.shape[0]
    index = jnp.arange(num_blocks, dtype=jnp.int32)
    is_valid = (block_experts >= 0) & (block_experts < num_experts)
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), block_experts[:-1]])
    following = jnp.concatenate([block_experts[1:], jnp.full((1,), -1, jnp.int32)])
    # each valid block's segment: its first block and one past its last
    first = jax.lax.cummax(jnp.where(is_valid & (block_experts != previous), index, 0))
    is_last = is_valid & (block_experts != following)
    end = jax.lax.cummin(jnp.where(is_last, index + 1, num_blocks), reverse=True)
    is_start = is_valid & ((index - first) % group == 0)
    return jnp.where(is_start, jnp.minimum(end - index, group), 0).astype(jnp.int32)
