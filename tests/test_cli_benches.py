"""The per-piece benchmarks (`python -m moe_jax.cli.kernel_bench`, `.interop_bench`) on the CPU."""

import jax
import pytest

from moe_jax.cli import interop_bench, kernel_bench


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
