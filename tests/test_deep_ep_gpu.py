"""DeepEP low-latency through moe_jax on one GPU (marked `gpu`; needs `deep_ep`).

DeepEP needs a torch process group, which this pytest process (JAX already started) cannot join
through `jax.distributed`; so the test launches `benchmarks/deep_ep_ll_bench.py --quick` as one
process through `python -m moe_jax.distributed`. Its checks: a moe_jax dispatch's valid rows,
scales and counts equal a direct DeepEP dispatch's, and `ModularMoE(DeepEPLowLatency,
MaskedExperts)` (DeepEP FP8 dispatch, masked DeepGEMM, DeepEP combine) matches single-device
`fused_moe` within 5e-2 relative error (vLLM's FP8 bound). The command-buffer mode runs the same
way (`--graph`).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import script_modules


def _run_ll_bench(port: int, *args: str) -> str:
    if importlib.util.find_spec("deep_ep") is None:
        pytest.skip("deep_ep is not installed (pip install tokenspeed-deepep==1.2.1.post20251110)")
    script = "benchmarks/deep_ep_ll_bench.py"
    proc = script_modules.run_distributed(script, *args, num_processes=1, port=port, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert '"failures": []' in proc.stdout
    return proc.stdout


@pytest.mark.gpu
def test_low_latency_layer_on_one_gpu_matches_fused_moe_and_direct_deep_ep():
    _run_ll_bench(29631, "--quick")


@pytest.mark.gpu
def test_low_latency_command_buffer_mode_equals_eager_and_replays_without_python():
    """`DeepEPLowLatency(command_buffer_compatible=True)`: round trips bit-equal to the eager
    adapter (also on fresh input buffers), the layer within FP8 tolerance of fused_moe, and XLA
    replaying its captures (fewer DeepEP host calls while timing than calls made)."""
    out = _run_ll_bench(29632, "--graph", "--skip-eager-timing", "--samples", "4", "--burst", "4")
    timing = next(
        json.loads(line) for line in out.splitlines() if '"timing": "graph_round_trip"' in line
    )
    calls = (4 + 2) * 2 * 4  # (samples + warm-ups) x 2 DeepEP calls x burst, all from Python
    assert timing["host_calls_while_timing"] < calls, timing
