"""moe_jax.flax_layer.MoE: fused_moe parity (eager, jax.jit, nnx.jit), float64 oracles, errors.

Layers use `experts="xla"` where a test compares them with `fused_moe(experts="xla")` at float32
rounding (the layer's wiring, not a backend, is under test there); the float64-oracle test runs
the layer as users get it (`experts="auto"`). Every test runs float32 dots in full float32
(`jax.default_matmul_precision("highest")`): on GPUs XLA otherwise uses TF32, which misses these
tolerances (about 5e-4 relative on the H200)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

nnx = pytest.importorskip("flax.nnx", reason="moe_jax.flax_layer needs the [flax] extra")

import moe_jax  # noqa: E402
from moe_jax import quant  # noqa: E402
from moe_jax.flax_layer import MoE, RouterConfig  # noqa: E402


@pytest.fixture(autouse=True)
def _float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


SOFTMAX = RouterConfig()
GROUPED_BIAS = RouterConfig(
    scoring_func="sigmoid",
    num_expert_group=4,
    topk_group=2,
    use_correction_bias=True,
    routed_scaling_factor=2.5,
)
GROUPED = RouterConfig(num_expert_group=4, topk_group=2, renormalize=False)
ROUTERS = {"softmax": SOFTMAX, "grouped_bias": GROUPED_BIAS, "grouped": GROUPED}


@dataclasses.dataclass(frozen=True)
class Problem:
    num_tokens: int
    hidden: int
    inter: int
    num_experts: int
    topk: int


SMALL = Problem(num_tokens=24, hidden=64, inter=32, num_experts=8, topk=2)
FP8_SHAPE = Problem(num_tokens=16, hidden=128, inter=128, num_experts=8, topk=2)


def make_layer(p: Problem, router=SOFTMAX, seed=0, **kwargs) -> MoE:
    kwargs.setdefault("experts", "xla")
    layer = MoE(
        p.hidden,
        p.inter,
        num_experts=p.num_experts,
        topk=p.topk,
        router=router,
        rngs=nnx.Rngs(seed),
        **kwargs,
    )
    if layer.e_score_correction_bias is not None:  # zeros at init: make the bias matter
        bias = 0.3 * jax.random.normal(jax.random.PRNGKey(seed + 7), (p.num_experts,))
        layer.e_score_correction_bias.set_value(bias)
    return layer


def tokens(p: Problem, seed=1, dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (p.num_tokens, p.hidden), dtype)


def route_independently(layer: MoE, x) -> tuple[jax.Array, jax.Array]:
    """The router spelled out with moe_jax.routing on float32 logits, not via layer.route."""
    logits = jnp.dot(
        x.astype(jnp.float32),
        layer.router_kernel[...].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    r = layer.router
    if r.is_grouped:
        bias = layer.e_score_correction_bias
        return moe_jax.grouped_topk(
            logits,
            layer.topk,
            r.renormalize,
            r.num_expert_group,
            r.topk_group,
            scoring_func=r.scoring_func,
            e_score_correction_bias=None if bias is None else bias[...],
            routed_scaling_factor=r.routed_scaling_factor,
        )
    w, ids = moe_jax.fused_topk(logits, layer.topk, r.renormalize, r.scoring_func)
    return w * r.routed_scaling_factor, ids


def shared_oracle(x, w1, w2) -> np.ndarray:
    """float64 shared experts: `oracles.fused_moe` of one expert [2nI, H] / [H, nI] that every
    token picks with weight 1 (float64 x: no rounding anywhere)."""
    num_tokens = np.shape(x)[0]
    return oracles.fused_moe(
        np.asarray(x, np.float64),
        np.asarray(w1)[None],
        np.asarray(w2)[None],
        np.ones((num_tokens, 1)),
        np.zeros((num_tokens, 1), np.int32),
    )


def run(layer: MoE, x, mode: str):
    if mode == "eager":
        return layer(x)
    if mode == "nnx.jit":
        return nnx.jit(lambda m, x: m(x))(layer, x)
    graphdef, state = nnx.split(layer)
    return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)


@pytest.mark.parametrize("mode", ["eager", "jax.jit", "nnx.jit"])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_layer_matches_fused_moe(router, mode):
    layer = make_layer(SMALL, ROUTERS[router])
    x = tokens(SMALL)
    out = run(layer, x, mode)
    topk_weights, topk_ids = route_independently(layer, x)
    expected = moe_jax.fused_moe(
        x, layer.w1[...], layer.w2[...], topk_weights, topk_ids, experts="xla"
    )
    assert out.shape == x.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_layer_matches_float64_oracle(router):
    r = ROUTERS[router]
    layer = make_layer(SMALL, r, num_shared_experts=2, experts="auto")
    x = tokens(SMALL)
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router_kernel[...], np.float64)
    if r.is_grouped:
        bias = layer.e_score_correction_bias
        weights, ids = oracles.grouped_topk(
            logits.astype(np.float32),
            SMALL.topk,
            renormalize=r.renormalize,
            num_expert_group=r.num_expert_group,
            topk_group=r.topk_group,
            scoring_func=r.scoring_func,
            bias=None if bias is None else np.asarray(bias[...]),
            routed_scaling_factor=r.routed_scaling_factor,
        )
    else:
        weights, ids = oracles.fused_topk(logits, SMALL.topk, renormalize=r.renormalize)
    got_w, got_ids = layer.route(x)
    order = np.argsort(np.asarray(got_ids), axis=1), np.argsort(ids, axis=1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(got_ids), order[0], 1), np.take_along_axis(ids, order[1], 1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(got_w), order[0], 1),
        np.take_along_axis(weights, order[1], 1),
        rtol=1e-5,
    )
    expected = oracles.fused_moe(
        np.asarray(x), np.asarray(layer.w1[...]), np.asarray(layer.w2[...]), weights, ids
    )
    expected += shared_oracle(x, layer.shared_w1[...], layer.shared_w2[...])
    np.testing.assert_allclose(layer(x), expected, rtol=2e-4, atol=2e-5)


def test_shared_experts_add_a_dense_mlp():
    plain = make_layer(SMALL)
    shared = make_layer(SMALL, num_shared_experts=3)
    assert shared.shared_w1.shape == (2 * 3 * SMALL.inter, SMALL.hidden)
    assert shared.shared_w2.shape == (SMALL.hidden, 3 * SMALL.inter)
    assert plain.shared_w1 is None and plain.shared_w2 is None
    # Same seed: routed params differ only because the shared ones take keys after them.
    x = tokens(SMALL)
    routed_only = moe_jax.fused_moe(
        x, shared.w1[...], shared.w2[...], *shared.route(x), experts="xla"
    )
    np.testing.assert_allclose(
        shared(x) - routed_only,
        shared_oracle(x, shared.shared_w1[...], shared.shared_w2[...]),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.cpu_numerics  # the layer's "auto" and experts="xla" are one pipeline on the CPU
@pytest.mark.parametrize("num_shared", [0, 1])
def test_quantize_matches_fused_moe_on_fp8_weights(num_shared):
    layer = make_layer(FP8_SHAPE, GROUPED_BIAS, num_shared_experts=num_shared)
    x = tokens(FP8_SHAPE)
    w1, w2 = layer.w1[...], layer.w2[...]
    float_out = layer(x)
    assert layer.quantize() is layer
    assert layer.is_fp8
    for name, w in (("w1", w1), ("w2", w2)):
        wq, scale = quant.per_block_quant_fp8(w)
        assert getattr(layer, name).dtype == jnp.float8_e4m3fn
        assert getattr(layer, f"{name}_scale").dtype == jnp.float32
        np.testing.assert_array_equal(
            np.asarray(getattr(layer, name)[...], np.float32), np.asarray(wq, np.float32)
        )
        np.testing.assert_array_equal(getattr(layer, f"{name}_scale")[...], scale)
    assert layer.w1_scale.shape == (8, 2, 1) and layer.w2_scale.shape == (8, 1, 1)
    out = nnx.jit(lambda m, x: m(x))(layer, x)
    expected = moe_jax.fused_moe(
        x,
        layer.w1[...],
        layer.w2[...],
        *route_independently(layer, x),
        w1_scale=layer.w1_scale[...],
        w2_scale=layer.w2_scale[...],
        experts="xla",
    )
    if num_shared:
        assert layer.shared_w1.dtype == jnp.float8_e4m3fn
        assert layer.shared_w1_scale.shape == (2, 1)
        n = FP8_SHAPE.num_tokens
        expected = expected + moe_jax.fused_moe(
            x,
            layer.shared_w1[...][None],
            layer.shared_w2[...][None],
            jnp.ones((n, 1)),
            jnp.zeros((n, 1), jnp.int32),
            w1_scale=layer.shared_w1_scale[...][None],
            w2_scale=layer.shared_w2_scale[...][None],
            experts="xla",
        )
    else:
        assert layer.shared_w1_scale is None
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # FP8 error against the float layer: a few percent, not garbage.
    rel = float(jnp.linalg.norm(out - float_out) / jnp.linalg.norm(float_out))
    assert 1e-4 < rel < 0.1


def test_fp8_at_construction_equals_quantize():
    built = make_layer(FP8_SHAPE, quant_config=quant.Fp8BlockQuant())
    later = make_layer(FP8_SHAPE).quantize()
    for name in ("w1", "w2", "w1_scale", "w2_scale", "router_kernel"):
        np.testing.assert_array_equal(
            np.asarray(getattr(built, name)[...], np.float32),
            np.asarray(getattr(later, name)[...], np.float32),
        )


def test_quantize_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        make_layer(SMALL).quantize()
    layer = make_layer(FP8_SHAPE).quantize()
    with pytest.raises(ValueError, match="already FP8"):
        layer.quantize()
    with pytest.raises(TypeError, match="Fp8BlockQuant"):
        make_layer(FP8_SHAPE).quantize("fp8")


def test_param_shapes_and_dtypes():
    p = SMALL
    layer = make_layer(p, GROUPED_BIAS, param_dtype=jnp.bfloat16, num_shared_experts=1)
    shapes = {k: (v.shape, v.dtype) for k, v in nnx.state(layer, nnx.Param).items()}
    bf16 = jnp.dtype(jnp.bfloat16)
    assert shapes == {
        "router_kernel": ((p.hidden, p.num_experts), bf16),
        "e_score_correction_bias": ((p.num_experts,), jnp.dtype(jnp.float32)),
        "w1": ((p.num_experts, 2 * p.inter, p.hidden), bf16),
        "w2": ((p.num_experts, p.hidden, p.inter), bf16),
        "shared_w1": ((2 * p.inter, p.hidden), bf16),
        "shared_w2": ((p.hidden, p.inter), bf16),
    }
    plain = make_layer(p)
    assert set(nnx.state(plain, nnx.Param)) == {"router_kernel", "w1", "w2"}
    assert plain.e_score_correction_bias is None and plain.w1_scale is None


def test_default_init_scales_by_fan_in():
    layer = MoE(256, 64, num_experts=4, topk=1, rngs=nnx.Rngs(0))
    # lecun_normal over the input (last) axis of the NT layout: std 1/sqrt(fan_in).
    assert abs(float(jnp.std(layer.w1[...])) - 256**-0.5) < 0.1 * 256**-0.5
    assert abs(float(jnp.std(layer.w2[...])) - 64**-0.5) < 0.1 * 64**-0.5


@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype, out_dtype",
    [
        (jnp.bfloat16, jnp.float32, None, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
        (jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_compute_dtype(x_dtype, param_dtype, dtype, out_dtype):
    layer = make_layer(SMALL, param_dtype=param_dtype, dtype=dtype)
    x = tokens(SMALL, dtype=x_dtype)
    out = layer(x)
    assert out.dtype == out_dtype
    tw, ti = route_independently(layer, x)  # router in float32 whatever the compute dtype
    expected = moe_jax.fused_moe(
        x.astype(out_dtype),
        layer.w1[...].astype(out_dtype),
        layer.w2[...].astype(out_dtype),
        tw,
        ti,
        experts="xla",
    )
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(expected, np.float32), rtol=1e-5, atol=1e-6
    )


def test_fp8_layer_infers_the_compute_dtype_from_x_alone():
    """As the `dtype` docstring says: with FP8 expert weights, None means x's dtype (not its
    result type with the float32 router params)."""
    layer = MoE(
        128, 128, num_experts=2, topk=1, quant_config=quant.Fp8BlockQuant(), rngs=nnx.Rngs(0)
    )
    x = jnp.ones((2, 128), jnp.bfloat16)
    assert layer.router_kernel[...].dtype == jnp.float32
    assert layer.compute_dtype(x) == jnp.bfloat16
    assert layer(x).dtype == jnp.bfloat16


def test_router_logits_are_float32_even_for_bf16_params():
    layer = make_layer(SMALL, param_dtype=jnp.bfloat16)
    logits = layer.router_logits(tokens(SMALL, dtype=jnp.bfloat16))
    assert logits.dtype == jnp.float32


def test_leading_dims_chunking_and_backends_agree():
    layer = make_layer(SMALL, GROUPED_BIAS, num_shared_experts=1)
    x = tokens(SMALL)
    ref = layer(x)
    np.testing.assert_allclose(layer(x.reshape(4, 6, -1)).reshape(ref.shape), ref, rtol=1e-6)
    chunked = make_layer(SMALL, GROUPED_BIAS, num_shared_experts=1, chunk_size=5)
    np.testing.assert_allclose(chunked(x), ref, rtol=1e-5, atol=1e-6)
    for experts in ("xla_masked", moe_jax.ContiguousExperts(gemm="xla", alignment=4)):
        other = make_layer(SMALL, GROUPED_BIAS, num_shared_experts=1, experts=experts)
        np.testing.assert_allclose(other(x), ref, rtol=1e-5, atol=1e-6)


def test_correction_bias_steers_choice():
    layer = make_layer(
        SMALL,
        RouterConfig(
            scoring_func="sigmoid", num_expert_group=1, topk_group=1, use_correction_bias=True
        ),
    )
    x = tokens(SMALL)
    layer.e_score_correction_bias.set_value(jnp.zeros(SMALL.num_experts).at[5].set(10.0))
    _, ids = layer.route(x)
    assert bool(jnp.all(jnp.any(ids == 5, axis=1)))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(router=RouterConfig(num_expert_group=3, topk_group=1)), ValueError, "multiple"),
        (dict(router=RouterConfig(num_expert_group=4, topk_group=5)), ValueError, "topk_group"),
        (
            dict(
                topk=1,
                router=RouterConfig(num_expert_group=8, topk_group=1, use_correction_bias=True),
            ),
            ValueError,
            "top-2",
        ),
        (dict(topk=9), ValueError, "topk=9"),
        (
            dict(topk=3, router=RouterConfig(num_expert_group=4, topk_group=1)),
            ValueError,
            "exceeds",
        ),
        (dict(num_shared_experts=-1), ValueError, "num_shared_experts"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(activation="relu"), ValueError, "unknown activation"),
        (dict(router={"scoring_func": "softmax"}), TypeError, "RouterConfig"),
    ],
)
def test_bad_config_raises(kwargs, error, match):
    args = dict(num_experts=8, topk=2, rngs=nnx.Rngs(0)) | kwargs
    with pytest.raises(error, match=match):
        MoE(64, 32, **args)


def test_router_config_and_call_errors():
    with pytest.raises(ValueError, match="unknown scoring_func"):
        RouterConfig(scoring_func="relu")
    with pytest.raises(ValueError, match="set both"):
        RouterConfig(num_expert_group=4)
    with pytest.raises(ValueError, match="grouped routing"):
        RouterConfig(use_correction_bias=True)
    with pytest.raises(ValueError, match="positive"):
        RouterConfig(num_expert_group=0, topk_group=0)
    with pytest.raises(TypeError, match="rngs"):
        MoE(64, 32, num_experts=8, topk=2)
    with pytest.raises(ValueError, match=r"H=64"):
        make_layer(SMALL)(jnp.ones((3, 32)))
    with pytest.raises(ValueError, match="unknown experts"):
        make_layer(SMALL, experts="cutlass")(tokens(SMALL))
