"""Runs the docstring examples of every module of the installed package (as `moe_jax.*`).

pytest's `--doctest-modules` would import `kernels/` and `interop/` from the repository as the
top-level packages `kernels` and `interop`, running each module twice and registering every
implementation twice; walking the installed package imports each module once, by its real name.
"""

import doctest
import importlib
import pkgutil

import pytest

# Modules whose import needs an optional dependency: (module prefix, dependency, extra).
_OPTIONAL = (
    ("moe_jax.flax_layer", "flax", "flax"),
    ("moe_jax.hf", "flax", "flax"),
    ("moe_jax.models", "flax", "flax"),
)


def _module_names() -> list[str]:
    """moe_jax and its submodules; kernels/interop are walked separately since an editable
    install maps them into the package with a finder, outside `moe_jax.__path__`."""
    names = {"moe_jax", "moe_jax.kernels", "moe_jax.interop"}
    for package in ("moe_jax", "moe_jax.kernels", "moe_jax.interop"):
        path = importlib.import_module(package).__path__
        names.update(info.name for info in pkgutil.walk_packages(path, prefix=package + "."))
    return sorted(names)


@pytest.mark.parametrize("name", _module_names())
def test_docstring_examples(name):
    for prefix, dependency, extra in _OPTIONAL:
        if name.startswith(prefix):
            pytest.importorskip(dependency, reason=f"{name} needs the [{extra}] extra")
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = {"jnp": importlib.import_module("jax.numpy"), "np": importlib.import_module("numpy")}
    for test in finder.find(module, name, extraglobs=globs):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} docstring example(s) of {name} failed (above)"
