"""benchmarks/waited_overhead.py (what a waited-for call costs beyond a streamed one) on a tiny
size: every program measured, the overhead the difference of the two figures, the JSON written."""

from __future__ import annotations

import json

import pytest
import script_modules


@pytest.fixture(scope="module")
def script():
    return script_modules.benchmark("waited_overhead")


def test_rows_and_json(script, tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert script.main(["--size", "32", "--samples", "2", "--burst", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    programs = [row["program"] for row in rows]
    assert programs[:2] == ["jax matmul 32^3 bf16", "jax chain of 20 elementwise passes"]
    for row in rows:
        assert row["streamed_us"] > 0 and row["waited_us"] > 0
        assert row["overhead_us"] == pytest.approx(row["waited_us"] - row["streamed_us"])
    table = capsys.readouterr().out
    assert "| jax matmul 32^3 bf16 |" in table and "overhead us" in table


def test_bad_arguments_name_the_argument(script, capsys):
    with pytest.raises(SystemExit):
        script.main(["--samples", "0"])
    assert "args.samples=0" in capsys.readouterr().err
