"""Training tools of benchmarks/: per-stage step times and the wgrad bench."""

from __future__ import annotations

import json
import math

import pytest
import script_modules

from moe_jax.cli.layer_bench import SHAPES, make_layer
from moe_jax.masked_experts import MaskedExperts
from moe_jax.registry import current_platform

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


def test_wgrad_bench_checks_and_times_each_wgrad(tmp_path):
    """Both GEMMs' wgrads on the small shape, each checked against the float32 XLA wgrad and
    timed: torch (its CPU twin off a GPU) everywhere; Mosaic and the compiled Pallas kernel on a
    GPU, reported with their refusal elsewhere."""
    pytest.importorskip("torch", reason="the torch wgrad needs torch (moe_jax[torch])")
    wgrad_bench = script_modules.benchmark("wgrad_bench")
    path = tmp_path / "wgrad.json"
    assert wgrad_bench.main(["--shapes", "small", "--iters", "1", "--json", str(path)]) == 0
    rows = {(r["gemm"], r["wgrad"]): r for r in json.loads(path.read_text())}
    on_gpu = current_platform() == "gpu"
    for gemm in ("GEMM1", "GEMM2"):
        for name in ("torch", "mosaic", "pallas") if on_gpu else ("torch",):
            row = rows[(gemm, name)]
            assert row["ms"] > 0 and row["rel error"] < 1e-2, row
        if not on_gpu:
            assert "Mosaic GPU kernels need an NVIDIA GPU" in rows[(gemm, "mosaic")]["skipped"]
            assert "needs an NVIDIA GPU" in rows[(gemm, "pallas")]["skipped"]
