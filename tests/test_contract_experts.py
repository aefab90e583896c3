"""The contract of every experts name a user may pass (`moe_jax.experts_names()`, the tests'
interpret twins included): `fused_moe(experts=name)` against the float64 loop `oracles.fused_moe`
on awkward routing (the same expert twice in a row, ids outside [0, E_global), negative router
weights, expert_map holes), one token and none, with FP8 and bf16 weights; and its VJP against
`jax.grad` of the float64 `oracles.fused_moe_jnp` where the name trains (bf16).

Names: every GEMM backend alone (contiguous) and "_masked", and each fused GEMM1 beside the
XLA GEMM ("xla+<fused>") and each GEMM beside the XLA fused GEMM1 ("<gemm>+xla"): each part of
a "<gemm>+<fused>" name is thus run in its place, and every part has its own op contract
(tests/test_contract_*.py), so the remaining products add no code path of their own. A name
whose plan refuses the problem here (a GPU kernel on a CPU, a fused GEMM1 on bf16) skips with
the plan's reason; "auto", "xla" and "xla_masked" never may.

Tolerances: `oracles.assert_moe_close` (bf16 two bf16 ulps; FP8 the same, but for one token row
per call within vLLM's own FP8 tolerance, where float32 vs float64 accumulation moved one
requantized code). Gradients: relative Frobenius error 3e-2 (bf16 roundings, as vLLM's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import name_params

from moe_jax import experts_names, fused_moe
from moe_jax.experts_by_name import FUSED_SEPARATOR
from moe_jax.plan import PlanError

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding; compiled kernels stay on the GPU

NEVER_SKIP = ("auto", "xla", "xla_masked")  # these run on every platform


def _contract_names() -> list[str]:
    names = []
    for name in experts_names():
        gemm, separator, fused = name.partition(FUSED_SEPARATOR)
        if not separator or gemm == "xla" or fused == "xla":
            names.append(name)
    return names


NAMES = name_params(_contract_names())
GRAD_TOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int = 3
    hidden: int = 256  # every backend's tile multiples (Mosaic FP8: N of 256, K of 128)
    inter: int = 128
    num_experts: int = 2  # local: few row blocks, as Mosaic's interpreter simulates each one
    expert_map: tuple[int, ...] | None = (0, -1, 1, -1)  # 4 global ids, 2 holes

    def __str__(self):
        return self.name


AWKWARD = Problem("awkward_ids_T5", 5)
PROBLEMS = [AWKWARD, Problem("one_token_one_empty_expert", 1, topk=1), Problem("no_tokens", 0)]


def _inputs(problem: Problem, dtype: str):
    rng = np.random.default_rng(oracles.seed("contract_experts", str(problem), dtype))
    t, h, i, e, k = (
        problem.num_tokens,
        problem.hidden,
        problem.inter,
        problem.num_experts,
        problem.topk,
    )
    num_global = e if problem.expert_map is None else len(problem.expert_map)
    ids = rng.integers(-1, num_global + 2, (t, k))  # outside [0, E_global) both sides
    if t and k > 1:
        ids[::2, 1] = ids[::2, 0]  # the same expert twice in a row
    if t == 1:
        ids[0, 0] = 0  # to local expert 0 (the other experts stay empty)
    x = rng.standard_normal((t, h)).astype(oracles.BF16)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    scales = {}
    if dtype == "fp8":
        w1, s1 = oracles.per_block_quant_fp8(w1)
        w2, s2 = oracles.per_block_quant_fp8(w2)
        scales = dict(w1_scale=s1, w2_scale=s2)
    else:
        w1, w2 = w1.astype(oracles.BF16), w2.astype(oracles.BF16)
    weights = rng.standard_normal((t, k)).astype(np.float32)  # negative weights too
    expert_map = None if problem.expert_map is None else np.array(problem.expert_map, np.int32)
    return x, w1, w2, weights, ids.astype(np.int32), expert_map, scales


def _run_or_skip(name: str, fn):
    """fn(), or a skip with the plan's refusal (never for `NEVER_SKIP`)."""
    try:
        return fn()
    except PlanError as error:
        if name in NEVER_SKIP:
            raise
        pytest.skip(f"{name}: {error}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_experts_match_the_float64_loop(name, dtype, problem):
    if problem.num_tokens == 1 and (dtype == "bfloat16" or "mosaic_fp8_interpret" in name):
        pytest.skip(
            "T=1 runs in FP8 only (the layout's one-token case is dtype-blind), and not where "
            "Mosaic's interpreter simulates a kernel (20 s a call; its one-token case is "
            "tests/test_contract_fused_gemm1.py's)"
        )
    x, w1, w2, weights, ids, expert_map, scales = _inputs(problem, dtype)
    arrays = [jnp.asarray(a) for a in (x, w1, w2, weights, ids)]
    kwargs = {k: jnp.asarray(v) for k, v in scales.items()}
    if expert_map is not None:
        kwargs["expert_map"] = jnp.asarray(expert_map)
    run = jax.jit(lambda *a, **kw: fused_moe(*a, experts=name, **kw))
    out = _run_or_skip(name, lambda: run(*arrays, **kwargs))
    assert out.shape == x.shape and out.dtype == jnp.bfloat16
    ref = oracles.fused_moe(x, w1, w2, weights, ids, expert_map=expert_map, **scales)
    oracles.assert_moe_close(out.astype(jnp.float32), oracles.round_to(ref, oracles.BF16), dtype)


@pytest.mark.parametrize("name", NAMES)
def test_experts_vjp_matches_the_float64_grad(name):
    """d<out, probe> / d(x, w1, w2, topk_weights) on the awkward routing, bf16 operands."""
    x, w1, w2, weights, ids, expert_map, _ = _inputs(AWKWARD, "bfloat16")
    probe = np.random.default_rng(oracles.seed("contract_experts_probe")).standard_normal(x.shape)

    def loss(x, w1, w2, weights):
        out = fused_moe(
            x, w1, w2, weights, jnp.asarray(ids), experts=name, expert_map=jnp.asarray(expert_map)
        )
        return jnp.sum(out.astype(jnp.float32) * probe)

    args = (jnp.asarray(x), jnp.asarray(w1), jnp.asarray(w2), jnp.asarray(weights))
    grads = _run_or_skip(name, lambda: jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args))
    local = oracles.local_ids(ids, AWKWARD.num_experts, expert_map)
    wants = oracles.fused_moe_grads(x, w1, w2, weights, probe, local)
    oracles.assert_grads_close(grads, wants, GRAD_TOL)
