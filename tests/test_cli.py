"""The command line on the CPU: `python -m moe_jax demo | info | bench [--decode | --train]`."""

import json
import pathlib
import re
import sys
import tomllib

import jax
import pytest

from moe_jax.__main__ import main
from moe_jax.cli import decode_bench, layer_bench, layer_report, train_bench


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
        "--variants",
        "jax_ragged_dot_bf16",
        "moe_jax_fp8",
        "moe_jax_fp8_unfused",
        "jax_mosaic_bf16",
        "moe_jax_fp8_graph",
        "moe_jax_fp8_fused_act",
        "moe_jax_fp8_fused_act_graph",
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
    if jax.default_backend() == "cpu":
        assert rows["jax_mosaic_bf16"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_graph"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_fused_act"]["skipped"] == "needs an NVIDIA GPU"
        assert rows["moe_jax_fp8_fused_act_graph"]["skipped"] == "needs an NVIDIA GPU"
    else:  # the Mosaic GPU ragged dot runs; "auto" picks a GPU GEMM backend
        assert rows["jax_mosaic_bf16"]["rel_err"] < 0.02
        graph = rows["moe_jax_fp8_graph"]  # skipped with a reason where DeepGEMM is missing
        assert graph.get("rel_err", 0.0) < 0.1
        assert not graph.get("skipped", "").startswith("failed:"), graph["skipped"]
        for name in ("moe_jax_fp8_fused_act", "moe_jax_fp8_fused_act_graph"):
            fused = rows[name]  # Hopper (and DeepGEMM) only: skipped with a reason elsewhere
            assert fused.get("rel_err", 0.0) < 0.1
            assert not fused.get("skipped", "").startswith("failed:"), fused["skipped"]
    assert png_path.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    assert "moe_jax_fp8" in captured.out and f"wrote {png_path}" in captured.out
    assert "[1/7] small jax_ragged_dot_bf16" in captured.err  # progress for long runs


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
    table = captured.out.splitlines()
    assert table[1].split()[:4] == ["shape", "variant", "fwd", "ms"]  # after the environment
    assert [line.split()[:2] for line in table[3:5]] == [[shape, "auto"], [shape, "torch_titan"]]
    assert f"[{shape}: T=" in captured.err and f"[2/2] {shape} torch_titan" in captured.err
    assert "{" not in captured.out + captured.err  # no raw JSON lines: one table


def test_bench_train_calls_the_train_bench(monkeypatch, tmp_path):
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
        (["bench", "--decode", "--shapes", "A"], "--shapes does not apply to --decode"),
        (["bench", "--train", "--tokens", "4"], "--tokens applies to bench --decode only"),
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


def test_bench_has_no_breakdown_option(capsys):
    """Each stage's time is a profiling tool: `python -m benchmarks.stage_breakdown`."""
    with pytest.raises(SystemExit):
        main(["bench", "--breakdown"])
    assert "unrecognized arguments: --breakdown" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [[], ["--decode"], ["--train"]], ids=["layer", "decode", "train"])
