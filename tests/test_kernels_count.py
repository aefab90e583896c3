"""Token counting (`moe_jax.permute.count_expert_num_tokens`, each `COUNTS` implementation; the
Pallas one `moe_jax.kernels.count`) against the NumPy loop in `oracles.count_expert_num_tokens`.

Integer sums with no atomics (each program owns its experts' counts): interpret mode computes the
compiled kernel's results exactly; only its Triton indexing and masking run on the GPU alone
(`-m gpu`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import permute as permute_front

IMPLS = impl_params(permute_front.COUNTS)  # every name, interpret twins too
# (name, T, k, E_local, E_global or None)
CI_PROBLEMS = [
    ("dups_and_out_of_range", 7, 3, 5, None),
    ("one_token", 1, 1, 1, None),
    ("no_tokens", 0, 4, 3, None),
    ("many_experts_two_programs", 37, 8, 40, None),
    ("expert_map_holes", 9, 4, 4, 10),
    ("more_pairs_than_a_block", 65, 5, 6, None),
    ("empty_expert_map", 4, 2, 3, 0),
]


def _run(impl, ids, num_local, expert_map):
    runs_or_skip(permute_front.COUNTS.get(impl), permute_front.problem_for(ids))
    return permute_front.count_expert_num_tokens(ids, num_local, expert_map, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=lambda p: p[0])
def test_count_matches_oracle(impl, problem):
    name, num_tokens, topk, num_local, num_global = problem
    rng = np.random.default_rng(oracles.seed("count", name))
    expert_map = None
    if num_global is None:
        ids = rng.integers(-3, num_local + 3, (num_tokens, topk))
    else:
        ids = rng.integers(-2, num_global + 2, (num_tokens, topk))
        local = rng.permutation(num_global)
        expert_map = np.where(local < num_local, local, -1)
    got = _run(
        impl,
        jnp.asarray(ids, jnp.int32),
        num_local,
        None if expert_map is None else jnp.asarray(expert_map, jnp.int32),
    )
    assert got.shape == (num_local,) and got.dtype == jnp.int32
    np.testing.assert_array_equal(got, oracles.count_expert_num_tokens(ids, num_local, expert_map))


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_count_rejects_bad_inputs(impl):
    """The front checks once, whichever implementation counts."""
    count = permute_front.count_expert_num_tokens
    with pytest.raises(TypeError, match="topk_ids"):
        count(jnp.zeros((2, 2)), 2, impl=impl)
    with pytest.raises(ValueError, match="num_local_experts"):
        count(jnp.zeros((2, 2), jnp.int32), 0, impl=impl)
    with pytest.raises(TypeError, match="expert_map"):
        count(jnp.zeros((2, 2), jnp.int32), 2, jnp.zeros((2,)), impl=impl)
