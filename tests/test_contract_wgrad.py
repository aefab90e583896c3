"""The contract of every grouped weight-gradient implementation
(`moe_jax.grouped_gemm_backward.WGRADS`, each name it holds, the tests' interpret twins included)
through the front `grouped_wgrad`: dw[e] = sum over expert e's rows of outer(dy[r], x[r]) against
the float64 loop, with an empty expert (its gradient written as zeros), invalid and duplicate ids,
padding rows holding NaN and inf (never read), no tokens, float32 and bf16.

Tolerances: float32 sums of products of unit-scale values (1e-4); bf16 operands and a bf16
gradient: one bf16 rounding of the result (1e-2 relative to the largest entry).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import grouped_gemm_backward, layouts
from moe_jax.grouped_gemm_backward import WGRADS

pytestmark = pytest.mark.cpu_numerics  # compiled kernels stay on the GPU (conftest.py)

# (name, T, k, E, n, k columns, alignment)
PROBLEMS = [
    ("empty_expert_dups_invalid", 13, 3, 5, 64, 48, 16),
    ("one_token", 1, 2, 3, 32, 16, 16),
    ("no_tokens", 0, 2, 3, 32, 16, 16),
]


@pytest.mark.parametrize("name", impl_params(WGRADS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p[0])
def test_wgrad_matches_float64_loop(name, dtype, problem):
    case, num_tokens, topk, num_experts, n, k, alignment = problem
    rng = np.random.default_rng(oracles.seed("contract_wgrad", case))
    ids = rng.integers(-1, num_experts + 1, (num_tokens, topk))
    ids[ids == 1] = 2  # expert 1 gets no rows
    if num_tokens and topk > 1:
        ids[::4, 1] = ids[::4, 0]  # the same expert twice in a row
    lay = layouts.permute_reference(
        jnp.asarray(rng.normal(size=(num_tokens, k)), dtype),
        jnp.asarray(ids, jnp.int32),
        num_experts=num_experts,
        alignment=alignment,
    )
    rows = lay.rows.shape[0]
    is_pad = np.asarray(lay.expert_ids) < 0
    dy = np.array(jnp.asarray(rng.normal(size=(rows, n)), dtype).astype(jnp.float32))
    x = np.array(lay.rows.astype(jnp.float32))
    dy[is_pad], x[is_pad] = np.nan, np.inf  # unspecified rows: the wgrad must not read them
    dy_j, x_j = jnp.asarray(dy, dtype), jnp.asarray(x, dtype)
    problem = grouped_gemm_backward.wgrad_problem(
        dy_j, x_j, num_experts=num_experts, alignment=alignment
    )
    runs_or_skip(WGRADS.get(name), problem)
    dw = grouped_gemm_backward.grouped_wgrad(
        dy_j,
        x_j,
        lay.expert_ids,
        lay.expert_ends,
        num_experts=num_experts,
        alignment=alignment,
        out_dtype=dtype,
        impl=name,
    )
    assert dw.shape == (num_experts, n, k) and dw.dtype == dtype
    want = np.zeros((num_experts, n, k))
    for r, e in enumerate(np.asarray(lay.expert_ids)):
        if e >= 0:
            want[e] += np.outer(dy[r].astype(np.float64), x[r].astype(np.float64))
    got = np.asarray(dw.astype(jnp.float32), np.float64)
    assert np.all(got[1] == 0.0), "the empty expert's gradient must be written as zeros"
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    else:
        scale = max(1.0, float(np.abs(want).max(initial=0)))
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * scale)
