"""Pallas GPU permute: tokens -> contiguous expert-major rows (`moe_jax.layouts.ContiguousLayout`).

Two steps. The routing metadata (where each (token, slot) lands, per-expert counts, which token
feeds each output row) is O(T*k) integers from `moe_jax.permute.ROUTING_METADATA` "auto": XLA's
fusions (on the H200 they beat the one kernel of `moe_jax.kernels.routing_metadata` except at
layer shape A, see `moe_jax.permute.xla_routing_metadata_first`; interpret mode runs the same
XLA ops). A
Pallas Triton kernel then does the heavy part in gather form: one program per block of output rows
and hidden columns reads the source token of each row and copies it, writing zeros on padding
rows (or, with `is_padding_zeroed=False`, nothing there: 20% of the bytes at layer shape B). Every
output element is written at most once, with no atomics, so interpret mode (CPU tests) runs the
same program.

Worked example, alignment 4, E=2, topk_ids = [[1, 0], [1, 1]] (pairs p = token*k + slot = 0..3):

    pair p          0  1  2  3        key (expert, E for invalid)   1  0  1  1
    rank in expert  0  0  1  2        segment starts (padded)       e0: 0, e1: 4
    dest = start[key] + rank:         inverse = [[4, 0], [5, 6]]
    source (token per output row):    [0, -1, -1, -1, 0, 1, 1, -1, -1, -1, -1, -1]
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
from moe_jax.permute import PERMUTES, ROUTING_METADATA, check_permute_args, problem_for
from moe_jax.registry import AUTO

# Copies move bits: each row dtype travels as the unsigned integer of its width.
_BITS_DTYPE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PermuteConfig:
    """Tunables of the row-gather kernel.

    Attributes:
      block_m: output rows per program (power of two).
      block_h: hidden columns per program (power of two); a tail past H is masked.
      num_warps: Triton warps per program.
      num_stages: Triton pipeline stages (the kernel has no loop; 1 is enough).
      has_eviction_hints: keep token rows in L2 (each is read k times) and stream the output
        rows past it (written once); False issues plain loads and stores.
    """

    block_m: int = 16
    block_h: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    has_eviction_hints: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_h", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"PermuteConfig.{name}={value} but a power of two is needed")
        if self.num_stages < 1:
            raise ValueError(f"PermuteConfig.num_stages={self.num_stages} but >= 1 is needed")


def heuristic_config(num_rows: int, hidden: int, itemsize: int) -> PermuteConfig:
    """Block sizes for copying `num_rows` rows of `hidden` elements of `itemsize` bytes.

    About 2 KiB of each row per program and 16 rows, so a program moves ~32 KiB; row blocks shrink
    for tiny problems. On an H200 (jax 0.11.2, T=4096/8192, k=8, H=7168/2048) 8 warps beat 4 by
    6% for 2-byte rows at H=2048 and lost 35% for FP8 rows there; elsewhere they tied.
    """
    block_h = _triton.hidden_block(hidden, cap=max(64, 2048 // itemsize))
    block_m = min(16, _triton.next_power_of_2(num_rows))
    num_warps = 8 if itemsize >= 2 else 4
    return PermuteConfig(block_m=block_m, block_h=block_h, num_warps=num_warps, num_stages=1)


def _gather_rows_kernel(
    # inputs
    source_ref,
    x_ref,
    scales_ref,
    # outputs
    out_ref,
    out_scales_ref,
    *,
    block_m: int,
    block_h: int,
    block_g: int,
    num_rows: int,
    num_tokens: int,
    hidden: int,
    num_groups: int,
    has_eviction_hints: bool,
    is_scales_group_major: bool,
    is_padding_zeroed: bool,
):
    """out[r, h] = x[source[r], h] where source[r] >= 0, else 0, for one [block_m, block_h] tile.

    The programs of the first column block also copy the rows' scales ([block_m, block_g]),
    into out_scales[r, g], or out_scales[g, r] with `is_scales_group_major`. Without
    `is_padding_zeroed` rows with source[r] < 0 are not written at all (rows and scales).
    """
    rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pl.program_id(1) * block_h + jnp.arange(block_h, dtype=jnp.int32)
    row_ok = rows < num_rows
    col_ok = cols < hidden
    source = plt.load(source_ref.at[jnp.where(row_ok, rows, 0)], mask=row_ok, other=-1)
    has_source = source >= 0
    # Clamped indices keep masked lanes in bounds; the mask decides what is read.
    token = jnp.clip(source, 0, num_tokens - 1)
    row_written = row_ok if is_padding_zeroed else row_ok & has_source
    taken = plt.load(
        x_ref.at[token[:, None], cols[None, :]],
        mask=has_source[:, None] & col_ok[None, :],
        other=0,
        eviction_policy="evict_last" if has_eviction_hints else None,
    )
    plt.store(
        out_ref.at[rows[:, None], cols[None, :]],
        taken,
        mask=row_written[:, None] & col_ok[None, :],
        eviction_policy="evict_first" if has_eviction_hints else None,
    )
    if scales_ref is None:
        return

    @pl.when(pl.program_id(1) == 0)
    def _copy_scales():
        groups = jnp.arange(block_g, dtype=jnp.int32)
        group_ok = groups < num_groups
        scales = plt.load(
            scales_ref.at[token[:, None], groups[None, :]],
            mask=has_source[:, None] & group_ok[None, :],
            other=0,
        )
        at = (
            (groups[None, :], rows[:, None])
            if is_scales_group_major
            else (rows[:, None], groups[None, :])
        )
        plt.store(
            out_scales_ref.at[at],
            scales,
            mask=row_written[:, None] & group_ok[None, :],
        )


def _gather_rows_no_scales_kernel(source_ref, x_ref, out_ref, **kwargs):
    _gather_rows_kernel(source_ref, x_ref, None, out_ref, None, **kwargs)


def _gather_rows(
    x: jax.Array,
    x_scales: jax.Array | None,
    source: jax.Array,
    *,
    config: PermuteConfig,
    is_scales_group_major: bool,
    is_padding_zeroed: bool,
    interpret: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """(x[source[r]], x_scales[source[r]]), zero where source[r] < 0 (left unwritten without
    `is_padding_zeroed`); bit-exact copies.

    With `is_scales_group_major` the row scales are written as float32[G, M] and returned as
    their transpose [M, G], for a GEMM that reads them through that transpose (XLA cancels the
    two, so no copy runs between the permute and GEMM1).

    Args:
      x: [T, H] rows of any 1-, 2- or 4-byte dtype. x_scales: float32[T, G] or None.
      source: int32[M] token of each output row, -1 for padding.
    """
    num_tokens, hidden = x.shape
    num_rows = source.shape[0]
    if hidden == 0 or (x_scales is not None and x_scales.shape[1] == 0):
        # an empty axis: the kernel's column or group block would read past it; XLA's gather
        def gather(a):
            return jnp.where((source >= 0)[:, None], a[jnp.clip(source, 0, num_tokens - 1)], 0)

        return gather(x), None if x_scales is None else gather(x_scales)
    block_h = min(config.block_h, _triton.next_power_of_2(hidden))
    num_groups = 0 if x_scales is None else x_scales.shape[1]
    kernel = functools.partial(
        _gather_rows_kernel if x_scales is not None else _gather_rows_no_scales_kernel,
        block_m=config.block_m,
        block_h=block_h,
        block_g=_triton.next_power_of_2(num_groups),
        num_rows=num_rows,
        num_tokens=num_tokens,
        hidden=hidden,
        num_groups=num_groups,
        has_eviction_hints=config.has_eviction_hints,
        is_scales_group_major=is_scales_group_major,
        is_padding_zeroed=is_padding_zeroed,
    )
    operands = [x] if x_scales is None else [x, x_scales]
    bits = [jax.lax.bitcast_convert_type(a, _BITS_DTYPE[a.dtype.itemsize]) for a in operands]
    out_shape = [jax.ShapeDtypeStruct((num_rows, hidden), bits[0].dtype)]
    if x_scales is not None:
        scales_shape = (num_groups, num_rows) if is_scales_group_major else (num_rows, num_groups)
        out_shape.append(jax.ShapeDtypeStruct(scales_shape, bits[1].dtype))
    with _triton.quiet_triton_deprecation():
        out = pl.pallas_call(
            kernel,
            grid=(pl.cdiv(num_rows, config.block_m), pl.cdiv(hidden, block_h)),
            out_shape=out_shape,
            interpret=interpret,
            compiler_params=_triton.compiler_params(
                num_warps=config.num_warps, num_stages=config.num_stages
            ),
            name=f"permute_{config.block_m=}_{block_h=}_{config.num_warps=}"
            f"_{config.has_eviction_hints=}",
        )(source, *bits)
    out = [jax.lax.bitcast_convert_type(o, a.dtype) for o, a in zip(out, operands, strict=True)]
    if x_scales is None:
        return out[0], None
    return out[0], out[1].T if is_scales_group_major else out[1]


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_experts",
        "alignment",
        "config",
        "is_scales_group_major",
        "is_padding_zeroed",
        "interpret",
    ),
)
def permute(
    x: jax.Array,
    topk_ids: jax.Array,
    *,
    num_experts: int,
    x_scales: jax.Array | None = None,
    expert_map: jax.Array | None = None,
    alignment: int = layouts.DEFAULT_ALIGNMENT,
    config: PermuteConfig | None = None,
    is_scales_group_major: bool = False,
    is_padding_zeroed: bool = True,
    interpret: bool = False,
) -> layouts.ContiguousLayout:
    """Copies each token once per chosen local expert into expert-contiguous rows.

    Bit-identical to `moe_jax.layouts.permute_reference`.

    Args:
      x: [T, H] tokens (bf16, float16, float32 or float8_e4m3fn).
      topk_ids: int[T, k] expert per slot; ids outside [0, E) after `expert_map` send that copy
        nowhere and never address memory.
      num_experts: E, the number of local experts.
      x_scales: optional float32[T, G] scales of FP8 tokens (G = H // 128), permuted with the rows.
      expert_map: optional int[E_global] global-to-local map, -1 for experts held elsewhere.
      alignment: segment length multiple (128 for DeepGEMM).
      config: block sizes of the copy kernel; None picks `heuristic_config(M, H, itemsize)`.
      is_scales_group_major: write the row scales as [G, M] in memory (returned transposed, the
        same values), for a GEMM that reads them so (`GroupedGemm.is_scales_group_major`).
      interpret: run the Pallas kernel in interpret mode (CPU tests).

    Returns:
      `ContiguousLayout` with M = `layouts.contiguous_num_rows(T, k, E, alignment)` rows; padding
      rows are zero and carry expert id -1.

    Example:
      >>> lay = permute(jnp.arange(4.0).reshape(2, 2), jnp.array([[1, 0], [1, 1]]),
      ...               num_experts=2, alignment=4, interpret=True)
      >>> lay.expert_ids.tolist(), lay.inverse.tolist(), lay.rows[4].tolist()
      ([0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1], [[4, 0], [5, 6]], [0.0, 1.0])
    """
    check_permute_args(x, topk_ids, num_experts, x_scales, expert_map, alignment)
    num_tokens, topk = topk_ids.shape
    num_rows = layouts.contiguous_num_rows(num_tokens, topk, num_experts, alignment)
    if num_tokens * topk == 0:  # nothing to route: the layout has no rows
        no_experts = jnp.zeros((num_experts,), jnp.int32)
        return layouts.ContiguousLayout(
            rows=jnp.zeros((0, x.shape[1]), x.dtype),
            row_scales=None if x_scales is None else jnp.zeros((0, x_scales.shape[1]), jnp.float32),
            expert_ids=jnp.zeros((0,), jnp.int32),
            inverse=jnp.full((num_tokens, topk), -1, jnp.int32),
            num_tokens_per_expert=no_experts,
            expert_ends=no_experts,
        )
    local = layouts.map_expert_ids(topk_ids, num_experts=num_experts, expert_map=expert_map)
    if config is None:
        config = heuristic_config(num_rows, x.shape[1], x.dtype.itemsize)
    meta = ROUTING_METADATA.select(AUTO, problem_for(local))(
        local, num_experts=num_experts, alignment=alignment, num_rows=num_rows
    )
    rows, row_scales = _gather_rows(
        x,
        x_scales,
        meta.source,
        config=config,
        is_scales_group_major=is_scales_group_major,
        is_padding_zeroed=is_padding_zeroed,
        interpret=interpret,
    )
    return layouts.ContiguousLayout(
        rows=rows,
        row_scales=row_scales,
        expert_ids=meta.expert_ids,
        inverse=meta.inverse,
        num_tokens_per_expert=meta.num_tokens_per_expert,
        expert_ends=meta.expert_ends,
    )


_triton.register_pallas(PERMUTES, permute)
