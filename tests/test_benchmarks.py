"""The tools of benchmarks/ (`python -m benchmarks.gemm_sweep`, `.kernel_gaps`,
`.stage_breakdown`) on the CPU."""

import doctest
import json
import shutil

import jax
import pytest
import script_modules

from moe_jax.cli import layer_bench, timing
from moe_jax.kernels import mosaic_fp8_gemm

gemm_sweep = script_modules.benchmark("gemm_sweep")
kernel_gaps = script_modules.benchmark("kernel_gaps")
stage_breakdown = script_modules.benchmark("stage_breakdown")


@pytest.mark.slow
def test_gemm_sweep_checks_and_ranks_every_config(tmp_path, capsys):
    """Tiny shape, GEMM2 (interpret mode off a GPU): the heuristic matches float32, every
    candidate matches the heuristic within the sweep's tolerance, results come best first."""
    path = tmp_path / "sweep.json"
    argv = ["--shape", "tiny", "--tokens", "2", "--gemms", "2", "--samples", "1", "--burst", "1"]
    argv += ["--alignment", "32", "--json", str(path)]
    assert gemm_sweep.main(argv) == 0
    report = json.loads(path.read_text())
    assert report["alignment"] == 32
    (entry,) = report["report"]
    assert entry["tokens"] == 2 and entry["gemm"] == 2 and entry["rel_error"] < 1e-5
    assert entry["alignment"] == 32
    results = entry["results"]
    assert "heuristic" in {r["config"] for r in results}
    assert len({r["config"] for r in results}) == len(results) > len(gemm_sweep.CANDIDATES) // 2
    assert all("failed" not in r for r in results), results
    if jax.default_backend() == "cpu":  # interpret mode: the same float32 sums in every tiling
        assert all(r["rel_to_heuristic"] < 1e-4 for r in results)
    times = [r["us"] for r in results]
    assert times == sorted(times) and all(r["gbs"] > 0 for r in results)
    assert "T=2 GEMM2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gemm_sweep.main(["--alignment", "24"])
    assert "multiple of 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gemm_sweep.main(["--burst", "0"])
    assert "pass positive counts" in capsys.readouterr().err


@pytest.mark.slow
def test_gemm_sweep_times_the_mosaic_kernel_on_64_row_segments(tmp_path, monkeypatch):
    """`--candidates mosaic`: the heuristic (the Pallas kernel) and every Mosaic config that
    fits, the Mosaic kernel's own heuristic labelled, each checked against the heuristic
    (interpret mode off a GPU; the first config of groups of one and of two, as interpret mode
    is slow)."""
    groups = {c.group_blocks: c for c in reversed(gemm_sweep.MOSAIC_CANDIDATES)}
    monkeypatch.setattr(gemm_sweep, "MOSAIC_CANDIDATES", (groups[1], groups[2]))
    path = tmp_path / "sweep.json"
    argv = ["--shape", "tiny", "--tokens", "2", "--gemms", "2", "--samples", "1", "--burst", "1"]
    argv += ["--alignment", "64", "--candidates", "mosaic", "--json", str(path)]
    assert gemm_sweep.main(argv) == 0
    (entry,) = json.loads(path.read_text())["report"]
    names = {r["config"] for r in entry["results"]}
    assert len(names) == 1 + len(gemm_sweep.MOSAIC_CANDIDATES)
    assert "heuristic" in names and sum(n.startswith("mosaic") for n in names) == 2
    assert any(" g1 " in n for n in names) and any(" g2 " in n for n in names)
    # GEMM2's K of one block, half a row block per expert: the default config, named as such
    (own,) = [n for n in names if n.endswith("[mosaic heuristic]")]
    assert own.startswith(gemm_sweep._describe(mosaic_fp8_gemm.MosaicFp8GemmConfig()))
    assert all("failed" not in r for r in entry["results"]), entry["results"]


