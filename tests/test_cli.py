"""The command line on the CPU: `python -m moe_jax demo | info | bench` and their wiring."""

import json
import sys
import types

import jax
import pytest

from moe_jax.__main__ import main


def test_demo_prints_checked_table(capsys):
    assert main(["demo", "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "fp8 block weights" in out and "bf16 weights" in out
    errors = [float(line.split()[-1]) for line in out.splitlines() if " weights  " in line]
    assert len(errors) == 2 and all(e < 0.1 for e in errors)


def test_info_reports_every_backend(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("deep_gemm", "torch", "mosaic", "xla"):
        assert out.count(f"    {name} ") == 2  # one line per dtype
    assert "no: DeepGEMM runs on NVIDIA GPUs only" in out or "deep_gemm  runs" in out


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
    stages = [s["stage"] for s in result["breakdown"]["small"]]
    if jax.default_backend() == "cpu":
        assert rows["jax_mosaic_bf16"]["skipped"] == "needs an NVIDIA GPU"
        gemm1, gemm2 = "GEMM1 (xla)", "GEMM2 (xla)"
    else:  # the Mosaic GPU ragged dot runs; "auto" picks a GPU GEMM backend
        assert rows["jax_mosaic_bf16"]["rel_err"] < 0.02
        gemm1, gemm2 = stages[2], stages[4]
        assert gemm1.startswith("GEMM1 (") and gemm2.startswith("GEMM2 ("), stages
    assert stages == [
        "quantize x",
        "permute",
        gemm1,
        "act*up + quantize",
        gemm2,
        "unpermute + reduce",
    ]
    assert all(s["ms"] > 0 for s in result["breakdown"]["small"])
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert "moe_jax_fp8" in captured.out and "stages of moe_jax_fp8" in captured.out
    assert "[1/3] small jax_ragged_dot_bf16" in captured.err  # progress for long runs


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--shapes", "Z"], "unknown shape 'Z'"),
        (["bench", "--variants", "nope"], "unknown variant 'nope'"),
    ],
)
def test_bench_rejects_unknown_names(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_bench_decode_calls_the_decode_bench(monkeypatch, tmp_path):
    calls = []

    def run_decode_bench(*, tokens, iters, json_path, plot_path):
        calls.append(dict(tokens=tokens, iters=iters, json_path=json_path, plot_path=plot_path))
        return 0

    fake = types.ModuleType("moe_jax.cli.decode_bench")
    fake.run_decode_bench = run_decode_bench
    monkeypatch.setitem(sys.modules, "moe_jax.cli.decode_bench", fake)
    path = str(tmp_path / "d.json")
    assert main(["bench", "--decode", "--tokens", "1", "8", "--iters", "3", "--json", path]) == 0
    assert main(["bench", "--decode"]) == 0
    assert calls == [
        dict(tokens=[1, 8], iters=3, json_path=path, plot_path=None),
        dict(tokens=None, iters=20, json_path=None, plot_path=None),
    ]


def test_bench_decode_without_its_module_says_so(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "moe_jax.cli.decode_bench", None)  # import fails
    assert main(["bench", "--decode"]) == 2
    assert "needs moe_jax.cli.decode_bench" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--tokens", "4"], "--tokens applies to bench --decode only"),
        (["bench", "--decode", "--breakdown"], "do not apply to --decode"),
    ],
)
def test_bench_rejects_options_of_the_other_mode(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
