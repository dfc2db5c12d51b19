"""What the command line says to a person: one ``error:`` line for a bad argument, the report's
words, and where it writes when the run directory is read-only."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.cli.demo import lost_text, verdict_text
from checkfreq.run.events import EventLog
from checkfreq.tools.report import load_run
from helpers import make_model, train_step

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ls", "--jsn", "."], "No such option: --jsn (Possible options: --json) (see 'checkfreq ls --help')"),
        (["lss"], "No such command 'lss'. Did you mean 'ls'? (see 'checkfreq --help')"),
        (["plan", "--iteration", "abc"], "Invalid value for '--iteration'"),
        (["ls"], "Missing argument 'directory'."),
        (["simulate", "--mtbf-hours", "0"], "Invalid value for --mtbf-hours: 0 is not a positive number"),
        (["simulate", "--persist", "-1"], "Invalid value for --persist: -1 is not a number of zero or more"),
        (
            ["plan", "--iteration", "1", "--stall", "1", "--persist", "1", "--mtbf-hours", "0"],
            "Invalid value for --mtbf-hours: 0 is not a positive number",
        ),
        (["demo", "--steps", "5"], "Invalid value for --steps: 5 is too few"),
    ],
)
def test_a_bad_argument_is_one_error_line_and_exit_status_2(args: list[str], says: str) -> None:
    result = runner.invoke(app, args, prog_name="checkfreq", terminal_width=80)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and says in lines[0]


def test_a_bad_argument_from_a_shell_is_one_line_too() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run(
        [sys.executable, "-m", "checkfreq.cli", "verify", "--remot", "x", "y"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: No such option: --remot (Possible options: --remote) (see 'python -m checkfreq.cli verify --help')"
    ]


def test_ls_of_a_file_says_it_is_a_file_not_that_it_does_not_exist(tmp_path: Path) -> None:
    given = tmp_path / "manifest.json"
    given.write_text("{}")
    result = runner.invoke(app, ["ls", str(given)], prog_name="checkfreq", terminal_width=80)
    assert result.exit_code == 2
    assert f"{given} is a file, not a checkpoint directory" in result.stderr and "does not exist" not in result.stderr


def test_simulate_explains_the_letters_of_its_header_where_it_prints_them() -> None:
    result = runner.invoke(app, ["simulate", "--runs", "5", "--work-hours", "2"], prog_name="checkfreq")
    assert result.exit_code == 0, result.output
    header, rest = result.stdout.split("\n", 1)
    legend = " ".join(rest.split("policy")[0].split())  # the lines between the header and the table
    for letter in ("W", "t_i", "C_b", "C_p", "R", "M", "q"):
        assert f"{letter}=" in header and f"{letter}: " in legend, letter
    assert "J = stall + recovery + lost work weighted by ω, how fast the loss" in " ".join(result.stdout.split())
    helped = runner.invoke(app, ["simulate", "--help"], prog_name="checkfreq", terminal_width=200)
    assert "C_b the seconds a checkpoint blocks training" in " ".join(helped.stdout.split())


def test_the_demo_says_a_restart_that_restored_nothing_shows_nothing() -> None:
    assert "bit for bit" not in verdict_text(identical=True, resumed_from=0)
    assert "nothing was restored" in verdict_text(identical=True, resumed_from=0)
    assert "bit for bit" in verdict_text(identical=True, resumed_from=10)
    assert "NO" in verdict_text(identical=False, resumed_from=10)


def test_no_arguments_still_prints_the_help() -> None:
    result = runner.invoke(app, [], prog_name="checkfreq")
    assert "Usage: checkfreq" in result.output and "error:" not in result.output


def _window(log: EventLog, step: int, interval_s: float, clean_s: float, iteration_s: float) -> None:
    log.write(
        "snapshot",
        step=step,
        stall_s=0.01,
        bytes=100,
        interval_steps=5,
        interval_s=interval_s,
        iteration_s=iteration_s,
        iteration_persisting_s=2 * iteration_s,
        clean_iterations=3,
        clean_iteration_s=clean_s,
    )
    log.write("commit", step=step, persist_s=0.05, bytes=120, bandwidth_gbps=1e-6)


def _report_lines(directory: Path) -> list[str]:
    result = runner.invoke(app, ["report", str(directory), "--no-plots"], terminal_width=300)
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def test_report_says_what_each_figure_is_and_why_a_fixed_policy_on_a_loaded_machine_is_over_the_bound(
    tmp_path: Path,
) -> None:
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Every", keep=3)
    for i, step in enumerate(range(5, 30, 5)):  # the clean steps take 0.1 s in some windows, 0.25 s in others
        _window(log, step, interval_s=2.0, clean_s=0.1 if i % 2 else 0.25, iteration_s=0.05)
    lines = _report_lines(tmp_path)
    step_time = next(line for line in lines if line.startswith("step time: "))
    assert (
        "on average over the clean steps (no persist running, no stall: what the overhead is measured "
        "against); the profiler's smoothed estimate at the end: 50 ms per step, 100 ms while a persist runs"
        in step_time
    )
    assert "far apart: the mean counts every clean step" in step_time  # 175 ms against 50 ms
    at = next(i for i, line in enumerate(lines) if line.startswith("overhead: "))
    assert "of wall time: the share of the time between checkpoints" in lines[at]
    assert lines[at + 1] == "over the 3.5 % that policy='auto' (the default) keeps to; what the log shows:"
    why = lines[at + 2 :]
    assert why[0].startswith("- a fixed policy (Every): it checkpoints at the interval it was given")
    assert "To do: policy='auto', or a longer interval (`checkfreq plan`" in why[0]
    assert why[1].startswith("- a loaded machine: the clean steps' mean time per window ran from 100 ms to 250 ms")
    assert len(why) == 2  # no settling to wait for under a fixed interval


def test_report_says_when_the_first_checkpoints_and_busy_storage_put_it_over_the_bound(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Auto", keep=3)
    _window(log, 5, interval_s=3.0, clean_s=0.1, iteration_s=0.1)  # the session's start-up: not counted
    for step in (10, 15, 20):  # the costs being measured: 50 % each
        _window(log, step, interval_s=1.0, clean_s=0.1, iteration_s=0.1)
    log.write("busy", step=22, waiting_for="persist", wait_s=0.2, interval_steps=5, persist_s=0.3, bandwidth_gbps=1e-6)
    for step in range(25, 60, 5):  # settled: 2.91 %
        _window(log, step, interval_s=0.515, clean_s=0.1, iteration_s=0.1)
    lines = _report_lines(tmp_path)
    at = next(i for i, line in enumerate(lines) if line.startswith("overhead: "))
    assert lines[at].startswith("overhead: 24.30 % of wall time")
    assert lines[at + 2].startswith("- the first checkpoints of each session: ")
    assert "without the first 3 windows of each session the overhead is 2.91 %" in lines[at + 2]
    assert lines[at + 3].startswith("- busy storage: 1 checkpoint(s) waited for the previous persist")
    assert len(lines) == at + 4


def test_report_within_the_bound_gives_no_advice(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Auto", keep=3)
    for step in range(5, 40, 5):
        _window(log, step, interval_s=0.515, clean_s=0.1, iteration_s=0.1)
    lines = _report_lines(tmp_path)
    assert lines[-1].startswith("overhead: 2.91 % of wall time: ")
    assert not any("keeps to" in line or "far apart" in line for line in lines)


def _unwritable(directory: Path) -> Callable[[], None]:
    """Make ``directory`` refuse new files, even to root; return how to undo it."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        return lambda: directory.chmod(0o700)
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("cannot make a directory immutable here (chattr +i needs root and a filesystem that has it)")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True) and None


