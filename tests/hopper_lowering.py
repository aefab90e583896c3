"""`lower_for_hopper`: a kernel's CUDA lowering for an H200 (sm_90) in any process, for the tests
that read what a kernel lowers to (Triton IR, Mosaic's PTX) on a machine without a GPU.

JAX produces the lowering on a CPU machine when asked for the "cuda" platform. Pallas Triton also
asks which GPU it lowers for: jax 0.10 assumed sm_90 in a process without one, while jax >= 0.11
refuses unless an abstract device names the GPU, which this does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from moe_jax.kernels._triton import quiet_triton_deprecation

HOPPER = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")


def lower_for_hopper(fn: Callable[..., Any], *args: Any) -> jax.stages.Lowered:
    """`jax.jit(fn)` traced on `args` (arrays or `jax.ShapeDtypeStruct`s) and lowered for CUDA on
    an H200, with or without a GPU in this process. Nothing is compiled or run. The jitted
    function is made afresh, so each call traces again (and a `pallas_call(debug=True)` prints
    its Triton IR again)."""
    hopper_mesh = AbstractMesh((1,), ("device",), abstract_device=HOPPER)
    with use_abstract_mesh(hopper_mesh), quiet_triton_deprecation():
        return jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",))
