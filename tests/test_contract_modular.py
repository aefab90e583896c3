"""Every PrepareFinalize that runs on a CPU paired with every Experts that consumes its
activation format (vLLM's modular-kernel combinations test): `ModularMoE(prepare_finalize,
experts)` against the float64 loop `oracles.fused_moe`, and each pair of mismatching formats
refused at construction.

Prepare/finalize: `NoEPPrepareFinalize` (standard rows), `MaskedPrepareFinalize` (the masked
blocks of DeepEP low latency, on one rank), `AllToAllPrepareFinalize` (JAX all-to-all, inside
`shard_map` on a one-device mesh; tests/test_expert_parallel.py runs 8 ranks). Experts:
`ContiguousExperts` and `MaskedExperts` with each grouped-GEMM name (`GEMMS`, the interpret twins
included); a GEMM whose plan refuses the problem here skips with the plan's reason. The pairing
is what this tests, so the problem is one small bf16 layer (the GEMMs' own contract is
tests/test_contract_grouped_gemm.py) with duplicate and out-of-range ids and negative weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import name_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import (
    AllToAllPrepareFinalize,
    ContiguousExperts,
    EPConfig,
    MaskedExperts,
    ModularMoE,
    NoEPPrepareFinalize,
)
from moe_jax.grouped_gemm import GEMMS
from moe_jax.plan import PlanError
from moe_jax.prepare_finalize import MaskedPrepareFinalize

pytestmark = pytest.mark.cpu_numerics  # XLA:CPU rounding (conftest.py)

T, H, I, E, K = 6, 64, 32, 4, 2  # noqa: E741 - DESIGN.md's dimension names
AXIS = "ep"

PREPARE_FINALIZES = {
    "no_ep": lambda: NoEPPrepareFinalize(),
    "masked": lambda: MaskedPrepareFinalize(num_experts=E),
    "all_to_all": lambda: AllToAllPrepareFinalize(EPConfig(axis_name=AXIS), num_experts=E),
}
EXPERTS = {"contiguous": ContiguousExperts, "masked": MaskedExperts}


def _consumes(pf_name: str, experts_name: str) -> bool:
    fmt = PREPARE_FINALIZES[pf_name]().activation_format
    return fmt in EXPERTS[experts_name].activation_formats


PAIRS = [(pf, ex) for pf in PREPARE_FINALIZES for ex in EXPERTS if _consumes(pf, ex)]
MISMATCHED = [(pf, ex) for pf in PREPARE_FINALIZES for ex in EXPERTS if not _consumes(pf, ex)]


def _inputs():
    rng = np.random.default_rng(oracles.seed("contract_modular"))
    x = rng.standard_normal((T, H)).astype(oracles.BF16)
    w1 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(oracles.BF16)
    w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(oracles.BF16)
    ids = np.array([[0, 0], [1, 3], [5, 2], [-1, 3], [2, 2], [3, -4]], np.int32)
    weights = rng.standard_normal((T, K)).astype(np.float32)  # negative weights too
    return x, w1, w2, weights, ids


def _run(layer: ModularMoE, pf_name: str, *args):
    if pf_name != "all_to_all":
        return jax.jit(layer)(*args)
    mesh = jax.make_mesh((1,), (AXIS,))
    mapped = jax.shard_map(layer, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False)
    sharding = NamedSharding(mesh, P(AXIS))  # the inputs laid out as the specs say
    return jax.jit(mapped)(*(jax.device_put(a, sharding) for a in args))


@pytest.mark.parametrize("gemm", name_params(GEMMS.names()))
@pytest.mark.parametrize(("pf_name", "experts_name"), PAIRS, ids=lambda v: v)
def test_every_pairing_matches_the_float64_loop(pf_name, experts_name, gemm):
    layer = ModularMoE(PREPARE_FINALIZES[pf_name](), EXPERTS[experts_name](gemm=gemm))
    x, w1, w2, weights, ids = _inputs()
    try:
        out = _run(layer, pf_name, *map(jnp.asarray, (x, w1, w2, weights, ids)))
    except PlanError as error:
        if gemm == "xla":
            raise
        pytest.skip(f"{gemm}: {error}")
    assert out.shape == (T, H) and out.dtype == jnp.bfloat16
    want = oracles.round_to(oracles.fused_moe(x, w1, w2, weights, ids), oracles.BF16)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize(("pf_name", "experts_name"), MISMATCHED, ids=lambda v: v)
def test_mismatched_formats_raise_at_construction(pf_name, experts_name):
    assert MISMATCHED, "every prepare/finalize pairs with every experts: nothing to refuse"
    pf = PREPARE_FINALIZES[pf_name]()
    with pytest.raises(ValueError, match=f"delivers the {pf.activation_format.value} activation"):
        ModularMoE(pf, EXPERTS[experts_name](gemm="xla"))


def test_the_pairings_cover_both_formats():
    """The lists above come from the classes' own formats: both formats are delivered and
    consumed, and one pairing is refused (the masked prepare with contiguous experts)."""
    assert {ex for _, ex in PAIRS} == set(EXPERTS)
    assert ("masked", "contiguous") in MISMATCHED
