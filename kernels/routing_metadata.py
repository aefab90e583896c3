"""Pallas GPU routing metadata of the contiguous layout in one kernel: where each (token, slot)
goes, the counts and segment ends per expert, and the token and expert of every row.

Equal, bit for bit, to `moe_jax.layouts.routing_metadata` (destinations in (token, slot) order
within an expert, segments padded to `alignment`, ids outside [0, E) sent nowhere).

The T*k pairs (flat index p = token * k + slot) are cut into C chunks of `block_c`. The grid has
2C programs; each takes a ticket from an atomic counter, and the ticket, not the program id,
decides its role (so a program that waits knows that every program it waits for has started):

1. tickets 0..C-1, histogram: count chunk `ticket`'s pairs per expert into hist[ticket, :],
   then add one to the "done" counter.
2. tickets C..2C-1, destinations of chunk c = ticket - C: spin until "done" reaches C, sum the
   histogram over all chunks (counts) and over the chunks before c, pad the counts to the
   alignment and prefix them over experts (segment starts); then, step by step over `block_p`
   pairs, give pair p the row `start[e] + (pairs of e in earlier chunks and steps) + (its rank
   among earlier pairs of e in the step)`, and write inverse[p], source[row] = p // k and
   expert_ids[row] = e. Last, it writes -1 to the padding rows of its block of E / C experts
   (the < alignment rows between an expert's pairs and its segment's end) and to its share of
   the rows past the last segment (at most M of them, M / C per chunk). Ticket C also writes
   counts and ends.

Each output element is written by exactly one program, so there are no races; the only atomics
are the two counters. In interpret mode (CPU tests) the programs run one after another in
ticket order, so no program ever waits and the same arithmetic runs.

Worked example, alignment 4, E=2, ids = [[1, 0], [1, 1]], block_c = 2 (C = 2 chunks, M = 12):

    histogram    chunk 0 = pairs 0, 1 (ids 1, 0): [1, 1]; chunk 1 = pairs 2, 3 (ids 1, 1): [0, 2]
    counts = [1, 3], padded = [4, 4], starts = [0, 4], ends = [4, 8]
    chunk 0      offsets start + earlier = [0, 4]: pair 0 (id 1) -> 4, pair 1 (id 0) -> 0
    chunk 1      offsets [0 + 1, 4 + 1] = [1, 5]: pair 2 -> 5, pair 3 -> 5 + 1 = 6
    inverse = [[4, 0], [5, 6]]
    source     = [0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1]
    expert_ids = [0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1]

Forward progress on a GPU: programs holding histogram tickets never wait, and every waiting
program got its ticket after all C histogram tickets were handed out, that is after C running
programs took them. Visibility: a histogram program's threads store, meet at a CTA barrier,
then one thread adds to "done" with acquire-release semantics at GPU scope (Pallas Triton's
atomics); a destinations program reads "done" atomically, meets its threads at a barrier, and
reads the histogram with volatile loads (from L2). The two counters start at zero: an int32[2]
zeros input aliased to an output, which XLA fills before each call.

The XLA fusions of `moe_jax.layouts.routing_metadata` are `moe_jax.permute.ROUTING_METADATA`'s
"auto" (BENCHMARKS.md, Thresholds: `xla_routing_metadata_first`); this kernel runs by name.
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

_TICKETS, _DONE = 0, 1  # the two counters
_MAX_CHUNKS = 256  # chunks of `block_c` pairs at most (BENCHMARKS.md, Thresholds)
# Loops of up to this many steps are unrolled (their loads need not wait on each other); longer
# ones stay loops: 32 unrolled steps (T*k = 128K pairs) took Triton over 2 minutes to compile.
MAX_UNROLLED_STEPS = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingMetadataConfig:
    """Tunables of the routing-metadata kernel.

    Attributes:
      block_p: pairs per step of the destinations (power of two); a step compares
        [block_p, block_p] pairs for their rank and [block_p, E_pad] for their expert.
      block_c: pairs per chunk (a power-of-two multiple of block_p): one histogram program
        and one destinations program each.
      block_r: histogram rows summed per step (power of two).
      block_m: padding rows per store (power of two).
      num_warps: Triton warps per program.
    """

    block_p: int = 64
    block_c: int = 256
    block_r: int = 32
    block_m: int = 128
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_p", "block_c", "block_r", "block_m", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(
                    f"RoutingMetadataConfig.{name}={value} but a power of two is needed"
                )
        if self.block_c < self.block_p:
            raise ValueError(
                f"RoutingMetadataConfig.block_c={self.block_c} < block_p={self.block_p}: a "
                "chunk holds whole steps"
            )


def heuristic_config(num_pairs: int, num_experts: int) -> RoutingMetadataConfig:
    """At most `_MAX_CHUNKS` chunks of whole steps; steps of 64 pairs (32 above 128
    experts, keeping a step's one-hot at <= 8K lanes).

    E.g. T*k = 32768 -> block_c = 128 (256 chunks of 2 steps); 65536 -> 256; 8 -> 16.
    """
    block_p = min(64 if num_experts <= 128 else 32, max(16, _triton.next_power_of_2(num_pairs)))
    block_c = max(block_p, _triton.next_power_of_2(pl.cdiv(num_pairs, _MAX_CHUNKS)))
    return RoutingMetadataConfig(block_p=block_p, block_c=block_c, block_r=32, block_m=128)


def _cta_barrier(interpret: bool) -> None:
    """bar.sync among the program's threads; interpret mode runs one thread, and has none."""
    if not interpret:
        plt.debug_barrier()


def _load_ids(ids_ref, pairs, *, num_pairs: int, num_experts: int):
    """int32 ids of `pairs`, -1 past the end and for ids outside [0, E) (they match no expert)."""
    in_range = pairs < num_pairs
    ids = plt.load(ids_ref.at[jnp.where(in_range, pairs, 0)], mask=in_range, other=-1)
    return jnp.where((ids >= 0) & (ids < num_experts), ids, -1)


def _steps(num_steps: int, body, carry):
    """carry = body(step, carry) for step in range(num_steps): unrolled up to
    `MAX_UNROLLED_STEPS`, a loop beyond."""
    if num_steps <= MAX_UNROLLED_STEPS:
        for step in range(num_steps):
            carry = body(step, carry)
        return carry
    return jax.lax.fori_loop(0, num_steps, body, carry)


def _histogram(ids_ref, hist_ref, chunk, *, block_p, block_c, experts, **ids_kw):
    """hist[chunk, e] = pairs of the chunk routed to e."""
    lanes = jnp.arange(block_p, dtype=jnp.int32)

    def step(i, hits):
        ids = _load_ids(ids_ref, chunk * block_c + i * block_p + lanes, **ids_kw)
        return hits + (ids[:, None] == experts[None, :]).astype(jnp.int32)

    hits = _steps(block_c // block_p, step, jnp.zeros((block_p, experts.shape[0]), jnp.int32))
    plt.store(
        hist_ref.at[chunk + jnp.zeros_like(experts), experts],
        jnp.sum(hits, axis=0, dtype=jnp.int32),
    )


def _wait_for_histograms(counters_ref, num_chunks: int) -> None:
    """Spins until `num_chunks` histogram programs have added to "done"."""

    def read_done(previous):
        # atomic + 0: a coherent read at GPU scope; the index is built from the carry, as a
        # constant closed over by a while body cannot be discharged in interpret mode
        return plt.atomic_add(counters_ref, previous * 0 + _DONE, previous * 0)

    jax.lax.while_loop(lambda done: done < num_chunks, read_done, read_done(jnp.int32(0)))


def _segments(hist_ref, chunk, *, block_r, num_chunks, experts, alignment):
    """(counts, earlier, starts, ends) int32[E_pad]: pairs per expert in all chunks and in the
    chunks before `chunk`, and the padded segments' first and one-past-last rows (lanes past E
    have empty segments at the end)."""
    chunk_lanes = jnp.arange(block_r, dtype=jnp.int32)

    def step(i, sums):
        total, before = sums
        rows = i * block_r + chunk_lanes
        hist = plt.load(
            hist_ref.at[jnp.where(rows < num_chunks, rows, 0)[:, None], experts[None, :]],
            mask=(rows < num_chunks)[:, None],
            other=0,
            volatile=True,
        )
        return total + hist, before + jnp.where((rows < chunk)[:, None], hist, 0)

    zeros = jnp.zeros((block_r, experts.shape[0]), jnp.int32)
    total, before = _steps(pl.cdiv(num_chunks, block_r), step, (zeros, zeros))
    counts = jnp.sum(total, axis=0, dtype=jnp.int32)
    # counts >= 0, so truncating division rounds up as a floor division would.
    padded = jax.lax.div(counts + (alignment - 1), jnp.int32(alignment)) * alignment
    is_before = experts[None, :] < experts[:, None]  # [e, f]: f comes before e
    starts = jnp.sum(jnp.where(is_before, padded[None, :], 0), axis=1, dtype=jnp.int32)
    return counts, jnp.sum(before, axis=0, dtype=jnp.int32), starts, starts + padded


def _place_pairs(
    ids_ref,
    inverse_ref,
    source_ref,
    expert_ids_ref,
    chunk,
    offsets,
    *,
    block_p,
    block_c,
    topk,
    num_rows,
    experts,
    **ids_kw,
):
    """inverse[p], source[inverse[p]] and expert_ids[inverse[p]] for the chunk's pairs;
    `offsets[e]` is the row of the chunk's first pair of expert e."""
    lanes = jnp.arange(block_p, dtype=jnp.int32)
    is_earlier_lane = lanes[None, :] < lanes[:, None]  # [p, q]: q comes before p

    def step(i, offsets):
        pairs = chunk * block_c + i * block_p + lanes
        ids = _load_ids(ids_ref, pairs, **ids_kw)
        hits = (ids[:, None] == experts[None, :]).astype(jnp.int32)  # [block_p, E_pad]
        offset = jnp.sum(hits * offsets[None, :], axis=1, dtype=jnp.int32)
        rank = jnp.sum(
            ((ids[:, None] == ids[None, :]) & is_earlier_lane).astype(jnp.int32), 1, dtype=jnp.int32
        )
        is_valid = ids >= 0
        inverse = jnp.where(is_valid, offset + rank, -1)
        plt.store(inverse_ref.at[pairs], inverse, mask=pairs < ids_kw["num_pairs"])
        # Lanes that go nowhere point past the rows (distinct, never written): interpret mode's
        # masked scatter then cannot write a stale value over a real lane's row.
        rows = jnp.where(is_valid, inverse, num_rows + lanes)
        plt.store(source_ref.at[rows], jax.lax.div(pairs, jnp.int32(topk)), mask=is_valid)
        plt.store(expert_ids_ref.at[rows], ids, mask=is_valid)
        return offsets + jnp.sum(hits, axis=0, dtype=jnp.int32)

    _steps(block_c // block_p, step, offsets)


def _mark_padding(
    source_ref,
    expert_ids_ref,
    chunk,
    counts,
    starts,
    ends,
    *,
    block_m,
    num_chunks,
    tail_rows_per_chunk,
    num_rows,
    num_experts,
    alignment,
    experts,
):
    """-1 in source and expert_ids on padding rows: the < alignment rows after the pairs of
    this chunk's block of experts, and its share of the rows past the last segment.

    Experts go `block_x` at a time ([block_x, block_a] tiles of rows), so one chunk holding all
    256 experts (T*k = 8) takes 16 steps, not 256.
    """
    per_chunk = pl.cdiv(num_experts, num_chunks)
    block_x = min(16, _triton.next_power_of_2(per_chunk))
    block_a = min(block_m, _triton.next_power_of_2(max(alignment - 1, 1)))
    expert_lanes = jnp.arange(block_x, dtype=jnp.int32)
    row_lanes = jnp.arange(block_a, dtype=jnp.int32)
    pad_end = starts + counts  # first padding row of each segment

    def store(rows, mask):
        # Masked lanes point past the rows, each at its own index: interpret mode's masked
        # scatter then cannot write a stale value over another lane's row.
        lane = jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape)
        rows = jnp.where(mask, rows, num_rows + lane)
        minus_one = jnp.full(rows.shape, -1, jnp.int32)
        plt.store(source_ref.at[rows], minus_one, mask=mask)
        plt.store(expert_ids_ref.at[rows], minus_one, mask=mask)

    def experts_step(i, carry):
        mine = chunk * per_chunk + i * block_x + expert_lanes  # [block_x]
        is_mine = (mine < (chunk + 1) * per_chunk) & (mine < num_experts)
        pick = experts[None, :] == mine[:, None]  # [block_x, E_pad]
        first = jnp.sum(jnp.where(pick, pad_end[None, :], 0), axis=1, dtype=jnp.int32)
        end = jnp.sum(jnp.where(pick, ends[None, :], 0), axis=1, dtype=jnp.int32)

        def rows_step(j, carry):
            rows = first[:, None] + j * block_a + row_lanes[None, :]  # [block_x, block_a]
            store(rows, is_mine[:, None] & (rows < end[:, None]))
            return carry

        return _steps(pl.cdiv(alignment - 1, block_a), rows_step, carry)

    _steps(pl.cdiv(per_chunk, block_x), experts_step, 0)
    used = jnp.max(ends)  # lanes past E end where the last expert does
    lanes = jnp.arange(block_m, dtype=jnp.int32)

    def tail_step(j, carry):
        rows = used + chunk * tail_rows_per_chunk + j * block_m + lanes
        store(rows, rows < num_rows)
        return carry

    _steps(tail_rows_per_chunk // block_m, tail_step, 0)


def _metadata_kernel(
    # inputs
    ids_ref,
    counters_in_ref,
    # outputs
    inverse_ref,
    counts_ref,
    ends_ref,
    source_ref,
    expert_ids_ref,
    hist_ref,
    counters_ref,
    *,
    block_p: int,
    block_c: int,
    block_r: int,
    block_m: int,
    block_e: int,
    num_pairs: int,
    topk: int,
    num_chunks: int,
    num_experts: int,
    num_rows: int,
    tail_rows_per_chunk: int,
    alignment: int,
    interpret: bool,
):
    """One program: a histogram chunk or a destinations chunk, by ticket (module docstring)."""
    del counters_in_ref  # the same buffer as counters_ref
    experts = jnp.arange(block_e, dtype=jnp.int32)
    ids_kw = dict(num_pairs=num_pairs, num_experts=num_experts)
    ticket = plt.atomic_add(counters_ref, jnp.int32(_TICKETS), jnp.int32(1))

    @pl.when(ticket < num_chunks)
    def _histogram_role():
        _histogram(
            ids_ref, hist_ref, ticket, block_p=block_p, block_c=block_c, experts=experts, **ids_kw
        )
        _cta_barrier(interpret)  # every thread's store before the release below
        plt.atomic_add(counters_ref, jnp.int32(_DONE), jnp.int32(1))

    @pl.when(ticket >= num_chunks)
    def _destinations_role():
        chunk = ticket - num_chunks
        _wait_for_histograms(counters_ref, num_chunks)
        _cta_barrier(interpret)  # the acquire above before any thread reads the histogram
        counts, earlier, starts, ends = _segments(
            hist_ref,
            chunk,
            block_r=block_r,
            num_chunks=num_chunks,
            experts=experts,
            alignment=alignment,
        )

        @pl.when(chunk == 0)
        def _store_segments():
            is_expert = experts < num_experts
            plt.store(counts_ref.at[experts], counts, mask=is_expert)
            plt.store(ends_ref.at[experts], ends, mask=is_expert)

        _place_pairs(
            ids_ref,
            inverse_ref,
            source_ref,
            expert_ids_ref,
            chunk,
            starts + earlier,
            block_p=block_p,
            block_c=block_c,
            topk=topk,
            num_rows=num_rows,
            experts=experts,
            **ids_kw,
        )
        _mark_padding(
            source_ref,
            expert_ids_ref,
            chunk,
            counts,
            starts,
            ends,
            block_m=block_m,
            num_chunks=num_chunks,
            tail_rows_per_chunk=tail_rows_per_chunk,
            num_rows=num_rows,
            num_experts=num_experts,
            alignment=alignment,
            experts=experts,
        )


@functools.partial(
    jax.jit, static_argnames=("num_experts", "alignment", "num_rows", "config", "interpret")
)
def routing_metadata(
    local_ids: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    num_rows: int,
    config: RoutingMetadataConfig | None = None,
    interpret: bool = False,
) -> layouts.RoutingMetadata:
    """The contiguous layout's routing metadata, in one Pallas kernel.

    Equal to `moe_jax.layouts.routing_metadata`.

    Arguments and `layouts.RoutingMetadata` as `moe_jax.permute.routing_metadata`, which checks
    them and answers empty ids itself (here T * k >= 1).

    Args:
      config: block sizes; None picks `heuristic_config(T * k, E)`.
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Example:
      >>> meta = routing_metadata(jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4,
      ...                         num_rows=12, interpret=True)
      >>> meta.inverse.tolist(), meta.source.tolist()
      ([[4, 0], [5, 6]], [0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1])
    """
    num_tokens, topk = local_ids.shape
    num_pairs = num_tokens * topk
    if config is None:
        config = heuristic_config(num_pairs, num_experts)
    # Expert lanes padded to a power of two (>= 16); ids never match the pad.
    block_e = max(16, _triton.next_power_of_2(num_experts))
    num_chunks = pl.cdiv(num_pairs, config.block_c)
    # The rows past the last segment number at most M (no pair valid), split over the chunks.
    tail_rows_per_chunk = pl.cdiv(pl.cdiv(num_rows, num_chunks), config.block_m) * config.block_m
    kernel = functools.partial(
        _metadata_kernel,
        block_p=config.block_p,
        block_c=config.block_c,
        block_r=config.block_r,
        block_m=config.block_m,
        block_e=block_e,
        num_pairs=num_pairs,
        topk=topk,
        num_chunks=num_chunks,
        num_experts=num_experts,
        num_rows=num_rows,
        tail_rows_per_chunk=tail_rows_per_chunk,
        alignment=alignment,
        interpret=interpret,
    )
    i32 = jnp.int32
    # an int64 id of 2**32 + 1 must go nowhere, not wrap to expert 1
    flat_ids = layouts.ids_as_int32(local_ids).reshape(-1)
    with _triton.quiet_triton_deprecation():
        inverse, counts, ends, source, expert_ids, _, _ = pl.pallas_call(
            kernel,
            grid=(2 * num_chunks,),
            out_shape=(
                jax.ShapeDtypeStruct((num_pairs,), i32),
                jax.ShapeDtypeStruct((num_experts,), i32),
                jax.ShapeDtypeStruct((num_experts,), i32),
                jax.ShapeDtypeStruct((num_rows,), i32),
                jax.ShapeDtypeStruct((num_rows,), i32),
                jax.ShapeDtypeStruct((num_chunks, block_e), i32),  # histogram (scratch)
                jax.ShapeDtypeStruct((2,), i32),  # ticket and done counters (scratch)
            ),
            input_output_aliases={1: 6},
            interpret=interpret,
            compiler_params=_triton.compiler_params(num_warps=config.num_warps, num_stages=1),
            name=f"routing_metadata_{config.block_p=}_{config.block_c=}",
        )(flat_ids, jnp.zeros((2,), i32))
    return layouts.RoutingMetadata(
        inverse=inverse.reshape(local_ids.shape),
        num_tokens_per_expert=counts,
        expert_ends=ends,
        source=source,
        expert_ids=expert_ids,
    )
