"""`moe_jax.cli.gpu_clocks`: reading nvidia-smi's clock and slowdown samples, and the reports
that print them. The sampling itself needs nvidia-smi and a GPU (`-m gpu`)."""

from __future__ import annotations

import dataclasses
import shutil
import time

import pytest

from moe_jax.cli import gpu_clocks, layer_report

# Lines as nvidia-smi --format=csv,noheader,nounits prints the FIELDS (H200, 2026-12-04,
# during shape A's timed loop), plus what it prints for a field a GPU does not report.
SAMPLES = [
    "1980, 1980, 123.43, Not Active, Not Active, Not Active, Not Active",
    "1425, 1980, 345.83, Active, Not Active, Not Active, Not Active",
    "1965, 1980, 369.62, Active, Not Active, Active, Not Active",
    "1980, 1980, [N/A], Not Active, Not Active, Not Active, Not Active",
]


def test_parse_counts_slowdowns_and_clock_range():
    summary = gpu_clocks.parse(SAMPLES)
    assert summary.samples == 4
    assert (summary.sm_mhz_min, summary.sm_mhz_top, summary.sm_mhz_rated) == (1425, 1980, 1980)
    assert summary.sm_mhz_median == 1972.5
    assert summary.power_w_max == pytest.approx(369.62)
    assert summary.slowed_share == 0.5
    assert summary.reasons == {"power cap": 2, "sw thermal": 1}
    assert "slowed in 50% of 4 samples (power cap 2, sw thermal 1)" in summary.line()


@pytest.mark.parametrize(
    "lines",
    [[], ["garbage"], ["No devices were found"], ["[N/A], 1980, 100, A, B, C"]],
    ids=["empty", "garbage", "no_devices", "short_line"],
)
def test_parse_without_readings_is_none(lines):
    assert gpu_clocks.parse(lines) is None


def test_monitor_without_nvidia_smi_records_nothing(monkeypatch):
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockMonitor() as clocks:
        pass
    assert clocks.summary is None


def test_monitor_that_cannot_start_records_nothing(monkeypatch, tmp_path):
    """An nvidia-smi on the PATH that cannot be executed (here a file without the execute
    bit, as `shutil.which` is told it exists) leaves the summary empty, and the block runs."""
    unusable = tmp_path / "nvidia-smi"
    unusable.write_text("")
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: str(unusable))
    ran = False
    with gpu_clocks.ClockMonitor() as clocks:
        ran = True
    assert ran and clocks.summary is None


def test_summary_line_without_power_readings():
    summary = gpu_clocks.parse(
        ["1980, 1980, [N/A], Not Active, Not Active, Not Active, Not Active"]
    )
    assert "power" not in summary.line() and "slowed in 0% of 1 samples" in summary.line()


def test_monitor_rejects_a_bad_interval():
    with pytest.raises(ValueError, match="interval_ms"):
        gpu_clocks.ClockMonitor(interval_ms=0)


def test_bench_table_lists_the_gpu_clocks_of_each_timed_row():
    summary = gpu_clocks.parse(SAMPLES)
    rows = [
        dict(
            shape="A",
            variant="moe_jax_fp8",
            ms=3.1,
            tflops=950.0,
            rel_err=4.3e-2,
            latency_ms=3.2,
            clocks=dataclasses.asdict(summary),
        ),
        dict(shape="B", variant="moe_jax_bf16", skipped="no GPU"),
    ]
    table = layer_report.format_table(rows)
    assert "GPU while timed" in table
    assert f"A      moe_jax_fp8            {summary.line()}" in table


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi")
def test_monitor_samples_the_gpu():
    with gpu_clocks.ClockMonitor(interval_ms=20) as clocks:
        time.sleep(0.5)
    assert clocks.summary is not None and clocks.summary.samples >= 2
    assert 0 < clocks.summary.sm_mhz_min <= clocks.summary.sm_mhz_rated