def test_bench_plot_without_matplotlib_fails_before_timing(monkeypatch, tmp_path, capsys, mode):
    """The refusal comes before any benchmark runs and names the extra that installs matplotlib."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    monkeypatch.setattr(layer_bench, "run_layer_bench", None)  # a bench that runs fails the test
    monkeypatch.setattr(decode_bench, "run_decode_bench", None)
    monkeypatch.setattr(train_bench, "run_train_bench", None)
    assert main(["bench", *mode, "--plot", str(tmp_path / "b.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install -e '.[notebooks]'" in err
    extras = tomllib.loads((pathlib.Path(__file__).parent.parent / "pyproject.toml").read_text())
    notebooks = extras["project"]["optional-dependencies"]["notebooks"]
    assert any(r.startswith("matplotlib") for r in notebooks)  # the extra named carries it
    assert not (tmp_path / "b.png").exists()


def test_json_is_written_when_the_plot_fails(tmp_path, capsys):
    path, png = tmp_path / "r.json", tmp_path / "r.png"

    def broken_plot(where):
        raise RuntimeError("no display")

    result = dict(environment={}, rows=[dict(shape="B", variant="v", ms=1.0)])
    status = layer_report.write_outputs(
        result, json_path=str(path), plot_path=str(png), draw=broken_plot
    )
    assert status == 1 and json.loads(path.read_text()) == result
    err = capsys.readouterr().err
    assert f"--plot {png} failed: RuntimeError: no display; the results are in {path}" in err


@pytest.mark.slow
def test_bench_writes_its_json_before_a_failing_plot(monkeypatch, tmp_path):
    """End to end: the rows reach the JSON file, and the command exits 1, when the plot fails."""

    def broken_plot(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(layer_report, "plot", broken_plot)
    path = tmp_path / "b.json"
    argv = ["bench", "--shapes", "small", "--variants", "jax_ragged_dot_bf16", "--iters", "1"]
    assert main([*argv, "--json", str(path), "--plot", str(tmp_path / "b.png")]) == 1
    (row,) = json.loads(path.read_text())["rows"]
    assert row["variant"] == "jax_ragged_dot_bf16" and row["ms"] > 0


def test_train_table_gives_each_skip_reason_once_in_one_line():
    reason = "NoImplementationError: no grouped GEMM runs GemmProblem(n=256,\n  k=256): no GPU"
    timed = {"fwd ms": 3.5, "step ms": 17.25, "step latency ms": 7.8, "err_dx": 4.7e-3}
    rows = [
        dict(shape="small", variant="auto", **timed),
        *(dict(shape="small", variant=v, skipped=reason) for v in ("deep_gemm", "torch")),
        dict(shape="small", variant="deep_gemm_mosaic_wgrad", skipped="other"),
    ]
    table = train_bench.format_table(rows)
    lines = table.splitlines()
    assert lines[0].split()[:6] == ["shape", "variant", "fwd", "ms", "step", "ms"]
    assert lines[2].split()[:5] == ["small", "auto", "3.500", "17.250", "7.800"]
    assert lines[3].split() == ["small", "deep_gemm", "skipped", "[1]"]
    assert lines[4].split() == ["small", "torch", "skipped", "[1]"]
    assert lines[5].split() == ["small", "deep_gemm_mosaic_wgrad", "skipped", "[2]"]
    one_line = "[1] NoImplementationError: no grouped GEMM runs GemmProblem(n=256, k=256): no GPU"
    assert lines[6] == one_line and lines[7] == "[2] other"
    assert table.count("GemmProblem") == 1


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusals off a GPU")
def test_bench_train_prints_a_shared_refusal_once(capsys):
    """The DeepGEMM variants refuse off a GPU for one reason, printed once for the three."""
    variants = ["deep_gemm", "deep_gemm_nt_dgrad", "deep_gemm_mosaic_wgrad"]
    assert main(["bench", "--train", "--variants", *variants, "--iters", "1"]) == 0
    captured = capsys.readouterr()
    assert (captured.out + captured.err).count("DeepGEMM runs on NVIDIA GPUs only") == 1
    assert [line.split()[-1] for line in captured.out.splitlines()[3:6]] == ["[1]"] * 3


def test_bench_table_columns_fit_the_longest_variant_name():
    timed = dict(ms=0.9, tflops=600.0, rel_err=4.3e-2, latency_ms=1.2)
    rows = [
        dict(shape="B", variant="moe_jax_fp8", **timed),
        dict(shape="B", variant="moe_jax_fp8_fused_act_graph", **timed),
        dict(shape="B", variant="moe_jax_bf16", skipped="no GPU"),
    ]
    lines = layer_report.format_table(rows).splitlines()
    header, short, long = lines[0], lines[2], lines[3]
    # the "ms" column ends at the same place in the header and in every timed row
    assert short.index("0.900") + 5 == long.index("0.900") + 5 == header.index("ms") + 2
    assert lines[4].split() == ["B", "moe_jax_bf16", "skipped", "[1]"]
    assert lines[5] == "[1] no GPU"


def test_bench_table_gives_the_first_call_where_it_was_timed():
    timed = dict(ms=0.9, tflops=600.0, rel_err=4.3e-2, latency_ms=1.2)
    rows = [
        dict(shape="B", variant="moe_jax_fp8", first_call_s=61.25, **timed),
        dict(shape="B", variant="torch_deep_gemm_fp8", **timed),  # no first call of its own
    ]
    lines = layer_report.format_table(rows).splitlines()
    assert lines[0].endswith("latency ms 1st call s")
    assert lines[2].split()[-2:] == ["1.200", "61.2"]
    assert lines[2].index("61.2") + 4 == len(lines[0])  # right-aligned under its header
    assert lines[3].split()[-2:] == ["1.200", "-"]
    assert "1st call s: the first call, compilation included" in lines[4]
