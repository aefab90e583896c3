"""benchmarks/sanitize_kernels.py, the compute-sanitizer driver of the GPU host, on a tiny shape: on
the CPU with the kernels' interpret-mode twins, so the driver itself is known to work before a
GPU run; on a GPU with the compiled kernels (the sanitizer runs there: scripts/gpu_check.sh)."""

from __future__ import annotations

import jax
import pytest
import script_modules

from moe_jax.registry import NoImplementationError


@pytest.fixture(scope="module")
def driver():
    return script_modules.benchmark("sanitize_kernels")


OFF_GPU = pytest.mark.skipif(
    jax.default_backend() == "gpu", reason="checks the CPU side (compiled kernels run on a GPU)"
)


@pytest.mark.slow
@pytest.mark.mosaic_interpret  # and the Pallas Triton kernels' interpret mode, on the CPU device
def test_every_kernel_runs_and_matches_xla_in_interpret_mode(driver, capsys):
    assert driver.main([], interpret=True, shape=driver.SHAPE_TINY) == 0
    out = capsys.readouterr().out
    for name, kernel in driver.kernels(driver.SHAPE_TINY).items():
        if kernel.interpret is None:
            assert f"{name}: skipped (no interpret mode)" in out
        else:
            assert f"{name} ({kernel.interpret}): ok" in out
    assert "all kernels ran at T=48" in out


def test_the_driver_covers_every_pallas_kernel_family(driver):
    runs = driver.kernels(driver.SHAPE_TINY)
    families = """permute_bf16 permute_fp8 permute_fp8_unzeroed unpermute unpermute_no_weights count
        routing_metadata group_quant act_and_quant grouped_gemm_fp8 grouped_gemm_bf16
        grouped_gemm_fp8_masked mosaic_gemm_fp8 mosaic_gemm_act_quant mosaic_gemm_bf16
        mosaic_wgrad_bf16 pallas_wgrad_bf16"""
    assert set(runs) == set(families.split())
    assert {k.compiled for k in runs.values()} == {"pallas", "mosaic", "mosaic_fp8"}


def test_unknown_kernel_names_are_refused(driver, capsys):
    assert driver.main(["permute"], interpret=True, shape=driver.SHAPE_TINY) == 2
    assert "unknown kernels ['permute']" in capsys.readouterr().err


@OFF_GPU
def test_a_refused_kernel_fails_the_run_off_a_gpu(driver, capsys):
    # Compiled kernels refuse the CPU: the sanitizer run must not pass without running them.
    assert driver.main(["count"], shape=driver.SHAPE_TINY) == 1
    assert "count: not run" in capsys.readouterr().out


@OFF_GPU
def test_kernels_without_interpret_mode_build_their_calls(driver):
    """The Mosaic runs cannot run here: their XLA side (same operands, same call) does, and the
    Mosaic implementation refuses the CPU by name."""
    runs = driver.kernels(driver.SHAPE_TINY)
    shape = driver.SHAPE_TINY
    y = runs["mosaic_gemm_bf16"].run("xla")
    assert y.shape[1] == 2 * shape.inter and float(abs(y.astype("float32")).max()) > 0
    dw = runs["mosaic_wgrad_bf16"].run("xla")
    assert dw.shape == (shape.num_experts, shape.inter, shape.hidden)
    for name in ("mosaic_gemm_bf16", "mosaic_wgrad_bf16"):
        with pytest.raises(NoImplementationError, match="mosaic: Mosaic GPU kernels need"):
            runs[name].run("mosaic")


@pytest.mark.gpu
def test_every_compiled_kernel_runs_and_matches_xla(driver, capsys):
    assert driver.main([], shape=driver.SHAPE_TINY) == 0
    out = capsys.readouterr().out
    for name, kernel in driver.kernels(driver.SHAPE_TINY).items():
        assert f"{name} ({kernel.compiled}): ok" in out
