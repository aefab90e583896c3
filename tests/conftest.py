"""Shared pytest setup.

- GPU-marked tests run only where JAX's default backend is a GPU.
- Rank promotion raises (as in Flax's CI) unless the environment says otherwise.
- Tests import the installed package (`moe_jax`, `moe_jax.kernels`, `moe_jax.interop`) and the
  float64 oracles beside them (`oracles`), never the top-level `kernels`/`interop` folders.
- float32 on GPUs: XLA runs float32 dots in TF32 unless asked otherwise; a test that holds float32
  to float64 oracles sets `jax.default_matmul_precision("highest")` itself.
"""

import os

os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX default backend is not 'gpu')")
    for item in items:
        # The marker, not `item.keywords`: a parameter id such as "gpu" is a keyword too.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
