"""`moe_jax.plan`: the plan of one experts call at the benchmark shapes, named backends and
impossible combinations, `ContiguousExperts.apply` running what its plan says, and
`python -m moe_jax info --plan`.

The GPU plans are computed on the CPU (`platform="gpu"`); `gpu_host` makes this machine look like
the GPU host the benchmarks run on (a Hopper GPU, DeepGEMM installed, a jax whose Mosaic GPU emits
inline PTX), which the backends otherwise judge by this machine's installation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax.plan
from moe_jax import ContiguousExperts, fused_moe, permute, quant
from moe_jax.__main__ import main
from moe_jax.experts import ExpertsProblem
from moe_jax.fused_gemm1 import FusedGemm1, XlaFusedGemm1
from moe_jax.grouped_gemm import XlaGemm
from moe_jax.plan import THRESHOLDS, PlanError, Thresholds, plan


def _problem(tokens, experts, hidden, inter, *, topk=8, fp8=True, platform="gpu", **changes):
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    return ExpertsProblem(
        num_tokens=tokens,
        topk=topk,
        num_experts=experts,
        hidden=hidden,
        intermediate=inter,
        x_dtype=dtype,
        mid_dtype="bfloat16",
        group_size=128 if fp8 else None,
        weight_bytes=0,
        w_dtype=dtype,
        platform=platform,
        **changes,
    )


SHAPE_A = dict(tokens=4096, experts=32, hidden=7168, inter=2048)
SHAPE_B = dict(tokens=8192, experts=128, hidden=2048, inter=768)
DECODE = dict(tokens=32, experts=256, hidden=7168, inter=2048)


@pytest.fixture
def gpu_host(monkeypatch):
    """This machine as the benchmarks' GPU host: Hopper, DeepGEMM, jax with inline PTX."""
    from moe_jax.interop import deep_gemm
    from moe_jax.kernels import mosaic_fp8_gather
    from moe_jax.kernels import mosaic_fp8_gemm as mg

    monkeypatch.setattr(deep_gemm, "_library", lambda: (object(), None))
    monkeypatch.setattr(deep_gemm, "_gpu_arch", lambda: "9.0")
    monkeypatch.setattr(mg, "_compute_capability", lambda: mg.HOPPER)
    monkeypatch.setattr(mosaic_fp8_gather, "has_inline_ptx", lambda: True)
    return monkeypatch


def test_shape_a_runs_deep_gemm_unfused(gpu_host):
    p = plan(_problem(**SHAPE_A))
    assert (p.gemm1.name, p.gemm2.name, p.alignment) == ("deep_gemm", "deep_gemm", 128)
    assert not p.fuses_act_quant and p.arrange == "permute"
    assert (p.permute_impl, p.act_quant_impl, p.unpermute_impl) == ("pallas",) * 3
    assert p.dgrads is p.wgrads is None and p.recompute == "none"  # FP8 rows: inference only
    assert "FUSED_ACT_QUANT_MAX_K" in p.reasons["gemm1"]


def test_shape_a_trains_with_the_forwards_gemms_as_dgrads(gpu_host):
    p = plan(_problem(**SHAPE_A, fp8=False))
    assert [d.name for d in p.dgrads] == ["deep_gemm", "deep_gemm"]
    assert p.reasons["dgrad"] == "the forward's deep_gemm runs dy x w^T"


@pytest.mark.parametrize("shape", [SHAPE_A, SHAPE_B, DECODE], ids=["A", "B", "decode"])
def test_frozen_fp8_weights_run_float_rows_through_fp8_gemms_unfused(gpu_host, shape):
    """bf16 tokens with FP8 weights (fused_moe under jax.grad): the FP8 GEMMs of the FP8
    plan, quantizing the rows themselves; no act + quant kernel, no fused GEMM1, no wgrad."""
    fp8 = plan(_problem(**shape))
    p = plan(dataclasses.replace(_problem(**shape), x_dtype="bfloat16"))
    assert (p.gemm2.name, p.alignment) == (fp8.gemm2.name, fp8.alignment)
    assert not p.fuses_act_quant and p.arrange == "permute" and p.act_quant_impl is None
    assert p.wgrads is None and [d.name for d in p.dgrads] == [p.gemm1.name, p.gemm2.name]
    named = plan(
        dataclasses.replace(_problem(**shape, platform="cpu"), x_dtype="float32"),
        fused_act_quant="xla_gathered",  # left out: the GEMMs quantize float rows
    )
    assert named.gemm1.name == "xla" and named.arrange == "permute"


