"""`scripts/gpu_check.sh`'s guard for the GPU a run is meant for (`MOE_JAX_REQUIRE_GPU`), on the
CPU: a stand-in `nvidia-smi` on PATH names the GPU."""

from __future__ import annotations

import os
import re
import sys

import pytest
import script_modules


def _fake_nvidia_smi(folder, name: str | None) -> str:
    """A PATH whose first folder holds an `nvidia-smi` printing `name` (none: no nvidia-smi
    answers, as on a machine without a GPU, where the command fails)."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + (f"echo '{name}'\n" if name else "exit 9\n"))
    script.chmod(0o755)
    return os.pathsep.join([str(folder), os.path.dirname(sys.executable), os.environ["PATH"]])


@pytest.mark.parametrize(
    "gpu, shown", [("NVIDIA H100 80GB HBM3", "'NVIDIA H100 80GB HBM3'"), (None, "'none found'")]
)
def test_another_gpu_runs_nothing_and_says_which_it_is(tmp_path, gpu, shown):
    out = tmp_path / "out"
    env = {"OUT": str(out), "MOE_JAX_REQUIRE_GPU": "H200"}
    env["PATH"] = _fake_nvidia_smi(tmp_path, gpu)
    done = script_modules.run_at_root(["bash", "scripts/gpu_check.sh", "baseline"], env, 60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"MOE_JAX_REQUIRE_GPU=H200 but this GPU is {shown}: nothing run" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["require_gpu.log"]  # no mode ran


def test_the_required_gpu_runs_the_mode(tmp_path):
    """On the named GPU the mode runs: here `baseline` without a baseline tree, which says how
    to make one (exit 2)."""
    env = {
        "OUT": str(tmp_path / "out"),
        "MOE_JAX_REQUIRE_GPU": "H200",
        "MOE_JAX_BASELINE_DIR": str(tmp_path / "none"),
        "PATH": _fake_nvidia_smi(tmp_path, "NVIDIA H200"),
    }
    done = script_modules.run_at_root(["bash", "scripts/gpu_check.sh", "baseline"], env, 60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "bash scripts/baseline_tree.sh COMMIT" in done.stderr


def test_the_peers_mode_names_variants_each_bench_knows():
    """`gpu_check.sh peers` runs `bench` with these arguments: each parses, and each variant is
    one its bench runs (a typo would cost a GPU run)."""
    from moe_jax import __main__ as cli
    from moe_jax import experts_names
    from moe_jax.cli import decode_bench, layer_bench, tokamax_peer, train_bench

    text = (script_modules.ROOT / "scripts" / "gpu_check.sh").read_text()
    block = text.split("\n  peers)", 1)[1].split(";;", 1)[0]
    runs = re.findall(r'"(--[^"$]+)"', block)
    assert len(runs) == 4, runs
    for run in runs:
        args = cli._parser().parse_args(["bench", *run.split()])
        if args.decode:
            known = {*experts_names(), *tokamax_peer.PEERS}
            known |= {name + decode_bench.BF16_SUFFIX for name in experts_names()}
        else:
            known = train_bench.VARIANTS if args.train else layer_bench.VARIANTS
        assert set(args.variants or ()) <= set(known), run


@pytest.mark.parametrize("listed, found", [(None, 0), ("GPU 0: NVIDIA H100 80GB HBM3", 1)])
def test_the_ep_mode_needs_two_gpus(tmp_path, listed, found):
    """`gpu_check.sh ep` on a host with fewer than 2 GPUs (`nvidia-smi -L` lists them) says so
    in its log and exits 3 at once: no one-GPU stand-in runs."""
    out = tmp_path / "out"
    env = {"OUT": str(out), "PATH": _fake_nvidia_smi(tmp_path, listed)}
    done = script_modules.run_at_root(["bash", "scripts/gpu_check.sh", "ep"], env, 30)
    assert done.returncode == 3, done.stdout + done.stderr
    said = f"ep: needs 2 or more GPUs on one host, found {found}: nothing run"
    assert said in done.stdout and said in (out / "ep.log").read_text()
