"""`import moe_jax` and the default `fused_moe` on a CPU import no GPU kernel, no optional
dependency (flax, torch, transformers, ...; installed here) and patch nothing in JAX: the kernels'
modules (`moe_jax.kernels.*`, which import Pallas Triton or Mosaic GPU) load
only when a kernel runs, and the lowering fixes they carry (`kernels/_wide_offsets.py`,
`kernels/_fp8_dot.py`) install only then. Checked in a fresh interpreter, since the test
process itself has imported the kernels (interpret_backends.py)."""

from __future__ import annotations

import json
import subprocess
import sys

OPTIONAL = ("flax", "torch", "transformers", "safetensors", "optax", "matplotlib")
FORBIDDEN_PREFIXES = (
    "moe_jax.kernels.",
    "jax.experimental.pallas.triton",
    "jax.experimental.pallas.mosaic_gpu",
    "jax.experimental.mosaic",
    "jax._src.pallas.triton",
    "jax._src.pallas.mosaic_gpu",
)

# Imports moe_jax, runs the default layer on small float32 inputs on the CPU, and prints the
# modules loaded after each step and which of the kernels' patches of the Pallas Triton lowering
# are in place (looked for only if that module is loaded: the check imports nothing).
SCRIPT = """
import json, sys
import jax
jax.config.update("jax_platforms", "cpu")
import jax.numpy as jnp
import moe_jax

after_import = sorted(sys.modules)
T, H, I, E, k = 8, 128, 128, 4, 2
keys = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(keys[0], (T, H), jnp.float32)
w1 = jax.random.normal(keys[1], (E, 2 * I, H), jnp.float32) * 0.05
w2 = jax.random.normal(keys[2], (E, H, I), jnp.float32) * 0.05
weights, ids = moe_jax.fused_topk(jax.random.normal(keys[3], (T, E)), k)
y = moe_jax.fused_moe(x, w1, w2, weights, ids)
jax.block_until_ready(y)
lowering = sys.modules.get("jax._src.pallas.triton.lowering")
patched = []
if lowering is not None:
    from jax import lax
    rules = ((lowering._compute_offsets_from_indices, "_moe_jax_wide_byte_offsets"),
             (lowering.triton_lowering_rules.get(lax.dot_general_p),
              "_moe_jax_fp8_imprecise_accumulation"))
    patched = [mark for rule, mark in rules if getattr(rule, mark, False)]
print(json.dumps(dict(after_import=after_import, after_call=sorted(sys.modules),
                      patched=patched, shape=list(y.shape))))
"""


def _forbidden(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(FORBIDDEN_PREFIXES) or m.split(".")[0] in OPTIONAL]


def test_import_and_default_layer_on_cpu_load_no_kernel_and_patch_nothing():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["shape"] == [8, 128]
    assert _forbidden(report["after_import"]) == [], "imported by `import moe_jax`"
    assert _forbidden(report["after_call"]) == [], "imported by fused_moe on the CPU"
    assert report["patched"] == [], "JAX's Pallas Triton lowering patched"