def test_kernel_gaps_summary_counts_overlaps_once_and_ranks_gaps():
    events = [  # given out of order; "c" runs on a second stream inside "b"
        kernel_gaps.KernelEvent("d", 100.0, 10.0),
        kernel_gaps.KernelEvent("a", 0.0, 10.0),
        kernel_gaps.KernelEvent("b", 30.0, 40.0),
        kernel_gaps.KernelEvent("c", 40.0, 5.0),
        kernel_gaps.KernelEvent("e", 111.0, 1.0),
    ]
    s = kernel_gaps.summarize(events, top=2)
    assert (s.num_kernels, s.span_ns, s.busy_ns) == (5, 112.0, 10.0 + 40.0 + 10.0 + 1.0)
    assert s.idle_ns == 112.0 - 61.0
    # gaps: a->b 20, b->d 30 (b, not the shorter c, ends the run), d->e 1
    assert s.largest == (kernel_gaps.Gap(30.0, "b", "d"), kernel_gaps.Gap(20.0, "a", "b"))
    assert kernel_gaps.summarize([]).num_kernels == 0 and kernel_gaps.summarize([]).largest == ()


def test_kernel_gaps_splits_forwards_by_kernel_count():
    events = [kernel_gaps.KernelEvent(f"k{i}", float(i), 0.5) for i in range(7)]
    parts = kernel_gaps.split_forwards(events[::-1], 3)
    assert [[e.name for e in p] for p in parts] == [["k0", "k1", "k2"], ["k3", "k4", "k5"]]
    with pytest.raises(ValueError, match="kernels_per_forward=0"):
        kernel_gaps.split_forwards(events, 0)


def test_kernel_gaps_reads_a_real_trace_and_says_when_it_has_no_gpu(tmp_path):
    """A CPU trace through the same reader: no GPU plane, so no kernels and the planes named."""
    fn = jax.jit(lambda x: x * 2 + 1)
    path, measured, clocks = kernel_gaps._trace(fn, (jax.numpy.ones(8),), 1, 2, str(tmp_path))
    assert measured.streamed_ms > 0
    if shutil.which("nvidia-smi") is None:  # elsewhere a trace this short may end unsampled
        assert clocks is None
    events, where = kernel_gaps.device_kernels(path)
    if jax.default_backend() == "cpu":
        assert events == [] and "no GPU kernel events" in where and "/host:CPU" in where
    else:
        assert events and where.startswith("/device:GPU")


def test_device_busy_ms_is_the_kernels_time_per_call():
    """Off a GPU there are no kernels to time (None); on one, a matmul large enough to bind the
    device (2 x 8192^3 bf16 flops, about 1.5 ms on an H100) keeps it busy for most of what the
    host clock sees of it back to back, and for no longer."""
    with pytest.raises(ValueError, match="calls=0"):
        kernel_gaps.device_busy_ms(jax.jit(lambda x: x), (jax.numpy.ones(8),), calls=0)
    if jax.default_backend() != "gpu":
        assert kernel_gaps.device_busy_ms(jax.jit(lambda x: x * 2), (jax.numpy.ones(8),)) is None
        return
    x = jax.random.normal(jax.random.key(0), (8192, 8192), jax.numpy.bfloat16)
    matmul = jax.jit(lambda x: x @ x)
    device_ms = kernel_gaps.device_busy_ms(matmul, (x,), calls=5)
    host_ms, _ = timing.time_jax(matmul, (x,), iters=6)
    assert 0.7 * host_ms < device_ms < 1.05 * host_ms, (device_ms, host_ms)


@pytest.mark.parametrize(
    ("argv", "messages"),
    [
        (["--shape", "Z"], ["unknown shape 'Z'"]),
        (["--experts", "deep_gemmm"], ["unknown --experts 'deep_gemmm'", "'mosaic_fp8'"]),
        (
            ["--variant", "moe_jax_fp9"],
            ["unknown --variant 'moe_jax_fp9'", "'moe_jax_fp8_fused_act'"],
        ),
        (["--variant", "moe_jax_fp8", "--experts", "deep_gemm"], ["--variant takes neither"]),
        (["--decode-tokens", "0"], ["--decode-tokens 0"]),
        pytest.param(
            [],
            ["needs a GPU"],
            marks=pytest.mark.skipif(jax.default_backend() == "gpu", reason="off a GPU only"),
        ),
    ],
    ids=["shape", "experts", "variant", "variant_and_experts", "decode_tokens", "no_gpu"],
)
def test_kernel_gaps_refuses_before_anything_runs(argv, messages, capsys):
    assert kernel_gaps.main(["--shape", "small", *argv]) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in messages), err


