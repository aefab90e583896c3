"""scripts/gpu_kernel_times.py's summary of an ncu CSV (the profiling itself needs a GPU and ncu:
`bash scripts/gpu_check.sh epilogue` runs it there)."""

from __future__ import annotations

import pytest
import script_modules

HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","gpu__time_duration.sum",'
    '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",'
    '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"'
)
META = '"1","7","(384, 1, 1)","(132, 1, 1)","0","9.0"'


@pytest.fixture(scope="module")
def times():
    yield from script_modules.loaded("gpu_kernel_times")


def _csv(tmp_path, unit, rows):
    units = ",".join(['""'] * 11 + [f'"{unit}"', '""', '""'])  # ncu's second line
    lines = ["==PROF== Connected to process 1 (python3)", HEADER, units]
    for i, (name, time, conflicts, ratio) in enumerate(rows):
        lines.append(f'"{i}","1","python3","h","{name}",{META},"{time}","{conflicts}","{ratio}"')
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("unit", "time", "us"), [("nsecond", "453,200", "453.2"), ("usecond", "453.2", "453.2")]
)
def test_summary_per_kernel_and_sum(times, tmp_path, unit, time, us):
    path = _csv(
        tmp_path, unit, [("fused_gemm", time, "1,234,567", "0.52"), ("gemm2", "0", "10", "0.1")]
    )
    conflicts = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
    stalls = "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
    assert [line.split() for line in times.summarize(path)] == [
        ["fused_gemm"],
        ["us", us],
        [conflicts, "1234567"],
        [stalls, "0.520"],
        ["gemm2"],
        ["us", "0.0"],
        [conflicts, "10"],
        [stalls, "0.100"],
        # counts and the time add up; a ratio has no sum
        ["sum", "over", "the", "kernels"],
        ["us", us],
        [conflicts, "1234577"],
    ]


def test_summary_keeps_the_columns_asked_for(times, tmp_path):
    path = _csv(tmp_path, "nsecond", [("fused_gemm", "453,200", "7", "0.52")])
    lines = [line.split() for line in times.summarize(path, "stalled")]
    assert lines == [
        ["fused_gemm"],
        ["smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "0.520"],
        ["sum", "over", "the", "kernels"],
    ]
    with pytest.raises(ValueError, match="no metric column matches 'nonsense'"):
        times.summarize(path, "nonsense")


def test_summary_refuses_a_file_without_ncu_rows(times, tmp_path):
    path = tmp_path / "log.txt"
    path.write_text("==ERROR== Failed to find metric l1tex__nonsense\n")
    with pytest.raises(ValueError, match="no ncu CSV rows"):
        times.summarize(str(path))


def test_command_line_needs_a_shape_or_a_csv(times, capsys):
    with pytest.raises(SystemExit) as exit_info:
        times.main([])
    assert exit_info.value.code == 2
    assert "give a shape to profile" in capsys.readouterr().err
