"""The contract of every grouped-GEMM backend (`moe_jax.grouped_gemm.GEMMS`, each name it holds,
the tests' interpret twins included): the contiguous and the masked layouts against the float64
loops in `oracles`, forward and VJP (`moe_jax.grouped_gemm_backward`, float operands; FP8 is
inference only).

A backend that refuses a problem here (a compiled kernel on a CPU, DeepGEMM without its wheel, a
dtype it does not take) skips with its `unsupported_reason`; on a GPU host the same tests run it.

Tolerances: float32 products summed in float32 (1e-4 on unit-scale sums); FP8 operands may be
multiplied by a native FP8 dot, which sums a 128-wide block with fewer bits on Hopper (2e-3); a
bf16 output adds one bf16 rounding (1e-2).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip
from gemm_problems import CONTRACT_PROBLEMS, routed_operands

from moe_jax import grouped_gemm_backward
from moe_jax.grouped_gemm import GEMMS, GemmProblem
from moe_jax.registry import current_platform

pytestmark = pytest.mark.cpu_numerics  # compiled kernels stay on the GPU (conftest.py)

GEMM_NAMES = impl_params(GEMMS)
TOL = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
FP8_DOT_TOL = dict(rtol=2e-3, atol=2e-3)
DTYPES = {"fp8": "float8_e4m3fn", "bfloat16": "bfloat16", "float32": "float32"}


def _tol(dtype: str, out_dtype, got) -> dict:
    """The tolerance of `got`: a backend may compute a bf16 result and cast it to out_dtype
    (DeepGEMM's and torch's D; torch's GPU GEMM on FP8 operands dequantized to bf16), held to the
    bf16 rounding; every other float32 result to float32's (FP8: the FP8 dot's)."""
    if dtype != "float32" and np.array_equal(got, oracles.round_to(got, oracles.BF16)):
        return TOL[jnp.bfloat16]
    if dtype == "fp8" and out_dtype == jnp.float32:
        return FP8_DOT_TOL
    return TOL[out_dtype]


def _dequant(dtype, x, w, x_scales, w_scales):
    if dtype == "fp8":
        return oracles.dequant_per_token_group(x, x_scales), oracles.dequant_per_block(w, w_scales)
    return x.astype(np.float64), w.astype(np.float64)


def _contiguous_case(name: str, problem):
    """(backend, alignment, operands, layout) of `problem` for backend `name`, or a skip."""
    backend = GEMMS.get(name)
    alignment = max(problem.alignment, backend.alignment)
    runs_or_skip(
        backend,
        GemmProblem(
            layout="contiguous",
            n=problem.n,
            k=problem.k,
            num_experts=problem.num_experts,
            num_pairs=problem.num_tokens * problem.topk,
            x_dtype=DTYPES[problem.dtype],
            w_dtype=DTYPES[problem.dtype],
            platform=current_platform(),
            alignment=alignment,
        ),
    )
    rng = np.random.default_rng(oracles.seed("contract_gemm", str(problem)))
    operands = routed_operands(problem, rng)
    x, _, x_scales, _, ids = operands
    lay = oracles.permute(x, ids, problem.num_experts, alignment=alignment, x_scales=x_scales)
    return backend, alignment, operands, lay


def _contiguous_args(lay, w):
    return (
        jnp.asarray(lay["rows"]),
        jnp.asarray(w),
        jnp.asarray(lay["expert_ids"], jnp.int32),
        jnp.asarray(lay["expert_ends"], jnp.int32),
    )


@pytest.mark.parametrize("name", GEMM_NAMES)
@pytest.mark.parametrize("out_dtype", list(TOL))
@pytest.mark.parametrize("problem", CONTRACT_PROBLEMS, ids=str)
def test_contiguous_matches_float64_loop(name, out_dtype, problem):
    backend, alignment, (x, w, x_scales, w_scales, ids), lay = _contiguous_case(name, problem)
    y = backend.contiguous(
        *_contiguous_args(lay, w),
        x_scales=None if x_scales is None else jnp.asarray(lay["row_scales"]),
        w_scales=None if w_scales is None else jnp.asarray(w_scales),
        alignment=alignment,
        out_dtype=out_dtype,
    )
    assert y.shape == (lay["rows"].shape[0], problem.n) and y.dtype == out_dtype
    x64, w64 = _dequant(problem.dtype, x, w, x_scales, w_scales)
    rows64 = oracles.permute(x64, ids, problem.num_experts, alignment=alignment)["rows"]
    want = oracles.grouped_gemm_contiguous(rows64, w64, lay["expert_ids"])
    is_row = lay["expert_ids"] >= 0  # padding rows are unspecified
    got = np.asarray(y.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(
        got[is_row], want[is_row], **_tol(problem.dtype, out_dtype, got[is_row])
    )


@pytest.mark.parametrize("name", GEMM_NAMES)
@pytest.mark.parametrize("problem", [p for p in CONTRACT_PROBLEMS if p.dtype != "fp8"], ids=str)
def test_contiguous_vjp_matches_float64_loop(name, problem):
    """dx[r] = g[r] @ w[e] on the rows (padding rows unspecified, as the forward's), dw[e] = sum
    over e's rows of g[r]^T x[r]: the backend's dgrad and the XLA weight gradient (`WGRADS` has
    its own contract)."""
    import jax

    backend, alignment, (x, w, _, _, ids), lay = _contiguous_case(name, problem)
    rows, w_j, expert_ids, expert_ends = _contiguous_args(lay, w)
    rng = np.random.default_rng(oracles.seed("contract_gemm_vjp", str(problem)))
    # The backward casts g to the rows' dtype: draw it representable there.
    g = rng.standard_normal((rows.shape[0], problem.n)).astype(x.dtype)

    def f(rows, w_j):
        return grouped_gemm_backward.grouped_gemm_contiguous(
            backend, rows, w_j, expert_ids, expert_ends,
            alignment=alignment, out_dtype=jnp.float32, wgrad="xla",
        )  # fmt: skip

    _, vjp = jax.vjp(f, rows, w_j)
    dx, dw = vjp(jnp.asarray(g, jnp.float32))
    assert dx.shape == rows.shape and dx.dtype == rows.dtype
    assert dw.shape == w_j.shape and dw.dtype == w_j.dtype
    g64, x64, w64 = (a.astype(np.float64) for a in (g, lay["rows"], w))
    e_of = lay["expert_ids"]
    want_dx = np.zeros(x64.shape)
    want_dw = np.zeros(w64.shape)
    for r, e in enumerate(e_of):
        if e >= 0:
            want_dx[r] = g64[r] @ w64[e]
            want_dw[e] += np.outer(g64[r], x64[r])
    tol = TOL[jnp.dtype(x.dtype).type]
    scale = max(1.0, float(np.abs(want_dw).max(initial=0)))
    is_row = e_of >= 0
    np.testing.assert_allclose(np.asarray(dx, np.float64)[is_row], want_dx[is_row], **tol)
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), want_dw, rtol=tol["rtol"], atol=tol["atol"] * scale
    )


# (name, dtype, E, max_m, n, k, rows per expert): empty blocks, full blocks, no rows at all.
MASKED_PROBLEMS = [
    # 70 rows: over one 64-row block (the Mosaic kernel's), one expert empty, one short
    ("fp8_over_a_block_empty_and_short", "fp8", 3, 70, 256, 256, (70, 0, 2)),
    ("bf16_empty_and_full", "bfloat16", 3, 5, 48, 64, (5, 0, 2)),
    ("f32_no_rows", "float32", 2, 4, 32, 64, (0, 0)),
]


def _masked_case(name, case):
    _, dtype, num_experts, max_m, n, k, counts = case
    backend = GEMMS.get(name)
    runs_or_skip(
        backend,
        GemmProblem(
            layout="masked",
            n=n,
            k=k,
            num_experts=num_experts,
            num_pairs=num_experts * max_m,
            x_dtype=DTYPES[dtype],
            w_dtype=DTYPES[dtype],
            platform=current_platform(),
            max_m=max_m,
        ),
    )
    rng = np.random.default_rng(oracles.seed("contract_masked", case[0]))
    x = rng.standard_normal((num_experts, max_m, k)).astype(np.float32)
    w = (rng.standard_normal((num_experts, n, k)) / 8).astype(np.float32)
    x_scales = w_scales = None
    if dtype == "fp8":
        x, x_scales = oracles.per_token_group_quant_fp8(x)
        w, w_scales = oracles.per_block_quant_fp8(w)
    elif dtype == "bfloat16":
        x, w = x.astype(oracles.BF16), w.astype(oracles.BF16)
    return backend, x, w, x_scales, w_scales, np.array(counts, np.int32)


@pytest.mark.parametrize("name", GEMM_NAMES)
@pytest.mark.parametrize("case", MASKED_PROBLEMS, ids=lambda c: c[0])
def test_masked_matches_float64_loop(name, case):
    backend, x, w, x_scales, w_scales, counts = _masked_case(name, case)
    y = backend.masked(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(counts),
        x_scales=None if x_scales is None else jnp.asarray(x_scales),
        w_scales=None if w_scales is None else jnp.asarray(w_scales),
        out_dtype=jnp.float32,
    )
    assert y.shape == (*x.shape[:2], w.shape[1]) and y.dtype == jnp.float32
    x64, w64 = _dequant(case[1], x, w, x_scales, w_scales)
    want = oracles.grouped_gemm_masked(x64, w64, counts)
    is_row = np.arange(x.shape[1])[None, :] < counts[:, None]  # rows past a count: unspecified
    got = np.asarray(y, np.float64)
    np.testing.assert_allclose(got[is_row], want[is_row], **_tol(case[1], jnp.float32, got[is_row]))


@pytest.mark.parametrize("name", GEMM_NAMES)
@pytest.mark.parametrize("case", [c for c in MASKED_PROBLEMS if c[1] != "fp8"], ids=lambda c: c[0])
def test_masked_vjp_matches_float64_loop(name, case):
    import jax

    backend, x, w, _, _, counts = _masked_case(name, case)
    rng = np.random.default_rng(oracles.seed("contract_masked_vjp", case[0]))
    g = rng.standard_normal((*x.shape[:2], w.shape[1])).astype(x.dtype)

    def f(x, w):
        return grouped_gemm_backward.grouped_gemm_masked(
            backend, x, w, jnp.asarray(counts), out_dtype=jnp.float32
        )

    _, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g, jnp.float32))
    g64, x64, w64 = (a.astype(np.float64) for a in (g, x, w))
    is_row = (np.arange(x.shape[1])[None, :] < counts[:, None])[..., None]
    want_dx = np.einsum("emn,enk->emk", g64 * is_row, w64)
    want_dw = np.einsum("emn,emk->enk", g64 * is_row, x64 * is_row)
    tol = TOL[jnp.dtype(x.dtype).type]
    np.testing.assert_allclose(
        np.asarray(dx, np.float64)[is_row[..., 0]], want_dx[is_row[..., 0]], **tol
    )
    scale = max(1.0, float(np.abs(want_dw).max(initial=0)))
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), want_dw, rtol=tol["rtol"], atol=tol["atol"] * scale
    )
