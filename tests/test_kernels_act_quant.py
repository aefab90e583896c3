"""FP8 group quantization kernels (alone and fused after act(gate) * up) vs references and
NumPy oracles."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import oracles
import pytest

from moe_jax.act_quant import act_and_quant_reference, group_quant_reference
from moe_jax.kernels.act_quant import (
    COMPILED_ACTIVATIONS,
    ActQuantConfig,
    act_and_quant,
    act_and_quant_reference,
    group_quant,
    group_quant_reference,
)

IMPLS = [
    pytest.param("reference"),
    pytest.param("pallas_interpret"),
    pytest.param("pallas", marks=pytest.mark.gpu),
]


@dataclasses.dataclass(frozen=True)
class Problem:
    rows: int
    inter: int
    dtype: str

    def __str__(self):
        return f"M{self.rows}-I{self.inter}-{self.dtype}"


PROBLEMS = [
    Problem(1, 128, "bfloat16"),
    Problem(77, 256, "bfloat16"),
    Problem(40, 384, "float32"),
    Problem(33, 128, "float16"),
    Problem(0, 128, "bfloat16"),
]


def oracle(h: np.ndarray, activation: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """NumPy: act in float64, rounded to dtype; product rounded to dtype; vLLM group quant."""
    h = h.astype(np.float64)
    inter = h.shape[1] // 2
    gate, up = h[:, :inter], h[:, inter:]
    if activation == "silu":
        act = gate / (1.0 + np.exp(-gate))
    else:
        from math import erf

        act = 0.5 * gate * (1.0 + np.vectorize(erf, otypes=[np.float64])(gate / np.sqrt(2.0)))
    act = act.astype(np.float32).astype(dtype).astype(np.float64)
    a = (act * up).astype(dtype).astype(np.float64)
    groups = a.reshape(a.shape[0], a.shape[1] // 128, 128)
    scales = (np.maximum(np.abs(groups).max(-1, initial=0.0), 1e-10) / 448.0).astype(np.float32)
    q = np.clip(groups / scales[..., None].astype(np.float64), -448, 448)
    q = q.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(a.shape), scales


def _run(impl, h, activation):
    if impl == "pallas" and activation not in COMPILED_ACTIVATIONS:
        with pytest.raises(NotImplementedError, match="Triton cannot lower erf"):
            act_and_quant(h, activation=activation)
        pytest.skip(f"{activation} has no compiled kernel (checked that it says so)")
    if impl == "reference":
        return act_and_quant_reference(h, activation=activation)
    return act_and_quant(h, activation=activation, interpret=impl == "pallas_interpret")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_act_and_quant_matches_oracle(impl, activation, problem):
    rng = np.random.default_rng(hash((str(problem), activation)) % 2**32)
    dtype = jnp.dtype(problem.dtype)
    h = jnp.asarray(rng.standard_normal((problem.rows, 2 * problem.inter)) * 4, dtype)
    q, scales = _run(impl, h, activation)
    q_ref, s_ref = oracle(np.asarray(h.astype(jnp.float32)), activation, dtype)
    assert q.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert q.shape == (problem.rows, problem.inter)
    assert scales.shape == (problem.rows, problem.inter // 128)
    # Scales within float32 rounding of the oracle's; q within one e4m3 step (float32 vs float64
    # activation and transcendental differences can move a value across a rounding boundary).
    np.testing.assert_allclose(np.asarray(scales), s_ref, rtol=1e-6)
    dq = np.asarray(q.astype(jnp.float32)) * np.repeat(np.asarray(scales), 128, axis=1)
    dq_ref = q_ref.astype(np.float32) * np.repeat(s_ref, 128, axis=1)
    one_step = 0.125 * np.abs(dq_ref) + np.repeat(s_ref, 128, axis=1) * 2.0**-9
    assert np.all(np.abs(dq - dq_ref) <= one_step)
    mismatched = np.sum(np.asarray(q.astype(jnp.float32)) != q_ref.astype(np.float32))
    assert mismatched <= 0.01 * q_ref.size


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_interpret_kernel_is_bitwise_reference(problem):
    rng = np.random.default_rng(7)
    h = jnp.asarray(rng.standard_normal((problem.rows, 2 * problem.inter)) * 4, problem.dtype)
    q, s = act_and_quant(h, config=ActQuantConfig(block_m=16), interpret=True)
    q_ref, s_ref = jax.jit(act_and_quant_reference)(h)
    np.testing.assert_array_equal(
        np.asarray(q.astype(jnp.float32)), np.asarray(q_ref.astype(jnp.float32))
    )
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of 256"):
        act_and_quant(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"x.shape=\(4, 200\)"):
        group_quant(jnp.zeros((4, 200), jnp.bfloat16))
    with pytest.raises(TypeError, match="h.dtype"):
        act_and_quant(jnp.zeros((4, 256), jnp.int32))
    with pytest.raises(ValueError, match="unknown activation"):
        act_and_quant(jnp.zeros((4, 256), jnp.bfloat16), activation="relu")
    with pytest.raises(ValueError, match="power of two"):
        ActQuantConfig(block_m=24)


def _assert_within_one_step(q, scales, q_ref, s_ref):
    """Scales to float32 rounding; codes equal but for rare one-step flips at rounding midpoints
    (Triton's float32 division is not always correctly rounded)."""
    np.testing.assert_allclose(np.asarray(scales), s_ref, rtol=1e-6)
    codes, codes_ref = np.asarray(q.astype(jnp.float32)), q_ref.astype(np.float32)
    step = 0.125 * np.abs(codes_ref) + 2.0**-9
    assert np.all(np.abs(codes - codes_ref) <= step)
    assert np.sum(codes != codes_ref) <= 0.01 * codes_ref.size


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_group_quant_matches_oracle(impl, problem):
    rng = np.random.default_rng(hash(str(problem)) % 2**32)
    x = jnp.asarray(rng.standard_normal((problem.rows, 2 * problem.inter)) * 5, problem.dtype)
    if impl == "reference":
        q, scales = group_quant_reference(x)
    else:
        q, scales = group_quant(x, interpret=impl == "pallas_interpret")
    q_ref, s_ref = oracles.per_token_group_quant_fp8(np.asarray(x.astype(jnp.float32)))
    assert q.shape == x.shape and scales.shape == (problem.rows, x.shape[1] // 128)
    if impl == "pallas":
        _assert_within_one_step(q, scales, q_ref, s_ref)
    else:  # the reference and interpret mode divide exactly: bitwise
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), q_ref.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(scales), s_ref)
