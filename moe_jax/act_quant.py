"""FP8 activation quantization ops, each with a registry of implementations.

- `group_quant`: the layer input, per token per `group_size` columns (vLLM's
  `per_token_group_quant_fp8`).
- `act_and_quant`: act(gate) * up on the first GEMM's output, then the same quantization for the
  second GEMM, fused into one pass where a kernel exists.

Implementations, chosen by `impl` through `moe_jax.registry`: "xla" (`moe_jax.quant` and
`moe_jax.activation`, everywhere), "pallas" (`moe_jax.kernels.act_quant`, NVIDIA GPUs, imported
when it first runs; the compiled act + quant kernel lowers `COMPILED_ACTIVATIONS` only), and
"auto" ("pallas" on a GPU where it runs, else "xla"). The fronts check the arguments once and
answer empty inputs (no rows or no groups) with XLA's empty arrays. Neither op is differentiable
(FP8 codes would take FP8 cotangents): differentiable FP8 GEMMs quantize their float rows inside
their VJPs (`moe_jax.grouped_gemm_backward`); differentiating one of these raises a TypeError.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from moe_jax import quant
from moe_jax.activation import act_and_mul, check_activation
from moe_jax.registry import (
    AUTO,
    FunctionImpl,
    OpProblem,
    Registry,
    current_platform,
    lazy,
    needs_gpu,
    pallas_then_xla,
)
from moe_jax.routing import require_int

# Activations the compiled (Triton) act + quant kernel lowers. Exact GELU needs erf/erfc, which
# the Pallas Triton lowering does not implement (jax 0.10-0.11); interpret mode runs every one.
COMPILED_ACTIVATIONS = ("silu",)


def group_quant_reference(x: jax.Array, *, group_size: int = 128) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX `group_quant`: `quant.per_token_group_quant_fp8`."""
    return quant.per_token_group_quant_fp8(x, group_size)