def test_kernel_gaps_times_kernels_per_forward_by_median():
    forwards = [  # gemm then two copies, per forward: gemm 10/30/20, copies 2x1, 2x2, 2x3
        [
            kernel_gaps.KernelEvent("gemm", 0.0, gemm),
            kernel_gaps.KernelEvent("copy", gemm, copy),
            kernel_gaps.KernelEvent("copy", gemm + copy + 1.0, copy),
        ]
        for gemm, copy in ((10.0, 1.0), (30.0, 2.0), (20.0, 3.0))
    ]
    assert kernel_gaps.kernel_times(forwards) == [
        kernel_gaps.KernelTime("gemm", 20.0, 1),
        kernel_gaps.KernelTime("copy", 4.0, 2),
    ]
    # a kernel missing from some forwards counts 0 there
    assert kernel_gaps.kernel_times([[kernel_gaps.KernelEvent("a", 0.0, 5.0)], []]) == [
        kernel_gaps.KernelTime("a", 2.5, 1)
    ]
    long = "void deep_gemm::impl<(Major)0, 0u, 4096u, 7168u, 32u, 128u>(float*, int*)"
    assert kernel_gaps.short_name(long) == "deep_gemm::impl<(Major)0, 0u, 4096u, 7168u, ...>"
    assert kernel_gaps.short_name("void k<1, 2>(int)") == "k<1, 2>"


def test_kernel_gaps_builds_a_bench_variant_or_says_why_not():
    """The variant's forward is `bench`'s own: the same function and arguments it times."""
    fn, args = kernel_gaps.forward_fn("small", variant="moe_jax_fp8")
    out = fn(*args)
    assert out.shape == args[0].shape and bool(jax.numpy.isfinite(out.astype("float32")).all())
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="moe_jax_fp8_fused_act: needs an NVIDIA"):
            kernel_gaps.forward_fn("small", variant="moe_jax_fp8_fused_act")


@pytest.mark.gpu
def test_kernel_gaps_profiles_a_bench_variant(tmp_path):
    path = tmp_path / "gaps.json"
    argv = ["--shape", "small", "--variant", "moe_jax_fp8_fused_act"]
    argv += ["--samples", "1", "--burst", "2", "--json", str(path)]
    assert kernel_gaps.main(argv) == 0
    summary = json.loads(path.read_text())
    assert summary["shape"] == "shape small, variant moe_jax_fp8_fused_act"
    assert any("mosaic" in k["name"] for k in summary["kernels"])


def test_kernel_gaps_counts_mosaic_gpu_kernels_as_gemms():
    assert kernel_gaps.stage_of("anonymous_mosaic_gpu_kernel") == "GEMMs"
    assert kernel_gaps.stage_of("input_reduce_fusion") == kernel_gaps.OTHER_STAGE


@pytest.mark.gpu
def test_kernel_gaps_profiles_the_named_experts(tmp_path, capsys):
    path = tmp_path / "gaps.json"
    argv = ["--shape", "small", "--experts", "xla", "--samples", "1", "--burst", "2"]
    assert kernel_gaps.main([*argv, "--json", str(path)]) == 0
    summary = json.loads(path.read_text())
    assert summary["shape"] == "shape small, experts=xla"
    assert summary["kernels"] and summary["device_span_us"] > 0
    assert "experts=xla" in capsys.readouterr().out


