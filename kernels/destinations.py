"""Pallas GPU routing metadata of the contiguous layout: counts, segment ends and destinations.

Equal, bit for bit, to `moe_jax.layouts.contiguous_destinations`: rows of an expert in (token,
slot) order, segments padded to `alignment`, ids outside [0, E) sent nowhere (-1).

Two small kernels over chunks of `DestinationsConfig.block_c` (token, slot) pairs, the flat
pair index p = token * k + slot, no atomics and no sort:

1. histogram: program c counts its chunk's pairs per expert -> hist int32[C, E_pad]
   (one-hot [block_p, E_pad] compares summed over pairs, `block_c / block_p` loop steps).
2. destinations: program c sums hist over all chunks (counts) and over chunks before c (pairs of
   earlier chunks), pads the counts to the alignment and takes their exclusive prefix over experts
   ([E_pad, E_pad] masked sum: segment starts). Its running offset per expert starts at
   `start[e] + earlier[e]`; each loop step over `block_p` pairs gives pair p the offset of its
   expert plus its rank among earlier pairs of the same expert in the step ([block_p, block_p]
   compare), then adds the step's one-hot counts to the offsets. Program 0 also writes counts
   and ends. Ranks thus follow pair order, as the reference's cumsum does.

Worked example, alignment 4, E=2, local_ids = [[1, 0], [1, 1]], block_c = block_p = 2:

    chunk 0 = pairs 0, 1 (ids 1, 0)    hist[0] = [1, 1]
    chunk 1 = pairs 2, 3 (ids 1, 1)    hist[1] = [0, 2]
    counts = [1, 3], padded = [4, 4], starts = [0, 4], ends = [4, 8]
    chunk 0: offsets start + earlier = [0, 4]: pair 0 (id 1) -> 4, pair 1 (id 0) -> 0
    chunk 1: offsets [0 + 1, 4 + 1] = [1, 5]: pair 2 -> 5, pair 3 -> 5 + 1 (rank 1 in step) = 6
    inverse = [[4, 0], [5, 6]]

Why two kernels, not one: a single kernel whose programs each own a block of experts (as
`count.py` does) streams all T*k pairs in one program when E <= block_e (one program at shape A,
T*k = 32K pairs, ~8 us of serial loop before any destination is written) and must know the
counts of every other expert block for its segment starts, so it streams the pairs twice. Cutting
the pairs into chunks spreads the work over ~64 programs; the price is one more launch and each
destinations program re-reading the [C, E] histogram (64 x 128 int32 = 32 KiB at shape B, from L2).

Measured on the H200 (2026-12-01, BENCHMARKS.md "Prefill"): slower than XLA, so
`"auto"` keeps XLA's destinations (`moe_jax.permute.xla_destinations_first`) and these kernels
run by name only. ncu at shape B (T*k = 64K, E = 128): histogram 20.4 us, destinations 36.5 us,
against about 28 us for XLA's fusions; host-timed at shape A, 46.7 us against 41.9. Likely causes,
not yet profiled: each loop step's 2-D one-hot reductions ([block_p, E_pad] and [block_p,
block_p]) go through shared memory across warps, and every destinations program repeats the
[E_pad, E_pad] prefix. A faster form would reduce once per chunk with a dot of one-hot blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax.kernels import _triton
from moe_jax.permute import DESTINATIONS

# Chunks of `block_c` pairs: about this many programs per kernel, so each destinations program
# re-reads a small histogram (64 x E int32).
_TARGET_CHUNKS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class DestinationsConfig:
    """Tunables of the histogram and destinations kernels.

    Attributes:
      block_p: (token, slot) pairs per loop step (power of two); the in-step rank compares
        [block_p, block_p] pairs.
      block_c: pairs per program (chunk; a power-of-two multiple of block_p).
      block_r: histogram rows (chunks) per loop step of the destinations kernel (power of two).
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages of the loops.
    """

    block_p: int = 64
    block_c: int = 512
    block_r: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_p", "block_c", "block_r", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"DestinationsConfig.{name}={value} but a power of two is needed")
        if self.block_c < self.block_p:
            raise ValueError(
                f"DestinationsConfig.block_c={self.block_c} < block_p={self.block_p}: a chunk "
                "holds whole loop steps"
            )
        if self.num_stages < 1:
            raise ValueError(f"DestinationsConfig.num_stages={self.num_stages} but >= 1 is needed")


def heuristic_config(num_pairs: int, num_experts: int) -> DestinationsConfig:
    """About `_TARGET_CHUNKS` chunks of at least one step; steps of 64 pairs (32 for E > 128,
    keeping the one-hot step at <= 8K lanes; at least 16, Triton's smallest comfortable block).
    E.g. T*k = 32768 -> block_c = 512 (64 programs of 8 steps)."""
    block_p = min(64 if num_experts <= 128 else 32, max(16, _triton.next_power_of_2(num_pairs)))
    block_c = max(block_p, _triton.next_power_of_2(pl.cdiv(num_pairs, _TARGET_CHUNKS)))
    return DestinationsConfig(
        block_p=block_p, block_c=block_c, block_r=16, num_warps=4, num_stages=2
    )


def _load_ids(ids_ref, pairs, *, num_pairs: int, num_experts: int):
    """int32 ids of `pairs`, -1 past the end and for ids outside [0, E) (they match no expert)."""
    in_range = pairs < num_pairs
    ids = plt.load(ids_ref.at[jnp.where(in_range, pairs, 0)], mask=in_range, other=-1)
    return jnp.where((ids >= 0) & (ids < num_experts), ids, -1)


def _histogram_kernel(
    # inputs
    ids_ref,
    # outputs
    hist_ref,
    *,
    block_p: int,
    block_c: int,
    block_e: int,
    num_pairs: int,
    num_experts: int,
):
    """hist[c, e]: pairs of chunk c (pairs [c * block_c, (c + 1) * block_c)) routed to e."""
    chunk = pl.program_id(0)
    experts = jnp.arange(block_e, dtype=jnp.int32)
    lanes = jnp.arange(block_p, dtype=jnp.int32)

    def step(i, acc):
        ids = _load_ids(
            ids_ref,
            chunk * block_c + i * block_p + lanes,
            num_pairs=num_pairs,
            num_experts=num_experts,
        )
        return acc + jnp.sum((ids[:, None] == experts[None, :]).astype(jnp.int32), axis=0)

    hist = jax.lax.fori_loop(0, block_c // block_p, step, jnp.zeros((block_e,), jnp.int32))
    # Both indices are vectors, as in the permute's 2-D gathers (a scalar row index is avoided).
    plt.store(hist_ref.at[chunk + jnp.zeros_like(experts), experts], hist)


def _destinations_kernel(
    # inputs
    ids_ref,
    hist_ref,
    # outputs
    inverse_ref,
    counts_ref,
    ends_ref,
    *,
    block_p: int,
    block_c: int,
    block_r: int,
    block_e: int,
    num_pairs: int,
    num_chunks: int,
    num_experts: int,
    alignment: int,
):
    """inverse[p] for the pairs of chunk c; program 0 also writes counts[e] and ends[e]."""
    chunk = pl.program_id(0)
    experts = jnp.arange(block_e, dtype=jnp.int32)
    chunk_lanes = jnp.arange(block_r, dtype=jnp.int32)

    def sum_hist(i, carry):  # counts over all chunks, and over the chunks before this one
        counts, earlier = carry
        rows = i * block_r + chunk_lanes
        hist = plt.load(
            hist_ref.at[jnp.where(rows < num_chunks, rows, 0)[:, None], experts[None, :]],
            mask=(rows < num_chunks)[:, None],
            other=0,
        )
        before = jnp.where((rows < chunk)[:, None], hist, 0)
        return counts + jnp.sum(hist, axis=0), earlier + jnp.sum(before, axis=0)

    zeros = jnp.zeros((block_e,), jnp.int32)
    counts, earlier = jax.lax.fori_loop(0, pl.cdiv(num_chunks, block_r), sum_hist, (zeros, zeros))
    # counts >= 0, so truncating division rounds up as a floor division would.
    padded = jax.lax.div(counts + (alignment - 1), jnp.int32(alignment)) * alignment
    # starts[e] = sum of padded[f] over f < e; rows e, columns f.
    is_before = experts[None, :] < experts[:, None]
    starts = jnp.sum(jnp.where(is_before, padded[None, :], 0), axis=1)

    @pl.when(chunk == 0)
    def _store_counts():
        is_expert = experts < num_experts
        plt.store(counts_ref.at[experts], counts, mask=is_expert)
        plt.store(ends_ref.at[experts], starts + padded, mask=is_expert)

    lanes = jnp.arange(block_p, dtype=jnp.int32)
    is_earlier_lane = lanes[None, :] < lanes[:, None]  # [p, q]: q comes before p

    def step(i, offsets):
        pairs = chunk * block_c + i * block_p + lanes
        ids = _load_ids(ids_ref, pairs, num_pairs=num_pairs, num_experts=num_experts)
        hits = (ids[:, None] == experts[None, :]).astype(jnp.int32)  # [block_p, block_e]
        offset = jnp.sum(hits * offsets[None, :], axis=1)
        same = (ids[:, None] == ids[None, :]) & is_earlier_lane
        rank = jnp.sum(same.astype(jnp.int32), axis=1)
        inverse = jnp.where(ids >= 0, offset + rank, -1)
        # Unclamped indices: masked lanes write nothing, and distinct lanes keep interpret
        # mode's masked scatter from writing a stale value over a real one.
        plt.store(inverse_ref.at[pairs], inverse, mask=pairs < num_pairs)
        return offsets + jnp.sum(hits, axis=0)

    jax.lax.fori_loop(0, block_c // block_p, step, starts + earlier)


@functools.partial(jax.jit, static_argnames=("num_experts", "alignment", "config", "interpret"))
def contiguous_destinations(
    local_ids: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    config: DestinationsConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where each (token, slot) lands in the contiguous layout, with counts and segment ends.

    Equal to `moe_jax.layouts.contiguous_destinations`.

    Args:
      local_ids: int[T, k] local expert ids (`moe_jax.layouts.map_expert_ids`); ids outside
        [0, E) go nowhere.
      num_experts: E, the number of local experts.
      alignment: segment length multiple (128 for DeepGEMM, 1 for none).
      config: block sizes; None picks `heuristic_config(T * k, E)`.
      interpret: run the Pallas kernels in interpret mode (CPU tests).

    Returns:
      (inverse int32[T, k]: row of each (token, slot), -1 where it goes nowhere;
      num_tokens_per_expert int32[E]; expert_ends int32[E]: one past each padded segment).

    Example:
      >>> inverse, counts, ends = contiguous_destinations(
      ...     jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4, interpret=True)
      >>> inverse.tolist(), counts.tolist(), ends.tolist()
      ([[4, 0], [5, 6]], [1, 3], [4, 8])
    """
    if local_ids.ndim != 2 or not jnp.issubdtype(local_ids.dtype, jnp.integer):
        raise TypeError(f"{local_ids.shape=} {local_ids.dtype=} but int[T, k] is needed")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{num_experts=} but a positive int is needed")
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"{alignment=} but a positive int is needed")
    num_pairs = local_ids.size
    if num_pairs == 0:  # nothing routed: every segment is empty
        no_experts = jnp.zeros((num_experts,), jnp.int32)
        return jnp.full(local_ids.shape, -1, jnp.int32), no_experts, no_experts
    if config is None:
        config = heuristic_config(num_pairs, num_experts)
    # Expert lanes padded to a power of two (>= 16, as the pair lanes); ids never match the pad.
    block_e = max(16, _triton.next_power_of_2(num_experts))
    num_chunks = pl.cdiv(num_pairs, config.block_c)
    flat = local_ids.astype(jnp.int32).reshape(-1)
    params = _triton.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)
    shared = dict(
        block_p=config.block_p,
        block_c=config.block_c,
        block_e=block_e,
        num_pairs=num_pairs,
        num_experts=num_experts,
    )
    with _triton.quiet_triton_deprecation():
        hist = pl.pallas_call(
            functools.partial(_histogram_kernel, **shared),
            grid=(num_chunks,),
            out_shape=jax.ShapeDtypeStruct((num_chunks, block_e), jnp.int32),
            interpret=interpret,
            compiler_params=params,
            name=f"destinations_histogram_{config.block_p=}_{config.block_c=}",
        )(flat)
        inverse, counts, ends = pl.pallas_call(
            functools.partial(
                _destinations_kernel,
                **shared,
                block_r=config.block_r,
                num_chunks=num_chunks,
                alignment=alignment,
            ),
            grid=(num_chunks,),
            out_shape=(
                jax.ShapeDtypeStruct((num_pairs,), jnp.int32),
                jax.ShapeDtypeStruct((num_experts,), jnp.int32),
                jax.ShapeDtypeStruct((num_experts,), jnp.int32),
            ),
            interpret=interpret,
            compiler_params=params,
            name=f"destinations_{config.block_p=}_{config.block_c=}_{config.block_r=}",
        )(flat, hist)
    return inverse.reshape(local_ids.shape), counts, ends


_triton.register_pallas(DESTINATIONS, contiguous_destinations)
