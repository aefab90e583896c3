"""Mosaic GPU FP8 grouped GEMM (`moe_jax.kernels.mosaic_fp8_gemm`) vs a float64 loop.

Tolerances: the compiled kernel runs Hopper's FP8 wgmma, whose accumulator sums each 128-wide K
block with fewer bits than float32 before the block's scales apply (2e-3 on unit-scale products,
as the Triton kernel's FP8 dot); interpret mode takes the same FP8 products with an exact
`dot_general` (the interpreter has no transposed shared-memory views) and runs everything else as
compiled: the persistent tile loop, the TMA pipeline (and the warp-specialised one), the skipped
padding blocks, the per-block scales and the output copies. bf16 output adds one rounding (1e-2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from gemm_problems import DEEPSEEK_V3_FP8_GEMM1, RoutedProblem

import moe_jax.fp8_training
from moe_jax import grouped_gemm
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.experts import ExpertsCall
from moe_jax.fused_gemm1 import fused_gemm1
from moe_jax.fused_moe import fused_moe
from moe_jax.grouped_gemm import GemmProblem
from moe_jax.kernels import mosaic_fp8_gemm as mg
from moe_jax.kernels import mosaic_fp8_tiles
from moe_jax.plan import fused_gemm1_order
from moe_jax.registry import NoImplementationError

# Interpret mode runs on the CPU device on GPU hosts (conftest); the compiled cases (marked gpu)
# stay on the GPU.
pytestmark = pytest.mark.mosaic_interpret

FP8_TOL = {jnp.float32: dict(rtol=2e-3, atol=2e-3), jnp.bfloat16: dict(rtol=1e-2, atol=1e-2)}
IMPLS = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]
CONFIGS = {  # by pytest id
    "two_warpgroups": mg.MosaicFp8GemmConfig(),
    "one_warpgroup_bn64": mg.MosaicFp8GemmConfig(num_compute_wgs=1, block_n=64),
    # K=256 (2 steps) chains the tiles' pipelines; K=384 (3 steps) runs them one by one
    "chained": mg.MosaicFp8GemmConfig(is_chained=True, max_concurrent_steps=2),
    "pairs_bn64": mg.MosaicFp8GemmConfig(group_blocks=2, block_n=64),
    "groups_of_4": mg.MosaicFp8GemmConfig(group_blocks=4),
    "pairs_chained": mg.MosaicFp8GemmConfig(
        group_blocks=2, is_chained=True, max_concurrent_steps=2
    ),
    # two K blocks per step, both wgmmas in flight (K=384 has 3 blocks: one per step there)
    "overlapped_pairs": mg.MosaicFp8GemmConfig(
        is_overlapped=True, group_blocks=2, max_concurrent_steps=2
    ),
    "overlapped_chained": mg.MosaicFp8GemmConfig(
        is_overlapped=True, is_chained=True, max_concurrent_steps=1
    ),
}


PROBLEMS = [
    # ids -1 and E on both sides of the valid range; several experts with two row blocks
    RoutedProblem("invalid_ids_two_blocks", 70, 2, 3, 256, 256),
    RoutedProblem("empty_experts_one_token", 1, 2, 8, 256, 384, only_experts=(2, 5)),
    # about 150 rows per expert: three row blocks each, a pair and an odd one
    RoutedProblem("three_blocks_per_expert", 300, 2, 2, 256, 256),
]


def _operands(problem: RoutedProblem, rng: np.random.Generator):
    shape = (problem.num_tokens, problem.topk)
    if problem.only_experts is not None:
        ids = rng.choice(np.array(problem.only_experts), size=shape)
        ids[:, 1:] = np.where(ids[:, 1:] == ids[:, :1], -1, ids[:, 1:])  # no duplicate in a row
    else:
        ids = rng.integers(-1, problem.num_experts + 1, size=shape)
    x = rng.standard_normal((problem.num_tokens, problem.k)).astype(np.float32)
    w = (rng.standard_normal((problem.num_experts, problem.n, problem.k)) / 8).astype(np.float32)
    x, x_scales = oracles.per_token_group_quant_fp8(x)
    w, w_scales = oracles.per_block_quant_fp8(w)
    # negative scales: the kernel multiplies by them as given
    w_scales = w_scales * np.where(rng.random(w_scales.shape) < 0.3, -1.0, 1.0).astype(np.float32)
    return x, w, x_scales, w_scales, ids.astype(np.int32)


def _run(lay, w, w_scales, *, config, out_dtype, interpret, alignment=64):
    return mg.mosaic_fp8_gemm_contiguous(
        jnp.asarray(lay["rows"]),
        jnp.asarray(w),
        jnp.asarray(lay["expert_ids"], jnp.int32),
        x_scales=jnp.asarray(lay["row_scales"]),
        w_scales=jnp.asarray(w_scales),
        alignment=alignment,
        out_dtype=out_dtype,
        config=config,
        interpret=interpret,
    )


def _check(y, problem, x, w, x_scales, w_scales, ids, lay, tol):
    x64 = oracles.dequant_per_token_group(x, x_scales)
    w64 = oracles.dequant_per_block(w, w_scales)
    # padding rows are unspecified (they may hold signalling NaNs): zero them before the cast
    valid = jnp.asarray(lay["expert_ids"])[:, None] >= 0
    y = np.asarray(jnp.where(valid, jnp.asarray(y).astype(jnp.float32), 0.0), np.float64)
    checked = 0
    for t in range(problem.num_tokens):
        for j in range(problem.topk):
            e = ids[t, j]
            if 0 <= e < problem.num_experts:
                np.testing.assert_allclose(y[lay["inverse"][t, j]], w64[e] @ x64[t], **tol)
                checked += 1
    assert checked == int(np.sum(lay["expert_ids"] >= 0)) > 0


def _config_cases():
    """Compiled (on a GPU), every config on every problem. Interpreted (10-30 s a case on a
    2-core CPU), each config on the problems whose shape exercises what it changes: the invalid
    ids and padding blocks of PROBLEMS[0] for all; K=384's three steps (PROBLEMS[1], with empty
    experts and one token) where the steps are chained or overlapped, or the warpgroups change;
    three row blocks per expert (PROBLEMS[2], a pair and an odd one) where blocks are grouped;
    the default config on all three."""
    default = mg.MosaicFp8GemmConfig()
    for name, c in CONFIGS.items():
        chosen = [PROBLEMS[0]]
        if c == default or c.is_chained or c.is_overlapped or c.num_compute_wgs != 2:
            chosen.append(PROBLEMS[1])
        if c == default or c.group_blocks > 1:
            chosen.append(PROBLEMS[2])
        for problem in chosen:
            yield pytest.param(True, c, problem, id=f"{problem}-{name}-interpret")
        for problem in PROBLEMS:
            yield pytest.param(
                False, c, problem, id=f"{problem}-{name}-compiled", marks=pytest.mark.gpu
            )


@pytest.mark.parametrize(("interpret", "config", "problem"), list(_config_cases()))
def test_matches_float64_loop(interpret, config, problem):
    rng = np.random.default_rng(oracles.seed(problem.name))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=64, x_scales=x_scales)
    out_dtype = jnp.bfloat16 if config.is_chained else jnp.float32
    y = _run(lay, w, w_scales, config=config, out_dtype=out_dtype, interpret=interpret)
    assert y.shape == (lay["rows"].shape[0], problem.n) and y.dtype == out_dtype
    _check(y, problem, x, w, x_scales, w_scales, ids, lay, FP8_TOL[out_dtype])


@pytest.mark.parametrize("interpret", IMPLS)
def test_rows_not_a_multiple_of_block_m(interpret):
    """M = 100 rows (a layout cut short after its last segment) is padded to whole row blocks."""
    rng = np.random.default_rng(5)
    problem = RoutedProblem("cut_short", 20, 2, 2, 256, 256)
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    ids = np.abs(ids) % 2
    lay = oracles.permute(x, ids, 2, alignment=64, x_scales=x_scales)
    last = int(lay["expert_ends"][-1]) - 64 + int(lay["num_tokens_per_expert"][-1])
    lay = {**lay, "rows": lay["rows"][:last], "row_scales": lay["row_scales"][:last]}
    lay["expert_ids"] = lay["expert_ids"][:last]
    y = _run(lay, w, w_scales, config=None, out_dtype=jnp.float32, interpret=interpret)
    assert y.shape == (last, 256)
    _check(y, problem, x, w, x_scales, w_scales, ids, lay, FP8_TOL[jnp.float32])


@pytest.mark.parametrize(
    ("group", "tiles", "sizes"),
    [
        # every valid block's two column tiles in a row
        (1, [(b, n) for b in range(6) for n in (0, 1)], [1, 1, 1, 1, 1, 1, 0, 0]),
        # an expert's blocks 2j and 2j+1 alternate at each column tile
        (
            2,
            [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
            + [(4, 0), (5, 0), (4, 1), (5, 1)],
            [2, 0, 1, 1, 2, 0, 0, 0],
        ),
        # groups of 4: expert 0's three blocks alternate
        (
            4,
            [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (3, 1)]
            + [(4, 0), (5, 0), (4, 1), (5, 1)],
            [3, 0, 0, 1, 2, 0, 0, 0],
        ),
    ],
)
def test_tile_table(group, tiles, sizes):
    """Expert 0 has blocks 0-2, expert 1 block 3, expert 2 blocks 4-5; the padding blocks (ids
    -1 and E=4) get no tile. Two column tiles."""
    block_experts = jnp.asarray([0, 0, 0, 1, 2, 2, -1, 4], jnp.int32)
    table = mosaic_fp8_tiles.tile_table(block_experts, 4, 2, group)
    count = int(table[-1])
    assert table.shape == (8 * 2 * group + 1,)
    assert count == len(tiles) and not np.any(np.asarray(table[count:-1]))
    assert [(int(c) // 2, int(c) % 2) for c in table[:count]] == tiles
    assert mosaic_fp8_tiles.group_sizes(block_experts, 4, group).tolist() == sizes


@pytest.mark.parametrize("interpret", IMPLS)
def test_heuristic_config_matches_float64_loop(interpret):
    """config=None on a layout of about five row blocks per expert and four K blocks takes the
    heuristic's groups of 4, overlapped steps and chained pipelines (two steps per tile, two
    slots)."""
    problem = RoutedProblem("four_k_blocks_in_pairs", 300, 2, 2, 256, 512)
    rng = np.random.default_rng(oracles.seed(problem.name))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=64, x_scales=x_scales)
    chosen = mg.heuristic_config(
        num_rows=lay["rows"].shape[0], num_experts=problem.num_experts, k=problem.k
    )
    assert chosen.group_blocks == 4 and chosen.is_chained and chosen.is_overlapped
    y = _run(lay, w, w_scales, config=None, out_dtype=jnp.bfloat16, interpret=interpret)
    _check(y, problem, x, w, x_scales, w_scales, ids, lay, FP8_TOL[jnp.bfloat16])


def test_every_heuristic_config_fits():
    """On DeepSeek-V3's layouts (T=1024, 2048 and 4096: 1.5, 2 and 3 row blocks per expert) and
    K of an even and an odd number of 128-wide blocks, every config the heuristic gives takes the
    default's 256-column tiles (the backend's refusals assume them), is a valid config and fits a
    program's shared memory (its choices are BENCHMARKS.md's `GROUPED_FROM_BLOCKS_PER_EXPERT`)."""
    for num_rows in (24320, 32512, 48896):
        for k in (7168, 2048, 384):
            config = mg.heuristic_config(num_rows=num_rows, num_experts=256, k=k)
            assert config.tile_n == mg.MosaicFp8GemmConfig().tile_n
            assert config.smem_bytes(jnp.bfloat16, k) <= mg.SMEM_LIMIT


def _act_quant(
    x, w1, expert_ids, *, x_scales, w1_scales, fn=mg.mosaic_fp8_gemm_act_quant_contiguous, **options
):
    """`fn` (the fused GEMM1 kernel or its reference) with `options` as `FusedGemm1Options`."""
    options = mg.FusedGemm1Options(**options)
    return fn(x, w1, expert_ids, x_scales=x_scales, w1_scales=w1_scales, options=options)


def _call(fn=mg.mosaic_fp8_gemm_contiguous, **changes):
    """`fn` on small zero operands with `changes`; the fused entry point names the weights
    w1 and w1_scales."""
    weights = "w1" if fn is _act_quant else "w"
    args = {
        "x": jnp.zeros((64, 128), jnp.float8_e4m3fn),
        weights: jnp.zeros((2, 256, 128), jnp.float8_e4m3fn),
        "expert_ids": jnp.zeros((64,), jnp.int32),
        "x_scales": jnp.ones((64, 1)),
        f"{weights}_scales": jnp.ones((2, 2, 1)),
        "alignment": 64,
        "interpret": True,
    }
    args.update(changes)
    return fn(**args)


def test_no_rows():
    x = jnp.zeros((0, 128), jnp.float8_e4m3fn)
    y = _call(x=x, expert_ids=jnp.zeros((0,), jnp.int32), x_scales=jnp.zeros((0, 1)))
    assert y.shape == (0, 256) and y.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(x=jnp.zeros((64, 128), jnp.bfloat16)), TypeError, "float8_e4m3fn"),
        (dict(alignment=32), ValueError, "alignment=32"),
        (dict(alignment=96), ValueError, "multiple of 64 rows"),
        (dict(x_scales=jnp.ones((64, 2))), ValueError, "x_scales.shape"),
        (dict(expert_ids=jnp.zeros((63,), jnp.int32)), ValueError, "expert_ids.shape"),
        (dict(w=jnp.zeros((2, 200, 128), jnp.float8_e4m3fn)), ValueError, "multiples of 128"),
        (
            dict(config=mg.MosaicFp8GemmConfig(num_compute_wgs=2, block_n=128)),
            ValueError,
            "N=256",
        ),
    ],
)
def test_refuses_with_a_reason(changes, error, match):
    if "config" in changes:  # N=256 takes one 256-column tile; N=128 cannot
        changes = {
            **changes,
            "w": jnp.zeros((2, 128, 128), jnp.float8_e4m3fn),
            "w_scales": jnp.ones((2, 1, 1)),
        }
        match = "N=128"
    with pytest.raises(error, match=match):
        _call(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        dict(block_n=32),
        dict(block_n=256),
        dict(max_concurrent_steps=0),
        dict(num_compute_wgs=3),
        dict(group_blocks=3),
    ],
)
def test_config_checks(changes):
    with pytest.raises(ValueError, match="MosaicFp8GemmConfig"):
        mg.MosaicFp8GemmConfig(**changes)


def test_refuses_a_config_over_the_shared_memory_of_a_program():
    """Five pipeline slots of the 64 x 256 tile with float32 output ask for 266 KiB (227 KiB
    fit); four with bf16 output, the heuristic's largest, 197 KiB."""
    config = mg.MosaicFp8GemmConfig(max_concurrent_steps=5)
    assert config.smem_bytes(jnp.float32, 256) == 5 * (64 * 128 + 4 * 64 + 256 * 128) + 64 * 256 * 4
    with pytest.raises(ValueError, match="lower max_concurrent_steps"):
        _call(config=config, out_dtype=jnp.float32)
    four_slots = mg.MosaicFp8GemmConfig(group_blocks=2, max_concurrent_steps=4)
    assert four_slots.smem_bytes(jnp.bfloat16, 256) < mg.SMEM_LIMIT
    # overlapped, a step's slot holds two K blocks (one where K has an odd number of blocks)
    overlapped = mg.MosaicFp8GemmConfig(is_overlapped=True, max_concurrent_steps=2)
    assert overlapped.smem_bytes(jnp.bfloat16, 256) == four_slots.smem_bytes(jnp.bfloat16, 256)
    assert overlapped.smem_bytes(jnp.bfloat16, 384) == mg.MosaicFp8GemmConfig(
        max_concurrent_steps=2
    ).smem_bytes(jnp.bfloat16, 384)