def test_kernel_gaps_sums_kernels_by_stage_and_plots_them(tmp_path):
    times = [
        kernel_gaps.KernelTime("void deep_gemm::sm90_fp8_gemm_1d2d_impl<0u>", 100.0, 1),
        kernel_gaps.KernelTime("grouped_gemm_config_block_m_16", 50.0, 1),
        kernel_gaps.KernelTime("act_quant_silu_bm32_w4_g1_gm", 20.0, 1),
        kernel_gaps.KernelTime("unpermute_config_block_t_2", 15.0, 1),
        kernel_gaps.KernelTime("permute_config_block_m_16", 10.0, 1),
        kernel_gaps.KernelTime("group_quant_bm32_w4_g1_gm", 5.0, 1),
        kernel_gaps.KernelTime("input_reduce_fusion_1", 3.0, 1),
        kernel_gaps.KernelTime("loop_select_fusion", 2.0, 2),
    ]
    stages = kernel_gaps.stage_times(times)
    assert stages == {
        "GEMMs": 150.0,
        "act*up + quantize": 20.0,
        "unpermute": 15.0,
        "permute": 10.0,
        "quantize x": 5.0,
        kernel_gaps.OTHER_STAGE: 5.0,
    }
    assert sum(stages.values()) == sum(t.ns for t in times)
    path = tmp_path / "stages.png"
    kernel_gaps.plot_stages("shape A", stages, 3000.0, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "name",
    sorted(p.stem for p in script_modules.BENCHMARKS.glob("*.py") if ">>>" in p.read_text()),
)
def test_docstring_examples(name):
    """The tools' docstring examples (tests/test_doctests.py runs the package's)."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(script_modules.benchmark(name), f"benchmarks.{name}"):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0, f"benchmarks.{name}: see above"


@pytest.mark.slow
def test_stage_breakdown_times_each_stage_and_the_gap_to_the_forward(tmp_path, capsys):
    """The small shape: each stage of the FP8 forward timed by the host clock (and its kernels'
    time on a GPU), beside the one-jit forward and the gap between them, printed and in the
    JSON."""
    path = tmp_path / "stages.json"
    assert stage_breakdown.main(["--shapes", "small", "--iters", "2", "--json", str(path)]) == 0
    result = json.loads(path.read_text())["shapes"]["small"]
    stages, forward = result["stages"], result["forward_ms"]
    names = [s["stage"] for s in stages]
    on_cpu = jax.default_backend() == "cpu"
    gemm1, gemm2 = ("GEMM1 (xla)", "GEMM2 (xla)") if on_cpu else (names[2], names[-2])
    assert gemm1.startswith("GEMM1 (") and gemm2.startswith("GEMM2 ("), names
    # "auto" fuses GEMM1 with act*up + quantize only on Hopper from 128-row segments, which the
    # small shape's rows do not ask for
    assert names == [
        "quantize x",
        "permute",
        gemm1,
        "act*up + quantize",
        gemm2,
        "unpermute + reduce",
    ]
    assert all(s["ms"] > 0 for s in stages) and forward > 0
    out = capsys.readouterr().out
    assert "stages of moe_jax_fp8, shape small: T=256" in out
    assert f"{'forward (one jit)':<48} {forward:>10.3f}" in out
    gap = forward - sum(s["ms"] for s in stages)
    device = [s["device_ms"] for s in stages]
    if on_cpu:  # no device kernels in the CPU backend's trace
        assert device == [None] * len(stages)
        assert f"{'forward - sum':<48} {gap:>+10.3f} {'-':>10}" in out
    else:  # each stage's kernels ran for some time
        assert all(0 < d for d in device), stages
        assert f"{'forward - sum':<48} {gap:>+10.3f} {forward - sum(device):>+10.3f}" in out
    with pytest.raises(SystemExit):
        stage_breakdown.main(["--iters", "0"])
    assert "--iters 0: at least 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.mosaic_interpret  # the interpret-mode kernel: on a GPU host, on its CPU device
def test_stage_breakdown_times_the_fused_first_gemm_as_one_stage(monkeypatch):
    """With GEMM1 fused to act*up + quantize (here the interpret-mode gathered kernel, on the
    CPU device) the breakdown times it as one stage and feeds its FP8 output to GEMM2; as that
    GEMM1 gathers its rows from the tokens, the layer routes instead of permuting, and so does
    the breakdown (the route's layout holds no rows: the fused stage reads the tokens). The
    permute stage is test_stage_breakdown_times_each_stage_and_the_gap_to_the_forward's."""
    from moe_jax.contiguous_experts import ContiguousExperts

    def one_call_samples(fn, args, *, iters):
        # the same timing loop with one call per sample: 4 calls of the slow interpreted kernel
        # per stage instead of 34 (the breakdown's wiring is tested here, not its timing)
        t = timing.time_calls(
            lambda: fn(*args), wait=jax.block_until_ready, samples=1, burst=1, latency_samples=1
        )
        return t.streamed_ms, t.latency_ms

    monkeypatch.setattr(stage_breakdown, "time_jax", one_call_samples)
    layer = layer_bench.make_layer(layer_bench.SHAPES["small"])
    fused = "mosaic_fp8_gathered_interpret"
    experts = ContiguousExperts(gemm="xla", alignment=128, fused_act_quant=fused)
    rows = stage_breakdown.stage_breakdown(layer, iters=2, experts=experts)
    assert [r["stage"] for r in rows] == [
        "quantize x",
        "route",
        f"GEMM1 + act*up + quantize ({fused})",
        "GEMM2 (xla)",
        "unpermute + reduce",
    ]
    assert all(r["ms"] > 0 for r in rows)
