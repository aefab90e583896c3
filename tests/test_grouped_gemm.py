"""The grouped-GEMM registry (names, refusals, preference) and the XLA reference backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import layouts
from moe_jax.grouped_gemm import GEMMS, GemmProblem
from moe_jax.registry import NoImplementationError


def _problem(**changes) -> GemmProblem:
    base = dict(
        layout="contiguous",
        n=256,
        k=256,
        num_experts=4,
        num_pairs=256,
        x_dtype="float8_e4m3fn",
        w_dtype="float8_e4m3fn",
        platform="cpu",
        alignment=128,
    )
    return GemmProblem(**{**base, **changes})


def test_every_named_backend_is_listed_and_loads():
    names = GEMMS.names()
    assert {"deep_gemm", "torch", "mosaic", "pallas", "xla"} <= set(names)
    for name in names:
        assert GEMMS.get(name).name == name


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown grouped GEMM implementation 'cutlass'.*'xla'"):
        GEMMS.get("cutlass")


def test_a_named_backend_that_refuses_says_why():
    problem = _problem()
    with pytest.raises(NoImplementationError) as error:
        GEMMS.select("mosaic", problem)
    assert list(error.value.refusals) == ["mosaic"]
    assert error.value.refusals["mosaic"] == GEMMS.get("mosaic").unsupported_reason(problem)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_auto_picks_the_first_backend_in_preference_that_runs(platform):
    problem = _problem(platform=platform)
    chosen = GEMMS.select("auto", problem)
    assert chosen.unsupported_reason(problem) is None
    preference = GEMMS.preference(problem)
    for name in preference[: preference.index(chosen.name)]:
        assert GEMMS.get(name).unsupported_reason(problem) is not None
    if platform == "cpu":
        assert preference == ("xla",) and chosen.name == "xla"


def test_unknown_layout_is_refused():
    assert "layout" in GEMMS.get("xla").unsupported_reason(_problem(layout="ragged"))


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
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        y = GEMMS.get("xla").contiguous(
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
    lay64 = oracles.permute(x64, ids, num_experts, alignment=128)
    np.testing.assert_array_equal(lay.expert_ids, lay64["expert_ids"])
    ref = oracles.grouped_gemm_contiguous(lay64["rows"], w64, lay64["expert_ids"])
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-4)  # padding rows: zero


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_masked_matches_float64_loop(dtype):
    rng = np.random.default_rng(6)
    num_experts, max_m, k, n = 3, 5, 64, 48
    x = rng.standard_normal((num_experts, max_m, k)).astype(jnp.dtype(dtype))
    w = (rng.standard_normal((num_experts, n, k)) / 8).astype(jnp.dtype(dtype))
    counts = np.array([5, 0, 2], np.int32)
    with jax.default_matmul_precision("highest"):  # float32 dots, not TF32, on a GPU
        y = GEMMS.get("xla").masked(
            jnp.asarray(x), jnp.asarray(w), jnp.asarray(counts), out_dtype=jnp.float32
        )
    ref = oracles.grouped_gemm_masked(x, w, counts)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)  # rows past counts: 0


def _fp8_operands():
    from moe_jax import quant

    xq, xs = quant.per_token_group_quant_fp8(jnp.ones((8, 256)))
    wq, ws = quant.per_block_quant_fp8(jnp.ones((2, 128, 256)))
    return dict(x=xq, w=wq, expert_ids=jnp.zeros(8, jnp.int32), x_scales=xs, w_scales=ws)


@pytest.mark.parametrize(
    "change,match",
    [
        # one scale for K = 256 was taken as a 256-column group
        (lambda o: dict(x_scales=o["x_scales"][:, :1]), r"x_scales\.shape=\(8, 1\)"),
        (lambda o: dict(w_scales=o["w_scales"][:, :, :1]), r"w_scales\.shape=\(2, 1, 1\)"),
        (lambda o: dict(expert_ids=jnp.zeros(7, jnp.int32)), r"expert_ids\.shape=\(7,\)"),
        (lambda o: dict(x=o["x"][:, :128], x_scales=o["x_scales"][:, :1]), r"one K"),
        (lambda o: dict(alignment=3), r"alignment=3.*multiple"),
    ],
)
def test_xla_contiguous_names_the_operand_at_fault(change, match):
    """The XLA backend checks what every backend takes (`check_contiguous_operands`) where it
    used to run wrong scales silently or fail in a reshape naming nothing."""
    operands = {**_fp8_operands(), "alignment": 8}
    operands.update(change(operands))
    with pytest.raises(ValueError, match=match):
        GEMMS.get("xla").contiguous(
            operands.pop("x"),
            operands.pop("w"),
            operands.pop("expert_ids"),
            None,
            out_dtype=jnp.float32,
            **operands,
        )