# --- the "mosaic_fp8" GEMM backend ------------------------------------------------------------


def _gemm_problem(**changes) -> GemmProblem:
    return dataclasses.replace(DEEPSEEK_V3_FP8_GEMM1, **changes)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (dict(platform="cpu"), "NVIDIA Hopper GPU"),
        (dict(x_dtype="bfloat16", w_dtype="bfloat16"), "FP8 operands only"),
        (dict(n=4096 + 128), "N a multiple of 256"),
        (dict(alignment=32), "alignment 32"),
        (dict(layout="ragged"), "layout"),
    ],
)
def test_backend_refuses_with_a_reason(changes, reason, monkeypatch):
    monkeypatch.setattr(mg, "_compute_capability", lambda: mg.HOPPER)
    backend = grouped_gemm.GEMMS.get("mosaic_fp8")
    assert backend.unsupported_reason(_gemm_problem()) is None
    assert reason in backend.unsupported_reason(_gemm_problem(**changes))
    assert backend.alignment == 64 and backend.max_alignment is None


def test_backend_refuses_gpus_without_wgmma(monkeypatch):
    monkeypatch.setattr(mg, "_compute_capability", lambda: "10.0")
    reason = grouped_gemm.GEMMS.get("mosaic_fp8").unsupported_reason(_gemm_problem())
    assert "compute capability 9.0, this GPU has 10.0" in reason


