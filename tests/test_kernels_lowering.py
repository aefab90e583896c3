"""`moe_jax.kernels.lowering.lower_for_hopper`: a Pallas Triton kernel lowers for sm_90 on a
machine without a GPU (jax >= 0.11 refuses that without an abstract device), and the result is a
CUDA lowering, not the CPU one."""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from moe_jax.kernels import _triton
from moe_jax.kernels.lowering import lower_for_hopper


def _double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def _kernel_call(x, *, debug: bool = False):
    return pl.pallas_call(
        _double,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
        debug=debug,
    )(x)


SPEC = jax.ShapeDtypeStruct((16, 128), jnp.float32)


def test_a_triton_kernel_lowers_for_cuda_on_any_machine():
    assert "__gpu$xla.gpu.triton" in lower_for_hopper(_kernel_call, SPEC).as_text()


def test_each_call_traces_afresh(capsys):
    """The tools read Pallas's printed IR, so a second lowering of the same function must print
    it again (`jax.jit` of the function itself would reuse its first trace)."""
    fn = functools.partial(_kernel_call, debug=True)
    for _ in range(2):
        capsys.readouterr()
        lower_for_hopper(fn, SPEC)
        assert "tt.func" in capsys.readouterr().out
