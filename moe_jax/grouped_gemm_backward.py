"""Differentiable grouped GEMMs: `jax.custom_vjp` fronts over every `GEMMS` backend, and the
grouped weight-gradient op with its registry.

Forward backends run in XLA (differentiable by themselves), in torch through
`jax.experimental.buffer_callback` (no JVP) or as Pallas kernels (no VJP). The fronts here make
all of them differentiable the same way, for `y[row] = x[row] @ w[expert(row)].T`:

- dgrad: dx = dy @ w[e], i.e. the same contiguous (or masked) GEMM against `w` transposed, run
  by the backend the plan chose (`moe_jax.plan.dgrad_gemm`: the forward's, where it takes the
  transposed problem): `GroupedGemm.contiguous_dgrad`, which backends with an NN kernel (torch,
  DeepGEMM bf16) run on `w` as stored; the others get `jnp.swapaxes(w, 1, 2)` [E, K, N].
- wgrad: dw[e] = dy_e^T x_e over each expert's rows, [E, N, K], accumulated in float32, through the
  `WGRADS` registry (contiguous layout); the masked layout's wgrad is a dense batched product.
- FP8 GEMMs of float rows: the rows are quantized in 1x128 groups inside the forward, against
  float8_e4m3fn weights held constant (`w_scales` given: a frozen checkpoint) or float master
  weights that the FP8 recipe quantizes (`recipe`, `moe_jax.fp8_training`). The dgrad quantizes
  dy alike and multiplies the FP8 w^T [E, K, N]: the 128x128 tiles of w^T are w's tiles
  transposed with the same scales, so nothing is quantized twice. Straight through the
  quantizers. FP8 operands (weights with `w_scales`, rows with `x_scales`) get no gradient:
  asking for one raises `fp8_weights_error`'s TypeError, naming it.

Rows of padding (expert id -1, or past a masked expert's count) have unspecified outputs, so their
cotangents are dropped: backends may leave garbage (even NaN) there. On the contiguous layout the
inputs' padding rows must be zero, as the layout's permuted rows are and as `ContiguousExperts`
makes the activation's (a masking pass here would cost one more read and write of x); the
masked layout's wgrad masks x itself. dx on padding rows is unspecified; the permute's backward
never reads it.

Residuals: x and w (with FP8 w its scales; under the recipe its FP8 w^T and their scales,
quantized together with w) only; nothing [M, N]-sized is saved.

WGRADS implementations: "xla" (`wgrad_reference`, everywhere), "torch" (`torch._grouped_mm`
with `offs`), "mosaic" (Mosaic GPU `transposed_ragged_dot`, named only) and "pallas"
(`moe_jax.kernels.wgrad`); "auto" tries them in `moe_jax.plan.wgrad_order`'s order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from moe_jax import act_quant, grouped_gemm, quant
from moe_jax.registry import AUTO, FunctionImpl, Registry
from moe_jax.routing import require_int


def fp8_weights_error(name: str) -> TypeError:
    """The refusal of a gradient to an FP8 operand (weights, rows) or its scales, naming it."""
    return TypeError(
        f"a gradient with respect to {name}: gradients through float8_e4m3fn expert weights are "
        "not defined (an inference checkpoint, held constant), nor through FP8 rows; they flow to "
        "float tokens, the router weights and other layers: differentiate with respect to those "
        "only (Flax NNX: leave the FP8 params out of nnx.grad's DiffState), or train float "
        "master weights, optionally with ContiguousExperts(recipe=fp8_training.Fp8Training())"
    )


def primal_values(primals: tuple, frozen: tuple[str | None, ...]) -> list:
    """The values of a `jax.custom_vjp(symbolic_zeros=True)` rule's primals; raises
    `fp8_weights_error` for one named in `frozen` that is being differentiated."""
    for primal, name in zip(primals, frozen, strict=True):
        if name is not None and primal is not None and primal.perturbed:
            raise fp8_weights_error(name)
    return [None if p is None else p.value for p in primals]


def instantiate(g):
    """A cotangent as an array (zeros for a `SymbolicZero`)."""
    return jnp.zeros(g.shape, g.dtype) if isinstance(g, SymbolicZero) else g


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmStatics:
    """Static arguments of one differentiable grouped GEMM call.

    Attributes:
      backend: the forward `GroupedGemm`.
      out_dtype: the forward's output dtype.
      alignment: the contiguous layout's segment multiple (None on the masked layout).
      wgrad: `WGRADS` choice for the contiguous layout's weight gradient.
      dgrad: the backward's `GroupedGemm` (None: `moe_jax.plan.dgrad_gemm`'s choice).
      recipe: the `moe_jax.fp8_training.Fp8Training` that quantizes float w, or None.
      expected_m: the masked layout's scheduling hint.
    """

    backend: grouped_gemm.GroupedGemm
    out_dtype: jnp.dtype
    alignment: int | None = None
    wgrad: object = AUTO
    dgrad: grouped_gemm.GroupedGemm | None = None
    recipe: object = None
    expected_m: int | None = None

    def fp8_rows(self, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        """a [..., K] quantized per row per 128 columns, with its scales [..., K/128]."""
        impl = AUTO if self.recipe is None else self.recipe.quant_impl
        q, s = act_quant.group_quant(a.reshape(-1, a.shape[-1]), impl=impl)
        return q.reshape(a.shape), s.reshape(*a.shape[:-1], -1)

    def dgrad_for(self, x, w, **layout) -> grouped_gemm.GroupedGemm:
        """`dgrad`, or for a call without one `moe_jax.plan.dgrad_gemm`'s (rows x, weights w)."""
        from moe_jax.plan import FP8, dgrad_gemm  # the one place backends are chosen

        if self.recipe is not None or w.dtype == quant.FP8_DTYPE:
            layout |= dict(x_dtype=FP8, w_dtype=FP8)  # the GEMMs' operands
        problem = grouped_gemm.GemmProblem.of(x, w, alignment=self.alignment, **layout)
        return self.dgrad or dgrad_gemm(self.backend, problem)[0]


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
    dgrad: grouped_gemm.GroupedGemm | None = None,
    recipe=None,
) -> jax.Array:
    """`backend.contiguous(...)` with a VJP (module docstring): [M, K] x [E, N, K] -> [M, N].

    Args as `GroupedGemm.contiguous`; float x with FP8 w (and `w_scales`) or with `recipe` runs
    an FP8 GEMM of the quantized rows. `wgrad` and `dgrad` choose the backward's kernels.
    """
    statics = GemmStatics(
        backend=backend,
        out_dtype=jnp.dtype(out_dtype),
        alignment=alignment,
        wgrad=wgrad,
        dgrad=dgrad,
        recipe=recipe,
    )
    return _contiguous_vjp(statics, x, x_scales, w, w_scales, expert_ids, expert_ends)