def test_interpret_backend_runs_anywhere_but_auto_never_picks_it():
    backend = grouped_gemm.GEMMS.get("mosaic_fp8_interpret")
    assert backend.interpret and backend.unsupported_reason(_gemm_problem(platform="cpu")) is None
    for platform in ("cpu", "gpu"):
        for pairs in (8, 256 * 32, 256 * 96, 10**7):
            names = grouped_gemm.GEMMS.preference(_gemm_problem(platform=platform, num_pairs=pairs))
            assert "mosaic_fp8_interpret" not in names


# --- GEMM1 with act(gate) * up and the FP8 quantization fused ------------------------------------

# The fused kernel takes one 128-column scale group of gate and of up per tile.
FUSED_CONFIGS = [
    pytest.param(mg.MosaicFp8GemmConfig(), id="two_warpgroups"),
    pytest.param(
        mg.MosaicFp8GemmConfig(is_overlapped=True, group_blocks=2, max_concurrent_steps=2),
        id="overlapped_pairs",
    ),
    pytest.param(
        mg.MosaicFp8GemmConfig(group_blocks=4, is_chained=True, max_concurrent_steps=2),
        id="groups_of_4_chained",
    ),
]
# One FP8 step is 2**-3 of a value's power of two, so the quantization's rounding moves a value
# by at most 2**-4 of it; the FP8 products (2e-3, above) and a bf16 rounding the GEMM's error may
# flip add to that, relative to the row's largest value.
ACT_QUANT_RTOL = 2.0**-4
ACT_QUANT_ATOL_OF_ROW_MAX = 1e-2


