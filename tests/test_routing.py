"""Routing (`fused_topk`, `grouped_topk`) against the float64 loops in `oracles`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracles
import pytest

from moe_jax import fused_topk, grouped_topk

# Weights are float32 probabilities; ids must match exactly.
TOL = {"float32": dict(rtol=2e-6, atol=1e-7), "bfloat16": dict(rtol=2e-6, atol=1e-7)}
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _maybe_jit(fn, jit: bool, **static):
    bound = functools.partial(fn, **static)
    return jax.jit(bound) if jit else bound


@dataclasses.dataclass(frozen=True)
class TopkProblem:
    name: str
    num_tokens: int
    num_experts: int
    topk: int

    def __str__(self):
        return self.name


TOPK_PROBLEMS = [
    TopkProblem("T1_E8_k2", 1, 8, 2),
    TopkProblem("T33_E16_k1", 33, 16, 1),
    TopkProblem("T17_E60_k6", 17, 60, 6),
    TopkProblem("T0_E8_k2", 0, 8, 2),
    TopkProblem("T5_E4_k4", 5, 4, 4),
]


@pytest.mark.parametrize(
    "dtype,jit",
    [("float32", False), ("float32", True), ("bfloat16", True)],
    ids=["float32-eager", "float32-jit", "bfloat16-jit"],
)
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("problem", TOPK_PROBLEMS, ids=str)
def test_fused_topk_matches_oracle(problem, scoring_func, renormalize, dtype, jit):
    rng = np.random.default_rng(
        oracles.seed("fused", str(problem), scoring_func, renormalize, dtype)
    )
    logits = (2 * rng.standard_normal((problem.num_tokens, problem.num_experts))).astype(
        DTYPES[dtype]
    )
    fn = _maybe_jit(
        fused_topk, jit, topk=problem.topk, renormalize=renormalize, scoring_func=scoring_func
    )
    weights, ids = fn(jnp.asarray(logits))
    ref_w, ref_ids = oracles.fused_topk(
        logits, problem.topk, renormalize=renormalize, scoring_func=scoring_func
    )
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, **TOL[dtype])
    assert np.all(np.diff(np.asarray(weights), axis=1) <= 0), "sorted descending"


@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
def test_fused_topk_ties_go_to_the_lower_id(scoring_func):
    logits = jnp.array(
        [[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, -1.0, 5.0, -1.0, 5.0]]
    )
    weights, ids = fused_topk(logits, 3, renormalize=False, scoring_func=scoring_func)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [2, 4, 0]]
    ref_w, ref_ids = oracles.fused_topk(
        np.asarray(logits), 3, renormalize=False, scoring_func=scoring_func
    )
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(weights), ref_w, **TOL["float32"])


def test_fused_topk_renormalize_has_no_epsilon():
    """Weights sum to exactly 1 after renormalization, even when the raw ones are tiny."""
    logits = jnp.array([[-200.0, 0.0, -201.0, -202.0]])  # experts 0, 2 get ~1e-87 -> 0 in fp32
    weights, ids = fused_topk(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 0]]
    assert weights.tolist() == [[1.0, 0.0]]


# --- grouped_topk ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
    name: str
    num_tokens: int
    num_experts: int
    topk: int
    num_expert_group: int
    topk_group: int

    def __str__(self):
        return self.name


GROUPED_PROBLEMS = [  # vLLM's test_grouped_topk grid, plus DeepSeek-V3's shape
    GroupedProblem("T1_E16_k2_G8_g2", 1, 16, 2, 8, 2),
    GroupedProblem("T33_E16_k2_G8_g2", 33, 16, 2, 8, 2),
    GroupedProblem("T64_E16_k2_G8_g2", 64, 16, 2, 8, 2),
    GroupedProblem("T33_E256_k8_G8_g4_deepseek", 33, 256, 8, 8, 4),
]


def _check_grouped(weights, ids, ref_w, ref_ids, tol):
    """k order is unspecified: compare id sets, and weights matched by id."""
    weights, ids = np.asarray(weights), np.asarray(ids)
    order, ref_order = np.argsort(ids, axis=1), np.argsort(ref_ids, axis=1)
    np.testing.assert_array_equal(
        np.take_along_axis(ids, order, 1), np.take_along_axis(ref_ids, ref_order, 1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(weights, order, 1), np.take_along_axis(ref_w, ref_order, 1), **tol
    )


@pytest.mark.parametrize(
    "scale,jit", [(1.0, False), (2.5, True)], ids=["scale1.0-eager", "scale2.5-jit"]
)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("scoring_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("problem", GROUPED_PROBLEMS, ids=str)
def test_grouped_topk_matches_oracle(problem, scoring_func, renormalize, has_bias, scale, jit):
    rng = np.random.default_rng(
        oracles.seed("grouped", str(problem), scoring_func, renormalize, has_bias, scale, jit)
    )
    logits = (2 * rng.standard_normal((problem.num_tokens, problem.num_experts))).astype(np.float32)
    bias = None
    if has_bias:
        bias = (0.5 * rng.standard_normal(problem.num_experts)).astype(np.float32)
    fn = _maybe_jit(
        grouped_topk,
        jit,
        topk=problem.topk,
        renormalize=renormalize,
        num_expert_group=problem.num_expert_group,
        topk_group=problem.topk_group,
        scoring_func=scoring_func,
        routed_scaling_factor=scale,
    )
    weights, ids = fn(
        jnp.asarray(logits), e_score_correction_bias=None if bias is None else jnp.asarray(bias)
    )
    ref_w, ref_ids = oracles.grouped_topk(
        logits,
        problem.topk,
        renormalize=renormalize,
        num_expert_group=problem.num_expert_group,
        topk_group=problem.topk_group,
        scoring_func=scoring_func,
        bias=bias,
        routed_scaling_factor=scale,
    )
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    _check_grouped(weights, ids, ref_w, ref_ids, TOL["float32"])
    if renormalize:
        np.testing.assert_allclose(np.asarray(weights).sum(axis=1), scale, rtol=1e-6)


def _logit(p):
    return np.log(p) - np.log1p(-p)


def test_grouped_topk_bias_scores_groups_by_top2_sum_and_weights_are_unbiased():
    """Group 0 = {0.9, 0.01}, group 1 = {0.6, 0.6}: the max picks group 0, the top-2 sum group 1.

    With a bias (even a zero one) vLLM uses the top-2 sum; weights come from the unbiased scores.
    """
    p = np.array([[0.9, 0.01, 0.6, 0.6, 0.1, 0.1, 0.2, 0.05]])
    logits = jnp.asarray(_logit(p), jnp.float32)
    args = dict(topk=1, renormalize=False, num_expert_group=4, topk_group=1, scoring_func="sigmoid")
    _, ids = grouped_topk(logits, **args)
    assert ids.tolist() == [[0]]
    weights, ids = grouped_topk(logits, **args, e_score_correction_bias=jnp.zeros(8))
    assert ids.tolist() == [[2]]
    np.testing.assert_allclose(np.asarray(weights), [[0.6]], rtol=1e-6)
    # A large bias on expert 3 steers the choice; its weight is still its unbiased 0.6.
    bias = jnp.zeros(8).at[3].set(5.0)
    weights, ids = grouped_topk(logits, **args, e_score_correction_bias=bias)
    assert ids.tolist() == [[3]]
    np.testing.assert_allclose(np.asarray(weights), [[0.6]], rtol=1e-6)


def test_grouped_topk_scores_round_to_the_logits_dtype():
    """bf16 logits: scores are rounded to bf16 (vLLM computes them in the logits' dtype)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((9, 16)).astype(ml_dtypes.bfloat16)
    weights, ids = grouped_topk(
        jnp.asarray(logits),
        2,
        False,
        num_expert_group=8,
        topk_group=2,
        scoring_func="sigmoid",
        e_score_correction_bias=jnp.asarray(rng.standard_normal(16), jnp.float32),
    )
    values = np.asarray(weights)
    np.testing.assert_array_equal(values, values.astype(ml_dtypes.bfloat16).astype(np.float32))


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "logits,kwargs,error,match",
    [
        (jnp.ones(8), {}, ValueError, r"gating_output\.shape"),
        (jnp.ones((2, 8), jnp.int32), {}, TypeError, r"gating_output\.dtype"),
        (jnp.ones((2, 8)), dict(topk=0), ValueError, r"topk=0"),
        (jnp.ones((2, 8)), dict(topk=9), ValueError, r"topk=9"),
        (jnp.ones((2, 8)), dict(scoring_func="relu"), ValueError, r"'relu'.*softmax.*sigmoid"),
    ],
    ids=["1d", "int", "k0", "k_gt_E", "scoring"],
)
def test_fused_topk_bad_input(logits, kwargs, error, match):
    with pytest.raises(error, match=match):
        fused_topk(logits, **{"topk": 2, **kwargs})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_expert_group=3), r"num_expert_group=3"),
        (dict(topk_group=5), r"topk_group=5"),
        (dict(topk=5), r"topk=5"),
        (dict(e_score_correction_bias=jnp.zeros(7)), r"e_score_correction_bias\.shape"),
        (dict(scoring_func="tanh"), r"unknown scoring_func 'tanh'.*softmax.*sigmoid"),
    ],
    ids=["E_not_multiple_of_G", "topk_group_gt_G", "k_gt_kept_experts", "bias_shape", "scoring"],
)
def test_grouped_topk_bad_input(kwargs, match):
    args = {"topk": 2, "renormalize": True, "num_expert_group": 4, "topk_group": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        grouped_topk(jnp.ones((3, 8)), **args)


@pytest.mark.parametrize(
    "route,match",
    [
        (lambda x: fused_topk(x, 2.0), r"topk=2\.0 must be an int"),
        (lambda x: grouped_topk(x, 2.0, True, 4, 2), r"topk=2\.0 must be an int"),
        (lambda x: grouped_topk(x, 2, True, 4.0, 2), r"num_expert_group=4\.0 must be an int"),
        (lambda x: grouped_topk(x, 2, True, 4, True), r"topk_group=True must be an int, not a"),
    ],
    ids=["fused_k", "grouped_k", "groups", "kept_groups_bool"],
)
def test_counts_must_be_ints_and_a_bad_one_leaves_later_calls_working(route, match):
    """A float k used to reach `jax.lax.top_k` as a shape: an error naming no argument, and
    every later valid call in the process failed the same way (JAX's cache kept the float)."""
    logits = jax.random.normal(jax.random.key(0), (3, 8))
    with pytest.raises(TypeError, match=match):
        route(logits)
    weights, ids = fused_topk(logits, 2)
    assert ids.shape == (3, 2) and weights.shape == (3, 2)
    assert grouped_topk(logits, 2, True, 4, 2)[1].shape == (3, 2)
    assert fused_topk(logits, np.int64(2))[1].shape == (3, 2)  # NumPy integers are ints


# --- under jax.jit ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route,traced,static_argnames",
    [
        pytest.param(
            lambda x, k: fused_topk(x, k),
            "topk",
            ("topk", "renormalize", "scoring_func"),
            id="fused_k",
        ),
        pytest.param(
            lambda x, r: fused_topk(x, 2, r),
            "renormalize",
            ("topk", "renormalize", "scoring_func"),
            id="fused_renormalize",
        ),
        pytest.param(
            lambda x, g: grouped_topk(x, 2, True, num_expert_group=g, topk_group=2),
            "num_expert_group",
            ("topk", "renormalize", "num_expert_group", "topk_group", "scoring_func"),
            id="grouped_groups",
        ),
    ],
)
def test_a_traced_static_argument_is_refused_naming_it(route, traced, static_argnames):
    """`jax.jit(fused_topk)(logits, 2)` traces the 2: the error says which argument and how to
    mark it static (it used to be "topk=JitTracer(~int32[]) must be an int")."""
    value = True if traced == "renormalize" else 4
    with pytest.raises(TypeError, match=rf"{traced} arrived traced") as raised:
        jax.jit(route)(jnp.ones((3, 8)), value)
    assert f"static_argnames={static_argnames}" in str(raised.value)


