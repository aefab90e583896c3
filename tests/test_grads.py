"""Gradients through the fast path: `jax.grad` of `fused_moe` in float32 (and with chunking, the
router weight on the input, the recompute policies) against `jax.grad` of an independent float64
jnp MoE (x64 enabled locally); every experts name's bf16 VJP is tests/test_contract_experts.py's.

The reference, `oracles.fused_moe_jnp`, restates the layer's math with no moe_jax code: per
(token, slot) it gathers the expert's weights and runs the MLP in float64, with no rounding.
Inputs: `oracles.moe_inputs` (negative router weights) with each test's ids. Tolerance (relative
Frobenius error of each gradient, `oracles.assert_grads_close`): float32 inputs 1e-5 (the library
rounds nowhere but float32 sums).

The "torch" cases run torch's CPU twin on the CPU; on a GPU, torch's grouped GEMM takes bfloat16
and FP8 only, so the float32 cases that name torch skip there, with the registry's refusal as the
reason (on the CPU a refusal is a failure, except torch's where torch is not installed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import fused_moe, layouts, permute
from moe_jax.activation import act_and_mul
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.masked_experts import MASKED_SUFFIX, MaskedExperts
from moe_jax.registry import NoImplementationError

TOL = 1e-5  # float32 inputs: relative Frobenius error of each gradient
T, H, I, E, K = 6, 16, 8, 4, 2  # noqa: E741 - DESIGN.md's dimension names

ALIGN = 8  # small segments keep the CPU programs small; every backend here accepts 8
EXPERTS = [
    pytest.param(
        ContiguousExperts(
            gemm="xla", permute_impl="xla", act_quant_impl="xla", alignment=ALIGN, wgrad="xla"
        ),
        id="xla",
    ),
    pytest.param(ContiguousExperts(gemm="torch", wgrad="torch", alignment=ALIGN), id="torch"),
    pytest.param(
        ContiguousExperts(gemm="xla", permute_impl="pallas_interpret", alignment=ALIGN),
        id="xla-pallas_permute",
    ),
    pytest.param(MaskedExperts(gemm="xla", act_quant_impl="xla"), id="xla_masked"),
    pytest.param(MaskedExperts(gemm="torch"), id="torch_masked"),
]

CASES = {  # every case has negative router weights (oracles.moe_inputs)
    "duplicates_and_invalid_ids": dict(ids=[[0, 0], [1, 1], [7, 3], [-1, 3], [1, 3], [-1, -2]]),
    "expert_map_holes": dict(
        ids=[[0, 5], [1, 2], [4, 3], [3, 0], [5, 5], [2, 1]],
        expert_map=[0, -1, 1, 2, -1, 3],
    ),
    "chunked": dict(ids=[[0, 1], [1, 1], [2, 3], [3, 0], [-1, 3], [2, 0]], chunk_size=4),
}


def _skip_off_cpu(error: NoImplementationError):
    """Skips with the refusal on a GPU, where torch refuses float32, or where torch is not
    installed (the [torch] extra) and the refusal is torch's; re-raises on the CPU otherwise."""
    if "torch" in error.refusals and importlib.util.find_spec("torch") is None:
        pytest.skip(f"torch is not installed (pip install 'moe_jax[torch]'): {error}")
    if jax.default_backend() == "cpu":
        raise error
    pytest.skip(f"the named backend refuses this problem on {jax.default_backend()}: {error}")


def _grads(experts, seed: int, ids, *, expert_map=None, **kwargs):
    """(float32 d<fused_moe(...), probe> / d(x, w1, w2, topk_weights), the float64 reference's)
    on seeded float32 inputs (`oracles.moe_inputs`) routed by `ids` int[T, k]."""
    (num_tokens, topk), rng = np.shape(ids), np.random.default_rng(seed)
    m = oracles.moe_inputs((num_tokens, H, I, E, topk), "float32", rng)
    probe = rng.standard_normal((num_tokens, H))  # loss = <out, probe>
    if expert_map is not None:
        kwargs["expert_map"] = jnp.asarray(expert_map, jnp.int32)

    def loss(x, w1, w2, topk_weights):
        out = fused_moe(x, w1, w2, topk_weights, jnp.asarray(ids), experts=experts, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * probe)

    try:
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*m.args()[:4])
    except NoImplementationError as error:
        _skip_off_cpu(error)
    local = oracles.local_ids(ids, E, expert_map)
    on_input = kwargs.get("apply_router_weight_on_input", False)
    return grads, oracles.fused_moe_grads(
        m.x, m.w1, m.w2, m.topk_weights, probe, local, weight_on_input=on_input
    )


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("case", list(CASES))
def test_grads_match_float64(experts, case):
    oracles.assert_grads_close(*_grads(experts, list(CASES).index(case), **CASES[case]), TOL)


