"""A newcomer's first hour (issue 65): the scripts' environments, a quiet editable install, and a
demo that says what it is waiting for."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# A virtualenv whose `python` records its arguments instead of running them: what the scripts
# install, in which order, is then read back without a network or a real install.
RECORDING_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$PYTHON_CALLS"
if [ "$1" = -c ]; then  # `python -c "import torch"`: installed only if the test says so
  [ -n "${HAS_TORCH:-}" ]; exit
fi
"""


def _run_script(tmp_path, command: str, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    python = venv / "bin" / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    unset = ("MOE_JAX_EXTRAS", "MOE_JAX_TORCH", "MOE_JAX_NEEDS_TORCH", "MOE_JAX_PIP_CONSTRAINTS")
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ |= {"MOE_JAX_VENV": str(venv), "PYTHON_CALLS": str(calls), **env}
    proc = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=environ, capture_output=True, text=True
    )
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_demo_environment_has_flax_for_the_readme_flax_example(tmp_path):
    proc, calls = _run_script(tmp_path, "bash scripts/demo.sh --tokens 8")
    assert proc.returncode == 0, proc.stderr
    assert calls == [
        "-m pip install -q --upgrade pip",
        "-m pip install -q -e .[flax]",
        "-m moe_jax demo --tokens 8",
    ]


def test_cpu_torch_is_installed_before_the_extras_that_would_pull_cuda(tmp_path):
    proc, calls = _run_script(
        tmp_path, "source scripts/_venv.sh", MOE_JAX_TORCH="cpu", MOE_JAX_EXTRAS="[hf]"
    )
    assert proc.returncode == 0, proc.stderr
    torch = calls.index(f"-m pip install -q torch --index-url {CPU_INDEX}")
    assert calls.index("-m pip install -q -e .[hf]") > torch


def test_cpu_torch_is_not_reinstalled_and_other_values_are_refused(tmp_path):
    proc, calls = _run_script(
        tmp_path / "has", "source scripts/_venv.sh", MOE_JAX_TORCH="cpu", HAS_TORCH="1"
    )
    assert proc.returncode == 0, proc.stderr
    assert not any("torch" in c for c in calls if c.startswith("-m pip"))
    proc, calls = _run_script(tmp_path / "bad", "source scripts/_venv.sh", MOE_JAX_TORCH="cuda")
    assert proc.returncode == 2
    assert "MOE_JAX_TORCH=cuda: use MOE_JAX_TORCH=cpu" in proc.stderr
    assert not any(c.startswith("-m pip install -q -e") for c in calls)


@pytest.mark.slow
def test_editable_build_is_quiet_and_keeps_the_package_dir_mapping(tmp_path):
    """setuptools warns, building an editable install of a package-dir mapping, that folders
    named like the package may shadow it; pyproject's backend (build_backend/) filters that one
    notice. Built here from a copy of the tracked tree with setuptools' and with our backend."""
    pytest.importorskip("setuptools.build_meta", reason="builds with this interpreter's setuptools")
    tree = tmp_path / "tree"
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "pyproject.toml",
            "MANIFEST.in",
            "README.md",
            "moe_jax",
            "kernels",
            "interop",
            "build_backend",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    build = (
        "import sys, zipfile; sys.path.insert(0, 'build_backend')\n"
        "import importlib; name, out = sys.argv[1:]  # setuptools rewrites sys.argv\n"
        "wheel = importlib.import_module(name).build_editable(out)\n"
        "with zipfile.ZipFile(out + '/' + wheel) as z:\n"
        "    print(*[z.read(n).decode() for n in z.namelist() if n.endswith('finder.py')])\n"
    )
    outputs = {}
    for backend in ("setuptools.build_meta", "moe_jax_build"):
        out = tmp_path / backend
        out.mkdir()
        proc = subprocess.run(
            # -P: the tree's kernels/ must not shadow an installed `kernels` (as pip's hook
            # runner, which puts only backend-path on sys.path)
            [sys.executable, "-P", "-W", "always", "-c", build, backend, str(out)],
            cwd=tree,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        outputs[backend] = proc
    notice = "Please be careful with folders in your working directory"
    assert notice in outputs["setuptools.build_meta"].stderr  # the notice this backend removes
    assert notice not in outputs["moe_jax_build"].stderr
    mapping = outputs["moe_jax_build"].stdout
    for package, folder in (("moe_jax.kernels", "kernels"), ("moe_jax.interop", "interop")):
        assert f"'{package}': '{tree / folder}'" in mapping


def test_demo_says_it_is_compiling_before_it_compiles(monkeypatch, capsys):
    from moe_jax.__main__ import main
    from moe_jax.cli import demo

    run_demo, seen = demo.run_demo, []

    def run_demo_after_the_notice(*args, **kwargs):
        seen.append(capsys.readouterr().err)  # what the user saw before the first compile
        return run_demo(*args, **kwargs)

    monkeypatch.setattr(demo, "run_demo", run_demo_after_the_notice)
    assert main(["demo", "--tokens", "8"]) == 0
    assert "compiling the layer for T=8 with FP8 and bf16 weights on cpu" in seen[0]
    assert "fp8 block weights" in capsys.readouterr().out
