"""scripts/gpu_kernel_times.py's summary of an ncu CSV and its command line (the profiling itself
needs a GPU and ncu: `bash scripts/gpu_check.sh epilogue` and `gather` run it there), and the
`gather` mode's own steps around ncu."""

from __future__ import annotations

import os
import sys

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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["B", "--variant", "nonsense"], "unknown --variant 'nonsense'"),
        (
            ["B", "--variant", "moe_jax_fp8_gathered", "--experts", "deep_gemm"],
            "--variant chooses the forward's experts itself: drop --experts",
        ),
    ],
)
def test_variant_is_checked_before_anything_runs(times, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        times.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# Nsight Compute needs a GPU; this stand-in takes its place in the test below only, to hold
# `gpu_check.sh gather`'s own steps (which ncu runs, with what, and what it does with their
# output) to account on the CPU: it logs its arguments, "profiles" by creating the report file
# named after -o, and prints the given CSV pages on --import
FAKE_NCU = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_NCU_CALLS"
case " $* " in
  *" --import "*" --page raw "*) cat "$FAKE_NCU_RAW" ;;
  *" --import "*" --page source "*) cat "$FAKE_NCU_SASS" ;;
  *)
    args=("$@")
    for i in "${!args[@]}"; do
      if [ "${args[$i]}" = -o ]; then touch "${args[$((i + 1))]}.ncu-rep"; fi
    done
    ;;
esac
"""


def test_gpu_check_gather_profiles_both_gemm1s_and_summarizes_them(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ncu").write_text(FAKE_NCU)
    (bin_dir / "ncu").chmod(0o755)
    raw = tmp_path / "raw.csv"
    raw.write_text(
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
        '"Block Size","Grid Size","Device","CC","gpu__time_duration.sum","dram__bytes_read.sum",'
        '"lts__t_sector_hit_rate.pct","sm__cycles_elapsed.avg"\n'
        + '"","","","","","","","","","","","nsecond","byte","%","cycle"\n'
        + '"0","1","python3","h","mosaic_gpu_kernel","1","7","(384, 1, 1)","(132, 1, 1)","0",'
        '"9.0","503,600","301,000,000","41.5","1000"\n'
    )
    sass = _sass_csv(
        tmp_path, [("      LDGSTS.E.BYPASS.128 [R1], [R2.64]", "30", "4,000", "0", "25", "5")]
    )
    out = tmp_path / "out"
    calls = tmp_path / "calls.txt"
    path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]])
    env = {
        "OUT": str(out),
        "PATH": path,
        "FAKE_NCU_CALLS": str(calls),
        "FAKE_NCU_RAW": str(raw),
        "FAKE_NCU_SASS": sass,
    }
    done = script_modules.run_at_root(["bash", "scripts/gpu_check.sh", "gather"], env, 120)
    assert done.returncode == 0, done.stdout + done.stderr
    tags = ["deep_gemm_mosaic_fp8", "moe_jax_fp8_gathered"]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gather.log"]
        + [f"gather_{tag}_{part}" for tag in tags for part in ("ncu.log", "raw.csv", "sass.csv")]
    )  # 7 files: the device tool brings back at most 8
    profiled = [line for line in calls.read_text().splitlines() if "--import " not in line]
    assert len(profiled) == 2
    for line, forward in zip(
        profiled, ["--experts deep_gemm+mosaic_fp8", "--variant moe_jax_fp8_gathered"], strict=True
    ):
        assert "--kernel-name regex:mosaic --launch-count 1" in line
        assert "--section MemoryWorkloadAnalysis " in line and "--section SourceCounters" in line
        assert line.endswith(f"python3 scripts/gpu_kernel_times.py B {forward}")
    log = (out / "gather.log").read_text()
    # the raw page summarized with the memory columns only, then the stall samples, per GEMM1
    assert log.count("dram__bytes_read.sum") == 4  # each kernel's line and the sum, twice
    assert log.count("lts__t_sector_hit_rate.pct") == 2 and "sm__cycles_elapsed" not in log
    assert log.count("503.6") == 4
    assert log.count("1 instructions, 30 stall samples") == 2
