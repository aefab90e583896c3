"""Gradients through frozen FP8 experts (issue 62): `jax.grad` of `fused_moe` and of the Flax MoE
with float8_e4m3fn expert weights, with respect to the tokens, the router weights and the
router, against `jax.grad` of the float64 `oracles.fused_moe_jnp` on the dequantized weights; and
the refusal, naming the argument, of a gradient to the FP8 weights or their scales.

Every experts name a user may pass (the tests' interpret twins included) runs the contract
suite's awkward routing (the same expert twice in a row, ids outside [0, E_global), negative
router weights, expert_map holes); the cheap names also one token and none. Of the names with a
fused GEMM1 one runs ("xla+xla_gathered"): under differentiation the GEMMs quantize float rows,
so the plan leaves any fused GEMM1 out and the rest is its GEMM's name. A name whose plan
refuses the problem here (a GPU kernel on a CPU) skips with the plan's reason; on a GPU host the
GPU names run, and `test_gpu_*` holds DeepGEMM's, Mosaic's and Pallas's FP8 dgrads at a larger
shape.

Tolerance (relative Frobenius error of each gradient), bf16 and float32 tokens alike: 8e-2, the
FP8 training recipe's (tests/test_training.py); measured 3e-2 on the awkward routing, 6e-2 for
one token. The FP8 forward quantizes the tokens and the activation in 1x128 groups and the
backward the output gradient (straight through the quantizers); the float64 reference
quantizes nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import name_params
from flax import nnx
from test_contract_experts import (
    AWKWARD,
    NEVER_SKIP,
    PROBLEMS,
    Problem,
    _contract_names,
    _inputs,
    _run_or_skip,
)

from moe_jax import MoE, fused_moe, quant
from moe_jax.experts import ExpertsCall, ExpertWeights
from moe_jax.experts_by_name import resolve_experts
from moe_jax.grouped_gemm import GEMMS
from moe_jax.grouped_gemm_backward import grouped_gemm_contiguous, grouped_gemm_masked

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding; compiled kernels stay on the GPU

TOL = 8e-2  # bf16 and float32 tokens alike
CHEAP = ("auto", "xla", "xla_masked", "torch", "torch_masked")  # also at T=1 and T=0


def _dequantized(w1, w2, scales):
    return (
        oracles.dequant_per_block(w1, scales["w1_scale"]),
        oracles.dequant_per_block(w2, scales["w2_scale"]),
    )


def _check_grads(name: str, problem: Problem, dtype: str, **options) -> None:
    """d<fused_moe(..., **options), probe> / d(x, topk_weights) against the float64 oracle's."""
    x, w1, w2, weights, ids, expert_map, scales = _inputs(problem, "fp8")
    x = x.astype(dtype)
    rng = np.random.default_rng(oracles.seed("frozen_fp8_probe", str(problem)))
    probe = rng.standard_normal(x.shape)
    kwargs = {k: jnp.asarray(v) for k, v in scales.items()}

    def loss(x, weights):
        out = fused_moe(
            x, w1, w2, weights, ids, experts=name, expert_map=jnp.asarray(expert_map),
            **kwargs, **options,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * probe)

    args = jnp.asarray(x), jnp.asarray(weights)
    grads = _run_or_skip(name, lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(*args))
    local = oracles.local_ids(ids, problem.num_experts, expert_map)
    on_input = options.get("apply_router_weight_on_input", False)
    want_x, _, _, want_w = oracles.fused_moe_grads(
        x, *_dequantized(w1, w2, scales), weights, probe, local, weight_on_input=on_input
    )
    oracles.assert_grad_close("x", grads[0], want_x, TOL)
    oracles.assert_grad_close("topk_weights", grads[1], want_w, TOL)
    assert grads[0].dtype == x.dtype


def _name_problem_params():
    names = [name for name in _contract_names() if "+" not in name] + ["xla+xla_gathered"]
    for param in name_params(names):
        (name,) = param.values
        for problem in PROBLEMS if name in CHEAP else [AWKWARD]:
            yield pytest.param(name, problem, id=f"{name}-{problem}", marks=param.marks)


@pytest.mark.parametrize(("name", "problem"), list(_name_problem_params()))
def test_frozen_fp8_grads_match_the_float64_oracle(name, problem):
    _check_grads(name, problem, "bfloat16")


@pytest.mark.parametrize("name", NEVER_SKIP)
def test_float32_tokens_too(name):
    _check_grads(name, AWKWARD, "float32")


@pytest.mark.parametrize("name", ["xla", "xla_masked"])
def test_chunks_and_the_router_weight_on_the_input(name):
    """Chunks of 2 tokens (the layer's static-shape loop), and top-1 weights applied to x."""
    _check_grads(name, AWKWARD, "bfloat16", chunk_size=2)
    top1 = Problem("top1_T5", 5, topk=1)
    _check_grads(name, top1, "bfloat16", apply_router_weight_on_input=True)


@pytest.mark.parametrize("argument", ["w1", "w2", "w1_scale", "w2_scale"])
def test_a_gradient_to_fp8_weights_or_scales_raises_naming_it(argument):
    x, w1, w2, weights, ids, expert_map, scales = _inputs(AWKWARD, "fp8")
    arrays = {k: jnp.asarray(v) for k, v in dict(w1=w1, w2=w2, **scales).items()}

    def loss(a):
        out = fused_moe(
            hidden_states=jnp.asarray(x),
            topk_weights=jnp.asarray(weights),
            topk_ids=jnp.asarray(ids),
            expert_map=jnp.asarray(expert_map),
            experts="xla",
            **{**arrays, argument: a},
        )
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(TypeError, match=rf"with respect to {argument}: gradients through float8"):
        jax.grad(loss)(arrays[argument])


