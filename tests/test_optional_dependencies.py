"""Optional dependencies stay optional: the library, its kernels, interop and CLI modules import
and run a layer without flax, optax, torch, transformers, safetensors, deep_gemm and deep_ep; what
needs one (a module, or one of the package's lazy names) says which pyproject extra installs it.
With all of them installed, `import moe_jax` loads none: tests/test_import_hygiene.py.

Each check runs in a fresh interpreter in which those packages cannot be imported
(`sys.modules[name] = None`), whatever this environment has installed.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONAL = (
    "flax",
    "optax",
    "torch",
    "transformers",
    "safetensors",
    "deep_gemm",
    "deep_ep",
    "tokamax",
)


def _run_without_optional(code: str) -> subprocess.CompletedProcess:
    prelude = f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT / "tests",  # not the repository root: only the installed package is importable
    )


def test_library_imports_and_runs_without_optional_dependencies():
    proc = _run_without_optional(
        """
        import importlib, pkgutil
        import jax.numpy as jnp
        import moe_jax
        from moe_jax import cli, interop, kernels

        optional = ("moe_jax.flax_layer", "moe_jax.hf_", "moe_jax.models")  # Flax
        names = []
        for package in (moe_jax, kernels, interop, cli):
            for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
                if not info.name.startswith(optional):
                    importlib.import_module(info.name)
                    names.append(info.name)
        assert "moe_jax.interop.deep_gemm" in names and "moe_jax.cli.timing" in names, names
        x = jnp.ones((2, 8)); w1 = jnp.ones((2, 4, 8)) / 8; w2 = jnp.ones((2, 8, 2))
        print("ran", moe_jax.fused_moe(x, w1, w2, *moe_jax.fused_topk(jnp.ones((2, 2)), 1)).shape)
        for name in ("MoE", "moe_from_pretrained"):  # the package's lazy names
            try:
                getattr(moe_jax, name)
            except ImportError as error:
                print(name, error)
        """
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ran (2, 8)" in proc.stdout
    assert "MoE moe_jax.flax_layer needs Flax: pip install 'moe_jax[flax]'" in proc.stdout
    assert "moe_from_pretrained moe_jax.hf_loading needs Flax: pip install 'moe_jax[hf]'" in (
        proc.stdout
    )


@pytest.mark.parametrize(
    "module,extra",
    [
        ("moe_jax.flax_layer", "flax"),
        ("moe_jax.hf_config", "flax"),
        ("moe_jax.hf_loading", "hf"),
        ("moe_jax.models.qwen3_moe", "flax"),
    ],
)
def test_flax_modules_without_flax_name_the_extra(module, extra):
    proc = _run_without_optional(
        f"""
        try:
            import {module}
        except ImportError as error:
            print(error)
        """
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"pip install 'moe_jax[{extra}]'" in proc.stdout


def test_extras_install_what_their_modules_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(extra: str) -> set[str]:
        """Distribution names the extra installs, through its own `moe_jax[...]` references."""
        found = set()
        for requirement in extras[extra]:
            name, _, rest = requirement.partition("[")
            name = name.split(">")[0].split("=")[0].strip()
            if name == project["name"]:
                for inner in rest.split("]")[0].split(","):
                    found |= names(inner.strip())
            else:
                found.add(name)
        return found

    assert "torch" in names("torch")
    assert "flax" in names("flax")
    # moe_jax.hf_loading builds moe_jax.flax_layer.MoE layers and reads safetensors through torch.
    assert {"flax", "torch", "safetensors", "transformers"} <= names("hf")
    assert names("flax") | names("torch") | names("hf") <= names("test") | {"deepinfer-gemm"}
    # The suite without torch has everything else the suite has.
    assert names("test") - names("test-no-torch") == {"torch"}