def _frozen(primals) -> list[str | None]:
    """(x, x_scales, w, w_scales, ...)'s FP8 operands, those beside scales, held constant."""
    names = ("x", "x_scales", "w", "w_scales") + (None,) * (len(primals) - 4)
    return [n if n and primals[i | 1] is not None else None for i, n in enumerate(names)]


def _contiguous_forward(statics, x, x_scales, w, w_scales, expert_ids, expert_ends):
    """(y, (the dgrad's weights, their scales)): the recipe's FP8 w^T [E, K, N], else w."""
    wt, wt_scales = w, w_scales
    if statics.recipe is not None:
        w, w_scales, wt, wt_scales = statics.recipe.quantize(w)
    if w_scales is not None and x_scales is None:  # float rows
        x, x_scales = statics.fp8_rows(x)
    y = statics.backend.contiguous(
        x,
        w,
        expert_ids,
        expert_ends,
        x_scales=x_scales,
        w_scales=w_scales,
        alignment=statics.alignment,
        out_dtype=statics.out_dtype,
    )
    return y, (wt, wt_scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _contiguous_vjp(statics, x, x_scales, w, w_scales, expert_ids, expert_ends):
    return _contiguous_forward(statics, x, x_scales, w, w_scales, expert_ids, expert_ends)[0]


def _contiguous_fwd(statics, *primals):
    x, _, w, _, expert_ids, expert_ends = values = primal_values(primals, _frozen(primals))
    y, wt = _contiguous_forward(statics, *values)
    return y, (x, w, *wt, expert_ids, expert_ends)


def _contiguous_bwd(statics, residuals, g):
    x, w, wt, wt_scales, expert_ids, expert_ends = residuals
    dtype = x.dtype if statics.recipe is None else jnp.bfloat16  # the recipe's dy and x: bf16
    g = jnp.where((expert_ids >= 0)[:, None], instantiate(g), 0).astype(dtype)
    dgrad = statics.dgrad_for(x, w)
    kwargs = dict(alignment=statics.alignment, out_dtype=x.dtype)
    if wt_scales is None:
        dx = dgrad.contiguous_dgrad(g, w, expert_ids, expert_ends, **kwargs)
    else:
        if statics.recipe is None:  # FP8 weights: w^T made here, not kept from the forward
            wt, wt_scales = jnp.swapaxes(wt, 1, 2), jnp.swapaxes(wt_scales, 1, 2)
        gq, gs = statics.fp8_rows(g)
        dx = dgrad.contiguous(
            gq, wt, expert_ids, expert_ends, x_scales=gs, w_scales=wt_scales, **kwargs
        )
    if w.dtype == quant.FP8_DTYPE:  # held constant
        return dx, None, None, None, None, None
    dw = grouped_wgrad_zero_padded(
        g,
        x.astype(dtype),
        expert_ids,
        expert_ends,
        num_experts=w.shape[0],
        alignment=statics.alignment,
        out_dtype=w.dtype,
        impl=statics.wgrad,
    )
    return dx, None, dw, None, None, None


_contiguous_vjp.defvjp(_contiguous_fwd, _contiguous_bwd, symbolic_zeros=True)


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
    dgrad: grouped_gemm.GroupedGemm | None = None,
) -> jax.Array:
    """`backend.masked(...)` with a VJP: [E, max_m, K] x [E, N, K] -> [E, max_m, N].

    Float x with FP8 w runs the FP8 GEMM of the quantized rows (module docstring). The weight
    gradient is the dense batched product over the valid rows (rows past a count are zeroed
    first), in float32.
    """
    statics = GemmStatics(
        backend=backend, out_dtype=jnp.dtype(out_dtype), expected_m=expected_m, dgrad=dgrad
    )
    return _masked_vjp(statics, x, x_scales, w, w_scales, num_rows_per_expert)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _masked_vjp(statics, x, x_scales, w, w_scales, num_rows_per_expert):
    if w_scales is not None and x_scales is None:  # float rows
        x, x_scales = statics.fp8_rows(x)
    return statics.backend.masked(
        x,
        w,
        num_rows_per_expert,
        x_scales=x_scales,
        w_scales=w_scales,
        expected_m=statics.expected_m,
        out_dtype=statics.out_dtype,
    )


def _masked_fwd(statics, *primals):
    values = primal_values(primals, _frozen(primals))
    return _masked_vjp(statics, *values), values


def _masked_bwd(statics, residuals, g):
    x, _, w, w_scales, counts = residuals
    is_valid = (jnp.arange(x.shape[1])[None, :] < counts[:, None])[..., None]
    g = jnp.where(is_valid, instantiate(g), 0).astype(x.dtype)
    g, g_scales = (g, None) if w_scales is None else statics.fp8_rows(g)
    dx = statics.dgrad_for(x, w, layout="masked").masked(
        g,
        jnp.swapaxes(w, 1, 2),
        counts,
        x_scales=g_scales,
        w_scales=None if w_scales is None else jnp.swapaxes(w_scales, 1, 2),
        expected_m=statics.expected_m,
        out_dtype=x.dtype,
    )
    if w_scales is not None:  # held constant
        return dx, None, None, None, None
    dw = jnp.einsum(
        "emn,emk->enk",
        g,
        jnp.where(is_valid, x, jnp.zeros((), x.dtype)),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return dx, None, dw.astype(w.dtype), None, None


_masked_vjp.defvjp(_masked_fwd, _masked_bwd, symbolic_zeros=True)
