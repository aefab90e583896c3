"""Today's code against an earlier commit's: benchmarks/bench_ratio.py on `bench --json` results,
and `gpu_check.sh baseline` end to end on the CPU (a baseline tree from
scripts/baseline_tree.sh)."""

from __future__ import annotations

import json
import shutil

import pytest
import script_modules


@pytest.fixture(scope="module")
def ratio():
    return script_modules.benchmark("bench_ratio")


def _bench_json(path, rows):
    path.write_text(json.dumps({"environment": {}, "rows": rows}))
    return str(path)


def _row(shape, variant, ms, latency_ms):
    return dict(shape=shape, variant=variant, ms=ms, latency_ms=latency_ms, rel_err=0.04)


def test_ratios_per_round_and_of_the_medians(ratio, tmp_path, capsys):
    skipped = dict(shape="B", variant="moe_jax_bf16", skipped="no GPU")
    base = [
        _bench_json(tmp_path / "b1.json", [_row("B", "fp8", 1.0, 1.3), _row("A", "fp8", 3.1, 3.2)]),
        _bench_json(tmp_path / "b2.json", [_row("B", "fp8", 1.2, 1.1), skipped]),
    ]
    cur = [
        _bench_json(tmp_path / "c1.json", [_row("B", "fp8", 0.9, 1.2), _row("A", "fp8", 3.0, 3.0)]),
        _bench_json(tmp_path / "c2.json", [_row("B", "fp8", 0.9, 1.0), skipped]),
    ]
    (entry,) = ratio.compare(ratio.load_runs(base), ratio.load_runs(cur))  # A not in every run
    assert entry["shape"] == "B" and entry["variant"] == "fp8"
    assert entry["baseline_ms"] == [1.0, 1.2] and entry["current_latency_ms"] == [1.2, 1.0]
    assert entry["round_ratios"] == pytest.approx([0.9, 0.75])
    assert entry["ms_ratio"] == pytest.approx(0.9 / 1.1)
    assert entry["latency_ms_ratio"] == pytest.approx(1.1 / 1.2)
    assert ratio.main(["--baseline", *base, "--current", *cur]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row == "| B | fp8 | 1.000 / 1.200 (1.300 / 1.100) | 0.900 / 0.900 (1.200 / 1.000) " + (
        "| 0.900 / 0.750 | 0.818, 0.917 |"
    )


def test_unusable_inputs_are_named(ratio, tmp_path, capsys):
    good = _bench_json(tmp_path / "good.json", [_row("B", "fp8", 1.0, 1.3)])
    other = _bench_json(tmp_path / "other.json", [_row("A", "fp8", 1.0, 1.3)])
    notbench = tmp_path / "list.json"
    notbench.write_text("[1, 2]")
    assert ratio.main(["--baseline", str(notbench), "--current", good]) == 2
    assert "list.json: not a `bench --json` result" in capsys.readouterr().err
    assert ratio.main(["--baseline", good, "--current", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    assert ratio.main(["--baseline", good, "--current", other]) == 2
    assert "no shape and variant was timed in every run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("git") is None or not (script_modules.ROOT / ".git").exists(),
    reason="needs a git checkout",
)
def test_gpu_check_baseline_times_the_baseline_tree_then_the_current_code(tmp_path):
    """The baseline tree of HEAD, marked so that its import shows in the log, against the
    installed code: one round of `bench` at the small shape on this machine's JAX backend."""
    tree = tmp_path / "baseline"
    made = script_modules.run_at_root(
        ["bash", "scripts/baseline_tree.sh", "HEAD", str(tree)], {}, 60
    )
    assert made.returncode == 0, made.stderr
    assert (tree / "COMMIT").read_text().strip() and (tree / "moe_jax" / "kernels").is_dir()
    with open(tree / "moe_jax" / "__init__.py", "a", encoding="utf-8") as init:
        init.write('\nprint("imported the baseline tree")\n')
    out = tmp_path / "out"
    env = {"OUT": str(out), "MOE_JAX_BASELINE_DIR": str(tree), "MOE_JAX_BASELINE_ROUNDS": "1"}
    bench = ["--shapes", "small", "--variants", "jax_ragged_dot_bf16", "--iters", "1"]
    done = script_modules.run_at_root(
        ["bash", "scripts/gpu_check.sh", "baseline", *bench], env, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    log = (out / "baseline.log").read_text()
    assert log.count("imported the baseline tree") == 1  # the baseline run only
    assert sorted(p.name for p in out.iterdir()) == [
        "baseline.log",
        "baseline_1.json",
        "current_1.json",
    ]
    assert "| small | jax_ragged_dot_bf16 |" in log


def test_gpu_check_baseline_without_a_tree_says_how_to_make_one(tmp_path):
    env = {"OUT": str(tmp_path), "MOE_JAX_BASELINE_DIR": str(tmp_path / "none")}
    done = script_modules.run_at_root(["bash", "scripts/gpu_check.sh", "baseline"], env, 60)
    assert done.returncode == 2
    assert "bash scripts/baseline_tree.sh COMMIT" in done.stderr
