"""pytest plugin of scripts/test_host_jax.sh (`-p host_jax_subset`): under the GPU host's JAX, a
Mosaic kernel's interpreted config grid runs each config once.

A test marked `mosaic_interpret` and parametrized by `config` runs, per test function, the first
case of each distinct (config, alignment); its other cases, the same config on other problems,
are deselected. The grids stay whole under the pinned JAX (scripts/test.sh), where the problems'
shapes are what they test. Under another JAX release, what breaks is the lowering or an API, and
that breaks every case of a config at once (e398131: one lowering change failed 23 tests; the
other jax-0.11-only failures, 10568df and dcebc23, were imports and a custom_vjp), so one case
per config finds it. MOE_JAX_HOST_JAX_ALL=1 (test_host_jax.sh) runs every case.
"""

from __future__ import annotations


def _config_key(item):
    callspec = getattr(item, "callspec", None)
    if callspec is None or "config" not in callspec.params:
        return None
    if item.get_closest_marker("mosaic_interpret") is None:
        return None
    if not callspec.params.get("interpret", True):
        return None  # compiled cases: GPU-marked, skipped on this CPU anyway
    params = callspec.params
    return item.module.__name__, item.originalname, repr(params["config"]), params.get("alignment")


def pytest_collection_modifyitems(config, items):
    seen, kept, deselected = set(), [], []
    for item in items:
        key = _config_key(item)
        if key is not None and key in seen:
            deselected.append(item)
            continue
        if key is not None:
            seen.add(key)
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
