"""`moe_jax.registry`: names, refusals, "auto", lazy imports; and, per op registry, that "auto"
takes "xla" on the CPU and that the implementation chosen is the one that ran (tokamax's
`correct_implementation_used`)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
from moe_jax import act_quant, grouped_gemm, permute, registry
from moe_jax.registry import (
    AUTO,
    FunctionImpl,
    NoImplementationError,
    OpProblem,
    Registry,
    current_platform,
)


@dataclasses.dataclass(frozen=True)
class Problem:
    platform: str
    size: int = 1


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    platforms: tuple[str, ...] = ("cpu", "gpu")
    max_size: int = 100

    def unsupported_reason(self, problem: Problem) -> str | None:
        if problem.platform not in self.platforms:
            return f"runs on {self.platforms}, not {problem.platform}"
        if problem.size > self.max_size:
            return f"size {problem.size} > {self.max_size}"
        return None


def _ops(*impls: Impl, preference=("fast", "medium", "slow"), modules=None) -> Registry:
    ops = Registry("toy op", preference=lambda problem: preference, modules=modules)
    for impl in impls:
        ops.register(impl)
    return ops


FAST = Impl("fast", platforms=("gpu",))
MEDIUM = Impl("medium", max_size=10)
SLOW = Impl("slow")


def test_names_are_sorted_and_get_returns_the_registered_object():
    ops = _ops(SLOW, FAST, MEDIUM)
    assert ops.names() == ("fast", "medium", "slow")
    assert ops.get("medium") is MEDIUM


def test_unknown_name_lists_the_valid_ones():
    ops = _ops(FAST, SLOW)
    with pytest.raises(ValueError, match=r"unknown toy op implementation 'cutlass'") as error:
        ops.select("cutlass", Problem("cpu"))
    assert "['auto', 'fast', 'slow']" in str(error.value)


def test_a_named_refusal_raises_with_its_reason():
    ops = _ops(FAST, SLOW)
    with pytest.raises(NoImplementationError, match=r"fast: runs on \('gpu',\), not cpu") as error:
        ops.select("fast", Problem("cpu"))
    assert error.value.refusals == {"fast": "runs on ('gpu',), not cpu"}
    assert isinstance(error.value, NotImplementedError)


def test_auto_takes_the_first_in_preference_that_runs():
    ops = _ops(FAST, MEDIUM, SLOW)
    assert ops.select(AUTO, Problem("gpu")) is FAST
    assert ops.select(AUTO, Problem("cpu")) is MEDIUM
    assert ops.select(AUTO, Problem("cpu", size=50)) is SLOW
    assert ops.preference(Problem("cpu")) == ("fast", "medium", "slow")


def test_auto_keeps_every_reason_in_preference_order_when_all_refuse():
    ops = _ops(FAST, MEDIUM, SLOW)
    with pytest.raises(NoImplementationError) as error:
        ops.select(AUTO, Problem("cpu", size=500))
    assert list(error.value.refusals) == ["fast", "medium", "slow"]
    assert error.value.refusals["medium"] == "size 500 > 10"
    assert error.value.refusals["slow"] == "size 500 > 100"
    for name in ("fast", "medium", "slow"):
        assert f"{name}: " in str(error.value)


def test_first_accepting_takes_names_in_the_order_given_or_none():
    ops = _ops(FAST, MEDIUM, SLOW)
    assert ops.first_accepting(("slow", "medium"), Problem("cpu")) is SLOW
    assert ops.first_accepting(("fast", "medium"), Problem("cpu", size=5)) is MEDIUM
    assert ops.first_accepting(("fast", "medium"), Problem("cpu", size=50)) is None
    assert ops.first_accepting((), Problem("gpu")) is None
    with pytest.raises(ValueError, match="unknown toy op implementation 'nope'"):
        ops.first_accepting(("nope",), Problem("cpu"))


def test_names_left_out_of_the_preference_run_only_when_named():
    ops = _ops(FAST, SLOW, preference=("fast",))
    with pytest.raises(NoImplementationError):
        ops.select(AUTO, Problem("cpu"))
    assert ops.select("slow", Problem("cpu")) is SLOW


def test_an_implementation_object_is_used_as_given_after_its_check():
    ops = _ops(SLOW)
    unregistered = Impl("mine")
    assert ops.select(unregistered, Problem("cpu")) is unregistered
    with pytest.raises(NoImplementationError, match="mine"):
        ops.select(Impl("mine", platforms=("tpu",)), Problem("cpu"))
    with pytest.raises(TypeError, match="unsupported_reason"):
        ops.select(42, Problem("cpu"))


def test_registration_rejects_duplicates_and_reserved_names():
    ops = _ops(SLOW)
    assert ops.register(SLOW) is SLOW  # the same object again is harmless (a re-import)
    with pytest.raises(ValueError, match="named 'slow' is already registered"):
        ops.register(Impl("slow"))
    with pytest.raises(ValueError, match="other than 'auto'"):
        ops.register(Impl(AUTO))
    with pytest.raises(ValueError, match="needs a name"):
        ops.register(Impl(""))


def test_reasons_cover_every_implementation():
    ops = _ops(FAST, MEDIUM, SLOW)
    assert ops.reasons(Problem("cpu")) == {
        "fast": "runs on ('gpu',), not cpu",
        "medium": None,
        "slow": None,
    }


def test_modules_are_imported_on_first_use_only(tmp_path, monkeypatch):
    """A listed module registers its implementation when first asked for; one that cannot be
    imported stays listed and says why."""
    (tmp_path / "toy_ops.py").write_text(
        textwrap.dedent(
            """
            from moe_jax.registry import Registry
            OPS = Registry(
                "toy op",
                preference=lambda problem: ("lazy", "base"),
                modules={"lazy": "toy_lazy", "broken": "toy_broken"},
            )
            """
        )
    )
    (tmp_path / "toy_lazy.py").write_text(
        "from moe_jax.registry import FunctionImpl\n"
        "from toy_ops import OPS\n"
        "OPS.register(FunctionImpl('lazy', lambda: 'lazy ran'))\n"
    )
    (tmp_path / "toy_broken.py").write_text("import a_module_that_does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("toy_ops", "toy_lazy", "toy_broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import toy_ops

    toy_ops.OPS.register(FunctionImpl("base", lambda: "base ran"))
    assert toy_ops.OPS.names() == ("base", "broken", "lazy")
    assert "toy_lazy" not in sys.modules
    chosen = toy_ops.OPS.select(AUTO, OpProblem(platform="cpu", dtype="float32"))
    assert "toy_lazy" in sys.modules and chosen.name == "lazy" and chosen() == "lazy ran"
    reasons = toy_ops.OPS.reasons(OpProblem(platform="cpu", dtype="float32"))
    assert reasons["lazy"] is None and reasons["base"] is None
    assert reasons["broken"].startswith("cannot be imported")
    with pytest.raises(ImportError):
        toy_ops.OPS.get("broken")


def test_function_impl_calls_its_function_and_refuses_by_its_rule():
    double = FunctionImpl("double", lambda x, *, by=2: x * by)
    assert double(3) == 6 and double(3, by=3) == 9
    assert double.unsupported_reason(OpProblem(platform="tpu", dtype="int32")) is None
    picky = FunctionImpl("picky", abs, lambda p: None if p.platform == "gpu" else "GPU only")
    assert picky.unsupported_reason(OpProblem(platform="cpu", dtype="int32")) == "GPU only"


def test_pallas_then_xla():
    assert registry.pallas_then_xla(OpProblem(platform="gpu", dtype="bfloat16")) == (
        "pallas",
        "xla",
    )
    assert registry.pallas_then_xla(OpProblem(platform="cpu", dtype="bfloat16")) == ("xla",)


# --- every op registry: "auto" on the CPU, and the chosen implementation is the one that ran ---


class _Recording:
    """Stands in for the implementation a registry chose, recording each use of it."""

    def __init__(self, impl, calls: list[str]):
        self._impl, self._calls = impl, calls
        self.name = impl.name

    def unsupported_reason(self, problem):
        return self._impl.unsupported_reason(problem)

    def __call__(self, *args, **kwargs):
        self._calls.append(self.name)
        return self._impl(*args, **kwargs)

    def __getattr__(self, attr):
        value = getattr(self._impl, attr)
        if attr in ("contiguous", "masked"):

            def method(*args, **kwargs):
                self._calls.append(f"{self.name}.{attr}")
                return value(*args, **kwargs)

            return method
        return value


def _record(monkeypatch, ops: Registry) -> tuple[list[str], list[str]]:
    """(names chosen by ops.select, uses of the chosen implementations) from now on."""
    chosen, ran = [], []
    select = ops.select

    def recording_select(choice, problem):
        impl = select(choice, problem)
        chosen.append(impl.name)
        return _Recording(impl, ran)

    monkeypatch.setattr(ops, "select", recording_select)
    return chosen, ran


IDS = jnp.array([[0, 2], [1, 1], [3, -1]], jnp.int32)
X = jnp.arange(3 * 128, dtype=jnp.float32).reshape(3, 128) / 100


def _run_permute():
    return permute.permute(X, IDS, num_experts=3, alignment=4)


# Built before any recording starts: the permute chooses its own VJP's unpermute by name, which
# a recorded run of the unpermute would count as a choice of "xla".
XLA_LAYOUT = permute.permute(X, IDS, num_experts=3, alignment=4, impl="xla")


def _run_unpermute():
    return permute.unpermute(XLA_LAYOUT.rows, XLA_LAYOUT.inverse, jnp.ones(IDS.shape))


def _run_count():
    return permute.count_expert_num_tokens(IDS, 3)


def _run_routing_metadata():
    return permute.routing_metadata(IDS, num_experts=3, alignment=4, num_rows=24)


def _run_group_quant():
    return act_quant.group_quant(X)


def _run_act_quant():
    return act_quant.act_and_quant(jnp.concatenate([X, X], axis=1))


OPS = [
    pytest.param(permute.PERMUTES, _run_permute, id="permute"),
    pytest.param(permute.UNPERMUTES, _run_unpermute, id="unpermute"),
    pytest.param(permute.COUNTS, _run_count, id="count"),
    pytest.param(permute.ROUTING_METADATA, _run_routing_metadata, id="routing_metadata"),
    pytest.param(act_quant.GROUP_QUANTS, _run_group_quant, id="group_quant"),
    pytest.param(act_quant.ACT_QUANTS, _run_act_quant, id="act_and_quant"),
]


@pytest.mark.parametrize(("ops", "run"), OPS)
def test_op_registry_lists_its_kernels_and_auto_runs_the_chosen_one(monkeypatch, ops, run):
    assert {"xla", "pallas", "pallas_interpret"} <= set(ops.names())
    problem = OpProblem(platform=jax.default_backend(), dtype="float32", activation="silu")
    expected = ops.preference(problem)[0]
    if jax.default_backend() == "cpu":
        assert ops.preference(problem) == ("xla",) and expected == "xla"
    chosen, ran = _record(monkeypatch, ops)
    jax.block_until_ready(run())
    assert chosen and set(chosen) == {expected}
    assert ran and set(ran) == {expected}, "the chosen implementation must be the one that ran"


def test_gemm_registry_auto_runs_the_chosen_backend(monkeypatch):
    """fused_moe(experts="auto") asks the GEMM registry once per GEMM and runs what it chose."""
    chosen, ran = _record(monkeypatch, grouped_gemm.GEMMS)
    rng = np.random.default_rng(41)
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((2, 32, 32)) / 6, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((2, 32, 16)) / 4, jnp.float32)
    ids = jnp.array([[0], [1], [1], [0]], jnp.int32)
    out = moe_jax.fused_moe(x, w1, w2, jnp.ones((4, 1)), ids, experts="auto")
    jax.block_until_ready(out)
    if jax.default_backend() == "cpu":
        assert chosen == ["xla", "xla"]
    assert len(chosen) == 2 and len(ran) == 2
    assert ran == [f"{name}.contiguous" for name in chosen]


def test_current_platform_follows_the_default_device():
    """ "auto" decides for where the computation runs: jax.default_device when set, else the
    default backend."""
    assert current_platform() == jax.default_backend()
    with jax.default_device(jax.devices("cpu")[0]):
        assert current_platform() == "cpu"
    with jax.default_device("cpu"):
        assert current_platform() == "cpu"


def test_xla_experts_choose_xla_in_every_stage_on_a_gpu_too():
    """experts="xla" names the pure-XLA reference of every stage, the backward's weight gradient
    included: on a GPU, where "auto" would take the Pallas kernels, each stage still picks XLA."""
    from moe_jax import grouped_gemm_backward
    from moe_jax.experts_by_name import resolve_experts

    experts = resolve_experts("xla")
    gemm = grouped_gemm.GemmProblem(
        layout="contiguous",
        n=32,
        k=32,
        num_experts=2,
        num_pairs=8,
        x_dtype="float32",
        w_dtype="float32",
        platform="gpu",
        alignment=8,
    )
    assert grouped_gemm_backward.WGRADS.preference(gemm)[0] != "xla"  # "auto" would not be XLA
    assert grouped_gemm_backward.WGRADS.select(experts.wgrad, gemm).name == "xla"
    assert grouped_gemm.GEMMS.select(experts.gemm, gemm).name == "xla"
    op = OpProblem(platform="gpu", dtype="float32", activation="silu")
    for ops in (permute.PERMUTES, permute.UNPERMUTES):
        assert ops.select(experts.permute_impl, op).name == "xla", ops.op
    assert act_quant.ACT_QUANTS.select(experts.act_quant_impl, op).name == "xla"
