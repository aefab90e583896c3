"""Pallas grouped weight gradient (`moe_jax.kernels.wgrad`) against a float64 loop over rows, its
registration in `WGRADS`, its refusals, and (GPU) the compiled kernel in a training step.

Tolerances: the kernel sums each expert's rows in float32 in `block_m`-row steps, so float32
operands match the float64 oracle to float32 summation error (rtol/atol 1e-4 on unit-scale
products); bf16 output adds one bf16 rounding (1e-2 relative).

What interpret mode does not cover: its dots are XLA:CPU's, so Triton's tile order and the
Hopper MMA's accumulation are checked only by the GPU-marked tests (against the same loop).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax.kernels.wgrad  # noqa: F401  (registers "pallas", "pallas_interpret")
from moe_jax import grouped_gemm, grouped_gemm_backward, layouts
from moe_jax.registry import NoImplementationError

kw = sys.modules["moe_jax.kernels.wgrad"]  # the package re-exports a function of that name

IMPLS = [pytest.param("pallas_interpret"), pytest.param("pallas", marks=pytest.mark.gpu)]


def _layout(seed: int, *, num_tokens: int, topk: int, num_experts: int, k: int, alignment: int):
    """A permuted layout whose routing leaves an expert empty, with invalid and duplicate ids."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, num_experts + 1, (num_tokens, topk))
    ids[ids == 1] = 2  # expert 1 gets no rows
    ids[::5, 1 % topk] = ids[::5, 0]  # duplicate experts in a row
    x = jnp.asarray(rng.normal(size=(num_tokens, k)), jnp.float32)
    return layouts.permute_reference(
        x, jnp.asarray(ids, jnp.int32), num_experts=num_experts, alignment=alignment
    )


def _oracle(dy: np.ndarray, x: np.ndarray, expert_ids: np.ndarray, num_experts: int):
    """float64 dw[e] = sum over rows r with expert_ids[r] == e of outer(dy[r], x[r])."""
    dw = np.zeros((num_experts, dy.shape[1], x.shape[1]))
    for r, e in enumerate(expert_ids):
        if e >= 0:
            dw[e] += np.outer(dy[r], x[r])
    return dw


def _operands(lay, n: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    is_valid = np.asarray(lay.expert_ids)[:, None] >= 0
    dy = np.where(is_valid, rng.normal(size=(lay.rows.shape[0], n)), 0.0)
    dy = np.asarray(jnp.asarray(dy, dtype).astype(jnp.float32), np.float64)
    x = np.asarray(jnp.asarray(lay.rows, dtype).astype(jnp.float32), np.float64)
    return dy, x


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "config",
    [
        kw.WgradConfig(),
        kw.WgradConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2),
        kw.WgradConfig(block_m=32, block_n=64, block_k=16, num_warps=4, num_stages=4),
    ],
    ids=["default", "small", "wide-n"],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wgrad_matches_float64_loop(impl, config, dtype):
    num_experts, n, k, alignment = 5, 64, 48, 32
    lay = _layout(1, num_tokens=37, topk=3, num_experts=num_experts, k=k, alignment=alignment)
    dy, x = _operands(lay, n, dtype, seed=2)
    chosen = grouped_gemm_backward.WGRADS.select(
        impl,
        grouped_gemm_backward.wgrad_problem(
            jnp.asarray(dy, dtype),
            jnp.asarray(x, dtype),
            num_experts=num_experts,
            alignment=alignment,
        ),
    )
    dw = chosen.fn(
        jnp.asarray(dy, dtype),
        jnp.asarray(x, dtype),
        lay.expert_ids,
        lay.expert_ends,
        num_experts=num_experts,
        alignment=alignment,
        out_dtype=dtype,
        config=config,
    )
    want = _oracle(dy, x, np.asarray(lay.expert_ids), num_experts)
    got = np.asarray(dw.astype(jnp.float32), np.float64)
    assert np.all(got[1] == 0.0), "the empty expert's gradient must be written as zeros"
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    else:
        error = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert error <= 1e-2, error


