"""`moe_jax.kernels.lowering.lower_for_hopper`: a Pallas Triton kernel lowers for sm_90 on a
machine without a GPU (jax >= 0.11 refuses that without an abstract device), and the result is a
CUDA lowering, not the CPU one."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax.kernels import _triton
from moe_jax.kernels.lowering import HOPPER, lower_for_hopper


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _kernel_call(x):
    return pl.pallas_call(
        _double,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
    )(x)


def test_a_triton_kernel_lowers_for_cuda_on_any_machine():
    lowered = lower_for_hopper(_kernel_call, jax.ShapeDtypeStruct((16, 128), jnp.float32))
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text
    assert HOPPER.device_kind == "NVIDIA H200"


def test_each_call_traces_afresh(capsys):
    """The tools read Pallas's printed IR, so a second lowering must print it again."""

    def fn(x):
        return pl.pallas_call(
            _double,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
            debug=True,
        )(x)

    spec = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    for _ in range(2):
        capsys.readouterr()
        lower_for_hopper(fn, spec)
        assert "tt.func" in capsys.readouterr().out