def test_shape_b_routes_and_gathers_its_rows_in_the_fused_gemm1(gpu_host):
    p = plan(_problem(**SHAPE_B))
    assert isinstance(p.gemm1, FusedGemm1) and p.gemm1.name == "mosaic_fp8_gathered"
    assert p.gathers_rows and p.arrange == "route" and p.permute_impl is None
    assert p.act_quant_impl is None and p.gemm2.name == "deep_gemm" and p.alignment == 128
    assert "GATHERED_MAX_N" in p.reasons["gemm1"]


def test_shape_b_on_a_jax_without_inline_ptx_says_why_it_permutes(gpu_host):
    from moe_jax.kernels import mosaic_fp8_gather

    gpu_host.setattr(mosaic_fp8_gather, "has_inline_ptx", lambda: False)
    p = plan(_problem(**SHAPE_B))
    assert p.gemm1.name == "mosaic_fp8" and p.fuses_act_quant and p.arrange == "permute"
    assert "inline PTX" in p.refusals["gemm1"]["mosaic_fp8_gathered"]


@pytest.mark.parametrize(
    ("tokens", "gemm", "alignment"),
    [(32, "pallas", 16), (512, "pallas", 32), (2048, "mosaic_fp8", 64), (8192, "deep_gemm", 128)],
)
def test_decode_sizes_follow_the_pairs_per_expert(gpu_host, tokens, gemm, alignment):
    """DeepSeek-V3's experts (E=256, k=8): 1, 16, 64 and 256 pairs per expert."""
    p = plan(_problem(**{**DECODE, "tokens": tokens}))
    assert (p.gemm1.name, p.gemm2.name, p.alignment) == (gemm, gemm, alignment)
    assert not p.fuses_act_quant


@pytest.mark.parametrize("shape", [SHAPE_A, SHAPE_B, DECODE], ids=["A", "B", "decode"])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_the_cpu_runs_xla_everywhere(shape, fp8):
    p = plan(_problem(**shape, fp8=fp8, platform="cpu"))
    assert (p.gemm1.name, p.gemm2.name, p.unpermute_impl, p.alignment) == ("xla",) * 3 + (16,)
    assert p.arrange == "permute" and p.permute_impl == "xla"
    assert p.act_quant_impl == ("xla" if fp8 else None)
    assert p.wgrads is None if fp8 else [w.name for w in p.wgrads] == ["xla", "xla"]
    assert p.dgrads is None if fp8 else [d.name for d in p.dgrads] == ["xla", "xla"]