def _run_act_quant(
    lay, w, w_scales, *, config, interpret, alignment=64, fn=mg.mosaic_fp8_gemm_act_quant_contiguous
):
    return _act_quant(
        jnp.asarray(lay["rows"]),
        jnp.asarray(w),
        jnp.asarray(lay["expert_ids"], jnp.int32),
        x_scales=jnp.asarray(lay["row_scales"]),
        w1_scales=jnp.asarray(w_scales),
        fn=fn,
        alignment=alignment,
        config=config,
        interpret=interpret,
    )


def _check_act_quant(q, s, x, w, x_scales, w_scales, lay):
    """Dequantized q * s against a float64 loop: GEMM1 of the dequantized operands rounded to
    bf16 (GEMM1's output), then act(gate) * up with vLLM's roundings; valid rows only."""
    valid = np.asarray(lay["expert_ids"]) >= 0
    assert valid.any()
    h = oracles.grouped_gemm_contiguous(
        oracles.dequant_per_token_group(lay["rows"], lay["row_scales"]),
        oracles.dequant_per_block(w, w_scales),
        lay["expert_ids"],
    )
    want = oracles.act_and_mul(oracles.round_to(h, jnp.bfloat16), dtype=jnp.bfloat16)[valid]
    # valid rows only: padding rows are unspecified (a kernel may leave NaN codes there)
    got = oracles.dequant_per_token_group(
        np.asarray(q.astype(jnp.float32))[valid], np.asarray(s)[valid]
    )
    row_max = np.abs(want).max(axis=1, keepdims=True)
    assert np.all(
        np.abs(got - want) <= ACT_QUANT_RTOL * np.abs(want) + ACT_QUANT_ATOL_OF_ROW_MAX * row_max
    )


