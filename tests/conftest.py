"""Shared pytest setup.

- GPU-marked tests run only where JAX's default backend is a GPU.
- Rank promotion raises (as in Flax's CI) unless the environment says otherwise.
- Tests import the installed package (`moe_jax`, `moe_jax.kernels`, `moe_jax.interop`) and the
  float64 oracles beside them (`oracles`), never the top-level `kernels`/`interop` folders.
- float32 on GPUs: XLA runs float32 dots in TF32 unless asked otherwise (about 5e-4 relative
  error), and the tests hold float32 to float64 oracles at 1e-5, so every test runs inside
  `jax.default_matmul_precision("highest")`. The library honours that setting; a test of the
  default itself carries the marker `default_matmul_precision` and runs without it.
- Tests marked `cpu_numerics` hold XLA pipelines to vLLM's rounding bit for bit (or at float32
  tolerance). XLA:GPU's float32 division is not correctly rounded and its transcendentals and
  FP8 dots differ, so on a GPU host they run on the CPU device (`jax.default_device`, which the
  registries' "auto" follows); their GPU-marked parameters, the compiled kernels, stay on the GPU.
- Tests marked `mosaic_interpret` run a Mosaic GPU kernel in interpret mode, whose simulated
  shared memory and barriers run as host callbacks: on an H200 host's GPU device one such test
  did not finish in 120 s, against 3.6 s on its CPU device (2026-12-03). On GPU hosts they run on
  the CPU device too; their GPU-marked parameters stay on the GPU.
- The kernels' interpret-mode backends ("pallas_interpret" and the like), CPU test vehicles that
  production registries do not list, are registered for every test (`interpret_backends.py`).
- `MOE_JAX_TEST_LOG=FILE` appends a line when each test starts and when it ends (the plugin
  tests/suite_log.py), so a run stopped by a time limit still says which tests were running and
  which took longest: `python3 scripts/test_log.py FILE` reads it.
"""

import os
import sys

os.environ.setdefault("JAX_NUMPY_RANK_PROMOTION", "raise")

# `python -m pytest` puts the working directory (the repository root) first on sys.path, which
# makes the kernels/ and interop/ folders importable as top-level packages. transformers probes
# for a `kernels` distribution (Hugging Face's kernel hub) and then imported ours that way, which
# ran every kernel module a second time (tests/test_architecture.py caught it). The tests import
# the installed package only, so the root leaves sys.path before anything else is imported.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

import jax  # noqa: E402
import pytest  # noqa: E402
from interpret_backends import register_interpret_backends  # noqa: E402
from suite_log import pytest_runtest_protocol  # noqa: E402, F401 (MOE_JAX_TEST_LOG's hook)


def pytest_configure(config):
    register_interpret_backends()


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (JAX default backend is not 'gpu')")
    for item in items:
        # The marker, not `item.keywords`: a parameter id such as "gpu" is a keyword too.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


CPU_DEVICE_MARKERS = ("cpu_numerics", "mosaic_interpret")  # run on the CPU device on GPU hosts


@pytest.fixture(autouse=True)
def _cpu_device_tests_on_the_cpu_device(request):
    node = request.node
    if (
        jax.default_backend() == "cpu"
        or all(node.get_closest_marker(name) is None for name in CPU_DEVICE_MARKERS)
        or node.get_closest_marker("gpu") is not None
    ):
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def _highest_matmul_precision(request):
    if request.node.get_closest_marker("default_matmul_precision") is not None:
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