@pytest.mark.parametrize(
    "fn,static_argnames,kwargs",
    [
        pytest.param(
            fused_topk,
            ("topk", "renormalize", "scoring_func"),
            dict(topk=2, renormalize=False, scoring_func="sigmoid"),
            id="fused",
        ),
        pytest.param(
            grouped_topk,
            ("topk", "renormalize", "num_expert_group", "topk_group", "scoring_func"),
            dict(
                topk=2, renormalize=False, num_expert_group=4, topk_group=2, scoring_func="sigmoid"
            ),
            id="grouped",
        ),
    ],
)
def test_the_documented_static_argnames_run_under_jit(fn, static_argnames, kwargs):
    doc = " ".join(fn.__doc__.split())
    listed = "(" + ", ".join(f'"{n}"' for n in static_argnames) + ")"
    assert f"jax.jit({fn.__name__}, static_argnames={listed})" in doc
    logits = jax.random.normal(jax.random.key(1), (5, 8))
    got = jax.jit(fn, static_argnames=static_argnames)(logits, **kwargs)
    want = fn(logits, **kwargs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --- NaN logits: documented, not checked --------------------------------------------------------

NAN_ROUTES = [
    pytest.param(lambda x: fused_topk(x, 2), "softmax", id="fused_softmax"),
    pytest.param(lambda x: fused_topk(x, 2, scoring_func="sigmoid"), "sigmoid", id="fused_sigmoid"),
    pytest.param(lambda x: grouped_topk(x, 2, True, 4, 2), "softmax", id="grouped_softmax"),
    pytest.param(
        lambda x: grouped_topk(x, 2, True, 4, 2, "sigmoid", jnp.zeros(8)),
        "sigmoid",
        id="grouped_sigmoid_bias",
    ),
]


@pytest.mark.parametrize("route,scoring_func", NAN_ROUTES)
def test_nan_logits_give_valid_ids_and_stay_in_their_token(route, scoring_func):
    """As the docstrings say: a token with a NaN logit gets distinct ids in [0, E) and NaN
    weights wherever a NaN score is chosen (softmax: all of them); other tokens are unaffected."""
    logits = jax.random.normal(jax.random.key(2), (4, 8))
    poisoned = logits.at[1, 5].set(jnp.nan).at[3].set(jnp.nan)  # one NaN; a whole row of NaN
    weights, ids = (np.asarray(a) for a in route(poisoned))
    clean_weights, clean_ids = (np.asarray(a) for a in route(logits))
    for t in (0, 2):
        np.testing.assert_array_equal(ids[t], clean_ids[t])
        np.testing.assert_array_equal(weights[t], clean_weights[t])
    assert ((ids >= 0) & (ids < 8)).all()
    assert all(len(set(row)) == 2 for row in ids.tolist())
    assert np.isnan(weights[3]).all()
    if scoring_func == "softmax":  # softmax spreads token 1's NaN over its whole row
        assert np.isnan(weights[1]).all()
    else:  # sigmoid: NaN only where expert 5 was chosen (renormalize then spreads it)
        assert np.isnan(weights[1]).any() == (5 in ids[1])


@pytest.mark.parametrize("route,scoring_func", NAN_ROUTES)
def test_checkify_float_checks_refuse_nan_logits(route, scoring_func):
    from jax.experimental import checkify

    checked = jax.jit(checkify.checkify(route, errors=checkify.float_checks))
    logits = jax.random.normal(jax.random.key(3), (4, 8))
    assert checked(logits)[0].get() is None
    error = checked(logits.at[2, 1].set(jnp.nan))[0].get()
    assert error is not None and "nan generated" in error
