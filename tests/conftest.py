"""Shared pytest setup: GPU-marked tests run only where JAX's default backend is a GPU."""

import os

os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX default backend is not 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
