"""The command line on the CPU: `python -m moe_jax demo | info | bench [--decode | --train]`."""

import json
import re

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
    assert "no: DeepGEMM runs on NVIDIA GPUs only" in out or re.search(r"deep_gemm +runs", out)
    # one column for the statuses, however long a backend's name
    rows = [line for line in out.splitlines() if re.match(r"    \w", line)]
    columns = {re.search(r"\w +(runs|no: )", row).start(1) for row in rows}
    assert len(rows) >= 8 and len(columns) == 1, rows


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
        "moe_jax_fp8_unfused",
        "jax_mosaic_bf16",
        "moe_jax_fp8_graph",
        "moe_jax_fp8_fused_act",
        "moe_jax_fp8_fused_act_graph",
        "moe_jax_fp8_fused_act_skipping",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
    ]
    assert main(argv) == 0
    result = json.loads(json_path.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["moe_jax_fp8"]["rel_err"] < 0.1
    assert rows["moe_jax_fp8_unfused"]["rel_err"] < 0.1  # never fused: runs everywhere
    assert rows["jax_ragged_dot_bf16"]["rel_err"] < 0.02
    # the first call compiles: it takes longer than a compiled call
    assert rows["moe_jax_fp8"]["first_call_s"] * 1e3 > rows["moe_jax_fp8"]["latency_ms"]
    stages = [s["stage"] for s in result["breakdown"]["small"]]
    if jax.default_backend() == "cpu":
        assert rows["jax_mosaic_bf16"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_graph"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_fused_act"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_fused_act_graph"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_fused_act_skipping"]["skipped"] == "needs an NVIDIA GPU"
        gemm1, gemm2 = "GEMM1 (xla)", "GEMM2 (xla)"
    else:  # the Mosaic GPU ragged dot runs; "auto" picks a GPU GEMM backend
        assert rows["jax_mosaic_bf16"]["rel_err"] < 0.02
        graph = rows["moe_jax_fp8_graph"]  # skipped with a reason where DeepGEMM is missing
        assert graph.get("rel_err", 0.0) < 0.1
        assert not graph.get("skipped", "").startswith("failed:"), graph["skipped"]
        fused_names = ("fused_act", "fused_act_graph", "fused_act_skipping")
        for name in (f"moe_jax_fp8_{n}" for n in fused_names):
            fused = rows[name]  # Hopper (and DeepGEMM) only: skipped with a reason elsewhere
            assert fused.get("rel_err", 0.0) < 0.1
            assert not fused.get("skipped", "").startswith("failed:"), fused["skipped"]
        gemm1, gemm2 = stages[2], stages[-2]
        assert gemm1.startswith("GEMM1 (") and gemm2.startswith("GEMM2 ("), stages
    # "auto" fuses GEMM1 with act*up + quantize only on Hopper from 128-row segments, which the
    # small shape's rows do not ask for
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
    # the gap: the one-jit forward (the moe_jax_fp8 row) minus the stages' sums, host and device
    breakdown = result["breakdown"]["small"]
    forward = rows["moe_jax_fp8"]["ms"]
    gap = forward - sum(s["ms"] for s in breakdown)
    assert f"{'forward (one jit)':<48} {forward:>10.3f}" in captured.out
    device = [s["device_ms"] for s in breakdown]
    if jax.default_backend() == "cpu":  # no device kernels in the CPU backend's trace
        assert device == [None] * len(breakdown)
        assert f"{'forward - sum':<48} {gap:>+10.3f} {'-':>10}" in captured.out
    else:  # each stage's kernels ran for some time
        assert all(0 < d for d in device), breakdown
        device_gap = forward - sum(device)
        assert f"{'forward - sum':<48} {gap:>+10.3f} {device_gap:>+10.3f}" in captured.out
    assert "[1/8] small jax_ragged_dot_bf16" in captured.err  # progress for long runs


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


@pytest.mark.slow
def test_bench_train_times_moe_jax_against_the_torch_step(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    json_path, png_path = tmp_path / "t.json", tmp_path / "t.png"
    argv = ["bench", "--train", "--variants", "auto", "torch_titan", "--iters", "1"]
    argv += ["--json", str(json_path), "--plot", str(png_path)]
    assert main(argv) == 0
    result = json.loads(json_path.read_text())
    shape = "small" if jax.default_backend() == "cpu" else "B"
    assert result["environment"]["backend"] == jax.default_backend()
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"auto", "torch_titan"} and {r["shape"] for r in rows.values()} == {shape}
    titan = rows["torch_titan"]
    if "skipped" in titan:  # torch before 2.8 has no CPU torch._grouped_mm
        assert tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8), titan["skipped"]
        names = ["auto"]
    else:
        assert rows["auto"]["speedup vs torch_titan"] > 0
        assert titan["speedup vs torch_titan"] == 1.0
        names = ["auto", "torch_titan"]
    for name in names:  # bf16 gradients against the float32 reference
        errors = {k: v for k, v in rows[name].items() if k.startswith("err_d")}
        assert len(errors) == 4 and all(e < 0.02 for e in errors.values()), (name, errors)
        assert rows[name]["step ms"] > 0 and rows[name]["fwd ms"] > 0
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert f"| {shape} | auto |" in captured.out and f"| {shape} | torch_titan |" in captured.out
    assert f"shape {shape}: T=" in captured.err  # progress while it runs