def test_the_cpu_plan_imports_no_kernel_module():
    code = (
        "import sys\nfrom moe_jax.contiguous_experts import ContiguousExperts\n"
        "from moe_jax.experts import ExpertsProblem\n"
        "p = ExpertsProblem(num_tokens=64, topk=2, num_experts=4, hidden=256, intermediate=128,"
        " x_dtype='float8_e4m3fn', mid_dtype='bfloat16', group_size=128, weight_bytes=0)\n"
        "ContiguousExperts().plan(p)\n"
        "print(sorted(m for m in sys.modules if m.startswith('moe_jax.kernels.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_recipe_plans_fp8_gemms_and_bf16_weight_gradients(gpu_host):
    recipe = moe_jax.fp8_training.Fp8Training()
    p = plan(_problem(**SHAPE_B, fp8=False), recipe=recipe)
    assert p.gemm1.name == "deep_gemm" and not p.fuses_act_quant
    assert [d.name for d in p.dgrads] == ["deep_gemm", "deep_gemm"]  # FP8 dy x FP8 w^T
    assert [w.name for w in p.wgrads] == ["pallas", "pallas"]  # about 640 rows per expert
    p = plan(_problem(**SHAPE_A, fp8=False), recipe=recipe)  # about 1150 rows per expert
    if importlib.util.find_spec("torch") is None:  # torch's wgrad refuses; Pallas runs next
        assert "torch" in p.refusals["wgrad"] and [w.name for w in p.wgrads] == ["pallas"] * 2
    else:
        assert [w.name for w in p.wgrads] == ["torch", "torch"]


def test_named_backends_build_plans_too():
    p = plan(_problem(**SHAPE_B, platform="cpu"), gemm="xla", fused_act_quant="xla_gathered")
    assert p.gemm1.name == "xla_gathered" and p.arrange == "route" and p.gemm2.name == "xla"
    assert "as given" in p.reasons["gemm1"] and p.alignment == 16
    p = plan(_problem(**SHAPE_B, platform="cpu"), gemm="xla", alignment=128, wgrad="xla")
    assert p.alignment == 128 and p.reasons["alignment"] == "alignment=128 as given"
    spy = _SpyGemm()
    assert plan(_problem(**SHAPE_B, platform="cpu"), gemm=spy).gemm2 is spy


@pytest.mark.parametrize(
    ("choices", "problem", "match"),
    [
        (dict(gemm="deep_gemm"), {}, r"gemm='deep_gemm': .*NVIDIA GPUs only"),
        (dict(gemm="cutlass"), {}, r"gemm='cutlass': unknown grouped GEMM"),
        (dict(fused_act_quant="xla"), dict(fp8=False), r"fused_act_quant='xla': .*FP8 inference"),
        (
            dict(gemm="pallas_interpret", fused_act_quant="mosaic_fp8_interpret"),
            dict(num_tokens=32),
            r"fused_act_quant='mosaic_fp8_interpret': .*64-row blocks, not alignment 16",
        ),
        (dict(fused_act_quant="xla"), dict(group_size=64), r"fused_act_quant=.*groups of 128"),
        (dict(act_quant_impl="pallas"), {}, r"act_quant_impl='pallas': .*NVIDIA GPU"),
        (dict(wgrad="pallas"), dict(fp8=False), r"wgrad='pallas': .*NVIDIA GPU"),
        (dict(permute_impl="pallas"), {}, r"permute_impl='pallas': .*NVIDIA GPU"),
        (dict(recompute="some"), {}, r"recompute='some': choose from"),
        (
            dict(fused_act_quant="xla", recipe=moe_jax.fp8_training.Fp8Training()),
            dict(fp8=False),
            r"fused_act_quant='xla' runs FP8 inference only.*training recipe",
        ),
    ],
)
def test_impossible_choices_fail_at_plan_time_naming_the_argument(choices, problem, match):
    shape = _problem(**SHAPE_B, platform="cpu", fp8=problem.pop("fp8", True))
    with pytest.raises(ValueError, match=match):
        plan(dataclasses.replace(shape, **problem), **choices)


def test_a_plan_error_is_also_a_refusal():
    with pytest.raises(PlanError) as raised:
        plan(_problem(**SHAPE_B, platform="cpu"), gemm="deep_gemm")
    assert list(raised.value.refusals) == ["deep_gemm"]


def test_every_threshold_points_to_its_benchmarks_row():
    lines = inspect.getsource(moe_jax.plan).splitlines()
    for field in dataclasses.fields(Thresholds):
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{field.name}:"))
        assert lines[at - 1].strip() == f'# BENCHMARKS.md "Thresholds": {field.name}'
        assert isinstance(getattr(THRESHOLDS, field.name), int)


# --- ContiguousExperts.apply runs its plan ----------------------------------------------------


class _SpyGemm(XlaGemm):
    """The XLA GEMM, counting its calls."""

    name = "spy"

    def __init__(self):
        self.calls = 0

    def contiguous(self, *args, **kwargs):
        self.calls += 1
        return super().contiguous(*args, **kwargs)


class _SpyFused(XlaFusedGemm1):
    """The gathered XLA fused GEMM1, counting its calls."""

    def __init__(self):
        super().__init__(gathers_rows=True)
        self.name, self.calls = "spy_gathered", 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return super().run(*args, **kwargs)


def _fp8_inputs(num_tokens=12, num_experts=4, hidden=256, inter=128, topk=2):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((num_experts, 2 * inter, hidden)) / 16, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((num_experts, hidden, inter)) / 11, jnp.float32)
    w1, s1 = quant.per_block_quant_fp8(w1)
    w2, s2 = quant.per_block_quant_fp8(w2)
    ids = jnp.asarray(rng.integers(0, num_experts, (num_tokens, topk)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (num_tokens, topk)), jnp.float32)
    return (x, w1, w2, weights, ids), dict(w1_scale=s1, w2_scale=s2)


def test_apply_runs_the_stages_its_plan_names(monkeypatch):
    """The fused, gathering GEMM1 of the plan runs once, GEMM2 once, the layer routes (the
    permute never runs), and the plan it ran is the one `plan` gives for the call."""
    plans = []
    build = ContiguousExperts.plan
    monkeypatch.setattr(
        ContiguousExperts, "plan", lambda self, p: plans.append(build(self, p)) or plans[-1]
    )
    monkeypatch.setattr(permute, "permute", None)  # calling it fails the test
    gemm, fused = _SpyGemm(), _SpyFused()
    experts = ContiguousExperts(gemm=gemm, fused_act_quant=fused, alignment=128)
    args, scales = _fp8_inputs()
    got = fused_moe(*args, **scales, experts=experts)
    (p,) = plans
    assert p.gemm1 is fused and p.gemm2 is gemm and p.arrange == "route"
    assert (fused.calls, gemm.calls) == (1, 1)
    monkeypatch.undo()
    want = fused_moe(*args, **scales, experts="xla")
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.05, atol=0.05
    )


class _NoWideDgrad(_SpyGemm):
    """The spy GEMM, refusing problems with fewer output columns than reduction ones (GEMM2's
    dgrad, [rows, H] x [E, I, H] with I < H)."""

    def unsupported_reason(self, problem):
        return "n < k" if problem.n < problem.k else super().unsupported_reason(problem)


