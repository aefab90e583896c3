"""The masked activation format through `ModularMoE`, on the CPU.

`MaskedPrepareFinalize` lays tokens out as DeepEP's low-latency dispatch does on one rank
([E_local, max_m, H] blocks in token order, counts per expert) and finalizes with the weighted sum
DeepEP's combine computes; `MaskedExperts` consumes those blocks. The pair must equal `fused_moe`:
exactly its "xla_masked" experts (the same blocks, built inside the experts from token rows),
the contiguous "xla" experts and the float64 oracle (`oracles.fused_moe`) within
`oracles.MOE_TOL`, with duplicate experts in a row, ids outside [0, E), expert_map holes and T=1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from oracles import assert_moe_close, moe_inputs

from moe_jax import MaskedExperts, ModularMoE, fused_moe
from moe_jax.prepare_finalize import MaskedPrepareFinalize

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

# (T, H, I, E, k): FP8 needs H and I multiples of 128.
SHAPES = {"float32": (7, 64, 32, 8, 3), "bfloat16": (7, 64, 32, 8, 3), "fp8": (5, 128, 128, 4, 2)}
EXPERTS = MaskedExperts(gemm="xla", act_quant_impl="xla")


def _run(inputs, *, experts=None, expert_map=None, max_m=None, **kwargs) -> np.ndarray:
    """ModularMoE(MaskedPrepareFinalize, MaskedExperts) jitted, or with `experts` `fused_moe`
    (expert_map an argument in both)."""
    if experts is None:
        pf = MaskedPrepareFinalize(
            num_experts=inputs.w1.shape[0],
            max_m=max_m,
            expert_map=None if expert_map is None else jnp.asarray(expert_map),
            quant_impl="xla",
        )
        layer = ModularMoE(pf, MaskedExperts(gemm="xla", act_quant_impl="xla", max_m=max_m))
    else:
        layer = functools.partial(fused_moe, experts=experts)
        if expert_map is not None:
            kwargs["expert_map"] = jnp.asarray(expert_map)
    scales = inputs.scales()
    return np.asarray(jax.jit(lambda *a: layer(*a, **scales, **kwargs))(*inputs.args()))


def check_against_references(inputs, dtype: str, *, expert_map=None, **kwargs) -> np.ndarray:
    """The masked format equals "xla_masked" bit for bit, and the oracle and "xla" within
    `oracles.assert_moe_close`'s tolerance."""
    out = _run(inputs, expert_map=expert_map, **kwargs)
    assert out.dtype == inputs.x.dtype and out.shape == inputs.x.shape
    same_blocks = _run(inputs, experts="xla_masked", expert_map=expert_map, **kwargs)
    np.testing.assert_array_equal(out, same_blocks)  # the same ops, built by the experts
    assert_moe_close(out, inputs.expected(expert_map=expert_map, **kwargs), dtype)
    contiguous = _run(inputs, experts="xla", expert_map=expert_map, **kwargs)
    assert_moe_close(out, np.asarray(contiguous, np.float64), dtype)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_masked_format_equals_fused_moe_with_duplicates_and_ids_out_of_range(dtype):
    shape = SHAPES[dtype]
    rng = np.random.default_rng(oracles.seed("masked", dtype))
    inputs = moe_inputs(shape, dtype, rng, id_low=-2, id_high=shape[3] + 2)
    inputs.topk_ids[0, :2] = 1  # a duplicate expert in a row
    inputs.topk_ids[1] = [-1, shape[3], -5][: shape[4]]  # routed nowhere: stays zero
    out = check_against_references(inputs, dtype)
    assert not out[1].astype(np.float32).any()


def test_masked_format_with_expert_map_holes():
    """10 global experts, 4 local ones scattered over the map; ids also below 0 and >= 10."""
    expert_map = np.array([-1, 2, -1, -1, 0, 3, -1, 1, -1, -1], np.int32)
    inputs = moe_inputs(
        (7, 32, 16, 4, 3), "float32", np.random.default_rng(5), id_low=-2, id_high=13
    )
    inputs.topk_ids[0] = [4, 4, 5]  # duplicate local expert
    inputs.topk_ids[1] = [0, 2, 12]  # nothing local
    out = check_against_references(inputs, "float32", expert_map=expert_map)
    assert not out[1].any() and np.abs(out).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_masked_format_one_token(dtype):
    _, h, i, e, _ = SHAPES[dtype]
    rng = np.random.default_rng(oracles.seed("T1", dtype))
    check_against_references(moe_inputs((1, h, i, e, 2), dtype, rng, id_high=e + 2), dtype)


def test_masked_format_router_weight_on_input():
    inputs = moe_inputs((7, 32, 16, 4, 1), "float32", np.random.default_rng(11))
    inputs.topk_weights = np.abs(inputs.topk_weights) * 3.0
    check_against_references(inputs, "float32", apply_router_weight_on_input=True)


def test_masked_format_max_m_drops_as_masked_experts_do():
    """max_m=2 < T: rows past the second of an expert are dropped in token order, as
    MaskedExperts(max_m=2) does on token rows."""
    inputs = moe_inputs((7, 32, 16, 4, 2), "float32", np.random.default_rng(13))
    out = _run(inputs, max_m=2)
    want = _run(inputs, experts=MaskedExperts(gemm="xla", act_quant_impl="xla", max_m=2))
    np.testing.assert_array_equal(out, want)
    assert not np.allclose(out, _run(inputs, experts="xla_masked"))  # something was dropped


def test_masked_format_gradients_equal_the_experts_own_layout():
    """d(out . g)/d(x, w1, w2, weights) through the masked format equal fused_moe's with the
    xla_masked experts (the same blocks built inside the experts)."""
    inputs = moe_inputs(
        (5, 32, 16, 4, 2), "float32", np.random.default_rng(17), id_low=-2, id_high=6
    )
    x, w1, w2, weights, ids = inputs.x, inputs.w1, inputs.w2, inputs.topk_weights, inputs.topk_ids
    ids[0] = [2, 2]
    g = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.float32)
    layer = ModularMoE(MaskedPrepareFinalize(num_experts=4, quant_impl="xla"), EXPERTS)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, jnp.asarray(ids)) * g)

    def reference(x, w1, w2, weights, ids):
        return fused_moe(x, w1, w2, weights, ids, experts="xla_masked")

    arrays = tuple(map(jnp.asarray, (x, w1, w2, weights)))
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*arrays)
    want = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2, 3)))(*arrays)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got[1])).max() > 0


def test_masked_tokens_are_not_chunked_and_the_map_goes_to_the_prepare():
    masked = MaskedPrepareFinalize(num_experts=4)  # with ContiguousExperts: test_contract_modular
    with pytest.raises(ValueError, match="chunk_size=8 but MaskedPrepareFinalize delivers masked"):
        ModularMoE(masked, EXPERTS, chunk_size=8)
    layer = ModularMoE(masked, EXPERTS)
    inputs = moe_inputs((3, 32, 16, 4, 2), "float32", np.random.default_rng(19))
    with pytest.raises(ValueError, match=r"MaskedPrepareFinalize\(expert_map=...\)"):
        layer(*inputs.args(), expert_map=jnp.arange(4))
