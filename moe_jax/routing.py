"""Router: top-k expert selection with vLLM's semantics.

- `fused_topk`: softmax (or sigmoid) over all E experts in float32, the k best sorted in descending
  order with ties going to the lower expert id, optional renormalization (no epsilon).
- `grouped_topk`: DeepSeek-V2/V3 grouped routing. Experts form `num_expert_group` equal groups; the
  `topk_group` best groups survive; the k best experts among them are chosen. With a correction bias
  (V3) the bias only steers the choice: group score = sum of the group's top-2 biased scores, and
  the weights come from the unbiased scores. Without a bias the group score is the group max.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

SCORING_FUNCS = ("softmax", "sigmoid")
# Arguments that set shapes or choose code: under `jax.jit` they must be static.
_FUSED_TOPK_STATIC = ("topk", "renormalize", "scoring_func")
_GROUPED_TOPK_STATIC = ("topk", "renormalize", "num_expert_group", "topk_group", "scoring_func")


def require_static(fn: str, static_argnames: tuple[str, ...], arguments: dict) -> None:
    """Raises a TypeError naming the `static_argnames` of `arguments` (fn's `locals()`) that
    arrived as tracers: `jax.jit(fn)` traces every argument it is given, Python ints and bools
    too, unless it is marked static, and these set shapes or choose code. A sequence (such as
    `block_shape`) is traced when an element is."""
    traced = [
        name
        for name in static_argnames
        if any(isinstance(v, jax.core.Tracer) for v in jax.tree.leaves(arguments[name]))
    ]
    if traced:
        raise TypeError(
            f"{fn}: {', '.join(traced)} arrived traced, but must be Python values known when "
            f"{fn} is traced (they set shapes and choose the code that runs). Under jax.jit, "
            f"mark them static: jax.jit({fn}, static_argnames={static_argnames}), or close over "
            f"them: jax.jit(lambda ...: {fn}(..., {traced[0]}=...))"
        )


def require_int(name: str, value) -> int:
    """`value` as a Python int (NumPy integers accepted), or a TypeError naming `name`: a float
    such as 2.0 would otherwise reach `jax.lax.top_k` as a shape."""
    if isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}={value!r} must be an int") from None


def _check_logits(gating_output: jax.Array, topk: int) -> None:
    require_int("topk", topk)
    if gating_output.ndim != 2:
        raise ValueError(f"gating_output.shape={gating_output.shape} but [T, E] is needed")
    if not jnp.issubdtype(gating_output.dtype, jnp.floating):
        raise TypeError(f"gating_output.dtype={gating_output.dtype} but a float dtype is needed")
    num_experts = gating_output.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, E={num_experts}]")


def _scores(logits: jax.Array, scoring_func: str) -> jax.Array:
    if scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)
    raise ValueError(f"unknown scoring_func {scoring_func!r}; choose from {list(SCORING_FUNCS)}")


def _renormalize(weights: jax.Array) -> jax.Array:
    return weights / jnp.sum(weights, axis=-1, keepdims=True)


def fused_topk(
    gating_output: jax.Array,
    topk: int,
    renormalize: bool = True,
    scoring_func: str = "softmax",
) -> tuple[jax.Array, jax.Array]:
    """Picks each token's k best experts.

    Under `jax.jit`, topk, renormalize and scoring_func are static:
    `jax.jit(fused_topk, static_argnames=("topk", "renormalize", "scoring_func"))`.

    NaN logits are not checked (a check would cost a device-to-host sync). A NaN makes its token's
    scores NaN (softmax: the whole row; sigmoid: that expert's): the token's ids stay distinct
    expert ids in [0, E), but which ones is unspecified, and its weights are NaN wherever a NaN
    score is chosen (with `renormalize`, all k). Other tokens are unaffected. To refuse NaN
    logits, run under checkify: `checkify.checkify(fused_topk, errors=checkify.float_checks)`
    returns an error naming the primitive that made the first NaN.

    Args:
      gating_output: float[T, E] router logits (computed in float32).
      topk: k.
      renormalize: divide the k weights by their sum.
      scoring_func: "softmax" over all E experts, or "sigmoid" per expert.

    Returns:
      (topk_weights float32[T, k], topk_ids int32[T, k]), sorted by descending weight; ties go to
      the lower expert id.

    Example:
      >>> w, ids = fused_topk(jnp.array([[0.0, 2.0, 1.0, 2.0]]), 2)
      >>> ids.tolist(), [round(v, 3) for v in w[0].tolist()]
      ([[1, 3]], [0.5, 0.5])
    """
    require_static("fused_topk", _FUSED_TOPK_STATIC, locals())
    _check_logits(gating_output, topk)
    scores = _scores(gating_output.astype(jnp.float32), scoring_func)
    weights, ids = jax.lax.top_k(scores, topk)
    if renormalize:
        weights = _renormalize(weights)
    return weights, ids.astype(jnp.int32)


def grouped_topk(
    gating_output: jax.Array,
    topk: int,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias: jax.Array | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """DeepSeek grouped top-k routing.

    Args:
      gating_output: float[T, E] router logits. Scores are rounded to this dtype, as in vLLM.
      topk: k experts per token.
      renormalize: divide the k weights by their sum (before scaling). Renormalization and
        scaling run in float32; vLLM 0.10 runs them in the logits' dtype (bf16 logits: weights
        within bf16's rounding, about 4e-3 relative, of vLLM's).
      num_expert_group: G; E must be a multiple of G. Group g holds experts [g*E/G, (g+1)*E/G).
      topk_group: how many groups survive per token.
      scoring_func: "softmax" or "sigmoid".
      e_score_correction_bias: optional float[E] added to the scores for selection only.
      routed_scaling_factor: multiplies the final weights.

    Returns:
      (topk_weights float32[T, k], topk_ids int32[T, k]); the k order is by descending selection
      score, but callers should treat it as unspecified (vLLM does not define it).

    Under `jax.jit`, every argument but the arrays and routed_scaling_factor is static:
    `jax.jit(grouped_topk, static_argnames=("topk", "renormalize", "num_expert_group",
    "topk_group", "scoring_func"))`. NaN logits are not checked; as in `fused_topk`, a token with
    a NaN logit gets distinct ids in [0, E), unspecified, and NaN weights wherever a NaN score is
    chosen; `checkify.float_checks` refuses them.

    Example:
      >>> logits = jnp.array([[0.0, 5.0, 4.0, 0.0, 3.0, 3.0, 0.0, 0.0]])
      >>> w, ids = grouped_topk(logits, 2, True, num_expert_group=4, topk_group=1)
      >>> ids.tolist()
      [[1, 0]]
    """
    require_static("grouped_topk", _GROUPED_TOPK_STATIC, locals())
    _check_logits(gating_output, topk)
    require_int("num_expert_group", num_expert_group)
    require_int("topk_group", topk_group)
    num_tokens, num_experts = gating_output.shape
    if num_expert_group <= 0 or num_experts % num_expert_group:
        raise ValueError(f"E={num_experts} must be a multiple of {num_expert_group=}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, {num_expert_group=}]")
    per_group = num_experts // num_expert_group
    if topk > topk_group * per_group:
        raise ValueError(f"{topk=} exceeds the {topk_group} surviving groups x {per_group} experts")
    has_bias = e_score_correction_bias is not None
    if has_bias and e_score_correction_bias.shape != (num_experts,):
        raise ValueError(
            f"e_score_correction_bias.shape={e_score_correction_bias.shape} but ({num_experts},) "
            "is needed"
        )
    if has_bias and per_group < 2:
        raise ValueError("a correction bias scores groups by their top-2 experts: need E/G >= 2")

    scores = _scores(gating_output.astype(jnp.float32), scoring_func).astype(gating_output.dtype)
    if has_bias:
        choice = scores.astype(jnp.float32) + e_score_correction_bias.astype(jnp.float32)[None, :]
        grouped = choice.reshape(num_tokens, num_expert_group, per_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    else:
        choice = scores.astype(jnp.float32)
        grouped = choice.reshape(num_tokens, num_expert_group, per_group)
        group_scores = jnp.max(grouped, axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    keep_group = jnp.any(
        best_groups[:, :, None] == jnp.arange(num_expert_group)[None, None, :], axis=1
    )
    keep_expert = jnp.repeat(keep_group, per_group, axis=1)
    masked = jnp.where(keep_expert, choice, -jnp.inf)
    chosen, ids = jax.lax.top_k(masked, topk)
    weights = jnp.take_along_axis(scores, ids, axis=1).astype(jnp.float32) if has_bias else chosen
    if renormalize:
        weights = _renormalize(weights)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)