def _unfused(lay, w, w_scales, *, config, interpret, alignment):
    """GEMM1 (bf16) by the same kernel, then the act + quantization kernel."""
    from moe_jax.kernels import act_quant as act_quant_kernels

    h = _run(
        lay,
        w,
        w_scales,
        config=config,
        out_dtype=jnp.bfloat16,
        interpret=interpret,
        alignment=alignment,
    )
    return act_quant_kernels.act_and_quant(
        h, expert_ids=jnp.asarray(lay["expert_ids"], jnp.int32), interpret=interpret
    )


PAIRS = mg.MosaicFp8GemmConfig(group_blocks=2, is_chained=True, max_concurrent_steps=2)
OVERLAPPED_PAIRS = FUSED_CONFIGS[1].values[0]


def _act_quant_cases():
    """Compiled (on a GPU), the whole grid. Interpreted (30-60 s a case on a 2-core CPU), each
    (config, alignment) once and each problem at each alignment once: the heuristic's
    overlapped pairs (ids outside [0, E)) and groups of 4 (three blocks per expert: a pair and an
    odd one, by the tile table); two warpgroups on K=384's three steps, one token and empty
    experts; at 128 rows, pairs ordered without a table over several pairs per expert, a pair's
    second block all padding (overlapped, ids outside), the heuristic's ungrouped config on one
    token, and groups of 4 that still take the table."""
    p0, p1, p2 = PROBLEMS
    two, overlapped, groups_of_4 = (c.values[0] for c in FUSED_CONFIGS)
    grid = [  # (name, config, problem, alignment, interpreted too)
        *((f"heuristic-{p}", None, p, 64, p is not p1) for p in PROBLEMS),
        (f"two_warpgroups-{p2}", two, p2, 64, False),
        (f"two_warpgroups-{p1}", two, p1, 64, True),
        (f"overlapped_pairs-{p2}", overlapped, p2, 64, True),
        (f"groups_of_4_chained-{p2}", groups_of_4, p2, 64, False),
        # 128-row segments: pairs ordered without a tile table (`is_dense`), a pair's second
        # block all padding where an expert has at most 64 rows; groups of 4 take the table
        *((f"dense_pairs-{p}", PAIRS, p, 128, p is p2) for p in PROBLEMS),
        (f"dense_overlapped-{p0}", overlapped, p0, 128, True),
        (f"table_groups_of_4-{p2}", groups_of_4, p2, 128, True),
        (f"dense_heuristic-{p1}", None, p1, 128, True),
    ]
    for name, config, problem, alignment, interpreted in grid:
        if interpreted:
            yield pytest.param(True, config, problem, alignment, id=f"{name}-interpret")
        yield pytest.param(
            False, config, problem, alignment, id=f"{name}-compiled", marks=pytest.mark.gpu
        )