def test_the_gemms_refuse_gradients_to_fp8_operands_naming_them():
    """Below the layer: FP8 weights (and their scales) and FP8 rows are held constant."""
    rng = np.random.default_rng(oracles.seed("frozen_fp8_gemms"))
    w, w_scales = (
        jnp.asarray(a) for a in oracles.per_block_quant_fp8(rng.standard_normal((2, 128, 128)))
    )
    x = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    ids, ends = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 16), jnp.array([16, 32], jnp.int32)
    xq, x_scales = quant.per_token_group_quant_fp8(x)

    def contiguous(x, w, w_scales, x_scales=None):
        y = grouped_gemm_contiguous(
            GEMMS.get("xla"), x, w, ids, ends, x_scales=x_scales, w_scales=w_scales,
            alignment=16, out_dtype=jnp.float32,
        )  # fmt: skip
        return y.sum()

    def masked(x, w, w_scales):
        y = grouped_gemm_masked(
            GEMMS.get("xla"), x.reshape(2, 16, 128), w, jnp.array([16, 3]), w_scales=w_scales,
            out_dtype=jnp.float32,
        )  # fmt: skip
        return y.sum()

    for fn, argnum, args, name in [
        (contiguous, 1, (x, w, w_scales), "w"),
        (contiguous, 2, (x, w, w_scales), "w_scales"),
        (contiguous, 0, (xq, w, w_scales, x_scales), "x"),
        (masked, 1, (x, w, w_scales), "w"),
    ]:
        with pytest.raises(TypeError, match=rf"with respect to {name}: "):
            jax.grad(fn, argnums=argnum)(*args)
    dx = jax.grad(contiguous)(x, w, w_scales)  # float rows: a gradient
    assert dx.shape == x.shape and bool(jnp.any(dx != 0))


def test_flax_moe_with_fp8_experts_passes_gradients_to_the_router_and_x():
    """nnx.grad of a loss with respect to the router kernel and the tokens of an FP8 layer,
    against the float64 softmax-top-k router (renormalized, the layer's default) feeding the
    float64 MoE on the dequantized weights; the expert choice (discrete) is the layer's."""
    layer = MoE(
        256, 128, num_experts=4, topk=2, quant_config=quant.Fp8BlockQuant(), experts="xla",
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    rng = np.random.default_rng(oracles.seed("frozen_fp8_flax"))
    x = jnp.asarray(rng.standard_normal((6, 256)), jnp.float32)
    probe = rng.standard_normal((6, 256))

    def loss(layer, x):
        return jnp.sum(layer(x) * jnp.asarray(probe, jnp.float32))

    router = nnx.DiffState(0, nnx.PathContains("router_kernel"))
    grads, dx = nnx.jit(nnx.grad(loss, argnums=(router, 1)))(layer, x)
    with pytest.raises(TypeError, match=r"with respect to w1: "):
        nnx.grad(loss)(layer, x)  # every Param, the FP8 experts' too

    ids = np.asarray(layer.route(x)[1])
    w1f, w2f = _dequantized(
        layer.w1[...],
        layer.w2[...],
        dict(w1_scale=layer.w1_scale[...], w2_scale=layer.w2_scale[...]),
    )
    with jax.enable_x64(True):

        def reference(kernel, x):
            probs = jax.nn.softmax(x @ kernel, axis=-1)
            weights = jnp.take_along_axis(probs, jnp.asarray(ids), axis=-1)
            weights = weights / weights.sum(axis=-1, keepdims=True)
            return jnp.sum(oracles.fused_moe_jnp(x, w1f, w2f, weights, ids) * jnp.asarray(probe))

        kernel = np.asarray(layer.router_kernel[...], np.float64)
        want_kernel, want_x = jax.grad(reference, argnums=(0, 1))(
            jnp.asarray(kernel), jnp.asarray(np.asarray(x, np.float64))
        )
    oracles.assert_grad_close("router_kernel", grads.router_kernel[...], want_kernel, TOL)
    oracles.assert_grad_close("x", dx, want_x, TOL)


GPU_PROBLEM = Problem(
    "gpu_T512", 512, topk=2, hidden=512, inter=256, num_experts=8, expert_map=None
)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["auto", "deep_gemm", "mosaic_fp8", "pallas", "deep_gemm_masked"])
def test_gpu_frozen_fp8_dgrads_match_the_float64_oracle(name):
    """The GPU kernels' FP8 dgrads (DeepGEMM's, Mosaic's, Pallas's) at 64 pairs per expert; on
    the contiguous layout the plan's dgrad is the named GEMM itself."""
    experts = resolve_experts(name)
    if hasattr(experts, "plan_for"):
        _, w1, w2, _, _, _, scales = _inputs(GPU_PROBLEM, "fp8")
        weights = ExpertWeights(*(jnp.asarray(a) for a in (w1, w2, *scales.values())))
        call = ExpertsCall(quant_config=quant.Fp8BlockQuant())
        p = experts.plan_for(weights, num_tokens=512, topk=2, x_dtype=jnp.bfloat16, call=call)
        assert [d.name for d in p.dgrads] == [p.gemm1.name, p.gemm2.name]
        assert name == "auto" or p.gemm1.name == name
    _check_grads(name, GPU_PROBLEM, "bfloat16")
