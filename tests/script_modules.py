"""scripts/ and benchmarks/ for their tests: a file of scripts/ (not a package) imported as a
module for one test module, a tool of benchmarks/ imported as `benchmarks.NAME`, a command run
at the repository root as the GPU host runs it, or a script run by `moe_jax.distributed`."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
BENCHMARKS = ROOT / "benchmarks"


def loaded(name: str) -> Iterator[ModuleType]:
    """Yields scripts/<name>.py as module `name` (in sys.modules while used: dataclasses look
    their module up), then removes it. Use as `yield from loaded(...)` in a fixture."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]


def benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py imported as `benchmarks.<name>` (its imports of the tools beside it
    work), the package registered from its folder: the repository root stays off sys.path, where
    it would make kernels/ and interop/ importable as top-level packages (tests/conftest.py)."""
    if "benchmarks" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "benchmarks", BENCHMARKS / "__init__.py", submodule_search_locations=[str(BENCHMARKS)]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks"] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"benchmarks.{name}")


def run_at_root(
    argv: list[str], env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """Runs `argv` in the repository root with the environment `env` added to this process's
    (this Python's folder first on PATH, so `python3` in a script is this interpreter), output
    captured as text."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return subprocess.run(
        argv,
        cwd=ROOT,
        env={**os.environ, "PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_distributed(
    script, *args: str, num_processes: int, port: int, timeout: float, env=None
) -> subprocess.CompletedProcess:
    """`python -m moe_jax.distributed --num-processes N --coordinator-address 127.0.0.1:PORT
    SCRIPT ARGS` (`script` relative to the repository root, or absolute), output captured; the
    launcher stops its processes a minute before `timeout`."""
    argv = ["--num-processes", str(num_processes), "--coordinator-address", f"127.0.0.1:{port}"]
    argv += ["--timeout-s", str(timeout - 60)]
    return subprocess.run(
        [sys.executable, "-m", "moe_jax.distributed", *argv, str(ROOT / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
