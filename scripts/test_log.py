"""What a test run's log says: which tests were still running when it stopped, which took longest.

    MOE_JAX_TEST_LOG=tests.log python3 -m pytest -n 8 ...     # tests/suite_log.py writes the log
    python3 scripts/test_log.py tests.log [--top N]

The log has a tab-separated line when each test starts and when it ends (tests/suite_log.py
says the format): "end", or "stop" where the run was interrupted inside the test. A run stopped
by a time limit may print no pytest summary; this says which tests it left unfinished (still
running when the log ends, with how long they had run by its last line, or stopped while
running) and the slowest that ended, with each worker's test count and busy time. `bash
scripts/gpu_check.sh suite` writes the log and runs this after pytest. Exit status 1 when a
test did not end, 2 for a log it cannot read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class LoggedTest:
    """One test in the log: `seconds` is None for a test still running when the log ends;
    `stopped` marks one the run was interrupted in (its seconds are those it ran)."""

    nodeid: str
    worker: str
    started: float
    seconds: float | None
    stopped: bool = False

    @property
    def ended(self) -> bool:
        return self.seconds is not None and not self.stopped


def read_log(lines: list[str]) -> tuple[list[LoggedTest], float]:
    """The log's tests in start order, and the wall clock of its last line (0.0 if empty).

    An "end" or "stop" closes the last open "start" of the same worker and node id (a test run
    twice, say by a rerun plugin, is two entries). A line that is not five tab-separated fields
    (say, one cut short by a killed run) raises ValueError naming its line number."""
    runs: list[LoggedTest] = []
    open_runs: dict[tuple[str, str], int] = {}  # (worker, node id) -> index into runs
    last = 0.0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 5 or fields[2] not in ("start", "end", "stop"):
            raise ValueError(f"line {number}: not a test log line: {line.rstrip()!r}")
        clock, worker, event, seconds, nodeid = fields
        last = max(last, float(clock))
        if event == "start":
            open_runs[(worker, nodeid)] = len(runs)
            runs.append(LoggedTest(nodeid, worker, started=float(clock), seconds=None))
        elif (worker, nodeid) in open_runs:
            index = open_runs.pop((worker, nodeid))
            runs[index] = dataclasses.replace(
                runs[index], seconds=float(seconds), stopped=event == "stop"
            )
        else:
            raise ValueError(f"line {number}: {nodeid} ends on {worker} without a start")
    return sorted(runs, key=lambda run: run.started), last


def summary(runs: list[LoggedTest], last: float, top: int = 15) -> str:
    """The tests that did not end (still running, longest first; stopped while running), the
    `top` slowest that ended and each worker's test count and busy seconds, as text."""
    running = [run for run in runs if run.seconds is None]  # in start order: longest first
    stopped = [run for run in runs if run.stopped]
    ended = sorted((run for run in runs if run.ended), key=lambda run: -run.seconds)
    out = [
        f"{len(runs)} tests started, {len(ended)} ended, {len(running)} still running, "
        f"{len(stopped)} stopped while running"
    ]
    if running:
        out.append("still running when the log ends (seconds so far, worker, test):")
        out += [f"  {last - run.started:8.1f}  {run.worker:6}  {run.nodeid}" for run in running]
    if stopped:
        out.append("stopped while running (seconds run, worker, test):")
        out += [f"  {run.seconds:8.1f}  {run.worker:6}  {run.nodeid}" for run in stopped]
    if ended and top:
        out.append(f"slowest {min(top, len(ended))} that ended (seconds, worker, test):")
        out += [f"  {run.seconds:8.1f}  {run.worker:6}  {run.nodeid}" for run in ended[:top]]
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
    return 0 if all(run.ended for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