@pytest.mark.parametrize(("interpret", "config", "problem", "alignment"), list(_act_quant_cases()))
def test_act_quant_matches_float64_loop_and_the_unfused_kernels(
    interpret, config, problem, alignment
):
    """Ids outside [0, E) and padding blocks, empty experts, several blocks per expert, against
    GEMM1 + `act_and_quant` by the same kernels. Compiled, the activation's approximations (exp2,
    and Mosaic GPU's division against the Pallas kernel's correctly rounded one) may move a code
    by one FP8 step. In interpret mode the two agree bit for bit on the CI machines' CPU (Xeon
    with AVX-512 BF16) under jax 0.10.2 and 0.11.2, but not on the H200 host's CPU under 0.11.2
    (2026-12-04: 0.07% of codes one step apart, rows whose largest activation rounded the other
    way): XLA's CPU code depends on the host, so both modes are held to the same bound."""
    rng = np.random.default_rng(oracles.seed("act_quant", problem.name))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=alignment, x_scales=x_scales)
    q, s = _run_act_quant(lay, w, w_scales, config=config, interpret=interpret, alignment=alignment)
    inter = problem.n // 2
    assert q.shape == (lay["rows"].shape[0], inter) and q.dtype == jnp.float8_e4m3fn
    assert s.shape == (lay["rows"].shape[0], inter // 128) and s.dtype == jnp.float32
    _check_act_quant(q, s, x, w, x_scales, w_scales, lay)
    q_ref, s_ref = _unfused(
        lay, w, w_scales, config=config, interpret=interpret, alignment=alignment
    )
    valid = np.asarray(lay["expert_ids"]) >= 0
    codes = np.asarray(q.astype(jnp.float32))[valid]
    codes_ref = np.asarray(q_ref.astype(jnp.float32))[valid]
    # A bf16 rounding of the activation that lands the other way moves a row's largest value
    # (its scale, by up to 2**-8) and the row's codes by one FP8 step at most.
    np.testing.assert_allclose(np.asarray(s)[valid], np.asarray(s_ref)[valid], rtol=2.0**-7)
    moved = codes != codes_ref
    assert moved.mean() <= 0.01
    np.testing.assert_allclose(codes[moved], codes_ref[moved], rtol=0.126)  # one e4m3 step


def test_act_quant_reference_matches_the_kernel_in_interpret_mode():
    """The pure-JAX reference (same signature): the same values as the kernel on valid rows."""
    problem = PROBLEMS[0]
    rng = np.random.default_rng(oracles.seed("act_quant_reference"))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=64, x_scales=x_scales)
    q, s = _run_act_quant(lay, w, w_scales, config=None, interpret=True)
    q_ref, s_ref = _run_act_quant(
        lay, w, w_scales, config=None, interpret=True, fn=mg.mosaic_fp8_gemm_act_quant_reference
    )
    valid = np.asarray(lay["expert_ids"]) >= 0
    # XLA's float32 GEMM and the kernel's per-block sums differ in the last bits: bf16 roundings
    # of GEMM1's output may flip, so compare as the float64 loop does
    _check_act_quant(q_ref, s_ref, x, w, x_scales, w_scales, lay)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    np.testing.assert_allclose(np.asarray(s)[valid], np.asarray(s_ref)[valid], rtol=2.0**-7)


def _act_quant_call(**changes):
    """`_call`'s operands (w as w1, w_scales as w1_scales) through the fused entry point."""
    return _call(fn=_act_quant, **changes)


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        (dict(activation="relu"), ValueError, "relu"),
        (dict(activation="gelu", interpret=False), NotImplementedError, "no compiled fused"),
        (dict(config=mg.MosaicFp8GemmConfig(block_n=64)), ValueError, "block_n=128"),
        (dict(alignment=32), ValueError, "alignment=32"),
        (dict(x=jnp.zeros((64, 128), jnp.bfloat16)), TypeError, "float8_e4m3fn"),
    ],
)
def test_act_quant_refuses_with_a_reason(changes, error, match):
    with pytest.raises(error, match=match):
        _act_quant_call(**changes)


