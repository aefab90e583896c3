"""Differentiable grouped GEMMs: `jax.custom_vjp` fronts over every `GEMMS` backend, and the
grouped weight-gradient op with its registry.

Forward backends run in XLA (differentiable by themselves), in torch through
`jax.experimental.buffer_callback` (no JVP) or as Pallas kernels (no VJP). The fronts here make
all of them differentiable the same way, for `y[row] = x[row] @ w[expert(row)].T`:

- dgrad: dx = dy @ w[e], i.e. the same contiguous (or masked) GEMM against `w` transposed,
  run by the forward's backend when it takes the transposed problem, else by
  `GEMMS.select("auto", ...)`: `GroupedGemm.contiguous_dgrad`, which backends with an NN kernel
  (torch, DeepGEMM bf16) run on `w` as stored; the others get `jnp.swapaxes(w, 1, 2)` [E, K, N].
- wgrad: dw[e] = dy_e^T x_e over each expert's rows, [E, N, K], accumulated in float32, through the
  `WGRADS` registry (contiguous layout); the masked layout's wgrad is a dense batched product.

Rows of padding (expert id -1, or past a masked expert's count) have unspecified outputs, so their
cotangents are dropped: backends may leave garbage (even NaN) there. On the contiguous layout the
inputs' padding rows must be zero, as the layout's permuted rows are and as `ContiguousExperts`
makes the activation's (a masking pass here would cost one more read and write of x); the
masked layout's wgrad masks x itself. dx on padding rows is unspecified; the permute's backward
never reads it.

Residuals: x and w only; nothing [M, N]-sized is saved.

Gradients through float8_e4m3fn weights (inference checkpoints) are not defined: differentiating
through them raises, naming the training recipe (`moe_jax.fp8_training`).

WGRADS implementations: "xla" (`wgrad_reference`, everywhere), "torch" (`torch._grouped_mm`
with `offs`), "mosaic" (Mosaic GPU `transposed_ragged_dot`, named only) and "pallas"
(`moe_jax.kernels.wgrad`); "auto" tries them in `moe_jax.plan.wgrad_order`'s order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moe_jax import grouped_gemm, quant
from moe_jax.registry import AUTO, FunctionImpl, Registry
from moe_jax.routing import require_int

FP8_WEIGHTS_MESSAGE = (
    "gradients through float8_e4m3fn expert weights are not defined (they are an inference "
    "checkpoint): train float master weights (bf16/float32), optionally with the FP8 recipe "
    "ContiguousExperts(recipe=moe_jax.fp8_training.Fp8Training())"
)


def _wgrad_preference(problem: grouped_gemm.GemmProblem) -> tuple[str, ...]:
    from moe_jax.plan import wgrad_order  # the one place "auto" is decided

    return wgrad_order(problem)[0]


WGRADS: Registry = Registry(
    "grouped wgrad",
    preference=_wgrad_preference,
    modules={
        "torch": "moe_jax.interop.torch_gemm",
        "mosaic": "moe_jax.kernels.mosaic_wgrad",
        "pallas": "moe_jax.kernels.wgrad",
    },
)


def wgrad_problem(
    dy: jax.Array, x: jax.Array, *, num_experts: int, alignment: int
) -> grouped_gemm.GemmProblem:
    """The `GemmProblem` of dw [E, N, K] = grouped dy [M, N]^T x [M, K]: dy as the rows, dw's
    shape in x's dtype as the weights."""
    dw = jax.ShapeDtypeStruct((num_experts, dy.shape[1], x.shape[1]), x.dtype)
    return grouped_gemm.GemmProblem.of(dy, dw, alignment=alignment)


