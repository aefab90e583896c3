"""moe_jax.flax_layer.MoE refuses bad construction arguments and inputs at once, naming them."""

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