@pytest.mark.parametrize("experts", EXPERTS[:2] + EXPERTS[3:4])
def test_grads_weight_on_input(experts):
    ids = [[0], [2], [2], [-1], [3], [1]]
    grads, wants = _grads(experts, 11, ids, apply_router_weight_on_input=True)
    oracles.assert_grads_close(grads, wants, TOL)


@pytest.mark.parametrize("num_tokens", [0, 1])
def test_grads_tiny_batches(num_tokens):
    ids = np.array([[2, 2]] * num_tokens, np.int64).reshape(num_tokens, K)
    grads, wants = _grads(EXPERTS[1].values[0], 3, ids)
    for got, want in zip(grads, wants, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_unpermute_backward_matches_oracle():
    """The scatter of g * w and the <g, y> router gradient, including rows shared by slots."""
    rng = np.random.default_rng(7)
    y = rng.normal(size=(10, 8))
    inverse = np.array([[3, 3], [0, -1], [5, 9], [-1, -1]])
    w = rng.normal(size=(4, 2))
    g = rng.normal(size=(4, 8))
    dy, dw = permute.unpermute_backward(
        jnp.asarray(g, jnp.float32),
        jnp.asarray(y, jnp.float32),
        jnp.asarray(inverse, jnp.int32),
        jnp.asarray(w, jnp.float32),
    )
    want_dy = np.zeros_like(y)
    want_dw = np.zeros_like(w)
    for t in range(4):
        for j in range(2):
            if inverse[t, j] >= 0:
                want_dy[inverse[t, j]] += g[t] * w[t, j]
                want_dw[t, j] = g[t] @ y[inverse[t, j]]
    np.testing.assert_allclose(np.asarray(dy), want_dy, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_act_and_mul_vjp_matches_float64(activation, dtype):
    """The activation's custom VJP (recomputed from x, padding rows masked) against float64
    autodiff of the plain formula; bf16 holds to its rounding of the result."""
    rng = np.random.default_rng(12)
    x = np.asarray(jnp.asarray(rng.normal(size=(7, 2 * 24)) * 3, dtype), np.float64)
    g = rng.normal(size=(7, 24))
    row_mask = np.array([True, True, False, True, False, True, True])

    def loss(x):
        a = act_and_mul(x, activation, row_mask=jnp.asarray(row_mask))
        return jnp.sum(a.astype(jnp.float32) * g)

    got = np.asarray(jax.grad(loss)(jnp.asarray(x, dtype)).astype(jnp.float32), np.float64)
    with jax.enable_x64(True):

        def reference(x):
            gate, up = x[:, :24], x[:, 24:]
            if activation == "silu":
                act = gate / (1.0 + jnp.exp(-gate))
            else:
                act = gate * 0.5 * (1.0 + jax.scipy.special.erf(gate / np.sqrt(2.0)))
            return jnp.sum(jnp.where(row_mask[:, None], act * up, 0.0) * g)

        want = np.asarray(jax.grad(reference)(jnp.asarray(x, jnp.float64)))
    assert np.all(got[~row_mask] == 0.0)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert error <= {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}[dtype], error


RECOMPUTE = ["activation", "gemm2", "all"]


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("gemm", ["xla", "torch"])
def test_recompute_matches_float64(gemm, recompute):
    """Every recomputation policy gives the float64 backward, on awkward routing and chunks."""
    experts = ContiguousExperts(gemm=gemm, wgrad=gemm, alignment=ALIGN, recompute=recompute)
    for case in ("duplicates_and_invalid_ids", "chunked"):
        grads = _grads(experts, 20 + RECOMPUTE.index(recompute), **CASES[case])
        oracles.assert_grads_close(*grads, TOL)


_FLOAT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}  # dtypes as jax prints them
_RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")


def _saved_float_bytes(experts, x, w1, w2, topk_weights, ids) -> int:
    """Bytes of the float residuals jax keeps for the backward, weights and inputs excluded."""

    def loss(x, w1, w2, topk_weights):
        return fused_moe(x, w1, w2, topk_weights, ids, experts=experts).astype(jnp.float32).sum()

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(loss, x, w1, w2, topk_weights)
    total = 0
    for line in printed.getvalue().splitlines():
        dtype, shape, origin = _RESIDUAL.match(line).groups()
        if "argument" in origin or dtype not in _FLOAT_BYTES:
            continue
        total += math.prod(int(d) for d in shape.split(",") if d) * _FLOAT_BYTES[dtype]
    return total


@pytest.mark.parametrize(
    "recompute, per_row",  # bytes per layout row (ContiguousExperts' docstring)
    [("none", (4, 6)), ("activation", (4, 4)), ("gemm2", (2, 4)), ("all", (0, 0))],
)
def test_recompute_saved_bytes(recompute, per_row):
    """The saved float residuals are what `ContiguousExperts.recompute` documents: per row,
    per_row[0] * H + per_row[1] * I bytes for bf16 tokens."""
    x, w1, w2, topk_weights, _ = oracles.moe_inputs(
        (T, H, I, E, K), "bfloat16", np.random.default_rng(9)
    ).args()
    ids = jnp.asarray(CASES["duplicates_and_invalid_ids"]["ids"])
    experts = ContiguousExperts(gemm="xla", alignment=ALIGN, recompute=recompute)
    saved = _saved_float_bytes(experts, x, w1, w2, topk_weights, ids)
    rows = layouts.permute_reference(x, ids, num_experts=E, alignment=ALIGN).rows.shape[0]
    assert saved == rows * (per_row[0] * H + per_row[1] * I)


def test_recompute_rejects_unknown_policy():
    with pytest.raises(ValueError, match="recompute='some'.*choose from"):
        ContiguousExperts(recompute="some")


GPU_EXPERTS = ["auto", "torch", "deep_gemm", "mosaic", "pallas", "torch_masked", "deep_gemm_masked"]


def _gpu_problem(seed: int):
    """bf16 layer (T=512, E=8, k=2, H=512, I=256) with softmax top-2 routing and a probe."""
    (t, h, e), rng = (512, 512, 8), np.random.default_rng(seed)
    x, w1, w2, _, _ = oracles.moe_inputs((t, h, 256, e, 2), "bfloat16", rng).args()
    logits = rng.normal(size=(t, e))
    ids = np.argsort(-logits, axis=1)[:, :2]
    ids[::7, 1] = ids[::7, 0]  # duplicates
    topk_weights = jnp.asarray(np.take_along_axis(logits, ids, 1), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)
    return x, w1, w2, topk_weights, jnp.asarray(ids, jnp.int32), probe


# Masked experts run in chunks of 256 tokens: at T=512 their E*T rows pass MaskedExperts'
# capacity bound (475 rows per expert for this problem; test_fused_moe tests the bound itself).
MASKED_CHUNK_SIZE = 256


def _gpu_grads(experts, x, w1, w2, topk_weights, ids, probe):
    is_masked = isinstance(experts, str) and experts.endswith(MASKED_SUFFIX)
    chunk_size = MASKED_CHUNK_SIZE if is_masked else None

    def loss(x, w1, w2, topk_weights):
        out = fused_moe(x, w1, w2, topk_weights, ids, experts=experts, chunk_size=chunk_size)
        return jnp.sum(out.astype(jnp.float32) * probe)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w1, w2, topk_weights)


