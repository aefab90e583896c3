"""The package face: `moe_jax.__all__` is what a user calls, and the Flax layer and the Hugging
Face loaders are imported on first use (without Flax they name the extra:
tests/test_optional_dependencies.py; `import moe_jax` loads no optional dependency:
tests/test_import_hygiene.py)."""

from __future__ import annotations

import types

import pytest

import moe_jax

PUBLIC = [
    "AllToAllPrepareFinalize",
    "ContiguousExperts",
    "EPConfig",
    "ExpertWeights",
    "MaskedExperts",
    "MoE",
    "ModularMoE",
    "NoEPPrepareFinalize",
    "RouterConfig",
    "ep_fused_moe",
    "ep_moe",
    "expert_map_for_rank",
    "experts_names",
    "fused_moe",
    "fused_topk",
    "grouped_topk",
    "load_hf_moe",
    "moe_from_hf",
    "moe_from_pretrained",
    "moe_reference",
    "quant",
]
LAZY = {"MoE", "RouterConfig", "load_hf_moe", "moe_from_hf", "moe_from_pretrained"}


def test_all_is_the_public_face_and_dir_shows_it():
    assert sorted(moe_jax.__all__) == PUBLIC
    assert dir(moe_jax) == sorted([*PUBLIC, "__version__"])


def test_every_public_name_is_documented():
    pytest.importorskip("flax", reason="MoE and the loaders need flax (extra 'flax')")
    for name in PUBLIC:
        value = getattr(moe_jax, name)
        assert (value.__doc__ or "").strip(), f"moe_jax.{name} has no docstring"


def test_other_names_are_submodules_only():
    """Whatever else `import moe_jax` binds is a submodule that the import loaded (reached as
    `moe_jax.permute` etc.), never a re-exported function or class outside `__all__`."""
    for name, value in vars(moe_jax).items():
        if name.startswith("_") or name in PUBLIC:
            continue
        assert isinstance(value, types.ModuleType), f"moe_jax.{name} is not in __all__"
        assert value.__name__ == f"moe_jax.{name}", f"moe_jax.{name} is {value.__name__}"


def test_lazy_names_import_their_module_on_first_use():
    pytest.importorskip("flax", reason="MoE and the loaders need flax (extra 'flax')")
    from moe_jax import flax_layer, hf_loading

    assert moe_jax.MoE is flax_layer.MoE and moe_jax.RouterConfig is flax_layer.RouterConfig
    assert moe_jax.moe_from_pretrained is hf_loading.moe_from_pretrained
    namespace = {}
    exec("from moe_jax import *", namespace)
    assert set(PUBLIC) <= set(namespace)
    with pytest.raises(AttributeError, match="module 'moe_jax' has no attribute 'GEMMS'"):
        moe_jax.GEMMS  # noqa: B018  (in moe_jax.grouped_gemm)