def test_report_on_a_read_only_run_writes_into_a_temporary_directory_and_says_so(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(run, policy=2, model=model, optimizer=opt) as ckpt:
        for _ in range(6):
            train_step(model, opt)
            ckpt.step()
    undo = _unwritable(run)
    try:
        result = runner.invoke(app, ["report", str(run)], terminal_width=300)
    finally:
        undo()
    assert result.exit_code == 0, result.output
    assert f"could not write into {run} (" in result.stdout
    assert "the files went to a new temporary directory instead (--out DIR chooses where)" in result.stdout
    png = Path(next(line for line in result.stdout.splitlines() if line.startswith("timeline: ")).split()[-1])
    assert png.is_file() and png.parent.name.startswith("checkfreq-report-") and (png.parent / "report.html").is_file()
    assert not (run / "report.png").exists()
    asked = runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "here")], terminal_width=300)
    assert asked.exit_code == 0 and (tmp_path / "here" / "report.png").is_file()
    assert "could not write" not in asked.stdout


def test_the_demo_says_a_persist_in_flight_is_why_more_steps_than_an_interval_were_lost(tmp_path: Path) -> None:
    """The case a demo's random kill lands on now and then (tests/integration/test_demo.py checks whichever comes)."""
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Auto", keep=3)
    _window(log, 10, interval_s=1.0, clean_s=0.1, iteration_s=0.1)
    log.write("snapshot", step=30, stall_s=0.01, bytes=100, interval_steps=20, interval_s=2.0)  # killed in its persist
    log.write("start", pid=2, policy="Auto", keep=3)
    log.write("restore", step=10, skipped=[], seeded=["profile", "policy"])
    assert lost_text(load_run(tmp_path), killed=41, restored=10) == (
        "the checkpoint of step 30 was still being written when the kill came at step 41, so the newest durable "
        "one was that of step 10, the one before it"
    )
