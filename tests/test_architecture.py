"""The import graph follows README's "Architecture" layers: a module imports only its own layer
and the ones below it (1 is the bottom; the command line, moe_jax/cli and __main__, is the top,
so the library never imports it), and every library module is assigned a layer. The command
line holds only what its commands import; the tools of benchmarks/ import the package, never the
reverse; both use its public names only.

Read from the source files with `ast` (nothing is imported), so the rule holds for every module,
imports inside functions included. Backends are found by fronts through module names in their
registries (`Registry(modules=...)`), which are strings, not imports.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOUNDATIONS, FRONTS, BACKENDS, COMPOSITION, TOOLS = 1, 2, 3, 4, 5
# Module -> layer, as README's Architecture section lists them. Package `__init__`s only re-export
# (PACKAGES); a library module imports their submodules, never their re-exported names.
LAYERS = {
    **dict.fromkeys(
        (
            "registry",
            "_pytree",
            "quant",
            "expert_rank",
            "layouts",
            "activation",
            "routing",
            "moe_inputs",
            "reference",
        ),
        FOUNDATIONS,
    ),
    **dict.fromkeys(
        (
            "grouped_gemm",
            "grouped_gemm_backward",
            "fused_gemm1",
            "permute",
            "act_quant",
            "fp8_training",
        ),
        FRONTS,
    ),
    **dict.fromkeys(
        ("kernels.*", "interop.bridge", "interop.deep_gemm", "interop.torch_gemm"), BACKENDS
    ),
    **dict.fromkeys(
        (
            "plan",
            "prepare_finalize",
            "experts",
            "contiguous_experts",
            "masked_experts",
            "experts_by_name",
            "modular",
            "fused_moe",
            "expert_parallel",
            "ep_api",
            "distributed",
            "flax_layer",
            "hf_config",
            "hf_checkpoint",
            "hf_weights",
            "hf_loading",
            "models.*",
            # DeepEP adapters are PrepareFinalize implementations (they import prepare_finalize,
            # experts and masked_experts); they live in interop/ because they call torch-hosted
            # DeepEP.
            "interop.deep_ep",
            "interop.deep_ep_layouts",
            "interop.deep_ep_ht",
            "interop.deep_ep_ll",
            "interop.deep_ep_ll_graph",
        ),
        COMPOSITION,
    ),
    **dict.fromkeys(("cli.*", "__main__"), TOOLS),
}
PACKAGES = ("moe_jax", "moe_jax.kernels", "moe_jax.interop")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in ("kernels", "interop"):  # installed as moe_jax.kernels / moe_jax.interop
        parts.insert(0, "moe_jax")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    _module_name(p): p for d in ("moe_jax", "kernels", "interop") for p in (ROOT / d).rglob("*.py")
}


def layer_of(module: str) -> int | None:
    """The layer of a library module (None: unassigned); packages have none either."""
    short = module.removeprefix("moe_jax.")
    if short in LAYERS:
        return LAYERS[short]
    return LAYERS.get(short.split(".")[0] + ".*")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for each moe_jax module an import statement reaches; `from a import b`
    reaches the submodule a.b where one exists, else a itself (a name a re-exports)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.append((node.lineno, full if full in MODULES else node.module))
    return [(line, m) for line, m in found if m == "moe_jax" or m.startswith("moe_jax.")]


def test_every_library_module_has_a_layer():
    unassigned = [m for m in MODULES if m not in PACKAGES and layer_of(m) is None]
    assert not unassigned, f"add {unassigned} to LAYERS here and to README's Architecture"
    assert {"moe_jax.fused_moe", "moe_jax.kernels.permute", "moe_jax.interop.deep_gemm"} <= set(
        MODULES
    )


LAYERED = sorted(m for m in MODULES if m not in PACKAGES)


# The one upward import: an op front's registry asks `moe_jax.plan` for its "auto" order (the
# one place "auto" is decided), from inside its preference function, when a call selects.
PLAN_ORDER = "moe_jax.plan"


def _lines_in_functions(tree: ast.AST) -> set[int]:
    """Line numbers of the import statements inside function bodies."""
    return {
        node.lineno
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }


def violations(module: str, source: str) -> list[str]:
    """The imports of `module` (given its source) that reach a higher layer or a package."""
    own = layer_of(module)
    tree = ast.parse(source)
    in_functions = _lines_in_functions(tree)
    bad = []
    for line, target in _imports(tree):
        if target in PACKAGES:
            if own != TOOLS:  # tools may use the public package; the library imports submodules
                bad.append(f"line {line}: names re-exported by {target}")
        elif target == PLAN_ORDER and own == FRONTS and line in in_functions:
            continue
        elif (layer_of(target) or 0) > own:
            bad.append(f"line {line}: {target} (layer {layer_of(target)})")
    return bad


@pytest.mark.parametrize("module", LAYERED)
def test_module_imports_only_its_layer_and_below(module):
    bad = violations(module, MODULES[module].read_text())
    assert not bad, f"{module} (layer {layer_of(module)}) imports a higher layer: {bad}"


def test_the_check_sees_violations():
    source = (
        "from moe_jax import quant, experts\n"
        "from moe_jax import fused_moe as fm\n"
        "from moe_jax import ContiguousExperts\n"
        "def f():\n"
        "    import moe_jax.kernels.permute\n"
        "    from moe_jax.plan import gemm_order\n"
        "from moe_jax.plan import plan\n"
    )
    assert violations("moe_jax.permute", source) == [
        "line 1: moe_jax.experts (layer 4)",
        "line 2: moe_jax.fused_moe (layer 4)",
        "line 3: names re-exported by moe_jax",
        "line 7: moe_jax.plan (layer 4)",  # the plan's order only from inside a function
        "line 5: moe_jax.kernels.permute (layer 3)",
    ]
    assert violations("moe_jax.cli.demo", source) == []


def test_readme_lists_the_layers():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Architecture", 1)[1].split("\n## ", 1)[0]
    missing = [
        name
        for name in LAYERS
        if "*" not in name
        and name != "_pytree"
        and not re.search(rf"[`/]{re.escape(name.split('.')[-1])}`", section)
    ]
    assert not missing, f"README's Architecture section does not place {missing}"


def _imported_names(path: pathlib.Path) -> list[str]:
    """Every module an import statement of the file names, relative imports aside ("from a
    import b" names a and a.b: b may be a submodule)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
    return names


def test_the_package_never_imports_the_benchmarks():
    """benchmarks/ (the profiling tools, run from a checkout) imports the installed package,
    never the reverse: no module of moe_jax/, kernels/ or interop/ imports it."""
    bad = [
        f"{module}: {name}"
        for module, path in MODULES.items()
        for name in _imported_names(path)
        if name.split(".")[0] == "benchmarks"
    ]
    assert not bad, bad


def test_the_cli_holds_only_what_its_commands_import():
    """moe_jax/cli is `python -m moe_jax demo | info | bench` and the modules those import, no
    more: every module of it is reached from moe_jax/__main__.py through moe_jax.cli imports.
    A profiling or exploration tool belongs in benchmarks/."""
    cli = {m for m in MODULES if m.startswith("moe_jax.cli.")}
    reached, todo = set(), ["moe_jax.__main__"]
    while todo:
        for name in _imported_names(MODULES[todo.pop()]):
            if name in cli and name not in reached:
                reached.add(name)
                todo.append(name)
    assert "moe_jax.cli.layer_bench" in reached and "moe_jax.cli.demo" in reached
    assert not cli - reached, f"no command imports {sorted(cli - reached)}: move to benchmarks/"


def test_tests_and_scripts_import_the_installed_package_only():
    """kernels/ and interop/ exist only as moe_jax.kernels / moe_jax.interop: no test, script or
    benchmark imports the folders as top-level packages (which would run every module twice)."""
    bad = []
    folders = ("tests", "scripts", "benchmarks")
    for path in sorted(p for folder in folders for p in (ROOT / folder).glob("*.py")):
        names = _imported_names(path)
        bad += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("kernels", "interop")]
    assert not bad, bad
    # By file, not by name: a PyPI distribution called `kernels` exists (and transformers probes
    # for it); only modules loaded from this repository's folders count. (The H200 suite run of
    # 2026-12-01 had a top-level `kernels` in sys.modules; where it came from was not recorded.)
    loaded = [
        name
        for name, module in list(sys.modules.items())
        if not name.startswith("moe_jax")
        and str(getattr(module, "__file__", "") or "").startswith(
            (str(ROOT / "kernels"), str(ROOT / "interop"))
        )
    ]
    assert not loaded, f"loaded from the repository folders, not the package: {loaded}"


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


PUBLIC_USERS = sorted(
    [
        *(p for m, p in MODULES.items() if m == "moe_jax.__main__" or m.startswith("moe_jax.cli")),
        *(ROOT / "benchmarks").glob("*.py"),
    ]
)


@pytest.mark.parametrize("path", PUBLIC_USERS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cli_and_the_benchmarks_use_public_names_only(path):
    assert not _private_uses(ast.parse(path.read_text())), f"{path.relative_to(ROOT)}"


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
