"""Which way imports go: the library never imports `moe_jax.cli`; the CLI and the tools of
benchmarks/ use public names only.

Read from the source files with `ast` (nothing is imported), so the rules hold for every module,
including ones no test imports.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLI = ROOT / "moe_jax" / "cli"
# moe_jax/__main__.py is the command-line entry point: it imports moe_jax.cli per command.
ENTRY = ROOT / "moe_jax" / "__main__.py"


def _sources(*dirs: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py"))


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every module an import statement names ("from a import b" names a and a.b)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


def _is_cli(module: str) -> bool:
    return module == "moe_jax.cli" or module.startswith("moe_jax.cli.")


LIBRARY = [
    p
    for p in _sources(ROOT / "moe_jax", ROOT / "kernels", ROOT / "interop")
    if CLI not in p.parents and p != ENTRY
]


def test_the_library_has_modules_to_check():
    names = {p.name for p in LIBRARY}
    assert {"fused_moe.py", "permute.py", "deep_gemm.py"} <= names
    assert not any(p.name.endswith("bench.py") for p in LIBRARY), "benchmarks belong in cli/"


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_library_module_does_not_import_the_cli(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = [m for m in _imported_modules(tree) if _is_cli(m)]
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}; the library never imports moe_jax.cli"


def _private_uses(tree: ast.AST) -> list[str]:
    """Private names of moe_jax the module reaches: imported, or as attributes of an import."""
    bound = set()  # local names bound to moe_jax modules or objects
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("moe_jax"):
                    bound.add(alias.asname or alias.name.split(".")[0])
                    if any(part.startswith("_") for part in alias.name.split(".")):
                        found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_jax"):
            parts = node.module.split(".")
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if any(p.startswith("_") for p in [*parts, alias.name]):
                    found.append(f"{node.module}.{alias.name}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


CLI_MODULES = [*_sources(CLI), ENTRY, *_sources(ROOT / "benchmarks")]


@pytest.mark.parametrize("path", CLI_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_cli_module_uses_public_names_only(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not _private_uses(tree), f"{path.relative_to(ROOT)} reaches private names"


def test_private_use_detection():
    source = (
        "from moe_jax.experts import _activate\n"
        "from moe_jax.interop import deep_gemm\n"
        "deep_gemm._resolve('x')\n"
        "import moe_jax.kernels._triton\n"
        "import torch\n"
        "torch._grouped_mm\n"
    )
    assert _private_uses(ast.parse(source)) == [
        "moe_jax.experts._activate",
        "moe_jax.kernels._triton",
        "deep_gemm._resolve",
    ]