def test_act_quant_no_rows_and_no_gradient():
    q, s = _act_quant_call(
        x=jnp.zeros((0, 128), jnp.float8_e4m3fn),
        expert_ids=jnp.zeros((0,), jnp.int32),
        x_scales=jnp.zeros((0, 1)),
    )
    assert q.shape == (0, 128) and s.shape == (0, 1)

    def loss(rows):
        q, s = fused_gemm1(
            rows,
            jnp.zeros((2, 256, 128), jnp.float8_e4m3fn),
            jnp.zeros((64,), jnp.int32),
            x_scales=jnp.ones((64, 1)),
            w1_scales=jnp.ones((2, 2, 1)),
            alignment=64,
            impl="mosaic_fp8_interpret",
        )
        return jnp.sum(s)

    with pytest.raises(TypeError, match="no gradient"):
        jax.grad(loss)(jnp.zeros((64, 128), jnp.float32).astype(jnp.float8_e4m3fn))


def _fp8_layer(seed: int):
    """A small FP8 layer ((x, w1, w2, topk_weights, topk_ids), scales): 70 tokens of top-2 over
    4 experts, H = I = 256, ids from -1 to E (outside the range both ways), negative weights,
    token 0 routed to expert 2 twice."""
    shape, rng = (70, 256, 256, 4, 2), np.random.default_rng(seed)
    inputs = oracles.moe_inputs(shape, "fp8", rng, id_low=-1, id_high=5)
    inputs.topk_ids[0] = 2  # an expert twice in one row
    return tuple(inputs.args()), inputs.scales()


