"""What the contract suites share (tests/test_contract_*.py, and the per-op modules that are
contract suites): one pytest parameter per name a registry holds, and the skip, with the
implementation's own reason, of a name that cannot run the problem here.

Parametrizing from `registry.names()` (read at collection, after conftest registered the
interpret-mode twins) gives a backend registered by name every test of its op; a compiled
kernel is collected everywhere and skips on a CPU with its `unsupported_reason`, so the same
test runs it on a GPU host.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import pytest


def runs_on_the_cpu_device(name: str) -> bool:
    """An interpret-mode twin, or a name built of XLA parts only ("xla", "xla_masked",
    "xla+xla_gathered"): on a GPU host, a `cpu_numerics` or `mosaic_interpret` test runs it on the
    CPU device (conftest.py). Every other name is a GPU implementation (or "auto")."""
    parts = name.removesuffix("_masked").split("+")
    return "interpret" in name or all(part in ("xla", "xla_gathered") for part in parts)


def _marks(name: str) -> list:
    marks = []
    # A Mosaic GPU kernel in interpret mode runs its simulated barriers as host callbacks: on a
    # GPU host such a test runs on the CPU device (conftest.py's `mosaic_interpret`).
    if "mosaic" in name and "interpret" in name:
        marks.append(pytest.mark.mosaic_interpret)
    # On a GPU host a GPU implementation keeps the GPU device in a `cpu_numerics` module (the
    # `gpu` marker, conftest.py); elsewhere it is left unmarked, to skip with its own reason.
    if not runs_on_the_cpu_device(name) and jax.default_backend() == "gpu":
        marks.append(pytest.mark.gpu)
    return marks


def name_params(names: Iterable[str]) -> list:
    """A pytest parameter per name (its id the name)."""
    return [pytest.param(name, id=name, marks=_marks(name)) for name in names]


def impl_params(registry) -> list:
    """A pytest parameter per name `registry` holds (`moe_jax.registry.Registry`)."""
    return name_params(registry.names())


def runs_or_skip(impl, problem):
    """`impl` when it runs `problem`; else the test skips with its `unsupported_reason`."""
    why = impl.unsupported_reason(problem)
    if why is not None:
        pytest.skip(f"{impl.name}: {why}")
    return impl
