"""The grouped-GEMM registry's names and the XLA backend's argument checks. The registry's rules
(unknown names, refusals, "auto") are tests/test_registry.py's, every backend's results against
the float64 loops tests/test_contract_grouped_gemm.py's."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from gemm_problems import DEEPSEEK_V3_FP8_GEMM1

from moe_jax.grouped_gemm import GEMMS


def test_every_named_backend_is_listed_and_loads():
    names = GEMMS.names()
    assert {"deep_gemm", "torch", "mosaic", "pallas", "xla"} <= set(names)
    for name in names:
        assert GEMMS.get(name).name == name


def test_unknown_layout_is_refused():
    ragged = dataclasses.replace(DEEPSEEK_V3_FP8_GEMM1, layout="ragged")
    assert "layout" in GEMMS.get("xla").unsupported_reason(ragged)


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
