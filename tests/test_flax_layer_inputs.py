"""moe_jax.flax_layer.MoE refuses bad construction arguments and inputs at once, naming them."""

import jax
import jax.numpy as jnp
import pytest

nnx = pytest.importorskip("flax.nnx", reason="moe_jax.flax_layer needs the [flax] extra")

from moe_jax.flax_layer import MoE  # noqa: E402


def _layer(**kwargs):
    return MoE(16, 8, num_experts=4, topk=2, rngs=nnx.Rngs(0), **kwargs)


def test_unknown_experts_name_fails_at_construction():
    with pytest.raises(ValueError, match=r"unknown experts 'nonexistent'.*auto"):
        _layer(experts="nonexistent")


@pytest.mark.parametrize("chunk_size", [4.5, 0, True])
def test_bad_chunk_size_fails_at_construction(chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        _layer(chunk_size=chunk_size)


def test_integer_tokens_are_refused_not_silently_cast():
    with pytest.raises(TypeError, match=r"x\.dtype=int32.*astype"):
        _layer()(jnp.ones((3, 16), jnp.int32))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(topk=2.0), r"topk=2\.0 must be an int"),
        (dict(num_experts=4.0), r"num_experts=4\.0 must be an int"),
        (dict(dtype=jnp.int32), r"dtype=int32"),
        (dict(dtype=jnp.float8_e4m3fn), r"dtype=float8_e4m3fn"),
        (dict(param_dtype=jnp.int8), r"param_dtype=int8"),
    ],
)
def test_bad_types_fail_at_construction_naming_the_argument(kwargs, match):
    args = {**dict(hidden_size=16, intermediate_size=8, num_experts=4, topk=2), **kwargs}
    with pytest.raises(TypeError, match=match):
        MoE(**args, rngs=nnx.Rngs(0))


def test_float64_is_refused_naming_x_or_param_dtype():
    """float64 would run in float32 inside; the error names what the user passed."""
    with jax.enable_x64(True):
        with pytest.raises(TypeError, match=r"param_dtype=float64"):
            _layer(param_dtype=jnp.float64)
        with pytest.raises(TypeError, match=r"x\.dtype=float64"):
            _layer()(jnp.ones((3, 16), jnp.float64))


def test_grouped_router_counts_must_be_ints():
    from moe_jax.flax_layer import RouterConfig

    with pytest.raises(TypeError, match=r"num_expert_group=2\.0 must be an int"):
        RouterConfig(num_expert_group=2.0, topk_group=1)
    with pytest.raises(TypeError, match=r"topk_group=True must be an int, not a bool"):
        RouterConfig(num_expert_group=2, topk_group=True)
