"""Imports a file of scripts/ (not a package) as a module for its test, for one test module."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

SCRIPTS = pathlib.Path(__file__).resolve().parent.parent / "scripts"


def loaded(name: str) -> Iterator[ModuleType]:
    """Yields scripts/<name>.py as module `name` (in sys.modules while used: dataclasses look
    their module up), then removes it. Use as `yield from loaded(...)` in a fixture."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[name]