def wgrad_reference(
    dy: jax.Array,
    x: jax.Array,
    expert_ids: jax.Array,
    expert_ends: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """dw[e] = sum over rows r of expert e of dy[r]^T x[r], in float32, then `out_dtype`.

    Args:
      dy: [M, N] output cotangents in the contiguous layout; rows with expert id -1 are ignored.
      x: [M, K] the GEMM's inputs; rows with expert id -1 are ignored (they may hold garbage).
      expert_ids: int32[M] expert of each row, -1 on padding; constant over each aligned block.
      expert_ends: int32[E] segment ends (unused here: the blocks carry their expert).
      num_experts: E.
      alignment: rows per block (the layout's segment multiple).
      out_dtype: dtype of dw.

    Returns:
      [E, N, K] in `out_dtype`; experts with no rows get zeros.

    Example:
      >>> dw = wgrad_reference(jnp.ones((2, 1)), jnp.array([[1.0], [2.0]]), jnp.array([1, -1]),
      ...                      jnp.array([0, 1]), num_experts=2, alignment=1,
      ...                      out_dtype=jnp.float32)
      >>> dw[:, 0, 0].tolist()
      [0.0, 1.0]
    """
    del expert_ends
    num_rows, n = dy.shape
    k = x.shape[1]
    acc = jnp.zeros((num_experts, n, k), jnp.float32)
    if num_rows == 0 or num_experts == 0:
        return acc.astype(out_dtype)
    is_valid = (expert_ids >= 0)[:, None]
    dy = jnp.where(is_valid, dy, jnp.zeros((), dy.dtype))
    x = jnp.where(is_valid, x, jnp.zeros((), x.dtype))
    num_blocks = num_rows // alignment
    blocks = (
        dy.reshape(num_blocks, alignment, n),
        x.reshape(num_blocks, alignment, k),
        expert_ids.reshape(num_blocks, alignment)[:, 0],
    )

    def step(acc, block):
        block_dy, block_x, expert = block
        product = jnp.dot(
            block_dy.T,
            block_x,
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        product = jnp.where(expert >= 0, product, 0.0)
        return acc.at[jnp.maximum(expert, 0)].add(product), None

    acc, _ = jax.lax.scan(step, acc, blocks)
    return acc.astype(out_dtype)


WGRADS.register(FunctionImpl("xla", wgrad_reference))


def grouped_wgrad(
    dy: jax.Array,
    x: jax.Array,
    expert_ids: jax.Array,
    expert_ends: jax.Array,
    *,
    num_experts: int,
    alignment: int,
    out_dtype: jnp.dtype,
    impl=AUTO,
) -> jax.Array:
    """Grouped weight gradient [E, N, K] on the contiguous layout (see `wgrad_reference`).

    `impl`: "auto", "xla", "torch" or an implementation object (`WGRADS`). Padding rows (id -1)
    may hold anything: they are zeroed here before any implementation sees them.
    """
    _check_wgrad_operands(dy, x, expert_ids, alignment=alignment)
    is_valid = (expert_ids >= 0)[:, None]
    dy = jnp.where(is_valid, dy, jnp.zeros((), dy.dtype))
    x = jnp.where(is_valid, x, jnp.zeros((), x.dtype))
    return grouped_wgrad_zero_padded(
        dy,
        x,
        expert_ids,
        expert_ends,
        num_experts=num_experts,
        alignment=alignment,
        out_dtype=out_dtype,
        impl=impl,
    )


def grouped_wgrad_zero_padded(
    dy, x, expert_ids, expert_ends, *, num_experts, alignment, out_dtype, impl
):
    """`grouped_wgrad` for operands whose padding rows are already zero (no masking pass)."""
    _check_wgrad_operands(dy, x, expert_ids, alignment=alignment)
    problem = wgrad_problem(dy, x, num_experts=num_experts, alignment=alignment)
    chosen = WGRADS.select(impl, problem)
    return chosen(
        dy,
        x,
        expert_ids,
        expert_ends,
        num_experts=num_experts,
        alignment=alignment,
        out_dtype=out_dtype,
    )


def _check_wgrad_operands(dy, x, expert_ids, *, alignment) -> None:
    """dy [M, N], x [M, K], expert_ids int[M] (or None), M a multiple of a positive `alignment`:
    the masking above would broadcast a one-row x over every row, and the XLA implementation's
    block reshape would fail without naming the argument."""
    if dy.ndim != 2 or x.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"{dy.shape=} {x.shape=}: need dy [M, N] and x [M, K] with one M")
    if expert_ids is not None and expert_ids.shape != (dy.shape[0],):
        raise ValueError(f"{dy.shape=} but {expert_ids.shape=}: expert_ids needs M entries")
    if require_int("alignment", alignment) < 1:
        raise ValueError(f"{alignment=} must be a positive int (the layout's segment multiple)")
    if dy.shape[0] % alignment:
        raise ValueError(
            f"{dy.shape=} but {alignment=}: the layout's rows M are a multiple of its alignment"
        )


def transposed_problem(
    problem: grouped_gemm.GemmProblem, *, x_dtype: str | None = None
) -> grouped_gemm.GemmProblem:
    """The dgrad's problem: dy [rows, N] x w^T [E, K, N] -> [rows, K]."""
    return dataclasses.replace(
        problem,
        n=problem.k,
        k=problem.n,
        x_dtype=problem.x_dtype if x_dtype is None else x_dtype,
    )


def select_dgrad(
    forward: grouped_gemm.GroupedGemm, problem: grouped_gemm.GemmProblem
) -> grouped_gemm.GroupedGemm:
    """The forward's backend if it runs the transposed `problem`, else "auto" for it."""
    if forward.unsupported_reason(problem) is None:
        return forward
    return grouped_gemm.GEMMS.select(AUTO, problem)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmStatics:
    """Static arguments of one differentiable grouped GEMM call.

    Attributes:
      backend: the forward `GroupedGemm`.
      alignment: the contiguous layout's segment multiple (None on the masked layout).
      out_dtype: the forward's output dtype.
      wgrad: `WGRADS` choice for the contiguous layout's weight gradient.
      expected_m: the masked layout's scheduling hint.
    """

    backend: grouped_gemm.GroupedGemm
    out_dtype: jnp.dtype
    alignment: int | None = None
    wgrad: object = AUTO
    expected_m: int | None = None


def _is_fp8(*arrays: jax.Array | None) -> bool:
    return any(a is not None and a.dtype == quant.FP8_DTYPE for a in arrays)


def grouped_gemm_contiguous(
    backend: grouped_gemm.GroupedGemm,
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    expert_ends: jax.Array,
    *,
    x_scales: jax.Array | None = None,
    w_scales: jax.Array | None = None,
    alignment: int,
    out_dtype: jnp.dtype,
    wgrad=AUTO,
) -> jax.Array:
    """`backend.contiguous(...)` with a VJP (module docstring): [M, K] x [E, N, K] -> [M, N].

    Args as `GroupedGemm.contiguous`; `wgrad` chooses the weight-gradient implementation.
    """
    kwargs = dict(alignment=alignment, out_dtype=out_dtype)
    if _is_fp8(x, w):
        return _inference_only(
            functools.partial(backend.contiguous, **kwargs),
            x,
            w,
            expert_ids,
            expert_ends,
            x_scales=x_scales,
            w_scales=w_scales,
        )
    statics = GemmStatics(
        backend=backend, out_dtype=jnp.dtype(out_dtype), alignment=alignment, wgrad=wgrad
    )
    return _contiguous_vjp(statics, x, w, expert_ids, expert_ends)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _contiguous_vjp(statics, x, w, expert_ids, expert_ends):
    return statics.backend.contiguous(
        x, w, expert_ids, expert_ends, alignment=statics.alignment, out_dtype=statics.out_dtype
    )


def _contiguous_fwd(statics, x, w, expert_ids, expert_ends):
    y = _contiguous_vjp(statics, x, w, expert_ids, expert_ends)
    return y, (x, w, expert_ids, expert_ends)


def _contiguous_bwd(statics, residuals, g):
    x, w, expert_ids, expert_ends = residuals
    g = jnp.where((expert_ids >= 0)[:, None], g, jnp.zeros((), g.dtype)).astype(x.dtype)
    problem = transposed_problem(grouped_gemm.GemmProblem.of(x, w, alignment=statics.alignment))
    dgrad = select_dgrad(statics.backend, problem)
    dx = dgrad.contiguous_dgrad(
        g, w, expert_ids, expert_ends, alignment=statics.alignment, out_dtype=x.dtype
    )
    dw = grouped_wgrad_zero_padded(
        g,
        x,
        expert_ids,
        expert_ends,
        num_experts=w.shape[0],
        alignment=statics.alignment,
        out_dtype=w.dtype,
        impl=statics.wgrad,
    )
    return dx, dw, None, None


_contiguous_vjp.defvjp(_contiguous_fwd, _contiguous_bwd)


def grouped_gemm_masked(
    backend: grouped_gemm.GroupedGemm,
    x: jax.Array,
    w: jax.Array,
    num_rows_per_expert: jax.Array,
    *,
    x_scales: jax.Array | None = None,
    w_scales: jax.Array | None = None,
    expected_m: int | None = None,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """`backend.masked(...)` with a VJP: [E, max_m, K] x [E, N, K] -> [E, max_m, N].

    The weight gradient is the dense batched product over the valid rows (rows past a count are
    zeroed first), in float32.
    """
    kwargs = dict(expected_m=expected_m, out_dtype=out_dtype)
    if _is_fp8(x, w):
        return _inference_only(
            functools.partial(backend.masked, **kwargs),
            x,
            w,
            num_rows_per_expert,
            x_scales=x_scales,
            w_scales=w_scales,
        )
    statics = GemmStatics(backend=backend, out_dtype=jnp.dtype(out_dtype), expected_m=expected_m)
    return _masked_vjp(statics, x, w, num_rows_per_expert)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _masked_vjp(statics, x, w, num_rows_per_expert):
    return statics.backend.masked(
        x, w, num_rows_per_expert, expected_m=statics.expected_m, out_dtype=statics.out_dtype
    )


def _masked_fwd(statics, x, w, num_rows_per_expert):
    return _masked_vjp(statics, x, w, num_rows_per_expert), (x, w, num_rows_per_expert)


def _masked_bwd(statics, residuals, g):
    x, w, counts = residuals
    is_valid = (jnp.arange(x.shape[1])[None, :] < counts[:, None])[..., None]
    g = jnp.where(is_valid, g, jnp.zeros((), g.dtype)).astype(x.dtype)
    problem = transposed_problem(
        grouped_gemm.GemmProblem.of(x, w, layout="masked", alignment=statics.alignment)
    )
    dgrad = select_dgrad(statics.backend, problem)
    dx = dgrad.masked(
        g, jnp.swapaxes(w, 1, 2), counts, expected_m=statics.expected_m, out_dtype=x.dtype
    )
    dw = jnp.einsum(
        "emn,emk->enk",
        g,
        jnp.where(is_valid, x, jnp.zeros((), x.dtype)),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return dx, dw.astype(w.dtype), None


_masked_vjp.defvjp(_masked_fwd, _masked_bwd)


def _inference_only(call, *args, x_scales, w_scales):
    """Runs an FP8 GEMM whose backward raises (gradients through FP8 weights are undefined)."""
    return _fp8_inference_vjp(call, args, (x_scales, w_scales))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_inference_vjp(call, args, scales):
    return call(*args, x_scales=scales[0], w_scales=scales[1])


def _fp8_inference_fwd(call, args, scales):
    return _fp8_inference_vjp(call, args, scales), None


def _fp8_inference_bwd(call, residuals, g):
    del call, residuals, g
    raise TypeError(FP8_WEIGHTS_MESSAGE)


_fp8_inference_vjp.defvjp(_fp8_inference_fwd, _fp8_inference_bwd)
