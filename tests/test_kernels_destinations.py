"""Pallas contiguous-layout destinations (`moe_jax.kernels.contiguous_destinations`) against the
NumPy loop in `oracles.contiguous_destinations` and, bit for bit, the XLA reference
`moe_jax.layouts.contiguous_destinations`.

Integer sums with no atomics (each program owns its chunk's pairs): interpret mode computes the
compiled kernels' results exactly; only their Triton indexing and masking run on the GPU alone
(`-m gpu`, which also runs layer shapes A and B)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import expert_rank, kernels, layouts
from moe_jax import permute as permute_front
from moe_jax.kernels.destinations import DestinationsConfig, heuristic_config
from moe_jax.kernels.permute import routing_metadata
from moe_jax.registry import OpProblem

IMPLS = [
    pytest.param("reference"),
    pytest.param("pallas_interpret"),
    pytest.param("pallas", marks=pytest.mark.gpu),
]


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int
    num_experts: int
    alignment: int = 16
    id_low: int = -3  # raw ids drawn from [id_low, num_experts + id_high): both sides invalid
    id_high: int = 3
    num_global: int | None = None  # ids mapped through an expert_map with holes first
    config: DestinationsConfig | None = None  # None: the heuristic

    def __str__(self):
        return self.name


# Several chunks, several steps per chunk and several histogram steps per program.
MANY_BLOCKS = DestinationsConfig(block_p=16, block_c=64, block_r=2)
CI_PROBLEMS = [
    Problem("dups_and_out_of_range", 7, 3, 5, alignment=4),
    Problem("one_token", 1, 1, 1, alignment=128, id_low=0, id_high=0),
    Problem("one_token_invalid", 1, 2, 3, id_low=-2, id_high=-3),
    Problem("no_tokens", 0, 4, 3),
    Problem("e_not_power_of_2_align_128", 37, 8, 33, alignment=128),
    Problem("alignment_1", 9, 2, 4, alignment=1),
    Problem("expert_map_holes", 9, 4, 4, alignment=8, num_global=10),
    Problem("many_blocks", 97, 5, 7, config=MANY_BLOCKS),
    Problem("many_blocks_align_128", 61, 6, 12, alignment=128, config=MANY_BLOCKS),
    Problem("duplicate_heavy", 40, 8, 2, id_low=0, id_high=0, config=MANY_BLOCKS),
]


def _local_ids(problem: Problem) -> np.ndarray:
    rng = np.random.default_rng(oracles.seed("destinations", problem.name))
    shape = (problem.num_tokens, problem.topk)
    if problem.num_global is None:  # raw ids: the kernel itself must send these nowhere
        return rng.integers(problem.id_low, problem.num_experts + problem.id_high, shape)
    ids = rng.integers(-2, problem.num_global + 2, shape)
    local = rng.permutation(problem.num_global)
    expert_map = np.where(local < problem.num_experts, local, -1)
    return oracles.local_ids(ids, problem.num_experts, expert_map)


def _run(impl: str, local: jax.Array, problem: Problem):
    kwargs = dict(num_experts=problem.num_experts, alignment=problem.alignment)
    if impl == "reference":
        return layouts.contiguous_destinations(local, **kwargs)
    return kernels.contiguous_destinations(
        local, **kwargs, config=problem.config, interpret=impl == "pallas_interpret"
    )


def _assert_outputs(got, problem: Problem):
    inverse, counts, ends = got
    assert inverse.shape == (problem.num_tokens, problem.topk) and inverse.dtype == jnp.int32
    assert counts.shape == ends.shape == (problem.num_experts,)
    assert counts.dtype == ends.dtype == jnp.int32


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_destinations_match_oracle(impl, problem):
    local = _local_ids(problem)
    got = _run(impl, jnp.asarray(local, jnp.int32), problem)
    _assert_outputs(got, problem)
    want = oracles.contiguous_destinations(local, problem.num_experts, alignment=problem.alignment)
    for name, g, w in zip(("inverse", "counts", "ends"), got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} of {problem}")


@pytest.mark.parametrize("num_tokens", [512, 513])
def test_reference_ranks_equal_the_oracle_on_both_sides_of_the_pairwise_bound(num_tokens):
    """The XLA reference ranks up to `expert_rank.PAIRWISE_MAX_PAIRS` pairs by pairwise
    comparison and beyond in blocks (8 slots: 4096 pairs and 4104): both give the oracle's
    layout, invalid ids and duplicates included."""
    assert expert_rank.PAIRWISE_MAX_PAIRS == 4096
    problem = Problem(f"bound_{num_tokens}", num_tokens, 8, 24, alignment=16)
    local = _local_ids(problem)
    got = _run("reference", jnp.asarray(local, jnp.int32), problem)
    want = oracles.contiguous_destinations(local, problem.num_experts, alignment=problem.alignment)
    for name, g, w in zip(("inverse", "counts", "ends"), got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=f"{name} of {problem}")


@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_interpret_kernel_equals_xla_bitwise(problem):
    local = jnp.asarray(_local_ids(problem), jnp.int32)
    got = _run("pallas_interpret", local, problem)
    want = _run("reference", local, problem)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_front_chooses_through_the_registry():
    local = jnp.asarray([[1, 0], [1, 1]], jnp.int32)
    problem = permute_front.problem_for(local)
    # XLA on every platform: on the H200 the Pallas kernels are slower (xla_destinations_first).
    assert permute_front.DESTINATIONS.select("auto", problem).name == "xla"
    for impl in ("auto", "xla", "pallas_interpret"):
        inverse, counts, ends = permute_front.contiguous_destinations(
            local, num_experts=2, alignment=4, impl=impl
        )
        assert (inverse.tolist(), counts.tolist(), ends.tolist()) == (
            [[4, 0], [5, 6]],
            [1, 3],
            [4, 8],
        ), impl


def test_permute_metadata_takes_destinations_auto(monkeypatch):
    # The Pallas permute asks DESTINATIONS for "auto", which is XLA on every platform
    # (moe_jax.permute.xla_destinations_first); record what ran.
    assert permute_front.DESTINATIONS.preference(OpProblem(platform="gpu", dtype="int32")) == (
        "xla",
    )
    ran = []
    select = permute_front.DESTINATIONS.select

    def recording_select(choice, problem):
        impl = select(choice, problem)
        ran.append(impl.name)
        return impl

    monkeypatch.setattr(permute_front.DESTINATIONS, "select", recording_select)
    # A shape no other test traces: kernels.permute is jitted, and a cached trace selects nothing.
    ids = jnp.asarray(np.random.default_rng(3).integers(-1, 5, (11, 3)), jnp.int32)
    x = jnp.ones((11, 40), jnp.bfloat16)
    got = kernels.permute(x, ids, num_experts=4, alignment=4, interpret=True)
    assert ran == ["xla"]
    want = layouts.permute_reference(x, ids, num_experts=4, alignment=4)
    for field in ("expert_ids", "inverse", "num_tokens_per_expert", "expert_ends", "rows"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    # By name, the routing metadata runs the Pallas kernels (interpret twin) to the same bits.
    local = layouts.map_expert_ids(ids, num_experts=4)
    num_rows = layouts.contiguous_num_rows(11, 3, 4, 4)
    metadata = routing_metadata(
        local, num_experts=4, alignment=4, num_rows=num_rows, impl="pallas_interpret"
    )
    np.testing.assert_array_equal(metadata[0], want.inverse)
    assert ran[-1] == "pallas_interpret"


def test_heuristic_config_shapes():
    # Layer shapes A and B: 64 programs of 8 / 16 steps.
    assert heuristic_config(4096 * 8, 32) == DestinationsConfig(block_p=64, block_c=512)
    assert heuristic_config(8192 * 8, 128) == DestinationsConfig(block_p=64, block_c=1024)
    assert heuristic_config(1, 1).block_p == 16  # Triton blocks stay >= 16 lanes


def test_destinations_reject_bad_inputs():
    with pytest.raises(TypeError, match="local_ids"):
        kernels.contiguous_destinations(jnp.zeros((2, 2)), num_experts=2, alignment=4)
    with pytest.raises(ValueError, match="num_experts"):
        kernels.contiguous_destinations(jnp.zeros((2, 2), jnp.int32), num_experts=0, alignment=4)
    with pytest.raises(ValueError, match="alignment"):
        kernels.contiguous_destinations(jnp.zeros((2, 2), jnp.int32), num_experts=2, alignment=0)
    with pytest.raises(ValueError, match="block_c"):
        DestinationsConfig(block_p=64, block_c=32)
    with pytest.raises(ValueError, match="block_r"):
        DestinationsConfig(block_r=3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "num_experts"), [(4096, 32), (8192, 128)], ids=["shape_A", "shape_B"]
)
def test_compiled_kernel_equals_xla_at_layer_shapes(num_tokens, num_experts):
    rng = np.random.default_rng(oracles.seed("destinations_gpu", num_tokens))
    ids = rng.integers(0, num_experts, (num_tokens, 8))
    ids[::7, 3] = ids[::7, 2]  # duplicate experts in a row
    ids[::5, 0] = -1  # slots routed nowhere
    local = jnp.asarray(ids, jnp.int32)
    kwargs = dict(num_experts=num_experts, alignment=layouts.DEFAULT_ALIGNMENT)
    try:
        got = jax.block_until_ready(kernels.contiguous_destinations(local, **kwargs))
    except Exception as error:  # a lowering failure: say which kernel, keep the cause
        raise AssertionError(
            f"compiled destinations kernel failed at T={num_tokens} E={num_experts} "
            f"({heuristic_config(num_tokens * 8, num_experts)}): {type(error).__name__}: {error}"
        ) from error
    want = layouts.contiguous_destinations(local, **kwargs)
    for name, g, w in zip(("inverse", "counts", "ends"), got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg=name)
