"""What a test run's log says: which tests were still running when it stopped, which took longest.

    MOE_JAX_TEST_LOG=tests.log python3 -m pytest -n 8 ...     # tests/conftest.py writes the log
    python3 scripts/test_log.py tests.log [--top N]

The log has a tab-separated line when each test starts and when it ends (wall clock in seconds,
xdist worker, "start" or "end", seconds the test took or "-", node id). A run stopped by a time
limit prints no pytest summary; this says which tests it left unfinished (and for how long they
had been running at the log's last line) and the slowest finished ones, with each worker's busy
time. `bash scripts/gpu_check.sh suite` writes the log and runs this after pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class LoggedTest:
    """One test in the log: `seconds` is None for a test that never ended."""

    nodeid: str
    worker: str
    started: float
    seconds: float | None


def read_log(lines: list[str]) -> tuple[list[LoggedTest], float]:
    """The log's tests in start order, and the wall clock of its last line (0.0 if empty).

    An "end" closes the last open "start" of the same worker and node id (a test run twice, say
    by a rerun plugin, is two entries). A line that is not five tab-separated fields (say, one
    cut short by a killed run) raises ValueError naming its line number."""
    runs: list[LoggedTest] = []
    open_runs: dict[tuple[str, str], int] = {}  # (worker, node id) -> index into runs
    last = 0.0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 5 or fields[2] not in ("start", "end"):
            raise ValueError(f"line {number}: not a test log line: {line.rstrip()!r}")
        clock, worker, event, seconds, nodeid = fields
        last = max(last, float(clock))
        if event == "start":
            open_runs[(worker, nodeid)] = len(runs)
            runs.append(LoggedTest(nodeid, worker, started=float(clock), seconds=None))
        elif (worker, nodeid) in open_runs:
            index = open_runs.pop((worker, nodeid))
            runs[index] = dataclasses.replace(runs[index], seconds=float(seconds))
        else:
            raise ValueError(f"line {number}: {nodeid} ends on {worker} without a start")
    return sorted(runs, key=lambda run: run.started), last


def summary(runs: list[LoggedTest], last: float, top: int = 15) -> str:
    """The unfinished tests (longest running first), the `top` slowest finished ones and each
    worker's test count and busy seconds, as text."""
    unfinished = sorted((run for run in runs if run.seconds is None), key=lambda run: run.started)
    finished = sorted(
        (run for run in runs if run.seconds is not None), key=lambda run: -run.seconds
    )
    out = [f"{len(runs)} tests started, {len(finished)} ended, {len(unfinished)} still running"]
    if unfinished:
        out.append("still running when the log ends (seconds so far, worker, test):")
        out += [f"  {last - run.started:8.1f}  {run.worker:6}  {run.nodeid}" for run in unfinished]
    if finished and top:
        out.append(f"slowest {min(top, len(finished))} that ended (seconds, worker, test):")
        out += [f"  {run.seconds:8.1f}  {run.worker:6}  {run.nodeid}" for run in finished[:top]]
    workers: dict[str, list[float]] = {}
    for run in runs:
        busy = run.seconds if run.seconds is not None else last - run.started
        workers.setdefault(run.worker, []).append(busy)
    per_worker = [f"{name} {len(t)} tests {sum(t):.0f} s" for name, t in sorted(workers.items())]
    out.append("per worker: " + ", ".join(per_worker))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the file MOE_JAX_TEST_LOG named")
    parser.add_argument("--top", type=int, default=15, help="slowest finished tests to list")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top {args.top}: pass 0 or more")
    try:
        with open(args.log, encoding="utf-8") as log:
            runs, last = read_log(log.readlines())
    except (OSError, ValueError) as err:
        print(f"{args.log}: {err}", file=sys.stderr)
        return 2
    print(summary(runs, last, top=args.top))
    return 1 if any(run.seconds is None for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
