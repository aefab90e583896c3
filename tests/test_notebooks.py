"""Executes notebooks/*.ipynb top to bottom so they cannot rot (their cells assert their claims)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "moe_jax_test_python"


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernel spec that runs this very interpreter, and a headless matplotlib."""
    spec_dir = tmp_path / "jupyter" / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "moe_jax tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    from jupyter_client.kernelspec import KernelSpecManager

    assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == sys.executable
    return monkeypatch


def execute(name: str, *, committed_with_plots: bool = False) -> str:
    """Runs a notebook from notebooks/ (as its working directory); returns its stream output.
    A notebook of _build.py's EXECUTED is committed with its outputs (plots included), which
    are cleared before it runs; the others are committed without."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if committed_with_plots:
        plots = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert plots, f"{name} is committed without its plots; run python notebooks/_build.py"
        for cell in code:
            cell.outputs, cell.execution_count = [], None
    assert all(not c.get("outputs") for c in code), (
        f"{name} is committed with outputs; clear them (python notebooks/_build.py)"
    )
    client = nbclient.NotebookClient(
        nb, kernel_name=KERNEL, timeout=240, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    client.execute()
    return "".join(
        o.get("text", "")
        for c in nb.cells
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream" and o.get("name") == "stdout"
    )


FLAX_REASON = "the notebook builds moe_jax.flax_layer.MoE layers (the [flax] extra)"


def test_tour(kernel_env):
    pytest.importorskip("flax", reason=FLAX_REASON)
    out = execute("01_tour.ipynb")
    assert "xla_masked         ran" in out
    assert "FP8 layer vs float layer" in out


def test_routing(kernel_env):
    pytest.importorskip("flax", reason=FLAX_REASON)
    out = execute("02_routing.ipynb")
    assert "hot-group share" in out and "max/mean load:" in out


def test_performance_without_results(kernel_env, tmp_path):
    kernel_env.setenv("MOE_JAX_BENCH_JSON", str(tmp_path / "absent.json"))
    kernel_env.setenv("MOE_JAX_PROFILE_JSON", str(tmp_path / "absent_profiles.json"))
    out = execute("03_performance.ipynb")
    assert "no benchmark results at" in out
    assert "no profile results at" in out
    assert "ridge points" in out


def test_performance_with_results(kernel_env, tmp_path):
    results = [
        {"shape": "A", "variant": "deep_gemm fp8", "ms": 3.1, "tflops": 931.0},
        {"shape": "shape_B", "variant": "torch bf16", "ms": 1.6},  # tflops derived
        {"shape": "B", "variant": "broken"},  # no ms: skipped
        {"shape": "Z", "variant": "unknown shape", "ms": 1.0},  # skipped
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results))
    kernel_env.setenv("MOE_JAX_BENCH_JSON", str(path))
    out = execute("03_performance.ipynb")
    assert f"2 measured points from {path}, 2 skipped" in out
    assert "shape B torch bf16" in out and "386.5 TFLOP/s" in out  # 618.5 GFLOP / 1.6 ms


def test_performance_with_the_committed_h200_results(kernel_env):
    # notebooks/bench_results.json is `python -m moe_jax bench --json` output from the H200.
    kernel_env.delenv("MOE_JAX_BENCH_JSON", raising=False)
    kernel_env.delenv("MOE_JAX_PROFILE_JSON", raising=False)
    out = execute("03_performance.ipynb")
    assert "10 measured points from bench_results.json" in out
    # notebooks/profile_results.json: `kernel_gaps --json` profiles, summed by stage
    assert "shape A: host  2975.7 us, kernels  2852.4 us  GEMMs 85%" in out
    assert "decode T=1: host   144.1 us" in out


def test_training(kernel_env):
    for module in ("flax", "optax"):
        pytest.importorskip(module, reason="the notebook trains a Flax MoE block with optax")
    out = execute("04_training.ipynb")
    assert "3 x 300 steps in" in out
    assert "+ correction bias" in out and "max/mean load" in out
    assert "weight gradient" in out


def test_model(kernel_env):
    for module in ("flax", "optax", "transformers", "torch"):
        pytest.importorskip(module, reason="the notebook loads and trains a transformers model")
    out = execute("05_model.ipynb", committed_with_plots=True)
    assert "logits vs transformers" in out and "300 steps in" in out
    assert "layer 3: max/mean load" in out
