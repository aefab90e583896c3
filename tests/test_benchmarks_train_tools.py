"""benchmarks/train_stages.py: per-stage forward and backward times of a training step."""

from __future__ import annotations

import json
import math

import pytest
import script_modules

from moe_jax.cli.layer_bench import SHAPES, make_layer
from moe_jax.masked_experts import MaskedExperts

train_stages = script_modules.benchmark("train_stages")

STAGES = ["permute", "GEMM1 (xla)", "act*up", "GEMM2 (xla)", "unpermute + reduce", "sum"]


def test_every_stage_is_timed_forward_and_backward(tmp_path, capsys):
    path = tmp_path / "stages.json"
    argv = ["--shape", "small", "--experts", "xla", "--iters", "1", "--json", str(path)]
    assert train_stages.main(argv) == 0
    assert "| stage | fwd ms | bwd ms |" in capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert [r["stage"] for r in rows] == STAGES
    for row in rows:
        assert row["fwd ms"] > 0 and row["bwd ms"] > 0, row
    assert math.isclose(rows[-1]["bwd ms"], sum(r["bwd ms"] for r in rows[:-1]))


def test_stage_times_refuse_the_masked_layout():
    with pytest.raises(ValueError, match="contiguous layout"):
        train_stages.stage_times(make_layer(SHAPES["small"]), iters=1, experts=MaskedExperts())
