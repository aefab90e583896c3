"""The grouped-GEMM registry (names, refusals, preference) and the XLA backend's argument checks;
every backend's results against the float64 loops: tests/test_contract_grouped_gemm.py."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from moe_jax.grouped_gemm import GEMMS, GemmProblem
from moe_jax.registry import NoImplementationError


def _problem(**changes) -> GemmProblem:
    base = dict(
        layout="contiguous",
        n=256,
        k=256,
        num_experts=4,
        num_pairs=256,
        x_dtype="float8_e4m3fn",
        w_dtype="float8_e4m3fn",
        platform="cpu",
        alignment=128,
    )
    return GemmProblem(**{**base, **changes})


def test_every_named_backend_is_listed_and_loads():
    names = GEMMS.names()
    assert {"deep_gemm", "torch", "mosaic", "pallas", "xla"} <= set(names)
    for name in names:
        assert GEMMS.get(name).name == name


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown grouped GEMM implementation 'cutlass'.*'xla'"):
        GEMMS.get("cutlass")


def test_a_named_backend_that_refuses_says_why():
    problem = _problem()
    with pytest.raises(NoImplementationError) as error:
        GEMMS.select("mosaic", problem)
    assert list(error.value.refusals) == ["mosaic"]
    assert error.value.refusals["mosaic"] == GEMMS.get("mosaic").unsupported_reason(problem)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_auto_picks_the_first_backend_in_preference_that_runs(platform):
    problem = _problem(platform=platform)
    chosen = GEMMS.select("auto", problem)
    assert chosen.unsupported_reason(problem) is None
    preference = GEMMS.preference(problem)
    for name in preference[: preference.index(chosen.name)]:
        assert GEMMS.get(name).unsupported_reason(problem) is not None
    if platform == "cpu":
        assert preference == ("xla",) and chosen.name == "xla"


def test_unknown_layout_is_refused():
    assert "layout" in GEMMS.get("xla").unsupported_reason(_problem(layout="ragged"))


def _fp8_operands():
    from moe_jax import quant

    xq, xs = quant.per_token_group_quant_fp8(jnp.ones((8, 256)))
    wq, ws = quant.per_block_quant_fp8(jnp.ones((2, 128, 256)))
    return dict(x=xq, w=wq, expert_ids=jnp.zeros(8, jnp.int32), x_scales=xs, w_scales=ws)


@pytest.mark.parametrize(
    "change,match",
    [
        # one scale for K = 256 was taken as a 256-column group
        (lambda o: dict(x_scales=o["x_scales"][:, :1]), r"x_scales\.shape=\(8, 1\)"),
        (lambda o: dict(w_scales=o["w_scales"][:, :, :1]), r"w_scales\.shape=\(2, 1, 1\)"),
        (lambda o: dict(expert_ids=jnp.zeros(7, jnp.int32)), r"expert_ids\.shape=\(7,\)"),
        (lambda o: dict(x=o["x"][:, :128], x_scales=o["x_scales"][:, :1]), r"one K"),
        (lambda o: dict(alignment=3), r"alignment=3.*multiple"),
    ],
)
def test_xla_contiguous_names_the_operand_at_fault(change, match):
    """The XLA backend checks what every backend takes (`check_contiguous_operands`) where it
    used to run wrong scales silently or fail in a reshape naming nothing."""
    operands = {**_fp8_operands(), "alignment": 8}
    operands.update(change(operands))
    with pytest.raises(ValueError, match=match):
        GEMMS.get("xla").contiguous(
            operands.pop("x"),
            operands.pop("w"),
            operands.pop("expert_ids"),
            None,
            out_dtype=jnp.float32,
            **operands,
        )