def test_bench_train_calls_the_train_bench(monkeypatch, tmp_path):
    from moe_jax.cli import train_bench

    calls = []
    monkeypatch.setattr(train_bench, "run_train_bench", lambda **kw: calls.append(kw) or 0)
    path, png = str(tmp_path / "t.json"), str(tmp_path / "t.png")
    argv = ["bench", "--train", "--shapes", "B", "--variants", "auto", "torch_titan"]
    assert main([*argv, "--iters", "3", "--json", path, "--plot", png]) == 0
    assert main(["bench", "--train"]) == 0
    assert calls == [
        dict(
            shapes=["B"], variants=["auto", "torch_titan"], iters=3, json_path=path, plot_path=png
        ),
        dict(shapes=None, variants=None, iters=20, json_path=None, plot_path=None),
    ]


def test_bench_decode_calls_the_decode_bench(monkeypatch, tmp_path):
    from moe_jax.cli import decode_bench

    calls = []
    monkeypatch.setattr(decode_bench, "run_decode_bench", lambda **kw: calls.append(kw) or 0)
    path = str(tmp_path / "d.json")
    argv = ["bench", "--decode", "--tokens", "1", "8", "--variants", "auto", "pallas"]
    assert main([*argv, "--iters", "3", "--json", path]) == 0
    assert calls == [
        dict(tokens=[1, 8], iters=3, json_path=path, plot_path=None, variants=["auto", "pallas"])
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--tokens", "4"], "--tokens applies to bench --decode only"),
        (["bench", "--decode", "--breakdown"], "do not apply to --decode"),
        (["bench", "--train", "--breakdown"], "--breakdown and --tokens do not apply to --train"),
        (["bench", "--train", "--tokens", "4"], "--breakdown and --tokens do not apply to --train"),
        (["bench", "--train", "--decode"], "--decode and --train are separate benchmarks"),
        (
            ["bench", "--train", "--shapes", "Z"],
            "unknown shape 'Z'; choose from ['A', 'B', 'small']",
        ),
        (["bench", "--train", "--variants", "nope"], "unknown variant 'nope'; choose from"),
        (["bench", "--train", "--iters", "0"], "--iters 0: at least 1"),
        # checked before any mode runs (the forward and decode benches crashed after measuring)
        (["bench", "--iters", "0"], "--iters 0: at least 1"),
        (["bench", "--decode", "--iters", "-1"], "--iters -1: at least 1"),
        (["bench", "--json", "/nonexistent/d/b.json"], "the folder /nonexistent/d does not exist"),
        (["bench", "--decode", "--plot", "/nonexistent/p.png"], "/nonexistent does not exist"),
        (["bench", "--decode", "--tokens", "1", "--variants", "auto", "nope"], "--variants nope"),
        (["demo", "--tokens", "0"], "--tokens 0: the demo needs at least 1 token"),
        (["demo", "--experts", "bogus"], "--experts bogus: unknown experts 'bogus'"),
    ],
)
def test_bench_rejects_options_of_the_other_mode(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
