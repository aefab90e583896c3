"""The unpermute (`moe_jax.permute.unpermute`, each `UNPERMUTES` implementation; the Pallas one
`moe_jax.kernels.unpermute`) against the float64 loop in `oracles.unpermute`.

Both modes run one kernel body that sums float32 products in slot order, as the reference does.
What interpret mode does not cover: Triton may contract the multiply-add into an FMA on the GPU,
so every implementation is held to the oracle's tolerance rather than to the reference's bits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import layouts
from moe_jax import permute as permute_front
from moe_jax.kernels.unpermute import UnpermuteConfig

IMPLS = impl_params(permute_front.UNPERMUTES)  # every name, interpret twins too
# Against the float64 oracle: float32 sums of k products round at ~1e-7 relative per step;
# a bf16 output rounds once at 2^-9 relative.
TOL = {
    jnp.float32: dict(rtol=1e-5, atol=1e-5),
    jnp.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int
    num_rows: int
    hidden: int
    has_weights: bool = True
    invalid_fraction: float = 0.25  # share of slots with inverse -1

    def __str__(self):
        return self.name


CI_PROBLEMS = [
    Problem("h192_odd_tokens", 7, 3, 24, 192),
    Problem("h320_no_weights", 5, 4, 30, 320, has_weights=False),
    Problem("h2560", 3, 2, 8, 2560),
    Problem("h100_masked_tail", 9, 2, 20, 100),
    Problem("one_token", 1, 1, 3, 64),
    Problem("no_tokens", 0, 4, 6, 64),
    Problem("all_invalid", 4, 2, 5, 64, invalid_fraction=1.0),
]


def _inputs(problem: Problem, dtype, rng: np.random.Generator):
    y = jnp.asarray(rng.standard_normal((problem.num_rows, problem.hidden)), dtype)
    # Rows drawn with repeats: two slots may read the same row.
    inverse = rng.integers(0, problem.num_rows, (problem.num_tokens, problem.topk))
    inverse[rng.random(inverse.shape) < problem.invalid_fraction] = -1
    weights = None
    if problem.has_weights:  # negative weights too
        weights = jnp.asarray(rng.uniform(-2, 2, inverse.shape), jnp.float32)
    return y, jnp.asarray(inverse, jnp.int32), weights


def _oracle(y, inverse, weights) -> np.ndarray:
    y = np.asarray(y.astype(jnp.float32))
    return oracles.unpermute(
        y, np.asarray(inverse), None if weights is None else np.asarray(weights)
    )


def _run(impl, y, inverse, weights, **kwargs):
    runs_or_skip(permute_front.UNPERMUTES.get(impl), permute_front.problem_for(y))
    return permute_front.unpermute(y, inverse, weights, impl=impl, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_unpermute_matches_oracle(impl, dtype, problem):
    rng = np.random.default_rng(oracles.seed("unpermute", str(problem), jnp.dtype(dtype).name))
    y, inverse, weights = _inputs(problem, dtype, rng)
    out = _run(impl, y, inverse, weights)
    assert out.shape == (problem.num_tokens, problem.hidden) and out.dtype == dtype
    expected = _oracle(y, inverse, weights)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, **TOL[dtype])
    is_empty = np.all(np.asarray(inverse) < 0, axis=1)
    assert not np.any(np.asarray(out.astype(jnp.float32))[is_empty]), "tokens with no slot not 0"
    if problem.num_tokens:  # every row written: no NaN from uninitialized memory either
        assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


@pytest.mark.parametrize("impl", IMPLS)
def test_unpermute_bf16_rows_to_float32_output(impl):
    rng = np.random.default_rng(31)
    y, inverse, weights = _inputs(Problem("bf16_to_f32", 6, 8, 40, 192), jnp.bfloat16, rng)
    out = _run(impl, y, inverse, weights, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _oracle(y, inverse, weights), **TOL[jnp.float32])
    reference = layouts.unpermute_reference(y, inverse, weights, out_dtype=jnp.float32)
    np.testing.assert_allclose(out, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (dict(y=jnp.zeros((4, 8), jnp.int32)), TypeError, "y.dtype"),
        (
            dict(inverse=jnp.zeros((2, 2), jnp.int64 if jax.config.x64_enabled else jnp.int16)),
            TypeError,
            "inverse",
        ),
        (dict(topk_weights=jnp.zeros((2, 3))), ValueError, "topk_weights.shape"),
        (dict(topk_weights=jnp.zeros((2, 2), jnp.int32)), TypeError, "topk_weights.dtype"),
    ],
)
@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_unpermute_rejects_bad_inputs(impl, args, error, match):
    """The front checks once, whichever implementation sums."""
    kwargs = dict(y=jnp.zeros((4, 8)), inverse=jnp.zeros((2, 2), jnp.int32), topk_weights=None)
    kwargs.update(args)
    with pytest.raises(error, match=match):
        permute_front.unpermute(kwargs["y"], kwargs["inverse"], kwargs["topk_weights"], impl=impl)


def test_unpermute_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="block_t"):
        UnpermuteConfig(block_t=6)
