"""Training through the fast path: the FP8 recipe's gradients, and the Flax layer under `nnx.grad`
and an optax step.

FP8 recipe tolerance: relative Frobenius error <= 8e-2 per gradient against the float64 backward
of the unquantized layer (the issue's bound; 1x128 / 128x128 e4m3 quantization of x, w, dy and the
activation, straight-through). Measured here: about 2e-2 to 4e-2.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import fused_moe
from moe_jax.contiguous_experts import ContiguousExperts
from moe_jax.fp8_training import Fp8Training
from moe_jax.kernels.mosaic_fp8_gemm import MosaicFp8Gemm, MosaicFp8GemmConfig

FP8_TOL = 8e-2
T, H, I, E, K = 8, 128, 128, 4, 2  # noqa: E741 - DESIGN.md's dimension names

HAS_TORCH = importlib.util.find_spec("torch") is not None
NEEDS_TORCH = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (pip install 'moe_jax[torch]')")
RECIPE_EXPERTS = [
    pytest.param(ContiguousExperts(gemm="xla", recipe=Fp8Training(quant_impl="xla")), id="xla"),
    pytest.param(
        ContiguousExperts(gemm="torch", wgrad="torch", recipe=Fp8Training()),
        id="torch",
        marks=NEEDS_TORCH,
    ),
    # the Mosaic GPU FP8 GEMM (interpret mode) for the forward and the dgrad GEMMs, with
    # 128-column tiles so that H = I = 128 fit
    pytest.param(
        ContiguousExperts(
            gemm=MosaicFp8Gemm(MosaicFp8GemmConfig(block_n=64), interpret=True),
            recipe=Fp8Training(quant_impl="xla"),
        ),
        id="mosaic_fp8_interpret",
        marks=[pytest.mark.slow, pytest.mark.mosaic_interpret],
    ),
]


@pytest.mark.parametrize("experts", RECIPE_EXPERTS)
def test_fp8_recipe_gradients_within_fp8_tolerance(experts):
    rng = np.random.default_rng(21)
    x = np.asarray(jnp.asarray(rng.normal(size=(T, H)), jnp.bfloat16), np.float64)
    w1 = np.asarray(jnp.asarray(rng.normal(size=(E, 2 * I, H)) / 12, jnp.bfloat16), np.float64)
    w2 = np.asarray(jnp.asarray(rng.normal(size=(E, H, I)) / 12, jnp.bfloat16), np.float64)
    topk_weights = rng.normal(size=(T, K))
    probe = rng.normal(size=(T, H))
    ids = np.array([[0, 0], [1, 3], [2, 9], [3, 1], [-1, 2], [0, 1], [2, 2], [3, 0]])

    def loss(x, w1, w2, topk_weights):
        out = fused_moe(x, w1, w2, topk_weights, jnp.asarray(ids), experts=experts)
        return jnp.sum(out.astype(jnp.float32) * probe)

    args = [jnp.asarray(a, jnp.bfloat16) for a in (x, w1, w2)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args, jnp.asarray(topk_weights))
    local = oracles.local_ids(ids, E)
    expected = oracles.fused_moe_grads(x, w1, w2, topk_weights, probe, local)
    oracles.assert_grads_close(grads, expected, FP8_TOL)


def test_fp8_recipe_refuses_fp8_weights():
    w1 = jnp.zeros((E, 2 * I, H), jnp.float8_e4m3fn)
    w2 = jnp.zeros((E, H, I), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="already float8_e4m3fn"):
        fused_moe(
            jnp.ones((T, H), jnp.bfloat16),
            w1,
            w2,
            jnp.ones((T, 1)),
            jnp.zeros((T, 1), jnp.int32),
            w1_scale=jnp.ones((E, 2, 1)),
            w2_scale=jnp.ones((E, 1, 1)),
            experts=ContiguousExperts(gemm="xla", recipe=Fp8Training()),
        )


def _nnx():
    return pytest.importorskip("flax.nnx", reason="moe_jax.flax_layer needs the [flax] extra")


def _layer(experts, *, seed=0):
    nnx = _nnx()
    from moe_jax.flax_layer import MoE

    return MoE(16, 8, num_experts=4, topk=2, experts=experts, rngs=nnx.Rngs(seed))


def test_flax_layer_grad_matches_xla_masked_and_reaches_the_router():
    """nnx.grad through the contiguous torch path equals the one through the masked XLA path
    (different layouts, GEMMs and backward code), and the router kernel gets a gradient.

    torch's grouped GEMM takes float32 on the CPU only (bf16/FP8 on a GPU): off the CPU the
    contiguous side runs the XLA GEMM and wgrad (still a different layout and backward code),
    and so it does without torch installed.
    """
    nnx = _nnx()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)), jnp.float32)

    def loss(layer):
        return jnp.mean(layer(x) ** 2)

    gemm = "torch" if jax.default_backend() == "cpu" and HAS_TORCH else "xla"
    fast = nnx.grad(loss)(_layer(ContiguousExperts(gemm=gemm, wgrad=gemm, alignment=8)))
    masked = nnx.grad(loss)(_layer("xla_masked"))
    for name in ("router_kernel", "w1", "w2"):
        got, want = np.asarray(fast[name][...]), np.asarray(masked[name][...])
        assert np.abs(want).max() > 0, name
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=name)


def test_optax_step_decreases_the_loss():
    nnx = _nnx()
    optax = pytest.importorskip("optax", reason="the optimizer step needs optax (Flax installs it)")
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
    target = jnp.asarray(np.tanh(rng.normal(size=(32, 16))), jnp.float32)
    layer = _layer(ContiguousExperts(gemm="xla", alignment=8), seed=1)
    optimizer = nnx.Optimizer(layer, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def step(layer, optimizer):
        def loss_fn(layer):
            return jnp.mean((layer(x) - target) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(layer)
        optimizer.update(layer, grads)
        return loss

    losses = [float(step(layer, optimizer)) for _ in range(8)]
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], losses
