"""The masked activation format through `ModularMoE`, on the CPU.

`MaskedPrepareFinalize` lays tokens out as DeepEP's low-latency dispatch does on one rank
([E_local, max_m, H] blocks in token order, counts per expert) and finalizes with the weighted sum
DeepEP's combine computes; `MaskedExperts` consumes those blocks. The pair must equal `fused_moe`:
exactly its "xla_masked" experts (the same blocks, built inside the experts from token rows),
the contiguous "xla" experts and the float64 oracle (`oracles.fused_moe`) within the tolerances
below, with duplicate experts in a row, ids outside [0, E), expert_map holes and T=1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import ContiguousExperts, MaskedExperts, ModularMoE, fused_moe
from moe_jax.prepare_finalize import MaskedPrepareFinalize

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

# Against the oracle rounded to the output dtype (outputs are O(1)), as tests/test_fused_moe.py:
# float32 to its rounding; bf16 and FP8 to ~2 bf16 ulps (one flipped intermediate rounding). FP8
# also allows one row per call up to 6e-2: a float32-vs-float64 GEMM1 sum can flip one bf16
# intermediate, whose requantization moves one FP8 code by 6%.
TOL = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
    "fp8": dict(rtol=1.6e-2, atol=1.6e-2),
}
FP8_LOOSE_TOL = dict(rtol=6e-2, atol=6e-2)
# (T, H, I, E, k): FP8 needs H and I multiples of 128.
SHAPES = {"float32": (7, 64, 32, 8, 3), "bfloat16": (7, 64, 32, 8, 3), "fp8": (5, 128, 128, 4, 2)}
EXPERTS = MaskedExperts(gemm="xla", act_quant_impl="xla")


def make_inputs(dtype: str, shape, *, seed: int, id_low: int = -2, id_high: int | None = None):
    """Tokens, weights and routing: ids with duplicates from [id_low, id_high) (default E + 2),
    normal router weights (negative ones included)."""
    t, h, i, e, k = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h)).astype(np.float32)
    w1 = (rng.standard_normal((e, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32)
    scales = {}
    if dtype == "fp8":
        x = x.astype(oracles.BF16)
        w1, scales["w1_scale"] = oracles.per_block_quant_fp8(w1)
        w2, scales["w2_scale"] = oracles.per_block_quant_fp8(w2)
    elif dtype == "bfloat16":
        x, w1, w2 = (a.astype(oracles.BF16) for a in (x, w1, w2))
    ids = rng.integers(id_low, e + 2 if id_high is None else id_high, (t, k)).astype(np.int32)
    weights = rng.standard_normal((t, k)).astype(np.float32)
    return x, w1, w2, weights, ids, scales


def masked_layer(x, w1, w2, weights, ids, scales, *, expert_map=None, max_m=None, **kwargs):
    """ModularMoE(MaskedPrepareFinalize, MaskedExperts), jitted."""
    pf = MaskedPrepareFinalize(
        num_experts=w1.shape[0],
        max_m=max_m,
        expert_map=None if expert_map is None else jnp.asarray(expert_map),
        quant_impl="xla",
    )
    layer = ModularMoE(pf, MaskedExperts(gemm="xla", act_quant_impl="xla", max_m=max_m))
    fn = jax.jit(lambda *a, **s: layer(*a, **s, **kwargs))
    arrays = (x, w1, w2, weights, ids)
    return np.asarray(
        fn(*map(jnp.asarray, arrays), **{n: jnp.asarray(s) for n, s in scales.items()})
    )


def reference_layers(x, w1, w2, weights, ids, scales, *, experts, expert_map=None, **kwargs):
    """fused_moe with `experts`, jitted (expert_map as an argument, like the masked layer's)."""
    fn = jax.jit(lambda *a, **s: fused_moe(*a, **s, experts=experts, **kwargs))
    extra = {n: jnp.asarray(s) for n, s in scales.items()}
    if expert_map is not None:
        extra["expert_map"] = jnp.asarray(expert_map)
    return np.asarray(fn(*map(jnp.asarray, (x, w1, w2, weights, ids)), **extra))


def assert_close(out, ref, dtype: str) -> None:
    out = np.asarray(out, np.float64)
    if dtype != "fp8":
        np.testing.assert_allclose(out, ref, **TOL[dtype])
        return
    tol = TOL["fp8"]
    bad_rows = np.flatnonzero((np.abs(out - ref) > tol["atol"] + tol["rtol"] * np.abs(ref)).any(-1))
    assert len(bad_rows) <= 1, f"rows {bad_rows} exceed {tol}"
    np.testing.assert_allclose(out, ref, **FP8_LOOSE_TOL)


def check_against_references(args, dtype: str, *, expert_map=None, **kwargs) -> np.ndarray:
    x, w1, w2, weights, ids, scales = args
    out = masked_layer(*args, expert_map=expert_map, **kwargs)
    assert out.dtype == x.dtype and out.shape == x.shape
    same_blocks = reference_layers(*args, experts="xla_masked", expert_map=expert_map, **kwargs)
    np.testing.assert_array_equal(out, same_blocks)  # the same ops, built by the experts
    ref = oracles.fused_moe(x, w1, w2, weights, ids, expert_map=expert_map, **scales, **kwargs)
    ref = oracles.round_to(ref, x.dtype)
    assert_close(out, ref, dtype)
    contiguous = reference_layers(*args, experts="xla", expert_map=expert_map, **kwargs)
    assert_close(out, np.asarray(contiguous, np.float64), dtype)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_masked_format_equals_fused_moe_with_duplicates_and_ids_out_of_range(dtype):
    args = make_inputs(dtype, SHAPES[dtype], seed=oracles.seed("masked", dtype))
    ids, num_experts = args[4], args[1].shape[0]
    ids[0, :2] = 1  # a duplicate expert in a row
    ids[1] = [-1, num_experts, -5][: ids.shape[1]]  # routed nowhere: stays zero
    out = check_against_references(args, dtype)
    assert not out[1].astype(np.float32).any()


def test_masked_format_with_expert_map_holes():
    """10 global experts, 4 local ones scattered over the map; ids also below 0 and >= 10."""
    expert_map = np.array([-1, 2, -1, -1, 0, 3, -1, 1, -1, -1], np.int32)
    args = make_inputs("float32", (7, 32, 16, 4, 3), seed=5, id_low=-2, id_high=13)
    args[4][0] = [4, 4, 5]  # duplicate local expert
    args[4][1] = [0, 2, 12]  # nothing local
    out = check_against_references(args, "float32", expert_map=expert_map)
    assert not out[1].any() and np.abs(out).max() > 0.1


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_masked_format_one_token(dtype):
    t, h, i, e, _ = SHAPES[dtype]
    args = make_inputs(dtype, (1, h, i, e, 2), seed=oracles.seed("T1", dtype), id_low=0)
    check_against_references(args, dtype)


def test_masked_format_router_weight_on_input():
    args = make_inputs("float32", (7, 32, 16, 4, 1), seed=11, id_low=0, id_high=4)
    args = (*args[:3], np.abs(args[3]) * 3.0, *args[4:])
    check_against_references(args, "float32", apply_router_weight_on_input=True)


def test_masked_format_max_m_drops_as_masked_experts_do():
    """max_m=2 < T: rows past the second of an expert are dropped in token order, as
    MaskedExperts(max_m=2) does on token rows."""
    args = make_inputs("float32", (7, 32, 16, 4, 2), seed=13, id_low=0, id_high=4)
    out = masked_layer(*args, max_m=2)
    want = reference_layers(*args, experts=MaskedExperts(gemm="xla", act_quant_impl="xla", max_m=2))
    np.testing.assert_array_equal(out, want)
    full = reference_layers(*args, experts="xla_masked")
    assert not np.allclose(out, full)  # something was dropped


def test_masked_format_gradients_equal_the_experts_own_layout():
    """d(out . g)/d(x, w1, w2, weights) through the masked format equal fused_moe's with the
    xla_masked experts (the same blocks built inside the experts)."""
    x, w1, w2, weights, ids, _ = make_inputs("float32", (5, 32, 16, 4, 2), seed=17)
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


def test_formats_must_match_and_masked_tokens_are_not_chunked():
    masked = MaskedPrepareFinalize(num_experts=4)
    with pytest.raises(
        ValueError, match="delivers the masked activation format but ContiguousExperts"
    ):
        ModularMoE(masked, ContiguousExperts(gemm="xla"))
    with pytest.raises(ValueError, match="chunk_size=8 but MaskedPrepareFinalize delivers masked"):
        ModularMoE(masked, EXPERTS, chunk_size=8)
    layer = ModularMoE(masked, EXPERTS)
    x, w1, w2, weights, ids, _ = make_inputs("float32", (3, 32, 16, 4, 2), seed=19)
    with pytest.raises(ValueError, match=r"MaskedPrepareFinalize\(expert_map=...\)"):
        layer(x, w1, w2, weights, ids, expert_map=jnp.arange(4))