def test_fused_first_gemm_by_object_takes_its_config():
    """`ContiguousExperts(fused_act_quant=MosaicFp8FusedGemm1(config))`: the fused GEMM1 with the
    tiles (here chained pairs of row blocks on 128-row segments) in the layer, within one FP8
    step of the requantization of the XLA experts (interpret mode)."""
    args, scales = _fp8_layer(oracles.seed("fused_first_gemm_object"))
    fused = mg.MosaicFp8FusedGemm1(PAIRS, interpret=True)
    experts = ContiguousExperts(gemm="xla", alignment=128, fused_act_quant=fused)
    got = np.asarray(fused_moe(*args, experts=experts, **scales), np.float64)
    want = np.asarray(fused_moe(*args, experts="xla", **scales), np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_fused_first_gemm_refusals():
    with pytest.raises(ValueError, match="training recipe"):
        ContiguousExperts(fused_act_quant="mosaic_fp8", recipe=moe_jax.fp8_training.Fp8Training())
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((2, 256, 256)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((2, 256, 128)), jnp.bfloat16)
    ids = jnp.zeros((8, 1), jnp.int32)
    weights = jnp.ones((8, 1), jnp.float32)
    experts = ContiguousExperts(gemm="xla", fused_act_quant="deep_gemm")
    with pytest.raises(ValueError, match="fused_act_quant='deep_gemm': unknown fused GEMM1"):
        fused_moe(x, w1, w2, weights, ids, experts=experts)
    experts = ContiguousExperts(gemm="xla", fused_act_quant="mosaic_fp8_interpret")
    with pytest.raises(NoImplementationError, match="fused_act_quant=.*FP8 inference only"):
        fused_moe(x, w1, w2, weights, ids, experts=experts)


def test_auto_fused_first_gemm_in_the_layer(monkeypatch):
    """`ContiguousExperts()` ("auto" GEMMs, `fused_act_quant="auto"`) fuses GEMM1 where
    `fused_gemm1_order` names a backend that accepts the problem, and runs the same layer as the
    unfused experts within one FP8 step of the requantization. On the CPU the order is pointed
    at the interpret-mode kernels (the GPU's rule never fuses there); a named GEMM, a training
    recipe or `fused_act_quant=None` never fuse."""
    import moe_jax.plan

    def interpret_where_gpu_would(problem):
        on_gpu = dataclasses.replace(problem.gemm, platform="gpu")
        names, why = fused_gemm1_order(dataclasses.replace(problem, gemm=on_gpu))
        return tuple(f"{name}_interpret" for name in names), why

    monkeypatch.setattr(moe_jax.plan, "fused_gemm1_order", interpret_where_gpu_would)
    args, scales = _fp8_layer(oracles.seed("auto_fused_first_gemm"))
    weights = moe_jax.experts.ExpertWeights(
        w1=args[1], w2=args[2], w1_scale=scales["w1_scale"], w2_scale=scales["w2_scale"]
    )
    sizes = dict(num_tokens=70, topk=2, x_dtype=jnp.float8_e4m3fn)
    auto = ContiguousExperts(alignment=128)
    assert auto.fused_act_quant == "auto"
    plan = auto.plan_for(weights, **sizes)
    assert plan.gemm1.name == "mosaic_fp8_gathered_interpret" and plan.gathers_rows
    assert plan.arrange == "route" and plan.gemm2.name == "xla"
    gelu = ExpertsCall(activation="gelu", quant_config=moe_jax.quant.Fp8BlockQuant())
    assert auto.plan_for(weights, **sizes, call=gelu).fuses_act_quant  # interpret: any activation
    assert not ContiguousExperts().plan_for(weights, **sizes).fuses_act_quant  # xla's 16 rows
    unfused = [
        ContiguousExperts(gemm="xla", alignment=128),
        ContiguousExperts(alignment=128, fused_act_quant=None),
    ]
    for experts in unfused:
        assert not experts.plan_for(weights, **sizes).fuses_act_quant, experts
    # the FP8 training recipe's GEMMs are FP8 problems too, on bf16 master weights
    master = moe_jax.experts.ExpertWeights(
        w1=args[1].astype(jnp.bfloat16), w2=args[2].astype(jnp.bfloat16)
    )
    recipe = ContiguousExperts(alignment=128, recipe=moe_jax.fp8_training.Fp8Training())
    plan = recipe.plan_for(master, **{**sizes, "x_dtype": jnp.bfloat16})
    assert not plan.fuses_act_quant and plan.wgrads is not None
    got = np.asarray(fused_moe(*args, experts=auto, **scales), np.float64)
    want = np.asarray(fused_moe(*args, experts=unfused[1], **scales), np.float64)
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_act_quant_heuristic_config_takes_pairs_on_128_row_segments():
    """About 10 row blocks per expert: the plain heuristic's groups of 4 become pairs where the
    kernel orders the tiles itself (128-row segments) and stay on 64-row segments."""
    sizes = dict(num_rows=81792, num_experts=128, k=2048)
    assert mg.heuristic_config(**sizes).group_blocks == 4
    paired = mg.act_quant_heuristic_config(**sizes, alignment=128)
    assert paired == dataclasses.replace(mg.heuristic_config(**sizes), group_blocks=2)
    assert mg.act_quant_heuristic_config(**sizes, alignment=64) == mg.heuristic_config(**sizes)


def test_act_quant_on_128_row_segments_builds_no_tile_table(monkeypatch):
    """On 128-row segments the tiles are ordered in the kernel (`is_dense`); on 64-row segments
    the XLA tile table is still built."""

    def refuse(*args, **kwargs):
        raise AssertionError("tile_table called")

    monkeypatch.setattr(mosaic_fp8_tiles, "tile_table", refuse)
    problem = PROBLEMS[0]
    rng = np.random.default_rng(oracles.seed("no_tile_table"))
    x, w, x_scales, w_scales, ids = _operands(problem, rng)
    lay = oracles.permute(x, ids, problem.num_experts, alignment=128, x_scales=x_scales)
    q, s = _run_act_quant(lay, w, w_scales, config=PAIRS, interpret=True, alignment=128)
    _check_act_quant(q, s, x, w, x_scales, w_scales, lay)
    with pytest.raises(AssertionError, match="tile_table called"):
        _run_act_quant(lay, w, w_scales, config=PAIRS, interpret=True, alignment=64)


def test_act_quant_counts_its_epilogue_in_the_shared_memory_check():
    """The fused epilogue stages the bf16 gate and up (32 KiB), three float32 rows (row maxima
    of each warpgroup, scales) and the FP8 codes (8 KiB) where the plain kernel stages its bf16
    tile (32 KiB); a config over a program's shared memory is refused before it is built."""
    config = mg.MosaicFp8GemmConfig(max_concurrent_steps=2, is_overlapped=True)
    plain = config.smem_bytes(jnp.bfloat16, 256)
    assert config.smem_bytes(jnp.bfloat16, 256, is_gated=True) == plain + 3 * 64 * 4 + 64 * 128
    with pytest.raises(ValueError, match="lower max_concurrent_steps"):
        _act_quant_call(config=mg.MosaicFp8GemmConfig(max_concurrent_steps=6))
