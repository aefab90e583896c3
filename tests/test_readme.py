"""README.md runs as written: every ```python block in a fresh Python on the CPU, and every
`python -m moe_jax ...` command line through the CLI's own parser (the `info` ones run: they are
cheap and compile nothing).

A block the suite cannot run (it needs a checkpoint on disk, a GPU, the network) is marked in the
README by the line `<!-- no-test: REASON -->` right above it, and skips with that reason.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

_PYTHON_BLOCK = re.compile(
    r"(?:<!-- no-test: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M
)
_BASH_BLOCK = re.compile(r"```bash\n(?P<code>.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`(python -m moe_jax [^`]*)`")
_CLI = "python -m moe_jax "


def _section(text: str, offset: int) -> str:
    """The heading above `offset`, as an id: "In a Flax model" -> "in-a-flax-model"."""
    headings = re.findall(r"^#+ (.*)$", text[:offset], re.M)
    return re.sub(r"[^a-z0-9]+", "-", headings[-1].lower()).strip("-") if headings else "top"


def python_blocks(text: str = README) -> list:
    """One pytest param per ```python block, id'd by its section; marked ones skip."""
    params, seen = [], {}
    for match in _PYTHON_BLOCK.finditer(text):
        section = _section(text, match.start())
        seen[section] = seen.get(section, 0) + 1
        marks = () if match["reason"] is None else pytest.mark.skip(reason=match["reason"])
        params.append(pytest.param(match["code"], id=f"{section}-{seen[section]}", marks=marks))
    return params


def cli_commands(text: str = README) -> list[str]:
    """Each `python -m moe_jax ...` line of a bash block (its comment cut) and each inline one
    (single commands only: `demo | info | bench` names three)."""
    commands = []
    for block in _BASH_BLOCK.finditer(text):
        for line in block["code"].splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(_CLI):
                commands.append(line)
    for span in _INLINE.findall(text.replace("\n", " ")):
        if "|" not in span and "..." not in span:
            commands.append(span.strip())
    return sorted(set(commands))


def _run(argv: list[str], cwd: pathlib.Path, timeout: float) -> subprocess.CompletedProcess:
    # Outside the clone's root (where kernels/ and interop/ would import as top-level packages),
    # on the CPU, as a reader on a laptop would.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_the_readme_has_code_to_run():
    blocks = python_blocks()
    assert len(blocks) >= 3, "README.md should show runnable Python (quickstart, Flax, training)"
    assert sum(not b.marks for b in blocks) >= 3, "most README blocks must run, not skip"
    assert any(" info --plan " in f" {c} " for c in cli_commands()), (
        "README.md should show `python -m moe_jax info --plan ...`"
    )


@pytest.mark.slow
@pytest.mark.parametrize("code", python_blocks())
def test_python_block_runs(code, tmp_path):
    result = _run([sys.executable, "-c", code], tmp_path, timeout=600)
    assert result.returncode == 0, (
        f"README block failed (exit {result.returncode}):\n{code}\n--- stderr ---\n"
        f"{result.stderr[-3000:]}"
    )


@pytest.mark.parametrize("command", cli_commands(), ids=str)
def test_cli_command_parses(command):
    from moe_jax import __main__ as cli

    argv = shlex.split(command)[3:]  # after "python -m moe_jax"
    try:
        args = cli._parser().parse_args(argv)
    except SystemExit as exit_:
        pytest.fail(f"`{command}` in README.md does not parse (argparse exit {exit_.code})")
    assert args.command == argv[0]


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in cli_commands() if c.split()[3] == "info"], ids=str)
def test_info_command_runs(command, tmp_path):
    result = _run([sys.executable, *shlex.split(command)[1:]], tmp_path, timeout=300)
    assert result.returncode == 0, f"`{command}` failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"`{command}` printed nothing"


def test_the_extraction_sees_marks_and_commands():
    """The two readers on a made-up README: a marked block skips with its reason, an unmarked one
    runs, and only single `python -m moe_jax` commands are collected."""
    text = (
        "# T\n## Quick\n```python\nprint(1)\n```\n<!-- no-test: needs a GPU -->\n```python\n"
        "print(2)\n```\n```bash\npython -m moe_jax bench --decode   # decode\npip install x\n```\n"
        "Run `python -m moe_jax demo | info | bench` or `python -m moe_jax info`.\n"
    )
    blocks, commands = python_blocks(text), cli_commands(text)
    assert [b.values[0] for b in blocks] == ["print(1)\n", "print(2)\n"]
    assert [b.id for b in blocks] == ["quick-1", "quick-2"]
    assert not blocks[0].marks and blocks[1].marks[0].kwargs["reason"] == "needs a GPU"
    assert commands == ["python -m moe_jax bench --decode", "python -m moe_jax info"]
