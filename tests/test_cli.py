"""The command line: `python -m moe_jax demo` and `python -m moe_jax bench` on the CPU."""

import json

import pytest

from moe_jax.__main__ import main


def test_demo_prints_checked_table(capsys):
    assert main(["demo", "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "fp8 block weights" in out and "bf16 weights" in out
    errors = [float(line.split()[-1]) for line in out.splitlines() if " weights  " in line]
    assert len(errors) == 2 and all(e < 0.1 for e in errors)


@pytest.mark.slow
def test_bench_writes_json_and_plot(tmp_path, capsys):
    json_path, png_path = tmp_path / "b.json", tmp_path / "b.png"
    argv = [
        "bench",
        "--shapes",
        "small",
        "--iters",
        "2",
        "--breakdown",
        "--variants",
        "jax_ragged_dot_bf16",
        "moe_jax_fp8",
        "jax_mosaic_bf16",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
    ]
    assert main(argv) == 0
    result = json.loads(json_path.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["moe_jax_fp8"]["rel_err"] < 0.1
    assert rows["jax_ragged_dot_bf16"]["rel_err"] < 0.02
    assert "skipped" in rows["jax_mosaic_bf16"]  # needs a GPU
    assert [s["stage"] for s in result["breakdown"]["small"]][0] == "quantize x"
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    assert "moe_jax_fp8" in capsys.readouterr().out


def test_bench_rejects_unknown_shape():
    with pytest.raises(SystemExit, match="unknown shape"):
        main(["bench", "--shapes", "Z"])


def test_info_reports_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("deep_gemm", "torch", "mosaic", "xla"):
        assert out.count(f"    {name} ") == 2  # one line per dtype
    assert "no: DeepGEMM runs on NVIDIA GPUs only" in out or "deep_gemm  runs" in out
