"""benchmarks/destinations_bench.py on the smallest shape: both modes run, check every candidate bit
for bit (the Pallas routing-metadata kernel in interpret mode off a GPU) and print one row per
candidate, so the script is known to work before device time is spent on it."""

from __future__ import annotations

import json

import pytest
import script_modules


@pytest.fixture(scope="module")
def bench():
    return script_modules.benchmark("destinations_bench")


@pytest.mark.parametrize("mode", [[], ["--metadata"]], ids=["rank_methods", "metadata"])
def test_every_candidate_is_checked_and_timed(bench, mode, tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    argv = [*mode, "--shapes", "decode_1", "--samples", "1", "--burst", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    names = [row["method"] for row in rows]
    if mode:
        assert names[0] == "xla" and any(name.startswith("pallas") for name in names)
    else:
        assert names[0].startswith("current") and "sorted" in names
    assert all(row["check"] == "exact" for row in rows)
    table = capsys.readouterr().out
    assert all(name in table for name in names)
