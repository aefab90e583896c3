"""The one-process-per-GPU launcher (`moe_jax.distributed`) and the multi-GPU EP checks.

The launcher test runs on the CPU: two processes start jax.distributed and torch.distributed
(gloo) together and all-reduce through the group DeepEP would use. So do the script's "jax" and
"grad" parts (JAX-native EP and its gradients against single-device `fused_moe`, timed, then the
targets' lines), at a small size on two CPU processes; the DeepEP HT gradient check reports
the adapter's refusal without failing. The `multigpu` test runs
`scripts/ep_multigpu.py --quick` on 2 GPUs (DeepEP high-throughput + ContiguousExperts with
DeepGEMM FP8, DeepEP low-latency, and JAX-native EP, each against single-device fused_moe) and
skips with a reason when fewer than 2 GPUs are visible.
"""

from __future__ import annotations

import importlib.util
import json
import os

import jax
import pytest
import script_modules

from moe_jax import distributed

CHILD = """
import argparse, jax, torch, torch.distributed as dist
from moe_jax import distributed
parser = argparse.ArgumentParser()
distributed.add_arguments(parser)
ctx = distributed.init_from_args(parser.parse_args())
total = torch.ones(1) * (ctx.process_id + 1)
dist.all_reduce(total, group=ctx.group)
print(f"rank={ctx.process_id} jax_processes={jax.process_count()} sum={int(total.item())}")
distributed.shutdown_distributed()
"""


def test_launcher_starts_jax_and_torch_together(tmp_path):
    pytest.importorskip("torch", reason="torch.distributed is the group DeepEP takes")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = script_modules.run_distributed(script, num_processes=2, port=29641, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank={rank} jax_processes=2 sum=3" in proc.stdout


def test_launcher_reports_the_first_failure_and_stops_the_rest(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import sys, time\n"
        "rank = int(sys.argv[sys.argv.index('--process-id') + 1])\n"
        "sys.exit(3) if rank == 1 else time.sleep(60)\n"
    )
    status = distributed.launch([str(script)], num_processes=2, timeout_s=50)
    assert status == 3


def test_init_distributed_rejects_bad_arguments():
    pytest.importorskip("torch", reason="init_distributed starts torch.distributed")
    with pytest.raises(ValueError, match="host:port"):
        distributed.init_distributed(coordinator_address="nohost", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="process_id=2"):
        distributed.init_distributed(
            coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2
        )


@pytest.mark.slow
def test_jax_and_grad_parts_on_two_cpu_processes():
    """Each rank's EP gradients w.r.t. x, w1, w2 and topk_weights match fused_moe's within the
    script's bounds (float32 1e-5, bf16 3e-2, relative, norm-wise); the ragged transport's
    gradient lowers to ragged all-to-alls but is not run (XLA:CPU lacks them); the timings and
    the padded transport's target line come out."""
    pytest.importorskip("torch", reason="the launcher starts torch.distributed")
    sizes = "--experts 8 --topk 2 --jax-tokens 32 --grad-tokens 32 --jax-hidden 128 --jax-inter 64"
    proc = script_modules.run_distributed(
        "scripts/ep_multigpu.py", "--parts", "jax,grad", *sizes.split(), num_processes=2,
        port=29661, timeout=400, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    checks = {(r["rank"], r["check"]): r for r in rows if "check" in r}
    for rank in (0, 1):
        for dtype, bound in (("float32", 1e-5), ("bfloat16", 3e-2)):
            assert checks[rank, f"grad_ep[ragged,{dtype}]"]["lowered"] is True
            for arg in ("x", "w1", "w2", "topk_weights"):
                assert checks[rank, f"grad_ep[padded,{dtype}][{arg}]"]["rel_error"] < bound
        assert {"rank": rank, "failures": []} in rows
    jax_row = next(r for r in rows if r.get("timing") == "jax" and r["rank"] == 0)
    assert jax_row["padded_exchange_us"] > 0 and jax_row["auto_resolves_to"] == "padded"
    targets = {r["target"].split(" ")[0]: r for r in rows if "target" in r}
    assert targets["jax_ep[padded]"]["verdict"] in ("PASS", "MISS")
    for name in ("jax_ep[ragged]", "deep_ep_ht", "deep_ep_ll", "deep_ep_ll_graph"):
        assert targets[name]["verdict"] == "NOT MEASURED", name


@pytest.fixture
def script():
    yield from script_modules.loaded("ep_multigpu")


def test_the_deep_ep_gradient_is_reported_refused_not_failed(script, capsys):
    """Under jax.grad the DeepEP HT layer refuses before any DeepEP call (no buffer needed):
    the ht part reports that reason as a refused check and records no failure."""
    from moe_jax import ContiguousExperts, ModularMoE
    from moe_jax.expert_parallel import expert_map_for_rank
    from moe_jax.interop import deep_ep_ht, deep_ep_layouts

    ctx = distributed.DistributedContext(
        process_id=1, num_processes=2, local_device_id=None, group=None
    )
    problem = deep_ep_layouts.DeepEPProblem(
        num_ranks=2, rank=1, num_experts=4, num_tokens=8, hidden=128, num_topk=2
    )
    layer = ModularMoE(
        deep_ep_ht.DeepEPHighThroughput(buffer=None, problem=problem), ContiguousExperts()
    )
    inputs = script.global_problem(
        tokens=16, experts=4, topk=2, hidden=128, inter=128, fp8=True, seed=0
    )
    xr, ew, wr, idr, _ = script.local_slices(ctx, *inputs)
    script.ht_gradient(ctx, layer, expert_map_for_rank(4, 2, 1), (xr, ew, wr, idr), inputs)
    row = json.loads(capsys.readouterr().out)
    assert row["check"] == "grad_deep_ep_ht" and "torch callbacks" in row["refused"]
    assert script.FAILURES == []


def _num_gpus() -> int:
    return jax.device_count() if jax.default_backend() == "gpu" else 0


@pytest.mark.multigpu
@pytest.mark.skipif(_num_gpus() < 2, reason="needs 2 GPUs on one host (one process per GPU)")
def test_expert_parallel_on_two_gpus_matches_fused_moe():
    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep is not installed (pip install tokenspeed-deepep==1.2.1.post20251110)")
    proc = script_modules.run_distributed(
        "scripts/ep_multigpu.py", "--quick", num_processes=2, port=29651, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count('"failures": []') == 2
