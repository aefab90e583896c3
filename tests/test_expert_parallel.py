"""Expert parallelism on JAX collectives (`moe_jax.expert_parallel`).

The 8-rank runs happen in a subprocess (`ep_multidevice.py`, 8 CPU devices); the expectations are
computed here: single-device `fused_moe` on the same inputs with the dropped pairs removed, the
float64 loop `oracles.fused_moe`, and the drop/route counts from `oracles.ep_dispatch`; with FP8
weights held constant, the gradients of single-device `fused_moe` and `oracles.fused_moe_grads`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ep_multidevice as epm
import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import fused_moe
from moe_jax.ep_api import ep_fused_moe
from moe_jax.expert_parallel import EPConfig, expert_map_for_rank, send_slots

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ep") / "results.npz")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={epm.NUM_RANKS}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "ep_multidevice.py"), path],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode:
        pytest.fail(f"ep_multidevice.py failed:\n{proc.stdout}\n{proc.stderr[-6000:]}")
    with np.load(path) as f:
        return dict(f)


def on_the_ranks_platform():
    """The 8 ranks run on CPU devices (the subprocess), so their expectations are computed on
    the CPU too: the comparison checks the EP logic, not one platform's float32/FP8 rounding
    against another's (on a GPU host the default device is a GPU)."""
    return jax.default_device(jax.devices("cpu")[0])


def expected_with_fused_moe(case, inputs, keep):
    with on_the_ranks_platform():
        x, w1, w2, weights, ids, kwargs = epm.layer_args(case, inputs)
        ids = jnp.where(jnp.asarray(keep), ids, -1)  # the dropped pairs removed
        out = fused_moe(x, w1, w2, weights, ids, experts="xla", **kwargs)
        return np.asarray(out, np.float32)


def ep_dispatch(case, inputs):
    """`oracles.ep_dispatch` of a case: (keep, num_dropped, num_routed_per_rank)."""
    capacity = case.capacity_per_rank or case.tokens_per_rank * case.topk
    return oracles.ep_dispatch(
        inputs["topk_ids"], num_ranks=epm.NUM_RANKS, num_experts=case.num_experts, capacity=capacity
    )


