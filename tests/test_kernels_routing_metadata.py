"""The contiguous layout's routing metadata (`moe_jax.permute.routing_metadata`, each
`ROUTING_METADATA` implementation; the Pallas one in one kernel, `moe_jax.kernels.routing_metadata`,
also at non-default configs) against the NumPy loops of `oracles.routing_metadata`, which the XLA
reference `moe_jax.layouts.routing_metadata` equals too, so all are bit for bit the same (its rank
methods on both sides of `expert_rank.PAIRWISE_MAX_PAIRS`: tests/test_layouts.py).

Integer sums; the kernel's only atomics are its ticket and "done" counters. Interpret mode runs
the programs one after another in ticket order, so no program waits and the arithmetic is the
compiled kernel's; the spin-wait, the barriers and Triton's indexing and masking run on the GPU
alone (`-m gpu`, which also runs layer shapes A and B and decode sizes, repeatedly, to catch an
ordering race)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest
from contract import impl_params, runs_or_skip

from moe_jax import layouts
from moe_jax import permute as permute_front
from moe_jax.kernels import routing_metadata as kernel
from moe_jax.kernels.routing_metadata import RoutingMetadataConfig, heuristic_config

IMPLS = impl_params(permute_front.ROUTING_METADATA)  # every name, interpret twins too
FIELDS = ("inverse", "num_tokens_per_expert", "expert_ends", "source", "expert_ids")


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
    config: RoutingMetadataConfig | None = None  # None: the heuristic
    extra_rows: int = 0  # rows past contiguous_num_rows: padding too

    def __str__(self):
        return self.name

    @property
    def num_rows(self) -> int:
        needed = layouts.contiguous_num_rows(
            self.num_tokens, self.topk, self.num_experts, self.alignment
        )
        return needed + self.extra_rows


# Several chunks, steps per chunk, histogram steps and padding steps per program.
MANY_BLOCKS = RoutingMetadataConfig(block_p=16, block_c=32, block_r=2, block_m=16)
CI_PROBLEMS = [
    Problem("dups_and_out_of_range", 7, 3, 5, alignment=4),
    Problem("one_token", 1, 1, 1, alignment=128, id_low=0, id_high=0),
    Problem("one_token_invalid", 1, 2, 3, id_low=-2, id_high=-3),
    Problem("no_tokens", 0, 4, 3),
    Problem("e_not_power_of_2_align_128", 37, 8, 33, alignment=128),
    Problem("alignment_1", 9, 2, 4, alignment=1),
    Problem("alignment_1_all_valid", 9, 2, 4, alignment=1, id_low=0, id_high=0),
    Problem("expert_map_holes", 9, 4, 4, alignment=8, num_global=10),
    Problem("many_blocks", 97, 5, 7, config=MANY_BLOCKS),
    Problem("many_blocks_align_128", 61, 6, 12, alignment=128, config=MANY_BLOCKS),
    Problem("duplicate_heavy", 40, 8, 2, id_low=0, id_high=0, config=MANY_BLOCKS),
    Problem("more_rows_than_needed", 13, 2, 3, alignment=4, extra_rows=21),
    Problem("experts_past_128", 50, 4, 130, alignment=8),
    # One chunk holding every expert's padding (decode: T*k = 8 pairs over 256 experts).
    Problem("decode_one_token", 1, 8, 256, alignment=128, id_low=0, id_high=0),
    Problem("decode_eight_tokens", 8, 8, 256, alignment=128),
    # Past routing_metadata.MAX_UNROLLED_STEPS: pair, histogram, expert and tail steps are loops.
    Problem(
        "looped_steps",
        70,
        8,
        40,
        alignment=40,
        config=RoutingMetadataConfig(block_p=16, block_c=256, block_r=1, block_m=2),
    ),
]


def _local_ids(problem: Problem) -> np.ndarray:
    rng = np.random.default_rng(oracles.seed("routing_metadata", problem.name))
    shape = (problem.num_tokens, problem.topk)
    if problem.num_global is None:  # raw ids: the kernel itself must send these nowhere
        ids = rng.integers(problem.id_low, problem.num_experts + problem.id_high, shape)
        if problem.topk > 1:
            ids[::3, 1] = ids[::3, 0]  # duplicate experts in a row
        return ids
    ids = rng.integers(-2, problem.num_global + 2, shape)
    local = rng.permutation(problem.num_global)
    expert_map = np.where(local < problem.num_experts, local, -1)
    return oracles.local_ids(ids, problem.num_experts, expert_map)


def _run(impl: str, local: jax.Array, problem: Problem) -> layouts.RoutingMetadata:
    """The reference, the front's `impl` (skipped with its reason where it cannot run here), or
    with a config the kernel itself (interpret mode for "pallas_interpret")."""
    kwargs = dict(
        num_experts=problem.num_experts, alignment=problem.alignment, num_rows=problem.num_rows
    )
    if impl == "reference":
        return layouts.routing_metadata(local, **kwargs)
    registry = permute_front.ROUTING_METADATA
    runs_or_skip(registry.get(impl), permute_front.problem_for(local))
    if problem.config is None or impl == "xla":
        return permute_front.routing_metadata(local, **kwargs, impl=impl)
    return kernel.routing_metadata(
        local, **kwargs, config=problem.config, interpret=impl == "pallas_interpret"
    )


def _assert_equal(got: layouts.RoutingMetadata, want, problem) -> None:
    shapes = dict(
        inverse=(problem.num_tokens, problem.topk),
        num_tokens_per_expert=(problem.num_experts,),
        expert_ends=(problem.num_experts,),
        source=(problem.num_rows,),
        expert_ids=(problem.num_rows,),
    )
    for name in FIELDS:
        g = getattr(got, name)
        w = want[name] if isinstance(want, dict) else getattr(want, name)
        assert g.dtype == jnp.int32 and g.shape == shapes[name], (name, g.dtype, g.shape)
        np.testing.assert_array_equal(g, w, err_msg=f"{name} of {problem}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("problem", CI_PROBLEMS, ids=str)
def test_routing_metadata_matches_oracle(impl, problem):
    local = _local_ids(problem)
    got = _run(impl, jnp.asarray(local, jnp.int32), problem)
    want = oracles.routing_metadata(
        local, problem.num_experts, alignment=problem.alignment, num_rows=problem.num_rows
    )
    _assert_equal(got, want, problem)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_routing_metadata_rejects_bad_inputs(impl):
    """The front checks once, whichever implementation computes."""
    ids = jnp.zeros((2, 2), jnp.int32)
    run = functools.partial(permute_front.routing_metadata, impl=impl)
    with pytest.raises(TypeError, match="local_ids"):
        run(jnp.zeros((2, 2)), num_experts=2, alignment=4, num_rows=12)
    with pytest.raises(ValueError, match="num_experts"):
        run(ids, num_experts=0, alignment=4, num_rows=12)
    with pytest.raises(ValueError, match="alignment"):
        run(ids, num_experts=2, alignment=0, num_rows=12)
    with pytest.raises(ValueError, match="num_rows=11"):
        run(ids, num_experts=2, alignment=4, num_rows=11)


def test_routing_metadata_config_rejects_bad_blocks():
    with pytest.raises(ValueError, match="block_c"):
        RoutingMetadataConfig(block_p=64, block_c=32)
    with pytest.raises(ValueError, match="block_m"):
        RoutingMetadataConfig(block_m=3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("num_tokens", "num_experts"),
    [(4096, 32), (8192, 128), (1, 256), (8, 256), (128, 256), (2048, 256), (16384, 256)],
    ids=["shape_A", "shape_B", "decode_1", "decode_8", "decode_128", "decode_2048", "T16K_E256"],
)
def test_compiled_kernel_equals_xla_repeatedly(num_tokens, num_experts):
    """Layer and decode shapes, 20 calls each back to back on fresh routings: a program that read
    the histogram before every chunk had stored it would give a wrong row somewhere."""
    rng = np.random.default_rng(oracles.seed("routing_metadata_gpu", num_tokens, num_experts))
    kwargs = dict(
        num_experts=num_experts,
        alignment=layouts.DEFAULT_ALIGNMENT,
        num_rows=layouts.contiguous_num_rows(num_tokens, 8, num_experts, 128),
    )
    routings = []
    for _ in range(20):
        ids = rng.integers(0, num_experts, (num_tokens, 8))
        ids[::7, 3] = ids[::7, 2]  # duplicate experts in a row
        ids[::5, 0] = -1  # slots routed nowhere
        routings.append(jnp.asarray(ids, jnp.int32))
    try:
        got = [kernel.routing_metadata(local, **kwargs) for local in routings]
        jax.block_until_ready(got)
    except Exception as error:  # a lowering failure: say which kernel, keep the cause
        raise AssertionError(
            f"compiled routing-metadata kernel failed at T={num_tokens} E={num_experts} "
            f"({heuristic_config(num_tokens * 8, num_experts)}): {type(error).__name__}: {error}"
        ) from error
    for i, (local, g) in enumerate(zip(routings, got, strict=True)):
        want = layouts.routing_metadata(local, **kwargs)
        for name in FIELDS:
            np.testing.assert_array_equal(
                getattr(g, name), getattr(want, name), err_msg=f"{name}, call {i}"
            )


def test_kernels_trace_under_x64():
    """With `jax_enable_x64` an int32 sum is int64 unless told otherwise: the metadata and count
    kernels failed to trace ("Invalid dtype for swap"); their sums now name int32."""
    ids = jnp.array([[1, 0], [1, 1], [-1, 5]], jnp.int32)
    with jax.enable_x64(True):
        got = permute_front.routing_metadata(
            ids, num_experts=2, alignment=4, num_rows=12, impl="pallas_interpret"
        )
        want = permute_front.routing_metadata(
            ids, num_experts=2, alignment=4, num_rows=12, impl="xla"
        )
        for name in ("inverse", "num_tokens_per_expert", "expert_ids", "source"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        counts = permute_front.count_expert_num_tokens(ids, 2, impl="pallas_interpret")
        np.testing.assert_array_equal(counts, [1, 3])
        mapped = permute_front.count_expert_num_tokens(
            ids, 1, expert_map=jnp.array([-1, 0], jnp.int32), impl="pallas_interpret"
        )
        np.testing.assert_array_equal(mapped, [3])
