"""Token layouts (`moe_jax.layouts`) exactly against the loops in `oracles`: the masked layout, the
rank methods of the contiguous layout and wide ids. The contiguous layout, the counts and the
unpermute are their ops' "xla" implementations, held to the same oracles (bit for bit against the
references for the permute) by tests/test_kernels_{permute,count,unpermute}.py."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import oracles
import pytest

from moe_jax import expert_rank, layouts


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    num_tokens: int
    topk: int
    num_experts: int
    hidden: int = 128
    id_low: int = -2  # ids from [id_low, num_experts + id_high): out of range on both sides
    id_high: int = 2
    num_global: int | None = None  # use an expert_map over this many global experts
    only_experts: tuple[int, ...] | None = None

    def __str__(self):
        return self.name


PROBLEMS = [
    Problem("T7_k3_E5_dups_oob", 7, 3, 5),
    Problem("T1_k1_E1", 1, 1, 1, id_low=0, id_high=0),
    Problem("T0_k2_E3", 0, 2, 3),
    Problem("T13_k4_E6_H256", 13, 4, 6, hidden=256),
    Problem("T9_k4_E4_map_holes", 9, 4, 4, num_global=10),
    Problem("T6_k3_E16_empty_experts", 6, 3, 16, only_experts=(0, 3, 15)),
    Problem("T4_k2_E3_all_invalid", 4, 2, 3, id_low=-3, id_high=-4),
    Problem("T33_k2_E4_valid", 33, 2, 4, id_low=0, id_high=0),
]


def _routing(problem: Problem, rng):
    shape = (problem.num_tokens, problem.topk)
    expert_map = None
    if problem.only_experts is not None:
        ids = rng.choice(np.array(problem.only_experts), size=shape)
    elif problem.num_global is not None:
        ids = rng.integers(-2, problem.num_global + 2, size=shape)
        expert_map = np.full(problem.num_global, -1, np.int32)
        owners = rng.choice(problem.num_global, problem.num_experts, replace=False)
        expert_map[owners] = np.arange(problem.num_experts)
    else:
        ids = rng.integers(problem.id_low, problem.num_experts + problem.id_high, size=shape)
    if problem.num_tokens and problem.topk > 1 and problem.id_low <= 0 < problem.num_experts:
        ids[0, :2] = 0  # a duplicate expert in one row
    return ids.astype(np.int32), expert_map


def _tokens(problem: Problem, rng, *, fp8: bool):
    x = rng.standard_normal((problem.num_tokens, problem.hidden)).astype(np.float32)
    if not fp8:
        return x, None
    q, s = oracles.per_token_group_quant_fp8(x)
    return q, s


def _eq(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32}
    if actual.dtype.kind not in "iub":  # floats (incl. ml_dtypes): compare bits
        assert actual.dtype == expected.dtype
        actual, expected = (a.view(bits[a.dtype.itemsize]) for a in (actual, expected))
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize(
    "fp8,max_m", [(False, None), (True, 1), (False, 3)], ids=["float32-all", "fp8-1", "float32-3"]
)
@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
def test_masked_layout_reference_matches_oracle(problem, fp8, max_m):
    """max_m None -> T (capacity: a token takes one row per expert, so nothing drops); a small
    max_m drops (token, expert) rows past it, counted in num_dropped."""
    rng = np.random.default_rng(oracles.seed("masked", str(problem), fp8, max_m))
    ids, expert_map = _routing(problem, rng)
    x, x_scales = _tokens(problem, rng, fp8=fp8)
    max_m = max(problem.num_tokens, 1) if max_m is None else max_m
    lay = jax.jit(
        lambda x, ids, s, m: layouts.masked_layout_reference(
            x, ids, num_experts=problem.num_experts, max_m=max_m, x_scales=s, expert_map=m
        )
    )(*(None if a is None else jnp.asarray(a) for a in (x, ids, x_scales, expert_map)))
    ref = oracles.masked_layout(
        x, ids, problem.num_experts, max_m=max_m, expert_map=expert_map, x_scales=x_scales
    )
    _eq(lay.rows, ref["rows"])
    _eq(lay.inverse, ref["inverse"])
    _eq(lay.num_tokens_per_expert, ref["num_tokens_per_expert"])
    assert int(lay.num_dropped) == ref["num_dropped"]
    if fp8:
        _eq(lay.row_scales, ref["row_scales"])
    if max_m >= problem.num_tokens:
        assert int(lay.num_dropped) == 0


def test_masked_layout_overflow_example():
    """Expert 0 is picked by tokens 0, 1 (twice) and 2 with room for 2: tokens 0 and 1 stay, and
    token 1's two slots share its one row."""
    x = jnp.arange(4.0)[:, None] * jnp.ones((1, 8))
    lay = layouts.masked_layout_reference(
        x, jnp.array([[0, 1], [0, 0], [1, 0]]), num_experts=2, max_m=2
    )
    assert lay.inverse.tolist() == [[0, 2], [1, 1], [3, -1]]
    assert lay.num_tokens_per_expert.tolist() == [2, 2]
    assert int(lay.num_dropped) == 1
    assert lay.rows[:, :, 0].tolist() == [[0.0, 1.0], [0.0, 2.0]]