@pytest.mark.parametrize("name", list(epm.CASES))
def test_ep_matches_fused_moe(ep_results, name):
    case = epm.CASES[name]
    inputs = epm.make_inputs(case)
    keep, dropped, routed = ep_dispatch(case, inputs)
    np.testing.assert_array_equal(ep_results[f"{name}/num_dropped"], dropped)
    np.testing.assert_array_equal(ep_results[f"{name}/num_routed_per_rank"], routed)
    if case.capacity_per_rank is not None:
        assert dropped.sum() > 0, "the case must overflow to test dropping"
    out = ep_results[f"{name}/out"]
    expected = expected_with_fused_moe(case, inputs, keep)
    tol = dict(rtol=2e-2, atol=2e-2) if case.fp8 else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, expected, **tol)
    if not case.fp8 and not case.weight_on_input:
        oracle = oracles.fused_moe(  # float64 inputs: no rounding anywhere
            inputs["x"].astype(np.float64),
            inputs["w1"],
            inputs["w2"],
            inputs["topk_weights"],
            np.where(keep, inputs["topk_ids"], -1),  # the dropped pairs removed
        )
        np.testing.assert_allclose(out, oracle, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", epm.GRAD_CASES)
def test_ep_gradients_through_frozen_fp8_experts(ep_results, name):
    """d<out, probe> / d(x, topk_weights) over 8 ranks with FP8 weights held constant, against
    single-device `fused_moe`'s with the dropped pairs removed (relative Frobenius 1e-2, measured
    3e-3 for the bf16 dx: the same quantized rows, the EP per-pair outputs rounded to bf16 before
    their sum) and the float64 oracle's on the dequantized weights (8e-2, measured 5e-2:
    tests/test_frozen_fp8_grads.py's tolerance). The forward under differentiation (float rows
    cross, the experts quantize them) equals the FP8 dispatch's."""
    case = epm.CASES[name]
    inputs = epm.make_inputs(case)
    keep = ep_dispatch(case, inputs)[0]
    probe = epm.probe(case)
    got = ep_results[f"{name}/dx"], ep_results[f"{name}/dweights"]
    with on_the_ranks_platform():
        x, w1, w2, weights, ids, kwargs = epm.layer_args(case, inputs)
        kept = jnp.where(jnp.asarray(keep), ids, -1)
        layer = lambda x, w: fused_moe(x, w1, w2, w, kept, experts="xla", **kwargs)  # noqa: E731
        single = jax.vjp(layer, x, weights)[1](jnp.asarray(probe, x.dtype))
        dequantized = (
            oracles.dequant_per_block(w1, kwargs["w1_scale"]),
            oracles.dequant_per_block(w2, kwargs["w2_scale"]),
        )
        local = oracles.local_ids(np.where(keep, inputs["topk_ids"], -1), case.num_experts)
        want_x, _, _, want_w = oracles.fused_moe_grads(x, *dequantized, weights, probe, local)
    for label, g, one, want in zip(
        ("x", "topk_weights"), got, single, (want_x, want_w), strict=True
    ):
        oracles.assert_grad_close(label, g, np.asarray(one.astype(jnp.float32), np.float64), 1e-2)
        oracles.assert_grad_close(label, g, want, 8e-2)
    np.testing.assert_array_equal(ep_results[f"{name}/vjp_out"], ep_results[f"{name}/out"])


def test_ep_dispatches_fp8_rows_unless_differentiated_and_refuses_w1_gradients(ep_results):
    assert "f8E4M3FN" in str(ep_results["fp8/all_to_all"])
    for key in ("fp8/grad_all_to_all", "fp8/grad_ragged"):  # the ragged VJP lowers too
        assert "bf16" in str(ep_results[key]) and "f8" not in str(ep_results[key]), key
    error = str(ep_results["fp8/w1_error"])
    assert error.startswith("a gradient with respect to w1: gradients through float8_e4m3fn")


def test_deep_ep_adapters_refuse_gradients_saying_what_to_do():
    from moe_jax import ContiguousExperts, MaskedExperts, ModularMoE, quant
    from moe_jax.interop import deep_ep_ht, deep_ep_ll
    from moe_jax.interop import deep_ep_layouts as dl

    problem = dl.DeepEPProblem(
        rank=0, num_ranks=8, num_experts=64, num_tokens=128, hidden=7168, num_topk=8
    )
    x, weights, ids = jnp.ones((2, 128)), jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32)
    w1, w2 = jnp.ones((2, 256, 128)) / 128, jnp.ones((2, 128, 128)) / 128
    (w1q, s1), (w2q, s2) = quant.per_block_quant_fp8(w1), quant.per_block_quant_fp8(w2)
    ht = deep_ep_ht.DeepEPHighThroughput(buffer=None, problem=problem)
    ht = ModularMoE(ht, ContiguousExperts())
    ll = ModularMoE(deep_ep_ll.DeepEPLowLatency(buffer=None, problem=problem), MaskedExperts())
    for loss in (
        lambda x: jnp.sum(ht(x, w1, w2, weights, ids)),
        lambda x: jnp.sum(ll(x, w1q, w2q, weights, ids, w1_scale=s1, w2_scale=s2)),
    ):
        with pytest.raises(TypeError, match=r"torch callbacks.*moe_jax\.ep_moe or ep_fused_moe"):
            jax.grad(loss)(x)


def test_ep_is_the_sum_of_vllm_expert_map_partial_sums(ep_results):
    # vLLM's EP: rank r computes fused_moe with its expert_map (others' experts contribute 0);
    # the token's output is the sum over ranks.
    case = epm.CASES["skewed"]
    per_rank = case.num_experts // epm.NUM_RANKS
    total = 0
    with on_the_ranks_platform():
        x, w1, w2, weights, ids, _ = epm.layer_args(case, epm.make_inputs(case))
        for r in range(epm.NUM_RANKS):
            own = slice(r * per_rank, (r + 1) * per_rank)
            total = total + np.asarray(
                fused_moe(
                    x,
                    w1[own],
                    w2[own],
                    weights,
                    ids,
                    experts="xla",
                    expert_map=expert_map_for_rank(case.num_experts, epm.NUM_RANKS, r),
                )
            )
    np.testing.assert_allclose(ep_results["skewed/out"], total, rtol=1e-5, atol=1e-5)


def test_transport_choice_and_errors(ep_results):
    np.testing.assert_array_equal(ep_results["auto/out"], ep_results["skewed/out"])
    assert bool(ep_results["ragged/hlo_has_ragged"])
    assert "split evenly over the 8 ranks" in str(ep_results["uneven/error"])


