"""Pallas GPU kernels: per-token-group FP8 quantization, alone or fused after act(gate) * up.

The fused kernel turns GEMM1's bf16 [M, 2I] into GEMM2's FP8 [M, I] plus float32 scales
[M, I / 128] in one pass. One program handles `block_m` rows of one 128-column group: it loads the
gate columns [g*128, (g+1)*128) and the up columns [I + g*128, ...), so the group's amax never
leaves registers.

Rounding matches `moe_jax.activation.act_and_mul` followed by
`moe_jax.quant.per_token_group_quant_fp8`: act in float32, rounded to the input dtype, the product
rounded again, then `scale = max(amax, 1e-10) / 448` and `q = clip(a / scale, +-448)` cast to
e4m3 with round-to-nearest-even. `group_quant` is the same kernel without the activation: it
quantizes the layer's input tokens before the permute (its scales by row, the order the
permute gathers them in); `act_and_quant` can write its scales group-major, for a GEMM2 that
reads them so (`is_scales_group_major`).

Interpret mode (the CPU tests) and the compiled kernel run one body; the roundings are spelled
per backend in `_divide`, `_divide_rows`, `_saturate` and `_round` so both round where the
reference rounds. Interpret mode does not cover the activation's float32 arithmetic, which the
compiled kernel spells with `exp2` (`KERNEL_ACTIVATIONS`): it can move an FP8 code by one step
where the activation lands on a bf16 rounding boundary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from moe_jax import layouts, quant
from moe_jax.activation import gated_activation, round_to_dtype
from moe_jax.kernels import _triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActQuantConfig:
    """Tunables of the quantization kernels (fused activation + quantization, and alone).

    Attributes:
      block_m: rows per program (power of two).
      num_warps: Triton warps per program.
      groups_per_program: 128-column groups per program (power of two; clipped to the largest
        power of two dividing the number of groups): a program loads `block_m` rows x
        `groups_per_program * 128` columns and quantizes them group by group.
      is_group_major: the grid's fastest axis walks column groups (programs launched together
        read neighbouring columns of the same rows) rather than row blocks.
    """

    block_m: int = 32
    num_warps: int = 4
    groups_per_program: int = 1
    is_group_major: bool = False

    def __post_init__(self):
        for name in ("block_m", "num_warps", "groups_per_program"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"ActQuantConfig.{name}={value} but a power of two is needed")


MIN_PROGRAMS = 512  # about 4 programs per H200 multiprocessor: small calls split rows finer
BLOCK_ROWS = 16  # rows per program of a large call
GROUPS_PER_PROGRAM = 2  # 128-column groups per program, where the group count allows


def heuristic_config(num_rows: int, num_groups: int = 1) -> ActQuantConfig:
    """Up to 16 rows x 2 groups of 128 columns per program, the grid walking column groups
    fastest; fewer rows per program where the call would have fewer than `MIN_PROGRAMS` programs
    (BENCHMARKS.md, Thresholds: `act_quant.heuristic_config`).

      >>> heuristic_config(36832, 16)
      ActQuantConfig(block_m=16, num_warps=4, groups_per_program=2, is_group_major=True)
      >>> heuristic_config(128, 16).block_m, heuristic_config(128, 3).groups_per_program
      (2, 1)
    """
    rows, groups = max(num_rows, 1), max(num_groups, 1)
    per_program = _triton.largest_power_of_2_divisor(groups, GROUPS_PER_PROGRAM)
    block_m = min(BLOCK_ROWS, _triton.next_power_of_2(rows))
    while block_m > 1 and -(-rows // block_m) * (groups // per_program) < MIN_PROGRAMS:
        block_m //= 2
    return ActQuantConfig(block_m=block_m, groups_per_program=per_program, is_group_major=True)


def _divide(a, b, *, interpret: bool):
    """a / b correctly rounded (IEEE round-to-nearest-even), as the reference divides.

    The same quotient in both modes, spelled per backend: XLA (interpret mode) rewrites
    a / broadcast(b) as a * (1 / b), which `quant.divide` prevents; Triton lowers float32 `/` to
    PTX `div.full.f32` (up to 2 ulp off, triton-lang/triton#10661), so the compiled kernel emits
    `div.rn.f32` itself. Remove the inline PTX once Triton's `/` lowers to `div.rn.f32`.
    """
    if interpret:
        return quant.divide(a, b)
    [quotient] = plt.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, jnp.broadcast_to(b, a.shape)],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return quotient


# One correction step after a multiply by the correctly rounded reciprocal (Markstein): the
# residual a - q0 * b is exact in an FMA (for |a| >= 2**-100), and q0 + residual / b, as an FMA
# with the reciprocal, is then the correctly rounded quotient; copysign keeps -0 / b == -0.
_DIVIDE_BY_RECIPROCAL_PTX = """{
    .reg .f32 q0, r, q1;
    mul.rn.f32 q0, $1, $2;
    neg.f32 r, q0;
    fma.rn.f32 r, r, $3, $1;
    fma.rn.f32 q1, r, $2, q0;
    copysign.f32 $0, $1, q1;
}"""


def _divide_rows(a, b, *, interpret: bool):
    """a [rows, C] / b [rows, 1], for the cast to e4m3 that follows: the same codes as the
    correctly rounded quotient, for finite b that is a normal float32 (the quantization scales,
    max(amax, 1e-10) / 448: 2.2e-13 to 7.6e35).

    Interpret mode divides (`quant.divide`). The compiled kernel takes one correctly rounded
    reciprocal per row (`div.rn.f32`) and per element a multiply and two FMAs
    (`_DIVIDE_BY_RECIPROCAL_PTX`): the correctly rounded quotient wherever |a| >= 2**-100; below
    that it may be one ulp off, but such a quotient casts to a zero of a's sign either way.
    """
    if interpret:
        return quant.divide(a, b)
    reciprocal = _divide(jnp.ones(b.shape, jnp.float32), b, interpret=False)
    [quotient] = plt.elementwise_inline_asm(
        _DIVIDE_BY_RECIPROCAL_PTX,
        args=[a, jnp.broadcast_to(reciprocal, a.shape), jnp.broadcast_to(b, a.shape)],
        constraints="=f,f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return quotient


def _saturate(q, *, interpret: bool):
    """q clipped to e4m3's +-448 before the cast, where the cast does not saturate itself.

    XLA's float32 -> e4m3 conversion (interpret mode) turns values past 448 into NaN, so the
    reference clips first. Triton's conversion on sm_90 is `cvt.rn.satfinite.e4m3x2.f32`, which
    rounds and saturates in one instruction (and keeps NaN, as the reference's clip does), so the
    compiled kernel skips the two min/max per element.
    """
    return jnp.clip(q, -quant.FP8_MAX, quant.FP8_MAX) if interpret else q


LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))


def _silu_by_exp2(x):
    """silu(x) = x / (1 + exp(-x)) with exp(-x) spelled exp2(-x * log2(e)), float32.

    Triton lowers `exp2` to one `ex2.approx` and a multiply (`exp` is libdevice's `__nv_expf`).
    Its error (2 ulp of float32) can move a result across a bf16 rounding boundary, which the
    GPU tests bound (one FP8 step, at most 1% of codes). Compiled kernel only: interpret mode
    keeps the reference's spelling.
    """
    return x / (1.0 + jnp.exp2(x * -LOG2E))


# The compiled kernel's spelling of an activation, where it has its own (else
# `moe_jax.activation.ACTIVATIONS`).
KERNEL_ACTIVATIONS = {"silu": _silu_by_exp2}


def _round(x, dtype, *, interpret: bool):
    """float32 `x` rounded to nearest even in `dtype`: a plain cast in Triton (`cvt.rn`), which
    XLA (interpret mode) may elide as excess precision unless told (`round_to_dtype`)."""
    return round_to_dtype(x, dtype) if interpret else x.astype(dtype)


def _store_quantized(
    a, q_ref, scale_ref, group: int, *, is_scales_group_major: bool, interpret: bool
):
    """Quantizes float32 rows `a` [block_m, 128] into column group `group` of the program's
    q_ref [block_m, G * 128] block and its scale_ref block: [block_m, G], or the transpose
    [G, block_m] with `is_scales_group_major` (group-major scales, see `act_and_quant`)."""
    amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
    scale = _divide(
        jnp.maximum(amax, quant.SCALE_EPS),
        jnp.full(amax.shape, quant.FP8_MAX, jnp.float32),
        interpret=interpret,
    )
    quotient = _divide_rows(a, scale, interpret=interpret)
    width = a.shape[1]
    q_ref[:, pl.ds(group * width, width)] = _saturate(quotient, interpret=interpret).astype(
        q_ref.dtype
    )
    if is_scales_group_major:
        scale_ref[pl.ds(group, 1), :] = scale.reshape(1, -1)
    else:
        scale_ref[:, pl.ds(group, 1)] = scale


def _act_quant_kernel(
    # inputs
    gate_ref,
    up_ref,
    expert_ids_ref,
    # outputs
    q_ref,
    scale_ref,
    *,
    activation: str,
    group_size: int,
    is_scales_group_major: bool,
    interpret: bool,
):
    """act(gate) * up quantized, for the program's rows and groups; with `expert_ids_ref`
    (int32[block_m], -1 on padding rows), a program whose rows are all padding writes nothing."""

    def compute():
        round_fn = functools.partial(_round, interpret=interpret)
        act_fn = None if interpret else KERNEL_ACTIVATIONS.get(activation)
        for group in range(q_ref.shape[1] // group_size):  # static: the program's groups
            columns = pl.ds(group * group_size, group_size)
            gate, up = gate_ref[:, columns], up_ref[:, columns]
            a = gated_activation(gate, up, activation, round_fn=round_fn, act_fn=act_fn)
            _store_quantized(
                a.astype(jnp.float32),
                q_ref,
                scale_ref,
                group,
                is_scales_group_major=is_scales_group_major,
                interpret=interpret,
            )

    if expert_ids_ref is None:
        compute()
    else:
        pl.when(jnp.max(expert_ids_ref[...]) >= 0)(compute)


def _act_quant_all_rows_kernel(gate_ref, up_ref, q_ref, scale_ref, **kwargs):
    _act_quant_kernel(gate_ref, up_ref, None, q_ref, scale_ref, **kwargs)


def _group_quant_kernel(
    # inputs
    x_ref,
    # outputs
    q_ref,
    scale_ref,
    *,
    group_size: int,
    is_scales_group_major: bool,
    interpret: bool,
):
    for group in range(q_ref.shape[1] // group_size):
        columns = pl.ds(group * group_size, group_size)
        a = x_ref[:, columns].astype(jnp.float32)
        _store_quantized(
            a,
            q_ref,
            scale_ref,
            group,
            is_scales_group_major=is_scales_group_major,
            interpret=interpret,
        )


def _quantize_call(
    kernel,
    x,
    *,
    num_rows,
    num_groups,
    group_size,
    column_offset,
    config,
    name,
    is_scales_group_major,
    interpret,
    expert_ids=None,
):
    """pallas_call over (row blocks, group blocks): reads x's groups [g*G, (g+1)*G) (and the
    same groups shifted by `column_offset` groups for a gated kernel, and each row block's
    `expert_ids` when given), writes q [M, num_groups * group_size] and scales
    [M, num_groups] (in memory [num_groups, M] with `is_scales_group_major`, returned as the
    transpose)."""
    cfg = heuristic_config(num_rows, num_groups) if config is None else config
    per_program = _triton.largest_power_of_2_divisor(num_groups, cfg.groups_per_program)
    padded_rows = -(-num_rows // cfg.block_m) * cfg.block_m
    if padded_rows != num_rows:
        x = jnp.pad(x, ((0, padded_rows - num_rows), (0, 0)))
        if expert_ids is not None:
            expert_ids = jnp.pad(expert_ids, (0, padded_rows - num_rows), constant_values=-1)
    grid = (padded_rows // cfg.block_m, num_groups // per_program)

    def index(order):  # (row block, group block) of a program whatever the grid's order
        return (lambda g, i: order(i, g)) if cfg.is_group_major else order

    block = (cfg.block_m, per_program * group_size)
    in_specs = [pl.BlockSpec(block, index(lambda i, g: (i, g)))]
    operands = [x]
    if column_offset:
        shift = column_offset // per_program
        in_specs.append(pl.BlockSpec(block, index(lambda i, g: (i, g + shift))))
        operands.append(x)
    if expert_ids is not None:
        in_specs.append(pl.BlockSpec((cfg.block_m,), index(lambda i, g: (i,))))
        operands.append(expert_ids)
    if is_scales_group_major:
        scales_shape = (num_groups, padded_rows)
        scales_spec = pl.BlockSpec((per_program, cfg.block_m), index(lambda i, g: (g, i)))
    else:
        scales_shape = (padded_rows, num_groups)
        scales_spec = pl.BlockSpec((cfg.block_m, per_program), index(lambda i, g: (i, g)))
    with _triton.quiet_triton_deprecation():
        q, scales = pl.pallas_call(
            functools.partial(
                kernel,
                group_size=group_size,
                is_scales_group_major=is_scales_group_major,
                interpret=interpret,
            ),
            out_shape=(
                jax.ShapeDtypeStruct((padded_rows, num_groups * group_size), quant.FP8_DTYPE),
                jax.ShapeDtypeStruct(scales_shape, jnp.float32),
            ),
            grid=grid[::-1] if cfg.is_group_major else grid,
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec(block, index(lambda i, g: (i, g))),
                scales_spec,
            ],
            compiler_params=_triton.compiler_params(num_warps=cfg.num_warps, num_stages=1),
            interpret=interpret,
            name=(
                f"{name}_bm{cfg.block_m}_w{cfg.num_warps}_g{per_program}"
                f"{'_gm' if cfg.is_group_major else ''}"
            ),
        )(*operands)
    if is_scales_group_major:
        return q[:num_rows], scales[:, :num_rows].T
    return q[:num_rows], scales[:num_rows]


def group_quant(
    x: jax.Array,
    *,
    group_size: int = 128,
    config: ActQuantConfig | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """vLLM's per-token-group FP8 quantization (`quant.per_token_group_quant_fp8`) as one kernel.

    Args:
      x: bf16/float16/float32[M, H] tokens (M >= 1); H a positive multiple of `group_size`.
        The front (`moe_jax.act_quant.group_quant`) checks the arguments and answers empty
        ones itself.
      group_size: columns per scale.
      config: block sizes; None picks `heuristic_config(M, H // group_size)`.
      interpret: run in Pallas interpret mode (CPU tests).

    Returns:
      (q float8_e4m3fn[M, H], scales float32[M, H // group_size]).
    """
    num_rows, hidden = x.shape
    return _quantize_call(
        _group_quant_kernel,
        x,
        num_rows=num_rows,
        num_groups=hidden // group_size,
        group_size=group_size,
        column_offset=0,
        config=config,
        name="group_quant",
        is_scales_group_major=False,  # the permute gathers them by token row
        interpret=interpret,
    )


def act_and_quant(
    h: jax.Array,
    *,
    activation: str = "silu",
    group_size: int = 128,
    config: ActQuantConfig | None = None,
    interpret: bool = False,
    expert_ids: jax.Array | None = None,
    is_scales_group_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """act(h[:, :I]) * h[:, I:] quantized to FP8 per row per `group_size` columns.

    Arguments (less `impl`) and result as `moe_jax.act_quant.act_and_quant`, whose checks this
    kernel relies on: the front answers empty arguments itself (here M >= 1) and refuses the
    activations the compiled kernel cannot lower ("gelu" runs in interpret mode only:
    `moe_jax.act_quant.COMPILED_ACTIVATIONS`). With `expert_ids`, programs whose rows are all
    padding are skipped, their rows of q and scales unspecified.

    Args:
      config: block sizes; None picks `heuristic_config(M, I // group_size)`.
      interpret: run in Pallas interpret mode (CPU tests).
    """
    num_rows, two_i = h.shape
    num_groups = two_i // 2 // group_size
    kernel = _act_quant_all_rows_kernel if expert_ids is None else _act_quant_kernel
    return _quantize_call(
        functools.partial(kernel, activation=activation),
        h,
        expert_ids=None if expert_ids is None else layouts.ids_as_int32(expert_ids),
        num_rows=num_rows,
        num_groups=num_groups,
        group_size=group_size,
        column_offset=num_groups,
        config=config,
        name=f"act_quant_{activation}",
        is_scales_group_major=is_scales_group_major,
        interpret=interpret,
    )
