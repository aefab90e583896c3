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


SASS_HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)",'
    '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier",'
    '"stall_long_sb","stall_wait","stall_barrier (Not Issued)"'
)


def _sass_csv(tmp_path, rows):
    """ncu's source page: the kernel's name line, the header, one line per SASS instruction
    (source, samples, runs, barrier / long scoreboard / wait samples)."""
    lines = ['"Kernel Name","anonymous_mosaic_gpu_kernel",', SASS_HEADER]
    for i, (source, samples, runs, barrier, long_sb, wait) in enumerate(rows):
        lines.append(
            f'"0x{i:04x}","{source}","{samples}","0","{runs}","{barrier}","{long_sb}","{wait}","99"'
        )
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_sass_summary_by_loop_level_and_opcode(times, tmp_path):
    path = _sass_csv(
        tmp_path,
        [
            ("      LDC R1, c[0x0][0x28]", "0", "132", "0", "0", "0"),
            ("@!P2  BRA 0x7f39", "40", "4,000", "0", "38", "2"),  # the K loop's wait
            ("      QGMMA.64x128x32.F32.E4M3.E4M3 R24", "20", "4,000", "0", "0", "20"),
            ("      WARPGROUP.DEPBAR.LE gsb0, 0x0", "15", "4,000", "15", "0", "0"),
            ("      MUFU.RCP R64, R64", "10", "500", "0", "0", "10"),  # a tile's epilogue
            ("      BAR.SYNC.DEFER_BLOCKING R2, 0x80", "15", "500", "14", "0", "1"),
        ],
    )
    lines = times.sass_summary(path, top=2)
    assert lines[0] == "6 instructions, 100 stall samples"
    assert lines[1].split() == [
        "run", "4000", "times:", "75.0%", "of", "samples,", "3", "instructions,", "1.2e+04",
        "issued",
    ]  # fmt: skip
    assert [line.split() for line in lines[2:5]] == [
        ["BRA", "40.0%"],
        ["QGMMA.64x128x32.F32.E4M3.E4M3", "20.0%"],
        ["WARPGROUP.DEPBAR.LE", "15.0%"],
    ]
    assert lines[5].startswith("run 500 times:  25.0% of samples, 2 instructions")
    assert [line.split()[0] for line in lines[6:8]] == ["BAR.SYNC.DEFER_BLOCKING", "MUFU.RCP"]
    assert lines[8].startswith("run 132 times:   0.0% of samples")
    # the two instructions with the most samples, with their largest stall reasons
    assert lines[11].split()[:3] == ["1", "40.0%", "4000"]
    assert lines[11].endswith("long_sb 38, wait 2")
    assert lines[12].split()[:3] == ["2", "20.0%", "4000"]
    assert len(lines) == 13


def test_sass_summary_refuses_other_pages(times, tmp_path):
    path = _csv(tmp_path, "nsecond", [("fused_gemm", "453,200", "7", "0.52")])
    with pytest.raises(ValueError, match="no SASS rows"):
        times.sass_summary(path)
    no_samples = tmp_path / "no_samples.csv"
    no_samples.write_text('"Address","Source","Instructions Executed"\n"0x0","NOP","1"\n')
    with pytest.raises(ValueError, match="collect --section SourceCounters"):
        times.sass_summary(str(no_samples))
