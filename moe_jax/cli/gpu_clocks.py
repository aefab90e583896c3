"""The GPU's SM clock and slowdown reasons while a benchmark times, sampled with `nvidia-smi`.

A figure timed while the GPU clocks itself down is not the figure of the same code on a cool,
uncapped GPU (BENCHMARKS.md "Prefill" records where the power cap hit). `ClockMonitor` samples
the clock and the reasons in the background while a block runs, so a benchmark can print what
the GPU did during its timing:

    with ClockMonitor() as clocks:
        timing = time_jax(fn, args, iters=20)
    print(clocks.summary.line() if clocks.summary else "no nvidia-smi here")

Where `nvidia-smi` is missing (CPU machines, CI) the monitor records nothing and `summary` is
None. The GPU sampled is the first one CUDA_VISIBLE_DEVICES names (0 when unset), i.e. JAX's
first GPU; `nvidia-smi` reports averages over its own sampling window, so a short slowdown can
be missed, never invented.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import subprocess
from collections.abc import Iterable

# nvidia-smi --query-gpu fields, in the order `parse` reads them
FIELDS = (
    "clocks.sm",
    "clocks.max.sm",
    "power.draw",
    "clocks_event_reasons.sw_power_cap",
    "clocks_event_reasons.hw_slowdown",
    "clocks_event_reasons.sw_thermal_slowdown",
    "clocks_event_reasons.hw_thermal_slowdown",
)
REASONS = ("power cap", "hw slowdown", "sw thermal", "hw thermal")
INTERVAL_MS = 50


@dataclasses.dataclass(frozen=True)
class ClockSummary:
    """What `nvidia-smi` saw over a timed block.

    Attributes:
      samples: readings taken.
      sm_mhz_min, sm_mhz_median, sm_mhz_top: SM clock over the readings.
      sm_mhz_rated: the GPU's maximum SM clock (`clocks.max.sm`).
      power_w_max: highest power draw read (a window average).
      slowed_share: share of readings with any slowdown reason active.
      reasons: the reasons seen active, by name (`REASONS`), with how many readings had each.
    """

    samples: int
    sm_mhz_min: float
    sm_mhz_median: float
    sm_mhz_top: float
    sm_mhz_rated: float
    power_w_max: float
    slowed_share: float
    reasons: dict[str, int]

    def line(self) -> str:
        """One line for a report.

        >>> s = ClockSummary(20, 1425.0, 1965.0, 1980.0, 1980.0, 370.0, 0.1, {"power cap": 2})
        >>> head, tail = s.line().split("; ")
        >>> head
        'SM clock 1425-1980 MHz (median 1965, rated 1980), power <= 370 W'
        >>> tail
        'slowed in 10% of 20 samples (power cap 2)'
        """
        slowed = ", ".join(f"{name} {count}" for name, count in self.reasons.items())
        power = "" if math.isnan(self.power_w_max) else f", power <= {self.power_w_max:.0f} W"
        return (
            f"SM clock {self.sm_mhz_min:.0f}-{self.sm_mhz_top:.0f} MHz (median "
            f"{self.sm_mhz_median:.0f}, rated {self.sm_mhz_rated:.0f}){power}; slowed in "
            f"{self.slowed_share:.0%} of {self.samples} samples{f' ({slowed})' if slowed else ''}"
        )


def _number(text: str) -> float | None:
    try:
        return float(text.strip().split()[0])
    except (ValueError, IndexError):
        return None


def parse(lines: Iterable[str]) -> ClockSummary | None:
    """A summary of `nvidia-smi --query-gpu=<FIELDS> --format=csv,noheader,nounits` lines;
    None when no line parses.

    >>> s = parse(["1980, 1980, 300.5, Not Active, Not Active, Not Active, Not Active",
    ...            "1425, 1980, 690.0, Active, Not Active, Not Active, Not Active"])
    >>> s.sm_mhz_min, s.slowed_share, s.reasons
    (1425.0, 0.5, {'power cap': 1})
    """
    clocks, powers, max_clock, slowed = [], [], 0.0, 0
    reasons = dict.fromkeys(REASONS, 0)
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(FIELDS):
            continue
        sm, sm_max, power = (_number(p) for p in parts[:3])
        if sm is None:
            continue
        clocks.append(sm)
        if power is not None:
            powers.append(power)
        if sm_max is not None:
            max_clock = max(max_clock, sm_max)
        active = [name for name, flag in zip(REASONS, parts[3:], strict=True) if flag == "Active"]
        slowed += bool(active)
        for name in active:
            reasons[name] += 1
    if not clocks:
        return None
    return ClockSummary(
        samples=len(clocks),
        sm_mhz_min=min(clocks),
        sm_mhz_median=statistics.median(clocks),
        sm_mhz_top=max(clocks),
        sm_mhz_rated=max_clock or max(clocks),
        power_w_max=max(powers) if powers else float("nan"),
        slowed_share=slowed / len(clocks),
        reasons={name: count for name, count in reasons.items() if count},
    )


def _gpu_index() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


class ClockMonitor:
    """Samples the GPU every `interval_ms` while the `with` block runs; `summary` afterwards
    (None where `nvidia-smi` is missing or read nothing)."""

    def __init__(self, interval_ms: int = INTERVAL_MS):
        if interval_ms < 1:
            raise ValueError(f"{interval_ms=} but a positive interval is needed")
        self.interval_ms = interval_ms
        self.summary: ClockSummary | None = None
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ClockMonitor:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        try:  # a monitor that cannot start records nothing; it never stops a benchmark
            self._process = subprocess.Popen(
                [
                    smi,
                    f"--id={_gpu_index()}",
                    f"--query-gpu={','.join(FIELDS)}",
                    "--format=csv,noheader,nounits",
                    f"-lms={self.interval_ms}",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        except OSError:
            self._process = None
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            out, _ = self._process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            out, _ = self._process.communicate()
        self.summary = parse(out.splitlines())
        self._process = None