def _problem(*, platform: str, num_pairs: int, num_experts: int = 4):
    return grouped_gemm.GemmProblem(
        layout="contiguous",
        n=64,
        k=64,
        num_experts=num_experts,
        num_pairs=num_pairs,
        x_dtype="bfloat16",
        w_dtype="bfloat16",
        platform=platform,
        alignment=16,
    )


def test_auto_takes_xla_on_the_cpu_and_names_run_what_they_name():
    wgrads = grouped_gemm_backward.WGRADS
    cpu = _problem(platform="cpu", num_pairs=64)
    assert wgrads.select("auto", cpu).name == "xla"
    assert wgrads.select("pallas_interpret", cpu).name == "pallas_interpret"
    with pytest.raises(NoImplementationError, match="needs an NVIDIA GPU"):
        wgrads.select("pallas", cpu)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(alignment=8), ValueError, "alignment=8"),
        (dict(n=24), ValueError, "N=24"),
        (dict(x_dtype=jnp.float16), TypeError, "dy.dtype"),
    ],
)
def test_wgrad_refuses_what_it_cannot_run(change, error, match):
    n = change.get("n", 32)
    alignment = change.get("alignment", 16)
    dy = jnp.zeros((32, n), jnp.float32)
    x = jnp.zeros((32, 16), change.get("x_dtype", jnp.float32))
    ends = jnp.array([16, 32], jnp.int32)
    with pytest.raises(error, match=match):
        kw.grouped_wgrad(
            dy,
            x,
            None,
            ends,
            num_experts=2,
            alignment=alignment,
            out_dtype=jnp.float32,
            interpret=True,
        )


def test_wgrad_problem_refusal_names_the_dimension():
    problem = grouped_gemm.GemmProblem(
        layout="contiguous",
        n=40,
        k=64,
        num_experts=2,
        num_pairs=8,
        x_dtype="bfloat16",
        w_dtype="bfloat16",
        platform="gpu",
        alignment=128,
    )
    assert "N=40" in kw.unsupported_reason(problem)


@pytest.mark.gpu
def test_gpu_training_step_with_the_pallas_wgrad():
    """bf16 gradients with wgrad="pallas" within 2e-2 of the float32 XLA backward (as every GPU
    backend's in test_grads)."""
    from moe_jax import fused_moe
    from moe_jax.contiguous_experts import ContiguousExperts

    rng = np.random.default_rng(41)
    t, h, inter, e = 512, 512, 256, 8
    x = jnp.asarray(rng.normal(size=(t, h)), jnp.bfloat16)
    w1 = jnp.asarray(rng.normal(size=(e, 2 * inter, h)) / 22, jnp.bfloat16)
    w2 = jnp.asarray(rng.normal(size=(e, h, inter)) / 16, jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, e, (t, 2)), jnp.int32)
    tw = jnp.asarray(rng.normal(size=(t, 2)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(t, h)), jnp.float32)

    def grads(experts, *weights):
        def loss(x, w1, w2, tw):
            return jnp.sum(
                fused_moe(x, w1, w2, tw, ids, experts=experts).astype(jnp.float32) * probe
            )

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*weights)

    got = grads(ContiguousExperts(gemm="deep_gemm", wgrad="pallas"), x, w1, w2, tw)
    reference = ContiguousExperts(gemm="xla", permute_impl="xla", act_quant_impl="xla", wgrad="xla")
    with jax.default_matmul_precision("highest"):
        want = grads(reference, *(a.astype(jnp.float32) for a in (x, w1, w2)), tw)
    for name, g, w in zip(("x", "w1", "w2", "topk_weights"), got, want, strict=True):
        g, w = g.astype(jnp.float32), w.astype(jnp.float32)
        error = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
        assert error <= 2e-2, f"d{name}: relative error {error:.2e}"
