"""The test log of a suite run (the plugin tests/suite_log.py, which tests/conftest.py loads,
writes it under MOE_JAX_TEST_LOG) and scripts/test_log.py, which says which tests a run cut short
left running or stopped and which were slowest."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import script_modules


@pytest.fixture(scope="module")
def log_script():
    yield from script_modules.loaded("test_log")


def _line(clock, worker, event, seconds, nodeid):
    return f"{clock}\t{worker}\t{event}\t{seconds}\t{nodeid}\n"


# two workers; gw1's second test never ended; gw0 ran "fast" again (a rerun), still running;
# gw2's test was interrupted
LOG = [
    _line(100.0, "gw0", "start", "-", "t.py::fast"),
    _line(100.5, "gw1", "start", "-", "t.py::slow"),
    _line(100.5, "gw0", "end", "0.50", "t.py::fast"),
    _line(100.6, "gw0", "start", "-", "t.py::medium"),
    _line(103.6, "gw0", "end", "3.00", "t.py::medium"),
    _line(110.5, "gw1", "end", "10.00", "t.py::slow"),
    _line(110.6, "gw1", "start", "-", "t.py::hangs"),
    _line(140.6, "gw0", "start", "-", "t.py::fast"),
    _line(100.0, "gw2", "start", "-", "t.py::interrupted"),
    _line(140.0, "gw2", "stop", "40.00", "t.py::interrupted"),
]


def test_unfinished_tests_and_the_slowest_are_named(log_script):
    runs, last = log_script.read_log(LOG)
    assert last == 140.6
    assert [(r.worker, r.nodeid, r.seconds, r.ended) for r in runs] == [
        ("gw0", "t.py::fast", 0.5, True),
        ("gw2", "t.py::interrupted", 40.0, False),
        ("gw1", "t.py::slow", 10.0, True),
        ("gw0", "t.py::medium", 3.0, True),
        ("gw1", "t.py::hangs", None, False),
        ("gw0", "t.py::fast", None, False),
    ]
    text = log_script.summary(runs, last, top=2).splitlines()
    assert text[0] == "6 tests started, 3 ended, 2 still running, 1 stopped while running"
    assert text[1].startswith("still running when the log ends")
    assert [line.split() for line in text[2:4]] == [
        ["30.0", "gw1", "t.py::hangs"],
        ["0.0", "gw0", "t.py::fast"],
    ]
    assert text[4].startswith("stopped while running")
    assert text[5].split() == ["40.0", "gw2", "t.py::interrupted"]
    assert text[6] == "slowest 2 that ended (seconds, worker, test):"
    assert [line.split()[2] for line in text[7:9]] == ["t.py::slow", "t.py::medium"]
    # gw0: 0.5 + 3 s ended, the rerun 0 s so far; gw1: 10 s for slow + 30 s so far for hangs
    assert text[9] == "per worker: gw0 3 tests 4 s, gw1 2 tests 40 s, gw2 1 tests 40 s"


def test_exit_status_says_whether_every_test_ended(log_script, tmp_path, capsys):
    log = tmp_path / "tests.log"
    log.write_text("".join(LOG))
    assert log_script.main([str(log)]) == 1
    assert "t.py::hangs" in capsys.readouterr().out
    log.write_text("".join(LOG[:6]))  # every test ended
    assert log_script.main([str(log), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "still running when" not in out and "slowest 1 that ended" in out


def test_bad_logs_and_arguments_are_named(log_script, tmp_path, capsys):
    log = tmp_path / "tests.log"
    log.write_text(LOG[0] + "1.0\tgw0\tstart\n")
    assert log_script.main([str(log)]) == 2
    assert "line 2: not a test log line" in capsys.readouterr().err
    log.write_text(LOG[0] + LOG[2] + LOG[2])
    assert log_script.main([str(log)]) == 2
    assert "line 3: t.py::fast ends on gw0 without a start" in capsys.readouterr().err
    assert log_script.main([str(tmp_path / "missing.log")]) == 2
    assert "missing.log" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        log_script.main([str(log), "--top", "-1"])
    assert "--top -1" in capsys.readouterr().err


def test_conftest_writes_a_line_when_each_test_starts_and_ends(log_script, tmp_path):
    """A real pytest run of two tests of this repository with the variable set. It runs
    inside an xdist worker when the suite does (gpu_check.sh suite): the worker's
    PYTEST_XDIST_WORKER, inherited, must not name the child's own process."""
    log = tmp_path / "tests.log"
    selected = [
        "tests/test_test_log.py::test_unfinished_tests_and_the_slowest_are_named",
        "tests/test_test_log.py::test_bad_logs_and_arguments_are_named",
    ]
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selected]
    env = {"MOE_JAX_TEST_LOG": str(log), "PYTEST_XDIST_WORKER": "gw7"}
    done = script_modules.run_at_root(argv, env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = log.read_text().splitlines()
    assert [line.split("\t")[2:5:2] for line in lines] == [
        ["start", selected[0]],
        ["end", selected[0]],
        ["start", selected[1]],
        ["end", selected[1]],
    ]
    assert all(line.split("\t")[1] == "main" for line in lines)
    runs, _ = log_script.read_log([line + "\n" for line in lines])
    assert all(run.seconds is not None and run.seconds >= 0 for run in runs)


def test_the_plugin_logs_a_stop_where_the_run_is_interrupted(log_script, tmp_path):
    """The plugin alone (`-p suite_log`) on a file whose second test interrupts the run, as
    Ctrl-C or `timeout -s INT` do: its start has a "stop", and the third test never starts."""
    tests = tmp_path / "test_interrupted.py"
    tests.write_text(
        textwrap.dedent(
            """
            def test_first():
                pass

            def test_interrupts():
                raise KeyboardInterrupt

            def test_never_runs():
                pass
            """
        )
    )
    log = tmp_path / "tests.log"
    env = {
        "MOE_JAX_TEST_LOG": str(log),
        "PYTHONPATH": str(script_modules.ROOT / "tests")
        + os.pathsep
        + os.environ.get("PYTHONPATH", ""),
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_log"]
    argv += ["--rootdir", str(tmp_path), str(tests)]
    done = script_modules.run_at_root(argv, env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr  # pytest's "interrupted"
    runs, _ = log_script.read_log(log.read_text().splitlines(keepends=True))
    assert [(run.nodeid.split("::")[1], run.ended, run.stopped) for run in runs] == [
        ("test_first", True, False),
        ("test_interrupts", False, True),
    ]
