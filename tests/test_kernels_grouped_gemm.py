"""Pallas grouped GEMM (`moe_jax.kernels.grouped_gemm`): its tile configs and packed-weight path
against a float64 loop, its backend's refusals and segments, and
`fused_moe(experts="pallas_interpret")` against the XLA path. The contract every GEMM backend
meets (layouts, dtypes, empty experts, T=0/1, VJP) is tests/test_contract_grouped_gemm.py's.

Tolerances: with FP8 tiles upcast to bf16 (exact) or bf16 operands, each 128-wide K block is summed
in float32, so with float32 output the kernel matches the float64 oracle to float32 summation
error (rtol/atol 1e-4 on unit-scale products). A native FP8 dot (the heuristic's FP8 choice, as
vLLM's) sums a block with fewer bits on Hopper: 2e-3. bf16 output adds one bf16 rounding (1e-2).

What interpret mode does not cover: its dots are XLA:CPU's, so the Hopper FP8 MMA's
reduced-precision block sum and Triton's tile order are checked only by the GPU-marked tests
(against the same float64 loop, at the FP8-dot tolerance); and the uint16 weight view runs here
on small weights (forced), while the 32-bit offset wrap it avoids (FP8 weights of 2**31 to
2**32 elements) exists only in compiled code on weights that size.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from gemm_problems import (
    DEEPSEEK_V3_FP8_GEMM1,
    RoutedProblem,
    grouped_gemm_contiguous_reference,
    routed_operands,
)

import moe_jax.kernels.grouped_gemm  # noqa: F401  (registers "pallas")
import moe_jax.quant
from moe_jax import grouped_gemm
from moe_jax.fused_moe import fused_moe
from moe_jax.grouped_gemm import GemmProblem
from moe_jax.plan import segment_alignment

gg = sys.modules["moe_jax.kernels.grouped_gemm"]  # the package re-exports a function of that name

IMPLS = [
    pytest.param("reference"),
    pytest.param("pallas_interpret"),
    pytest.param("pallas", marks=pytest.mark.gpu),
]
TOL = {jnp.float32: dict(rtol=1e-4, atol=1e-4), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
FP8_DOT_TOL = dict(rtol=2e-3, atol=2e-3)


_operands = routed_operands


def _dequant(problem, x, w, x_scales, w_scales):
    if problem.dtype == "fp8":
        return oracles.dequant_per_token_group(x, x_scales), oracles.dequant_per_block(w, w_scales)
    return x.astype(np.float64), w.astype(np.float64)


def _run(impl, lay, w, w_scales, *, alignment, out_dtype, config=None):
    args = (jnp.asarray(lay["rows"]), jnp.asarray(w), jnp.asarray(lay["expert_ids"], jnp.int32))
    scales = dict(
        x_scales=None if lay.get("row_scales") is None else jnp.asarray(lay["row_scales"]),
        w_scales=None if w_scales is None else jnp.asarray(w_scales),
    )
    if impl == "reference":
        return grouped_gemm_contiguous_reference(
            *args, **scales, alignment=alignment, out_dtype=out_dtype
        )
    return gg.grouped_gemm_contiguous(
        *args,
        **scales,
        alignment=alignment,
        out_dtype=out_dtype,
        config=config,
        interpret=impl == "pallas_interpret",
    )


def _check_against_loop(y, problem, x, w, x_scales, w_scales, ids, lay, tol):
    """Each routed (token, slot) row equals w64[e] @ x64[t]; padding rows are not checked."""
    x64, w64 = _dequant(problem, x, w, x_scales, w_scales)
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    assert np.all(np.isfinite(y[lay["expert_ids"] >= 0]))
    checked = 0
    for t in range(problem.num_tokens):
        for j in range(problem.topk):
            e = ids[t, j]
            if not 0 <= e < problem.num_experts:
                continue
            np.testing.assert_allclose(y[lay["inverse"][t, j]], w64[e] @ x64[t], **tol)
            checked += 1
    assert checked == int(np.sum(lay["expert_ids"] >= 0))


CONFIGS = [
    gg.GroupedGemmConfig(block_m=16, block_n=16, block_k=32, num_stages=1),
    gg.GroupedGemmConfig(block_m=32, block_n=128, is_transposed=True),
    gg.GroupedGemmConfig(block_m=16, block_n=64, block_k=64, is_fp8_dot=True),
    gg.GroupedGemmConfig(block_m=32, block_n=128, is_transposed=True, is_column_major=True),
    # Hopper's FP8 wgmma (kernels/_fp8_dot.py): on the GPU, held to the FP8-dot tolerance.
    gg.GroupedGemmConfig(
        block_m=32, block_n=128, is_transposed=True, is_fp8_dot=True, is_fp8_wgmma=True
    ),
]


@pytest.mark.parametrize("impl", IMPLS[1:])
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
def test_grouped_gemm_configs(impl, config):
    problem = RoutedProblem("fp8_configs", 13, 2, 5, 256, 256, alignment=32)
    rng = np.random.default_rng(3)
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=32, x_scales=x_scales)
    y = _run(impl, lay, w, w_scales, alignment=32, out_dtype=jnp.float32, config=config)
    tol = FP8_DOT_TOL if config.is_fp8_dot else TOL[jnp.float32]
    _check_against_loop(y, problem, x, w, x_scales, w_scales, ids, lay, tol)


def test_rows_not_a_multiple_of_block_m_are_padded():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.bfloat16)
    ids = jnp.asarray([0] * 16 + [1] * 4, jnp.int32)  # the last segment is cut short
    y = gg.grouped_gemm_contiguous(x, w, ids, alignment=16, out_dtype=jnp.float32, interpret=True)
    want = grouped_gemm_contiguous_reference(x, w, ids, alignment=16, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)


def _problem(**changes) -> GemmProblem:
    return dataclasses.replace(DEEPSEEK_V3_FP8_GEMM1, **{"num_pairs": 8, **changes})


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(platform="cpu"), "needs an NVIDIA GPU"),
        (dict(k=192), "multiples of 128"),
        (dict(x_dtype="bfloat16"), "FP8 activations"),
        (dict(x_dtype="bfloat16", w_dtype="float32"), "one dtype"),
        (dict(alignment=8), "alignment 8"),
        (dict(layout="ragged"), "layout"),
    ],
)
def test_compiled_backend_refuses_with_a_reason(changes, reason):
    assert reason in grouped_gemm.GEMMS.get("pallas").unsupported_reason(_problem(**changes))


def test_interpret_backend_runs_anywhere_but_auto_never_picks_it():
    problem = _problem(platform="cpu", x_dtype="bfloat16", w_dtype="bfloat16")
    assert grouped_gemm.GEMMS.get("pallas_interpret").unsupported_reason(problem) is None
    for platform in ("cpu", "gpu"):
        for pairs in (8, 10**6):
            names = grouped_gemm.GEMMS.preference(_problem(platform=platform, num_pairs=pairs))
            assert "pallas_interpret" not in names


# bf16: the segments are chosen by pairs per expert whatever the dtype; the FP8 layer through
# this backend is tests/test_contract_experts.py's (16-row segments) and its FP8 GEMM on 32- and
# 64-row segments test_contract_grouped_gemm.py's.
@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize(
    ("num_tokens", "alignment"), [(6, 16), (24, 32), (100, 64)], ids=lambda v: str(v)
)
@pytest.mark.parametrize(
    "impl", ["pallas_interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
)
def test_fused_moe_matches_the_xla_experts(impl, num_tokens, alignment, dtype):
    """Through `fused_moe` with the layout the backend asks for: 16-, 32- and 64-row segments
    (3, 12 and 50 mean pairs per expert), against the XLA experts on the same weights."""
    rng = np.random.default_rng(7)
    num_experts, hidden, inter, topk = 4, 256, 128, 2
    probe = _problem(num_pairs=num_tokens * topk, num_experts=num_experts)
    assert segment_alignment(grouped_gemm.GEMMS.get(impl), probe) == alignment
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((num_experts, 2 * inter, hidden)) / 16, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((num_experts, hidden, inter)) / 11, jnp.float32)
    ids = jnp.asarray(rng.integers(-1, num_experts, (num_tokens, topk)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, topk)), jnp.float32)
    scales = {}
    if dtype == "fp8":
        w1, s1 = jax.jit(moe_jax.quant.per_block_quant_fp8)(w1)
        w2, s2 = jax.jit(moe_jax.quant.per_block_quant_fp8)(w2)
        scales = dict(w1_scale=s1, w2_scale=s2)
    else:
        w1, w2 = w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16)
    got = fused_moe(x, w1, w2, weights, ids, experts=impl, **scales)
    want = fused_moe(x, w1, w2, weights, ids, experts="xla", **scales)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # The same rounding points on both paths; an FP8 requantization may differ by one step.
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_decode_bench_runs_on_the_tiny_shape(tmp_path, capsys):
    """The tiny shape named explicitly (a GPU's default is DeepSeek-V3's); a named variant that
    refuses the problem here (deep_gemm on the CPU) is reported as skipped with its reason."""
    from moe_jax.cli.decode_bench import run_decode_bench

    path = tmp_path / "decode.json"
    status = run_decode_bench(
        tokens=[2],
        iters=1,
        json_path=str(path),
        shape="tiny",
        variants=["auto", "pallas_interpret", "deep_gemm"],
    )
    assert status == 0
    table = capsys.readouterr().out
    assert "| T | active experts | limit us | auto us | x limit |" in table
    (row,) = json.loads(path.read_text())["rows"]
    assert row["tokens"] == 2 and 1 <= row["active_experts"] <= 8
    for name in ("auto", "pallas_interpret"):
        assert row["variants"][name]["rel_error"] < 0.1  # FP8 activations vs float32
    deep_gemm = row["variants"]["deep_gemm"]
    if jax.default_backend() == "cpu":
        assert "deep_gemm" in deep_gemm["skipped"] and "failed" not in deep_gemm["skipped"]
    elif "skipped" in deep_gemm:  # a refusal (e.g. no DeepGEMM installed), not a failure
        assert not deep_gemm["skipped"].startswith("failed"), deep_gemm["skipped"]
    else:
        assert deep_gemm["rel_error"] < 0.1


@pytest.mark.parametrize("impl", IMPLS[1:])
@pytest.mark.parametrize("is_fp8_dot", [False, True])
def test_uint16_packed_weights_path(impl, is_fp8_dot, monkeypatch):
    """The path for FP8 weights of 2**31..2**32 elements, forced on a small problem."""
    monkeypatch.setattr(gg, "_needs_packing", lambda w: True)
    problem = RoutedProblem("fp8_packed", 10, 2, 3, 128, 256)
    rng = np.random.default_rng(8)
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=16, x_scales=x_scales)
    config = gg.GroupedGemmConfig(is_fp8_dot=is_fp8_dot)
    y = _run(impl, lay, w, w_scales, alignment=16, out_dtype=jnp.float32, config=config)
    tol = FP8_DOT_TOL if is_fp8_dot else TOL[jnp.float32]
    _check_against_loop(y, problem, x, w, x_scales, w_scales, ids, lay, tol)