def _gpu_reference(x, w1, w2, topk_weights, ids, probe):
    f32 = [a.astype(jnp.float32) for a in (x, w1, w2)]
    experts = ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla", wgrad="xla")
    with jax.default_matmul_precision("highest"):
        grads = _gpu_grads(experts, *f32, topk_weights, ids, probe)
    return [np.asarray(g, np.float64) for g in grads]


@pytest.mark.gpu
@pytest.mark.parametrize("experts", GPU_EXPERTS)
def test_gpu_backend_grads_match_float32_xla(experts):
    """bf16 gradients of every GPU backend within 2e-2 of the float32 XLA backward."""
    args = _gpu_problem(31)
    try:
        grads = _gpu_grads(experts, *args)
    except NoImplementationError as error:
        pytest.skip(f"{experts} does not run this problem here: {error}")
    oracles.assert_grads_close(grads, _gpu_reference(*args), 2e-2)


@pytest.mark.gpu
def test_gpu_fp8_recipe_grads_match_float32_xla():
    """DeepGEMM FP8 recipe gradients within 8e-2 of the float32 backward of the bf16 layer."""
    from moe_jax.fp8_training import Fp8Training

    args = _gpu_problem(32)
    grads = _gpu_grads(ContiguousExperts(recipe=Fp8Training()), *args)
    oracles.assert_grads_close(grads, _gpu_reference(*args), 8e-2)


def test_act_and_mul_refuses_float64():
    """float64 used to pass and run in float32 (2.7e-8 off a float64 loop) under a float64 dtype."""
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match=r"x\.dtype=float64"):
            act_and_mul(jnp.ones((2, 4), jnp.float64))
