"""The grouped-GEMM registry (names, refusals, preference) and the XLA reference backend."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import grouped_gemm, layouts
from moe_jax.grouped_gemm import GemmProblem


def _problem(**changes) -> GemmProblem:
    base = dict(
        layout="contiguous",
        num_rows=256,
        n=256,
        k=256,
        num_groups=4,
        x_dtype="float8_e4m3fn",
        w_dtype="float8_e4m3fn",
        alignment=128,
        platform="cpu",
    )
    return GemmProblem(**{**base, **changes})


def test_every_named_backend_is_listed_and_loads():
    names = grouped_gemm.available_gemms()
    assert {"deep_gemm", "torch", "mosaic", "xla"} <= set(names)
    for name in names:
        assert grouped_gemm.get_gemm(name).name == name


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown GEMM backend 'cutlass'; choose from \["):
        grouped_gemm.get_gemm("cutlass")


def test_a_named_backend_that_refuses_says_why():
    with pytest.raises(NotImplementedError, match="mosaic"):
        grouped_gemm.select_gemm("mosaic", _problem())


def test_none_picks_the_first_backend_in_preference_that_runs():
    problem = _problem()
    chosen = grouped_gemm.select_gemm(None, problem)
    assert chosen.unsupported_reason(problem) is None
    for name in grouped_gemm.PREFERENCE[: grouped_gemm.PREFERENCE.index(chosen.name)]:
        assert grouped_gemm.get_gemm(name).unsupported_reason(problem) is not None
    assert grouped_gemm.get_gemm("deep_gemm").unsupported_reason(problem)  # CPU: refuses


def test_unknown_layout_is_refused():
    assert "layout" in grouped_gemm.get_gemm("xla").unsupported_reason(_problem(layout="ragged"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_xla_contiguous_matches_float64_loop(dtype):
    rng = np.random.default_rng(5)
    num_tokens, topk, num_experts, hidden, n = 37, 2, 4, 256, 128
    ids = rng.integers(-1, num_experts, (num_tokens, topk)).astype(np.int32)
    x = rng.standard_normal((num_tokens, hidden)).astype(np.float32)
    w = (rng.standard_normal((num_experts, n, hidden)) / 16).astype(np.float32)
    x_scales = w_scales = None
    if dtype == "fp8":
        x, x_scales = oracles.per_token_group_quant_fp8(x)
        w, w_scales = oracles.per_block_quant_fp8(w)
    elif dtype == "bfloat16":
        x, w = x.astype(oracles.BF16), w.astype(oracles.BF16)
    lay = layouts.permute_reference(
        jnp.asarray(x),
        jnp.asarray(ids),
        num_experts=num_experts,
        x_scales=None if x_scales is None else jnp.asarray(x_scales),
        alignment=128,
    )
    y = grouped_gemm.get_gemm("xla").contiguous(
        lay.rows,
        jnp.asarray(w),
        lay.expert_ids,
        lay.expert_ends,
        x_scales=lay.row_scales,
        w_scales=None if w_scales is None else jnp.asarray(w_scales),
        alignment=128,
        out_dtype=jnp.float32,
    )
    x64 = oracles.dequant_per_token_group(x, x_scales) if dtype == "fp8" else x.astype(np.float64)
    w64 = oracles.dequant_per_block(w, w_scales) if dtype == "fp8" else w.astype(np.float64)
    inverse, expert_ids = np.asarray(lay.inverse), np.asarray(lay.expert_ids)
    y = np.asarray(y)
    for t in range(num_tokens):
        for j in range(topk):
            if ids[t, j] < 0:
                assert inverse[t, j] == -1
                continue
            row = inverse[t, j]
            np.testing.assert_allclose(y[row], w64[ids[t, j]] @ x64[t], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(y[expert_ids < 0], 0.0)  # padding rows: zero from this backend