def test_count_with_map_ignores_ids_outside_the_map_and_nonlocal_entries():
    expert_map = jnp.array([-1, 1, 0, 5])  # 5 is not a valid local id for E_local = 2
    ids = jnp.array([[0, 1, 2], [3, 4, -1], [1, 1, 2]])
    assert layouts.count_expert_num_tokens(ids, 2, expert_map).tolist() == [2, 3]


def test_layout_docstring_example():
    """The worked example in the module docstring."""
    lay = layouts.permute_reference(
        jnp.arange(4.0).reshape(2, 2), jnp.array([[1, 0], [1, 1]]), num_experts=2, alignment=4
    )
    assert lay.expert_ids.tolist() == [0, -1, -1, -1, 1, 1, 1, -1, -1, -1, -1, -1]
    assert lay.inverse.tolist() == [[4, 0], [5, 6]]
    assert lay.expert_ends.tolist() == [4, 8]


# --- contiguous_destinations: every rank method against a loop over pairs -------------------


def _destinations_by_loop(ids, num_experts: int, alignment: int):
    """(inverse, counts, ends) of the contiguous layout by one pass over the pairs in (token,
    slot) order: a pair's rank is how many pairs of its expert came before it."""
    ids = np.asarray(ids)
    rank = []
    counts = [0] * num_experts
    for e in ids.reshape(-1).tolist():
        if 0 <= e < num_experts:
            rank.append(counts[e])
            counts[e] += 1
        else:
            rank.append(None)
    ends, row = [], 0
    for c in counts:
        row += -(-c // alignment) * alignment
        ends.append(row)
    inverse = [
        -1 if r is None else ends[e] - -(-counts[e] // alignment) * alignment + r
        for e, r in zip(ids.reshape(-1).tolist(), rank, strict=True)
    ]
    return np.array(inverse, np.int64).reshape(ids.shape), np.array(counts), np.array(ends)


def _pair_ids(num_tokens: int, topk: int, num_experts: int, rng, *, hot: bool = False):
    """int32[T, k] ids in [-2, E + 2) (invalid on both sides), with the first two slots of every
    third token on one expert; `hot` sends about 70% of pairs to expert 0, so blocks carry long
    runs of one expert into the next."""
    ids = rng.integers(-2, num_experts + 2, size=(num_tokens, topk))
    if hot:
        ids = np.where(rng.random(ids.shape) < 0.7, 0, ids)
    if topk > 1:
        ids[::3, 1] = ids[::3, 0]
    return ids.astype(np.int32)


# (T, k, E, alignment): T=0, T=1, k=1, E=1; P = 255, 256 and 257 straddle `expert_rank.BLOCK`
# (256); 768 is three whole blocks, 1000 and 2056 are not multiples of the block. Each method
# runs on every shape; which one `contiguous_destinations` picks is tested below.
DESTINATION_SHAPES = [
    (0, 8, 4, 4),
    (1, 1, 1, 1),
    (1, 8, 3, 4),
    (300, 2, 1, 8),
    (255, 1, 5, 4),
    (256, 1, 5, 4),
    (257, 1, 5, 4),
    (64, 8, 24, 16),
    (513, 1, 7, 1),
    (96, 8, 32, 128),
    (125, 8, 6, 4),
    (257, 8, 32, 128),
]


@pytest.mark.parametrize("hot", [False, True], ids=["uniform", "hot"])
@pytest.mark.parametrize("shape", DESTINATION_SHAPES, ids=lambda s: "T{}_k{}_E{}_a{}".format(*s))
@pytest.mark.parametrize("method", expert_rank.METHODS)
def test_contiguous_destinations_methods_match_loop(method, shape, hot):
    num_tokens, topk, num_experts, alignment = shape
    rng = np.random.default_rng(oracles.seed("destinations", shape, hot))
    ids = _pair_ids(num_tokens, topk, num_experts, rng, hot=hot)
    got = jax.jit(
        lambda i: layouts.contiguous_destinations(
            i, num_experts=num_experts, alignment=alignment, method=method
        )
    )(jnp.asarray(ids))
    want = _destinations_by_loop(ids, num_experts, alignment)
    for name, g, w in zip(("inverse", "counts", "ends"), got, want, strict=True):
        assert g.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} by {method}")


# Pair counts around the block size B.
BLOCK_SIZES = {
    "0": lambda b: 0,
    "B-1": lambda b: b - 1,
    "B": lambda b: b,
    "B+1": lambda b: b + 1,
    "3B": lambda b: 3 * b,
    "3B+B/2+1": lambda b: 3 * b + b // 2 + 1,
}


@pytest.mark.parametrize("triangular_max_blocks", [0, expert_rank.TRIANGULAR_PREFIX_MAX_BLOCKS])
@pytest.mark.parametrize("block", [1, 7, 16])
@pytest.mark.parametrize("size", list(BLOCK_SIZES))
def test_rank_blocked_at_block_boundaries(size, block, triangular_max_blocks):
    """Ranks and counts of `expert_rank.rank_blocked` on both sides of block boundaries, the
    blocks prefixed by the masked sum and (triangular_max_blocks=0) by the cumsum over blocks."""
    num_pairs = BLOCK_SIZES[size](block)
    num_experts = 5
    rng = np.random.default_rng(oracles.seed("rank_blocked", num_pairs, block))
    ids = _pair_ids(num_pairs, 1, num_experts, rng, hot=bool(num_pairs % 2))
    rank, counts = expert_rank.rank_blocked(
        jnp.asarray(ids.reshape(-1)),
        num_experts=num_experts,
        block=block,
        triangular_max_blocks=triangular_max_blocks,
    )
    inverse, want_counts, _ = _destinations_by_loop(ids, num_experts, alignment=1)
    is_valid = (ids.reshape(-1) >= 0) & (ids.reshape(-1) < num_experts)
    starts = np.cumsum(want_counts) - want_counts
    want_rank = inverse.reshape(-1) - starts[np.clip(ids.reshape(-1), 0, num_experts - 1)]
    assert rank.shape == (num_pairs,) and rank.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(rank)[is_valid], want_rank[is_valid])
    np.testing.assert_array_equal(np.asarray(counts), want_counts)


