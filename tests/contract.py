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

import pytest


def _marks(name: str) -> list:
    # A Mosaic GPU kernel in interpret mode runs its simulated barriers as host callbacks: on a
    # GPU host such a test runs on the CPU device (conftest.py's `mosaic_interpret`).
    if "mosaic" in name and "interpret" in name:
        return [pytest.mark.mosaic_interpret]
    return []


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
