"""Pallas grouped GEMM (`moe_jax.kernels.grouped_gemm`) vs a float64 loop, its backend registration,
the segments it asks for, and `fused_moe(experts="pallas_interpret")` against the XLA path.

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
from gemm_problems import DEEPSEEK_V3_FP8_GEMM1, RoutedProblem

import moe_jax.kernels.grouped_gemm  # noqa: F401  (registers "pallas")
import moe_jax.quant
from moe_jax import grouped_gemm, layouts
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertWeights
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


CI_PROBLEMS = [
    RoutedProblem("fp8_padding_and_invalid_ids", 9, 2, 4, 256, 256),
    RoutedProblem("fp8_single_expert", 5, 1, 1, 128, 384, alignment=32),
    RoutedProblem(
        "fp8_empty_experts_align64", 11, 3, 8, 128, 256, alignment=64, only_experts=(1, 6)
    ),
    RoutedProblem("bf16_empty_experts", 7, 3, 8, 48, 96, dtype="bfloat16", only_experts=(0, 5, 7)),
    RoutedProblem("bf16_one_token", 1, 1, 3, 64, 32, dtype="bfloat16"),
]


def _operands(problem: RoutedProblem, rng: np.random.Generator):
    """(x, w, x_scales, w_scales, ids) in numpy: FP8 by vLLM's recipe or bf16."""
    shape = (problem.num_tokens, problem.topk)
    if problem.only_experts is not None:
        ids = rng.choice(np.array(problem.only_experts), size=shape)
    else:
        ids = rng.integers(-1, problem.num_experts + 1, size=shape)  # invalid ids both sides
    x = rng.standard_normal((problem.num_tokens, problem.k)).astype(np.float32)
    w = (rng.standard_normal((problem.num_experts, problem.n, problem.k)) / 8).astype(np.float32)
    if problem.dtype == "fp8":
        x, x_scales = oracles.per_token_group_quant_fp8(x)
        w, w_scales = oracles.per_block_quant_fp8(w)
        return x, w, x_scales, w_scales, ids.astype(np.int32)
    return x.astype(oracles.BF16), w.astype(oracles.BF16), None, None, ids.astype(np.int32)


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
        return gg.grouped_gemm_contiguous_reference(
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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("out_dtype", list(TOL))
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_grouped_gemm_matches_float64_loop(impl, out_dtype, problem):
    rng = np.random.default_rng(12)
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(
        x, ids, problem.num_experts, alignment=problem.alignment, x_scales=x_scales
    )
    y = _run(impl, lay, w, w_scales, alignment=problem.alignment, out_dtype=out_dtype)
    assert y.shape == (lay["rows"].shape[0], problem.n) and y.dtype == out_dtype
    tol = FP8_DOT_TOL if problem.dtype == "fp8" and out_dtype == jnp.float32 else TOL[out_dtype]
    _check_against_loop(y, problem, x, w, x_scales, w_scales, ids, lay, tol)


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


def test_heuristic_follows_the_h200_sweep():
    """DeepSeek-V3 GEMM1 layouts of T=1, 8, 32, 512, 1024 (alignment 16) and T=2048 (64):
    BENCHMARKS.md's sweeps."""
    shape = dict(num_experts=256, n=4096, k=7168, alignment=16)
    single = gg.heuristic_config(num_rows=128, is_fp8=True, **shape)  # T=1: rows first
    assert (single.block_n, single.num_stages, single.is_transposed) == (64, 6, False)
    assert not single.is_column_major
    # Short segments launched columns first (T=8, T=32) take the wide transposed tile.
    short = gg.heuristic_config(num_rows=1024, is_fp8=True, **shape)
    short_32 = gg.heuristic_config(num_rows=4096, is_fp8=True, **shape)
    mid = gg.heuristic_config(num_rows=7936, is_fp8=True, **shape)
    long = gg.heuristic_config(num_rows=12032, is_fp8=True, **shape)
    for config in (short, short_32, mid):
        assert (config.block_n, config.num_stages, config.is_transposed) == (128, 5, True)
    assert (long.block_n, long.num_stages, long.is_transposed) == (128, 3, True)
    assert all(c.block_m == 16 and c.is_column_major for c in (short, short_32, mid, long))
    # T=2048 on 64-row segments: the x rows fill wgmma's 64 rows, the tile runs untransposed.
    wide = gg.heuristic_config(num_rows=32512, is_fp8=True, **{**shape, "alignment": 64})
    assert (wide.block_m, wide.block_n, wide.num_stages, wide.is_transposed) == (64, 128, 4, False)
    assert all(c.is_fp8_wgmma for c in (short, mid, long, wide))
    bf16 = gg.heuristic_config(num_rows=7936, is_fp8=False, **shape)
    assert (bf16.num_stages, bf16.is_column_major, bf16.is_fp8_dot) == (3, False, False)
    assert not bf16.is_fp8_wgmma
    bf16_wide = gg.heuristic_config(num_rows=32512, is_fp8=False, **{**shape, "alignment": 64})
    assert (bf16_wide.num_stages, bf16_wide.is_transposed) == (3, True)


def test_rows_not_a_multiple_of_block_m_are_padded():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((20, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.bfloat16)
    ids = jnp.asarray([0] * 16 + [1] * 4, jnp.int32)  # the last segment is cut short
    y = gg.grouped_gemm_contiguous(x, w, ids, alignment=16, out_dtype=jnp.float32, interpret=True)
    want = gg.grouped_gemm_contiguous_reference(x, w, ids, alignment=16, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "impl", ["pallas_interpret", pytest.param("pallas", marks=pytest.mark.gpu)]
)
def test_masked_layout_matches_float64_loop(impl):
    rng = np.random.default_rng(6)
    num_experts, max_m, n, k = 3, 5, 128, 256
    counts = np.array([5, 0, 2])
    x = rng.standard_normal((num_experts, max_m, k)).astype(np.float32)
    w = (rng.standard_normal((num_experts, n, k)) / 8).astype(np.float32)
    xq, xs = oracles.per_token_group_quant_fp8(x)
    wq, ws = oracles.per_block_quant_fp8(w)
    y = grouped_gemm.GEMMS.get(impl).masked(
        jnp.asarray(xq),
        jnp.asarray(wq),
        jnp.asarray(counts, jnp.int32),
        x_scales=jnp.asarray(xs),
        w_scales=jnp.asarray(ws),
        out_dtype=jnp.float32,
    )
    assert y.shape == (num_experts, max_m, n)
    x64, w64 = oracles.dequant_per_token_group(xq, xs), oracles.dequant_per_block(wq, ws)
    for e in range(num_experts):
        for r in range(counts[e]):
            np.testing.assert_allclose(np.asarray(y[e, r]), w64[e] @ x64[e, r], **FP8_DOT_TOL)


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


def test_contiguous_experts_take_the_pallas_alignment():
    weights = ExpertWeights(
        w1=jnp.zeros((4, 64, 32), jnp.bfloat16), w2=jnp.zeros((4, 32, 32), jnp.bfloat16)
    )
    pair = ContiguousExperts(gemm="pallas_interpret").plan_for(
        weights, num_tokens=3, topk=2, x_dtype=jnp.bfloat16
    )
    assert pair.gemm1.name == pair.gemm2.name == "pallas_interpret"
    assert pair.alignment == gg.PallasGemm.alignment == 16
    rows = layouts.contiguous_num_rows(3, 2, 4, pair.alignment)
    assert rows == 80  # round_up(6 pairs + 4 segments * 15 padding rows, 16)


@pytest.mark.parametrize(
    ("num_pairs", "alignment"),
    [(0, 16), (1, 16), (2048, 16), (2049, 32), (4096, 32), (4097, 64), (10**7, 64)],
)
def test_pallas_layout_alignment_grows_with_pairs_per_expert(num_pairs, alignment):
    """16 rows up to 8 mean pairs per expert, 32 up to 16, 64 above; a caller's own wins."""
    pallas = grouped_gemm.GEMMS.get("pallas")
    assert segment_alignment(pallas, _problem(num_pairs=num_pairs)) == alignment
    weights = ExpertWeights(
        w1=jnp.zeros((256, 64, 32), jnp.bfloat16), w2=jnp.zeros((256, 32, 32), jnp.bfloat16)
    )
    for align, want in ((None, alignment), (48, 48)):
        pair = ContiguousExperts(gemm="pallas_interpret", alignment=align).plan_for(
            weights, num_tokens=num_pairs, topk=1, x_dtype=jnp.bfloat16
        )
        assert pair.alignment == want


@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
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