def test_contiguous_destinations_picks_the_rank_method_by_size(monkeypatch):
    """Pairwise up to `expert_rank.PAIRWISE_MAX_PAIRS` pairs, blocked above; `method` overrides."""
    assert expert_rank.method_for(0) == "pairwise"
    assert expert_rank.method_for(expert_rank.PAIRWISE_MAX_PAIRS) == "pairwise"
    assert expert_rank.method_for(expert_rank.PAIRWISE_MAX_PAIRS + 1) == "blocked"
    assert expert_rank.method_for(1 << 20) == "blocked"
    called = []

    def spy(name, ranker):
        def ranked(*args, **kwargs):
            called.append(name)
            return ranker(*args, **kwargs)

        return ranked

    spies = {n: spy(n, r) for n, r in expert_rank.RANKERS.items()}
    monkeypatch.setattr(expert_rank, "RANKERS", spies)
    topk = 8
    bound = expert_rank.PAIRWISE_MAX_PAIRS // topk
    for num_tokens in (bound, bound + 1):  # 4096 and 4104 pairs
        ids = jnp.zeros((num_tokens, topk), jnp.int32)
        layouts.contiguous_destinations(ids, num_experts=2, alignment=4)
    layouts.contiguous_destinations(ids, num_experts=2, alignment=4, method="pairwise")
    assert called == ["pairwise", "blocked", "pairwise"]
    with pytest.raises(ValueError, match="unknown rank method"):
        layouts.contiguous_destinations(ids, num_experts=2, alignment=4, method="scan")


def test_64_bit_ids_int32_cannot_hold_go_nowhere():
    """Under `jax_enable_x64` the id 2**32 + 1 used to wrap to expert 1 in the cast to int32 (and
    an expert_map entry the same way); now such ids count nowhere, as any id outside [0, E)."""
    from moe_jax import fused_moe
    from moe_jax.reference import moe_reference

    with jax.enable_x64(True):
        big = 2**32 + 1
        ids = jnp.array([[big, 0], [-big, 1]], jnp.int64)
        np.testing.assert_array_equal(layouts.ids_as_int32(ids), [[-1, 0], [-1, 1]])
        np.testing.assert_array_equal(layouts.count_expert_num_tokens(ids, 2), [1, 1])
        expert_map = jnp.array([big, 0], jnp.int64)
        np.testing.assert_array_equal(
            layouts.map_expert_ids(jnp.array([[0, 1]]), num_experts=2, expert_map=expert_map),
            [[-1, 0]],
        )
        x = jnp.ones((1, 8), jnp.float32)
        w1, w2 = jnp.ones((2, 4, 8), jnp.float32) / 8, jnp.ones((2, 8, 2), jnp.float32)
        far = jnp.array([[big]], jnp.int64)
        for experts in ("xla", "xla_masked"):
            out = fused_moe(x, w1, w2, jnp.ones((1, 1), jnp.float32), far, experts=experts)
            np.testing.assert_array_equal(out, np.zeros((1, 8)))
        ref = moe_reference(x, w1, w2, jnp.ones((1, 1), jnp.float32), far)
        np.testing.assert_array_equal(ref, np.zeros((1, 8)))
    with pytest.raises(TypeError, match=r"ids\.dtype=float32"):
        layouts.ids_as_int32(jnp.zeros((2,), jnp.float32))