def test_a_dgrad_the_forwards_gemm_refuses_goes_to_auto():
    problem = _problem(12, 4, 256, 128, topk=2, fp8=False, platform="cpu")
    p = plan(problem, gemm=_NoWideDgrad())
    assert [d.name for d in p.dgrads] == ["spy", "xla"] and p.refusals["dgrad"]["spy"] == "n < k"


@pytest.mark.parametrize("fp8", [True, False], ids=["frozen_fp8", "float32"])
def test_the_backward_runs_the_plans_dgrads(monkeypatch, fp8):
    """jax.grad through the layer calls the plan's dgrad backends, once per GEMM."""
    spies = (_SpyGemm(), _SpyGemm())
    build = ContiguousExperts.plan
    monkeypatch.setattr(
        ContiguousExperts,
        "plan",
        lambda self, problem: dataclasses.replace(build(self, problem), dgrads=spies),
    )
    (x, w1, w2, weights, ids), scales = _fp8_inputs()
    if not fp8:  # the same weights in float32
        w1, w2 = (
            quant.dequant_per_block(w1, scales.pop("w1_scale")),
            quant.dequant_per_block(w2, scales.pop("w2_scale")),
        )

    def loss(x):
        return fused_moe(x, w1, w2, weights, ids, experts="xla", **scales).sum()

    jax.grad(loss)(x.astype(jnp.float32))
    assert [s.calls for s in spies] == [1, 1]


def test_apply_keeps_what_the_recompute_plan_saves():
    experts = ContiguousExperts(gemm="xla", recompute="all")
    args, _ = _fp8_inputs()
    x, w1, w2, weights, ids = (a.astype(jnp.float32) if a.dtype != jnp.int32 else a for a in args)
    grad = jax.grad(lambda w1: fused_moe(x, w1, w2, weights, ids, experts=experts).sum())(w1)
    assert grad.shape == w1.shape and bool(jnp.isfinite(grad).all())


# --- python -m moe_jax info --plan -------------------------------------------------------------


def _info_plan(capsys, shape, *extra):
    argv = ["info", "--plan", "--topk", "8", "--fp8", *extra]
    for flag, key in (("--tokens", "tokens"), ("--experts", "experts"), ("--hidden", "hidden")):
        argv += [flag, str(shape[key])]
    assert main([*argv, "--intermediate", str(shape["inter"])]) == 0
    return capsys.readouterr().out


def _stage(out: str, stage: str) -> str:
    return next(line.split(None, 1)[1] for line in out.splitlines() if line.split()[:1] == [stage])


def test_info_plan_prints_the_gpu_plans_of_a_b_and_decode(gpu_host, capsys):
    out = _info_plan(capsys, SHAPE_A, "--platform", "gpu")
    assert _stage(out, "gemm1") == "deep_gemm" and _stage(out, "gemm2") == "deep_gemm"
    assert _stage(out, "dgrad") == "none (FP8 rows: inference)"
    inference, frozen = out.split("under jax.grad (FP8 weights held constant, bf16 tokens):")
    assert _stage(frozen, "dgrad") == "deep_gemm / deep_gemm"
    assert "why: the forward's deep_gemm runs dy x w^T" in frozen
    assert "planned for gpu" in out if jax.default_backend() != "gpu" else True
    out = _info_plan(capsys, SHAPE_B, "--platform", "gpu")
    assert _stage(out, "arrange").startswith("route") and _stage(out, "gemm2") == "deep_gemm"
    assert _stage(out, "gemm1").startswith("mosaic_fp8_gathered (fused")
    out = _info_plan(capsys, DECODE, "--platform", "gpu")
    assert _stage(out, "gemm1") == "pallas" and _stage(out, "alignment") == "16 rows"
    assert "why: auto: FP8, 1 pairs per expert <= PALLAS_MAX_PAIRS_PER_EXPERT" in out


def test_info_plan_on_the_cpu_and_its_refusals(capsys):
    out = _info_plan(capsys, SHAPE_B, "--platform", "cpu")
    assert _stage(out, "gemm1") == "xla" and _stage(out, "alignment") == "16 rows"
    assert main(["info", "--plan", "--tokens", "8"]) == 2
    assert "needs --hidden --intermediate --experts --topk" in capsys.readouterr().err
    assert main(["info", "--tokens", "8"]) == 2
    assert "--tokens: for --plan only" in capsys.readouterr().err


def test_experts_names_lists_what_a_user_may_pass():
    """Without the tests' interpret twins (a fresh interpreter): no "_interpret" name."""
    code = "from moe_jax import experts_names; print(' '.join(experts_names()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names = out.stdout.split()
    assert "auto" in names and "deep_gemm_masked" in names and "xla+mosaic_fp8_gathered" in names
    assert not [name for name in names if "interpret" in name]
