"""The contract of every fused GEMM1 (`moe_jax.fused_gemm1.FUSED_GEMM1S`, each name it holds, the
tests' interpret twins included): act(x @ w1[e]^T gate) * up, rounded to bf16 and quantized in
128-column groups, against the float64 loop, on rows of the contiguous layout (or, for a
gathered backend, the tokens and each row's source), with invalid and duplicate ids, empty
experts, one token and none. FP8 inference only: the op has no gradient.

Tolerance: GEMM1 sums in float32 where the oracle sums in float64, so a bf16 rounding of GEMM1's
output or of the product may fall the other way, moving one FP8 code by one e4m3 step and a
group's scale by one bf16 step (at most 1% of the codes).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax.fused_gemm1 import FUSED_GEMM1S, FusedGemm1Problem, fused_gemm1
from moe_jax.grouped_gemm import GemmProblem
from moe_jax.registry import current_platform

pytestmark = pytest.mark.cpu_numerics  # compiled kernels stay on the GPU (conftest.py)

ALIGNMENT = 128  # every fused backend tiles 128-row segments


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int
    num_experts: int
    hidden: int = 128
    inter: int = 128
    activation: str = "silu"

    def __str__(self):
        return self.name


PROBLEMS = [
    Problem("invalid_dup_ids_empty_experts", 9, 3, 4),
    Problem("one_token_gelu", 1, 2, 3, activation="gelu"),
    Problem("no_tokens", 0, 2, 3),
]


@pytest.mark.parametrize("name", impl_params(FUSED_GEMM1S))
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_fused_gemm1_matches_float64_loop(name, problem):
    backend = FUSED_GEMM1S.get(name)
    e, h, i = problem.num_experts, problem.hidden, problem.inter
    runs_or_skip(
        backend,
        FusedGemm1Problem(
            gemm=GemmProblem(
                layout="contiguous",
                n=2 * i,
                k=h,
                num_experts=e,
                num_pairs=problem.num_tokens * problem.topk,
                x_dtype="float8_e4m3fn",
                w_dtype="float8_e4m3fn",
                platform=current_platform(),
                alignment=ALIGNMENT,
            ),
            activation=problem.activation,
            group_size=128,
        ),
    )
    rng = np.random.default_rng(oracles.seed("contract_fused_gemm1", str(problem)))
    ids = rng.integers(-1, e + 1, (problem.num_tokens, problem.topk))
    ids[ids == 2] = 0  # expert 2 gets no rows
    if problem.num_tokens:
        ids[::3, 1] = ids[::3, 0]  # the same expert twice in a row
    x, x_scales = oracles.per_token_group_quant_fp8(
        rng.standard_normal((problem.num_tokens, h)).astype(np.float32)
    )
    w1, w1_scales = oracles.per_block_quant_fp8(
        (rng.standard_normal((e, 2 * i, h)) / 4).astype(np.float32)
    )
    lay = oracles.permute(x, ids, e, alignment=ALIGNMENT, x_scales=x_scales)
    if backend.gathers_rows:
        meta = oracles.routing_metadata(
            oracles.local_ids(ids, e), e, alignment=ALIGNMENT, num_rows=lay["rows"].shape[0]
        )
        inputs = dict(x=x, x_scales=x_scales, row_sources=jnp.asarray(meta["source"], jnp.int32))
    else:
        inputs = dict(x=lay["rows"], x_scales=lay["row_scales"], row_sources=None)
    q, scales = fused_gemm1(
        jnp.asarray(inputs["x"]),
        jnp.asarray(w1),
        jnp.asarray(lay["expert_ids"], jnp.int32),
        x_scales=jnp.asarray(inputs["x_scales"]),
        w1_scales=jnp.asarray(w1_scales),
        alignment=ALIGNMENT,
        activation=problem.activation,
        row_sources=inputs["row_sources"],
        impl=name,
    )
    num_rows = lay["rows"].shape[0]
    assert q.shape == (num_rows, i) and q.dtype == jnp.float8_e4m3fn
    assert scales.shape == (num_rows, i // 128) and scales.dtype == jnp.float32
    is_row = lay["expert_ids"] >= 0  # padding rows are unspecified
    rows64 = oracles.dequant_per_token_group(lay["rows"], lay["row_scales"])
    w64 = oracles.dequant_per_block(w1, w1_scales)
    gemm1 = oracles.round_to(
        oracles.grouped_gemm_contiguous(rows64, w64, lay["expert_ids"]), oracles.BF16
    )
    a = oracles.act_and_mul(gemm1, problem.activation, oracles.BF16)
    q_ref, s_ref = oracles.per_token_group_quant_fp8(a[is_row].astype(np.float32))
    np.testing.assert_allclose(np.asarray(scales)[is_row], s_ref, rtol=1e-2)
    codes = np.asarray(q.astype(jnp.float32))[is_row]
    codes_ref = np.asarray(q_ref).astype(np.float32)
    step = 0.125 * np.abs(codes_ref) + 2.0**-9
    assert np.all(np.abs(codes - codes_ref) <= step)
    assert np.sum(codes != codes_ref) <= 0.01 * max(codes_ref.size, 1)