def act_and_quant_reference(
    h: jax.Array,
    *,
    activation: str = "silu",
    group_size: int = 128,
    expert_ids: jax.Array | None = None,
    is_scales_group_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX `act_and_quant`: `act_and_mul` then `quant.per_token_group_quant_fp8`, on every
    row (padding rows named by `expert_ids` may be left unspecified; this computes them too).
    `is_scales_group_major` asks a kernel how to lay its output out in memory; XLA lays out
    its own arrays, and the values are the same either way."""
    del expert_ids, is_scales_group_major
    return quant.per_token_group_quant_fp8(act_and_mul(h, activation), group_size)


GROUP_QUANTS = Registry("group_quant", preference=pallas_then_xla)
ACT_QUANTS = Registry("act_and_quant", preference=pallas_then_xla)
# JAX would otherwise try to differentiate the Pallas kernels' bodies (inline PTX has no
# derivative rule), and an FP8 result's cotangent would be FP8 too.
NO_GRADIENT_MESSAGE = (
    "FP8 activation quantization has no gradient (FP8 rows are for inference): fused_moe and "
    "the Flax MoE differentiate through float8_e4m3fn expert weights on float tokens, which "
    "their GEMMs quantize; call those, or pass float rows to the experts and GEMMs"
)


def without_gradient(fn: Callable[[jax.Array], tuple[jax.Array, jax.Array]]):
    """`fn` as a function whose differentiation raises TypeError(NO_GRADIENT_MESSAGE)."""
    call = jax.custom_vjp(fn)
    call.defvjp(lambda x: (fn(x), None), _refuse_gradient)
    return call


def _refuse_gradient(residuals, cotangents):
    raise TypeError(NO_GRADIENT_MESSAGE)


def _refuse_compiled(problem: OpProblem) -> str | None:
    why = needs_gpu(problem)
    if why is None and problem.activation not in (None, *COMPILED_ACTIVATIONS):
        why = (
            f"the compiled kernel lowers {COMPILED_ACTIVATIONS} only, not {problem.activation!r} "
            "(Pallas Triton cannot lower erf)"
        )
    return why


GROUP_QUANTS.register(FunctionImpl("xla", group_quant_reference))
GROUP_QUANTS.register(
    FunctionImpl("pallas", lazy("moe_jax.kernels.act_quant:group_quant"), _refuse_compiled)
)
ACT_QUANTS.register(FunctionImpl("xla", act_and_quant_reference))
ACT_QUANTS.register(
    FunctionImpl("pallas", lazy("moe_jax.kernels.act_quant:act_and_quant"), _refuse_compiled)
)


def check_float_rows(x: jax.Array, name: str, *, group_size: int, columns_per_group: int = 1):
    """Checks quantization input `name` (x or h): float rows [M, C] with C a multiple of
    `columns_per_group` * `group_size` (2 for act*up's gate and up halves), and a positive
    `group_size`; raises naming the one at fault."""
    if require_int("group_size", group_size) < 1:
        raise ValueError(f"group_size={group_size!r} but a positive int is needed")
    multiple = columns_per_group * group_size
    if x.ndim != 2 or x.shape[1] % multiple:
        raise ValueError(f"{name}.shape={x.shape} but [M, C] with C a multiple of {multiple}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise TypeError(f"{name}.dtype={x.dtype} but bfloat16, float16 or float32 is needed")


def group_quant(
    x: jax.Array, *, group_size: int = 128, impl: str = AUTO
) -> tuple[jax.Array, jax.Array]:
    """FP8 per-token-group quantization of tokens.

    Args:
      x: bf16/float16/float32[M, H] tokens; H a multiple of `group_size`.
      group_size: columns per scale.
      impl: "auto", "xla", "pallas" or an implementation object (`GROUP_QUANTS`).

    Returns:
      (q float8_e4m3fn[M, H], scales float32[M, H // group_size]).

    Example:
      >>> q, s = group_quant(jnp.full((1, 128), 2.0))
      >>> float(s[0, 0] * 448)
      2.0
    """
    check_float_rows(x, "x", group_size=group_size)
    problem = OpProblem(platform=current_platform(), dtype=jnp.dtype(x.dtype).name)
    chosen = GROUP_QUANTS.select(impl, problem)
    if x.size == 0:  # no rows or no groups: nothing to quantize, no kernel launch
        chosen = GROUP_QUANTS.get("xla")
    return without_gradient(lambda v: chosen(v, group_size=group_size))(x)


def act_and_quant(
    h: jax.Array,
    *,
    activation: str = "silu",
    group_size: int = 128,
    impl: str = AUTO,
    expert_ids: jax.Array | None = None,
    is_scales_group_major: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """act(h[:, :I]) * h[:, I:] quantized to FP8 per row per `group_size` columns.

    Args:
      h: bf16/float16/float32[M, 2I] output of the first GEMM; I a multiple of `group_size`.
      activation: "silu" or "gelu".
      group_size: columns per scale (128 in vLLM's block recipe).
      impl: as for `group_quant`; the compiled kernel refuses activations it cannot lower, so
        "auto" takes XLA for those.
      expert_ids: optional int[M], the contiguous layout's expert of each row (-1 on padding):
        padding rows of the result are then unspecified, and the kernel skips whole blocks
        of them (the layout pads each expert to the alignment; GEMM2's output there is
        never read).
      is_scales_group_major: have the kernel write the scales as [I // group_size, M] in
        memory (the values are the same), for a GEMM2 that reads them through that transpose
        (`GroupedGemm.is_scales_group_major`), so that XLA cancels the transposes.

    Returns:
      (q float8_e4m3fn[M, I], scales float32[M, I // group_size]).

    Raises:
      TypeError: when differentiated (see NO_GRADIENT_MESSAGE).
    """
    check_activation(activation)
    check_float_rows(h, "h", group_size=group_size, columns_per_group=2)
    if expert_ids is not None and (
        expert_ids.shape != (h.shape[0],) or not jnp.issubdtype(expert_ids.dtype, jnp.integer)
    ):
        raise ValueError(
            f"expert_ids.shape={expert_ids.shape} expert_ids.dtype={expert_ids.dtype} but "
            f"int[{h.shape[0]}] (one expert per row of h, -1 on padding) is needed"
        )
    problem = OpProblem(
        platform=current_platform(), dtype=jnp.dtype(h.dtype).name, activation=activation
    )
    chosen = ACT_QUANTS.select(impl, problem)
    if h.size == 0:  # no rows or no groups: nothing to quantize, no kernel launch
        chosen = ACT_QUANTS.get("xla")
    return without_gradient(
        lambda v: chosen(
            v,
            activation=activation,
            group_size=group_size,
            expert_ids=expert_ids,
            is_scales_group_major=is_scales_group_major,
        )
    )(h)