def test_send_slots_worked_example_and_oracle():
    slot, local, routed = send_slots(
        jnp.array([[3, 0], [2, 2]]), num_experts=4, num_ranks=2, capacity=2
    )
    assert slot.tolist() == [[2, 0], [3, -1]]
    assert local.tolist() == [[1, 0], [0, 0]]
    assert routed.tolist() == [1, 3]
    rng = np.random.default_rng(0)
    ids = rng.integers(-2, 18, size=(9, 4))
    slot, _, routed = send_slots(jnp.asarray(ids), num_experts=16, num_ranks=4, capacity=3)
    valid = (ids >= 0) & (ids < 16)
    np.testing.assert_array_equal(np.asarray(routed), np.bincount(ids[valid] // 4, minlength=4))
    seen = {}
    for t in range(9):
        for j in range(4):
            e = ids[t, j]
            if not 0 <= e < 16:
                assert slot[t, j] == -1
                continue
            d = e // 4
            pos = seen.get(d, 0)
            seen[d] = pos + 1
            assert slot[t, j] == (d * 3 + pos if pos < 3 else -1)


def test_expert_map_for_rank_matches_vllm():
    assert expert_map_for_rank(8, 4, 2).tolist() == [-1, -1, -1, -1, 0, 1, -1, -1]
    # The last rank takes the remainder.
    assert expert_map_for_rank(7, 3, 2).tolist() == [-1, -1, -1, -1, 0, 1, 2]
    assert expert_map_for_rank(7, 3, 0).tolist() == [0, 1, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="rank=3"):
        expert_map_for_rank(8, 3, 3)


def test_single_rank_mesh_overflow_is_reported():
    # One rank owns everything: capacity 3 of 8 pairs keeps (token, slot) order's first 3.
    mesh = jax.make_mesh((1,), ("ep",))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((2, 8, 8)) / 3, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((2, 8, 4)) / 2, jnp.float32)
    ids = jnp.array([[0, 1], [1, 1], [0, 0], [1, 0]])
    weights = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    out, stats = ep_fused_moe(
        mesh, x, w1, w2, weights, ids, axis_name="ep", capacity_per_rank=3, transport="padded"
    )
    assert stats.num_dropped.tolist() == [5]
    assert stats.num_routed_per_rank.tolist() == [[8]]
    keep = np.array([[1, 1], [1, 0], [0, 0], [0, 0]], bool)
    expected = fused_moe(x, w1, w2, weights, jnp.where(keep, ids, -1), experts="xla")
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


def test_config_errors():
    with pytest.raises(ValueError, match="unknown EP transport implementation 'nccl'"):
        EPConfig(axis_name="ep", transport="nccl")
    with pytest.raises(ValueError, match="capacity_per_rank=0"):
        EPConfig(axis_name="ep", capacity_per_rank=0)
    with pytest.raises(TypeError, match=r"capacity_per_rank=2\.0 must be an int"):
        EPConfig(axis_name="ep", capacity_per_rank=2.0)


def test_global_arguments_are_checked_before_the_split():
    """Errors name the shapes the caller passed: checked per rank, a missing w2_scale asked for
    a rank's (2, 1, 1) scales, and a [9, k] topk_ids failed inside the sharding."""
    from moe_jax import quant

    mesh = jax.make_mesh((1,), ("ep",))
    x = jnp.ones((8, 128), jnp.bfloat16)
    w1, s1 = quant.per_block_quant_fp8(jnp.ones((4, 256, 128)))
    w2, s2 = quant.per_block_quant_fp8(jnp.ones((4, 128, 128)))
    weights, ids = jnp.ones((8, 2)), jnp.zeros((8, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"pass w2_scale of shape \(4, 1, 1\)"):
        ep_fused_moe(mesh, x, w1, w2, weights, ids, axis_name="ep", w1_scale=s1)
    with pytest.raises(ValueError, match=r"topk_ids\.shape=\(9, 2\)"):
        bad_ids = jnp.zeros((9, 2), jnp.int32)
        ep_fused_moe(mesh, x, w1, w2, weights, bad_ids, axis_name="ep", w1_scale=s1, w2_scale=s2)


def test_unknown_mesh_axis_is_named():
    mesh = jax.make_mesh((1,), ("ep",))
    x, w1, w2 = jnp.ones((2, 8)), jnp.ones((2, 4, 8)), jnp.ones((2, 8, 2))
    with pytest.raises(ValueError, match=r"axis_name='tp' is not an axis of the mesh.*'ep'"):
        ep_fused_moe(
            mesh, x, w1, w2, jnp.ones((2, 1)), jnp.zeros((2, 1), jnp.int32), axis_name="tp"
        )
