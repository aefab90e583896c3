"""The per-piece benchmarks (`python -m moe_jax.cli.kernel_bench`, `.gemm_sweep`, `.interop_bench`)
on the CPU."""

import json

import jax
import pytest

from moe_jax.cli import gemm_sweep, interop_bench, kernel_bench


@pytest.mark.slow
def test_kernel_bench_tiny_interpret_checks_every_kernel(capsys):
    assert kernel_bench.main(["--tiny", "--interpret", "--copy-bytes", "4096"]) == 0
    out = capsys.readouterr().out
    lines = {
        line.split(" | ")[0].strip("| "): line for line in out.splitlines() if "| tiny |" in line
    }
    assert set(lines) == {
        "permute",
        "metadata alone",
        "destinations",
        "unpermute",
        "group_quant",
        "act_and_quant",
    }
    # Interpret mode runs the kernels' arithmetic: the layouts and quantized bytes are exact.
    permutes = [line for line in out.splitlines() if line.startswith("| permute | tiny")]
    assert len(permutes) == 2 and all(line.endswith("| exact |") for line in permutes)
    assert "| ok max abs err" in lines["unpermute"]
    assert lines["group_quant"].endswith("| exact |")
    assert lines["destinations"].endswith("| exact |")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal off a GPU")
def test_interop_bench_refuses_without_a_gpu(capsys):
    pytest.importorskip("torch", reason="the interop benchmark imports torch first")
    assert interop_bench.main(["--iters", "1", "--reps", "1"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_gemm_sweep_checks_and_ranks_every_config(tmp_path, capsys):
    """Tiny shape, GEMM2 (interpret mode off a GPU): the heuristic matches float32, every
    candidate matches the heuristic within the sweep's tolerance, results come best first."""
    path = tmp_path / "sweep.json"
    argv = ["--shape", "tiny", "--tokens", "2", "--gemms", "2", "--samples", "1"]
    argv += ["--json", str(path)]
    assert gemm_sweep.main(argv) == 0
    (entry,) = json.loads(path.read_text())["report"]
    assert entry["tokens"] == 2 and entry["gemm"] == 2 and entry["rel_error"] < 1e-5
    results = entry["results"]
    assert "heuristic" in {r["config"] for r in results}
    assert len({r["config"] for r in results}) == len(results) > len(gemm_sweep.CANDIDATES) // 2
    assert all("failed" not in r for r in results), results
    if jax.default_backend() == "cpu":  # interpret mode: the same float32 sums in every tiling
        assert all(r["rel_to_heuristic"] < 1e-4 for r in results)
    times = [r["us"] for r in results]
    assert times == sorted(times) and all(r["gbs"] > 0 for r in results)
    assert "T=2 GEMM2" in capsys.readouterr().out
