"""``checkfreq report``: timeline PNG/HTML and summary from a real run's event log."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import checkfreq as cf
from checkfreq.cli import app
from checkfreq.run.events import EventLog, read_events
from checkfreq.tools.report import human_seconds, load_run, summary_text
from checkfreq.tools.report_files import plotted_overhead, render_figure
from helpers import make_model, train_step

runner = CliRunner()


def session(directory: Path, steps: int) -> None:
    """One training session: restore whatever is there, train ``steps`` more, checkpoint every 5."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with cf.Checkpointer(directory, model=model, optimizer=opt, policy=5, keep=2) as ckpt:
        ckpt.restore()
        for _ in range(steps):
            train_step(model, opt)
            ckpt.step()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two sessions: 12 steps, then a restart that resumes from step 10 and reaches step 30."""
    directory = tmp_path_factory.mktemp("report") / "run"
    session(directory, 12)
    session(directory, 20)
    return directory


def busy_s(snapshot: dict) -> float:
    """A window's wall time less the loop's other work the profiler set aside in it (``away_s``: a
    step much slower than the others, as on a busy machine), as the report's overhead counts it."""
    return snapshot["interval_s"] - (snapshot.get("away_s") or 0.0)


def expected_summary(events: list[dict]) -> dict:
    """The summary computed straight from the raw log, independently of checkfreq.tools.report."""
    snapshots = [e for e in events if e["event"] == "snapshot"]
    commits = [e for e in events if e["event"] == "commit"]
    fences = {e["step"]: e["stall_s"] for e in events if e["event"] == "fence"}
    stalls = [fences.get(s["step"], s["stall_s"]) for s in snapshots]
    clean = [(e["clean_iterations"], e["clean_iteration_s"]) for e in snapshots if e["clean_iterations"]]
    run_clean = sum(n * m for n, m in clean) / sum(n for n, _ in clean)
    counted, after_boundary = [], True
    for e in events:
        if e["event"] in ("start", "restore"):
            after_boundary = True
        elif e["event"] == "snapshot":
            baseline = e["clean_iteration_s"] if e["clean_iteration_s"] is not None else run_clean
            if not after_boundary and baseline is not None and busy_s(e) > 0:
                counted.append((e, baseline))
            after_boundary = False
    explained = sum(
        max(0.0, min(e["interval_steps"] * baseline, busy_s(e) - fences.get(e["step"], e["stall_s"])))
        for e, baseline in counted
    )  # steps faster than the yardstick explain at most the window less its stall, and never less than nothing
    return {
        "clean_iteration_s": run_clean,
        "checkpoints": len(snapshots),
        "committed": len(commits),
        "sessions": sum(e["event"] == "start" for e in events),
        "restores": sum(e["event"] == "restore" for e in events),
        "stall_total_s": sum(stalls),
        "stall_max_s": max(stalls),
        "stall_median_s": statistics.median(stalls),
        "persist_median_s": statistics.median(e["persist_s"] for e in commits),
        "bandwidth_median_gbps": statistics.median(e["bandwidth_gbps"] for e in commits),
        "bytes_written": sum(e["bytes"] for e in commits),
        "overhead": 1 - explained / sum(busy_s(e) for e, _ in counted),
        "last_step": snapshots[-1]["step"],
    }


@pytest.fixture(scope="module")
def reported(run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """``checkfreq report RUN --out OUT --json [--tensorboard OUT/tb]``: its parsed output and OUT."""
    out = tmp_path_factory.mktemp("out")
    tensorboard = ["--tensorboard", str(out / "tb")] if importlib.util.find_spec("tensorboard") else []
    result = runner.invoke(app, ["report", str(run), "--out", str(out), "--json", *tensorboard])
    assert result.exit_code == 0, result.output
    return json.loads(result.output), out


def test_report_summary_matches_the_event_log(run: Path, reported: tuple[dict, Path]) -> None:
    doc, _ = reported
    summary, expected = doc["summary"], expected_summary(read_events(run))
    assert expected["checkpoints"] == 6 and expected["sessions"] == 2 and expected["restores"] == 1
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value), key
    assert summary["failed"] == 0 and summary["unfinished"] == 0 and summary["last_step"] == 30
    assert summary["interval_median_steps"] == 5
    assert [c["step"] for c in doc["checkpoints"]] == [5, 10, 15, 20, 25, 30]
    assert [c["first_of_session"] for c in doc["checkpoints"]] == [True, False, True, False, False, False]
    text = summary_text(load_run(run))
    assert "6 checkpoints (6 committed, 0 failed" in text and "2 session(s), 1 restore(s)" in text
    assert f"median {human_seconds(expected['stall_median_s'])}" in text
    assert f"{100 * expected['overhead']:.2f} %" in text


def test_report_shows_each_session_separately(run: Path, reported: tuple[dict, Path]) -> None:
    doc, _ = reported
    first, resumed = doc["sessions"]
    assert (first["restored_step"], first["checkpoints"], first["first_step"], first["last_step"]) == (None, 2, 5, 10)
    assert (resumed["restored_step"], resumed["checkpoints"], resumed["first_step"], resumed["last_step"]) == (
        10,
        4,
        15,
        30,
    )
    assert resumed["seeded"] == ["profile", "policy"] and resumed["interval_median_steps"] == 5
    assert first["checkpoints_per_step"] == pytest.approx(2 / 10) and (
        resumed["checkpoints_per_step"] == pytest.approx(4 / 20)
    )
    assert [c["session"] for c in doc["checkpoints"]] == [0, 0, 1, 1, 1, 1]
    events = read_events(run)
    second_start = [i for i, e in enumerate(events) if e["event"] == "start"][1]
    # the first one's window holds the restore
    windows = [e for e in events[second_start:] if e["event"] == "snapshot"][1:]
    counted = [e for e in windows if busy_s(e) > 0]
    clean = {c["step"]: c["baseline_iteration_s"] for c in doc["checkpoints"]}
    stalls = {c["step"]: c["stall_s"] for c in doc["checkpoints"]}
    explained = sum(
        max(0.0, min(e["interval_steps"] * clean[e["step"]], busy_s(e) - stalls[e["step"]])) for e in counted
    )  # as expected_summary: never less than nothing
    assert resumed["overhead"] == pytest.approx(1 - explained / sum(busy_s(e) for e in counted))
    text = summary_text(load_run(run))
    assert "session 1: started fresh; 2 checkpoints, steps 5..10, 200 per 1000 steps" in text
    assert (
        "session 2: restored step 10 (took over the step and checkpoint costs measured before and the "
        "policy's state (for policy='auto', the interval it chose and its overhead budget), so it goes on "
        "from what the run had learned instead of learning it afresh); 4 checkpoints, steps 15..30"
    ) in text


def test_report_prints_the_summary_and_where_the_files_are(run: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path)])
    assert result.exit_code == 0 and summary_text(load_run(run)) in result.output
    assert str(tmp_path / "report.png") in result.output and (tmp_path / "report.html").is_file()


def test_report_no_plots_writes_no_file(run: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(run), "--out", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0 and summary_text(load_run(run)) in result.output
    assert "report.png" not in result.output and not list(tmp_path.iterdir())
    result = runner.invoke(app, ["report", str(run), "--no-plots", "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["files"] is None
    assert not list(run.glob("report.*"))


MATPLOTLIB_MISSING = """
import sys
sys.modules["matplotlib"] = None  # as if it were not installed: any import of it fails
sys.argv = ["checkfreq", *sys.argv[1:]]
from checkfreq.command import main
main()
"""


def test_report_without_matplotlib_is_one_error_line_and_no_plots_still_works(run: Path, tmp_path: Path) -> None:
    """The ``checkfreq`` entry point in a process where matplotlib cannot be imported."""
    plain = subprocess.run(
        [sys.executable, "-c", MATPLOTLIB_MISSING, "report", str(run), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr
    assert plain.stderr.strip().splitlines() == [
        "error: the report's plots need the matplotlib package: pip install 'checkfreq[cli]' "
        "(or leave them out: checkfreq report --no-plots prints the summary alone)"
    ]
    summary = subprocess.run(
        [sys.executable, "-c", MATPLOTLIB_MISSING, "report", str(run), "--no-plots"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert summary.returncode == 0, summary.stderr
    assert summary.stdout.startswith(f"run {run}: 6 checkpoints") and not list(tmp_path.iterdir())


def test_report_png_is_a_real_nonblank_image(reported: tuple[dict, Path]) -> None:
    image = matplotlib.image.imread(reported[1] / "report.png")
    height, width = image.shape[:2]
    assert height >= 800 and width >= 800
    rgb = image[..., :3]
    not_white = (rgb < 0.95).any(axis=-1).mean()
    colored = (np.abs(rgb[..., 0] - rgb[..., 2]) > 0.3).sum()  # plotted lines, not just grey axes
    assert not_white > 0.02 and colored > 500


def test_report_html_is_self_contained(reported: tuple[dict, Path]) -> None:
    page = (reported[1] / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "6 checkpoints" in page
    assert "<script" not in page and "src=" not in page and "<link" not in page
    assert page.count("<tr>") == 1 + 6


def test_matching_of_outcomes_failures_restarts_and_overhead(tmp_path: Path) -> None:
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Every", keep=3)
    log.write("snapshot", step=5, stall_s=0.001, bytes=100, interval_steps=5, interval_s=9.0, iteration_s=None)
    log.write("fence", step=5, wait_s=0.019, stall_s=0.02)
    log.write("commit", step=5, persist_s=0.5, bytes=120, bandwidth_gbps=2.4e-7)
    log.write("snapshot", step=10, stall_s=0.01, bytes=100, interval_steps=5, interval_s=2.0, iteration_s=0.15)
    log.write("error", step=10, message="disk full")
    log.write("start", pid=2, policy="Every", keep=3)
    log.write("restore", step=5, skipped=[])
    log.write("snapshot", step=10, stall_s=0.03, bytes=100, interval_steps=5, interval_s=7.0, iteration_s=0.2)
    log.write("commit", step=10, persist_s=0.7, bytes=120, bandwidth_gbps=1.7e-7)
    log.write(
        "snapshot",
        step=15,
        stall_s=0.04,
        bytes=100,
        interval_steps=5,
        interval_s=2.0,
        iteration_s=0.5,
        clean_iterations=3,
        clean_iteration_s=0.3,
    )
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "commit", "step": 15, "pers')  # torn by a kill
    report = load_run(tmp_path)
    recs, s = report.records, report.summary
    assert [(r.step, r.status) for r in recs] == [
        (5, "committed"),
        (10, "failed"),
        (10, "committed"),
        (15, "unfinished"),
    ]
    assert recs[0].stall_s == 0.02 and recs[0].bytes == 120 and recs[1].error == "disk full"
    assert [r.overhead for r in recs] == [None, pytest.approx(0.25), None, pytest.approx(0.25)]
    assert (s.checkpoints, s.committed, s.failed, s.unfinished, s.sessions, s.restores) == (4, 2, 1, 1, 2, 1)
    # Step 10's window had no clean iteration: it is measured against the run's clean mean (0.3 s).
    assert [r.baseline_iteration_s for r in recs] == [0.3, 0.3, 0.3, 0.3]
    assert s.overhead == pytest.approx(1 - (5 * 0.3 + 5 * 0.3) / (2.0 + 2.0))
    assert s.stall_total_s == pytest.approx(0.02 + 0.01 + 0.03 + 0.04) and s.bytes_written == 240
    assert s.clean_iteration_s == 0.3 and s.iteration_s == 0.5


def test_a_one_checkpoint_session_and_steps_faster_than_the_yardstick_say_what_they_mean(tmp_path: Path) -> None:
    """What `checkfreq demo` and `report` print for them, instead of ``n/a`` and a bare -50 %."""
    log = EventLog(tmp_path)
    log.write("start", pid=1, policy="Every", keep=3)
    log.write(
        "snapshot",
        step=5,
        stall_s=0.01,
        bytes=100,
        interval_steps=5,
        interval_s=2.0,
        iteration_s=0.2,
        clean_iterations=4,
        clean_iteration_s=0.2,
    )
    log.write("commit", step=5, persist_s=0.1, bytes=120, bandwidth_gbps=1e-6)
    log.write("start", pid=2, policy="Every", keep=3)
    log.write("restore", step=5, skipped=[])
    for step in (10, 15, 20):  # 5 steps of 0.3 s each in 1 s: faster than the yardstick
        log.write(
            "snapshot",
            step=step,
            stall_s=0.01,
            bytes=100,
            interval_steps=5,
            interval_s=1.0,
            iteration_s=0.3,
            clean_iterations=4,
            clean_iteration_s=0.3,
        )
        log.write("commit", step=step, persist_s=0.1, bytes=120, bandwidth_gbps=1e-6)
    lines = summary_text(load_run(tmp_path)).splitlines()
    assert "persist: median 100 ms at 1 kB/s," in lines[3], "a slow rate in a unit a person reads, not 0.000001 GB/s"
    # what the steps cannot explain is the stall at least (1 - 1.5 / 1 = -50 % was noise, not a cost)
    assert lines[-3].startswith("overhead: 1.00 % of wall time: the share of the time between checkpoints")
    assert lines[-2] == (
        "session 1: started fresh; 1 checkpoint, at step 5, 200 per 1000 steps, interval and overhead not "
        "measured: the window up to a session's first checkpoint holds its start-up, so they need a second checkpoint"
    )
    assert lines[-1] == (
        "session 2: restored step 5; 3 checkpoints, steps 10..20, 200 per 1000 steps, "
        "interval median 5 steps, overhead 1.00 %"
    )
    assert "n/a" not in "\n".join(lines[-3:])


def test_report_without_an_event_log_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "no event log" in result.output


def test_tensorboard_scalars_match_the_report(reported: tuple[dict, Path]) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    doc, out = reported
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    stalls = events.Scalars("checkfreq/stall_ms")
    assert [e.step for e in stalls] == [c["step"] for c in doc["checkpoints"]]
    assert [e.value for e in stalls] == pytest.approx([1e3 * c["stall_s"] for c in doc["checkpoints"]], rel=1e-6)
    assert [e.wall_time for e in stalls] == pytest.approx([c["time"] for c in doc["checkpoints"]])
    assert len(events.Scalars("checkfreq/persist_ms")) == 6
    assert doc["tensorboard_scalars"] == sum(len(events.Scalars(tag)) for tag in events.Tags()["scalars"])


def test_ranks_of_one_job_count_each_checkpoint_once_and_keep_their_own_stalls(tmp_path: Path) -> None:
    logs = [EventLog(tmp_path, rank=rank) for rank in (0, 1)]
    for log in logs:
        log.write("start", pid=log.rank, policy="Every", keep=3)
    for step, stalls in ((3, (0.01, 0.03)), (6, (0.02, 0.05))):
        for log, stall in zip(logs, stalls, strict=True):
            log.write("snapshot", step=step, stall_s=stall, bytes=100, interval_steps=3, interval_s=1.0)
        logs[1].write("fence", step=step, wait_s=0.01, stall_s=stalls[1] + 0.01)
        for log in logs:
            log.write("commit", step=step, persist_s=0.1, bytes=120, bandwidth_gbps=1e-6)
    report = load_run(tmp_path)
    s = report.summary
    assert (s.checkpoints, s.committed, s.sessions) == (2, 2, 1)
    assert report.rank_stalls == {0: [0.01, 0.02], 1: [pytest.approx(0.04), pytest.approx(0.06)]}
    assert "stall per rank: rank 0 median 15 ms, max 20 ms; rank 1 median 50 ms, max 60 ms" in summary_text(report)


def test_timeline_breaks_between_sessions_skips_short_windows_and_draws_from_zero(tmp_path: Path) -> None:
    """Two sessions of 10-step windows; each ends with a 3-step save() window."""
    directory = tmp_path / "exp7" / "checkpoints"
    directory.mkdir(parents=True)
    log = EventLog(directory)

    def checkpoint(step: int, steps: int) -> None:
        log.write(
            "snapshot",
            step=step,
            stall_s=0.005,
            bytes=100,
            interval_steps=steps,
            interval_s=0.01 * steps + 0.005,
            iteration_s=0.01,
            clean_iterations=steps - 1,
            clean_iteration_s=0.01,
            reason="policy",
        )
        log.write("commit", step=step, persist_s=0.02, bytes=120, bandwidth_gbps=6e-6)

    log.write("start", pid=1, policy="Every", keep=3)
    for step in (10, 20, 30, 40):
        checkpoint(step, 10)
    checkpoint(43, 3)
    log.write("start", pid=2, policy="Every", keep=3)
    log.write("restore", step=43, skipped=[])
    for step in (50, 60, 70, 80):
        checkpoint(step, 10 if step > 50 else 7)
    checkpoint(83, 3)
    report = load_run(directory)
    windows = [(r.step, r.overhead is not None) for r in report.records]
    assert windows == [
        (10, False),
        (20, True),
        (30, True),
        (40, True),
        (43, True),
        (50, False),
        (60, True),
        (70, True),
        (80, True),
        (83, True),
    ]
    # The 3-step windows count in the run's overhead, but get no point of their own.
    assert [r.step for r, o in zip(report.records, plotted_overhead(report), strict=True) if o is not None] == [
        20,
        30,
        40,
        60,
        70,
        80,
    ]

    figure = render_figure(report)
    iteration, _, persist, interval, overhead = figure.axes[:5]
    restore_time = report.restores[0]["time"] - report.start_time
    for ax in (iteration, persist, interval, overhead):
        lines = [
            line for line in ax.get_lines() if line.get_transform() == ax.transData and line.get_linestyle() != "None"
        ]
        data_lines = [line for line in lines if not (min(line.get_xdata()) < restore_time < max(line.get_xdata()))]
        assert lines and data_lines == lines, ax.get_ylabel()  # no line crosses the restore
    assert len([line for line in overhead.get_lines() if line.get_label() in ("per window", "_nolegend_")]) == 2
    assert interval.get_ylim()[0] == 0 and interval.get_ylim()[1] > 10  # the constant 10 steps, on an axis from 0
    assert "exp7/checkpoints (10 checkpoints, 2 sessions)" in figure.get_suptitle()  # the path, not just "checkpoints"


def test_the_copies_lag_in_seconds_and_snapshots_and_where_a_lost_node_resumes(tmp_path: Path) -> None:
    """Rank 0's copy of snapshot 2 lands after its snapshots 3 and 4 (2.5 s); rank 1's of 5 at once:
    the report gives the lag's median and max, and step 2 as where a node lost at the end resumes."""
    logs = [EventLog(tmp_path, rank=rank) for rank in (0, 1)]
    for log in logs:
        log.write("start", time=0.0, pid=log.rank, policy="Every", keep=3)
    for step in range(1, 7):
        for log in logs:
            log.write("memory", time=float(step), step=step, stall_s=0.001, bytes=100)
    logs[0].write("replica", time=4.5, step=2, to=1, bytes=100, seconds=0.1, kept=True)
    logs[1].write("replica", time=5.2, step=5, to=0, bytes=100, seconds=0.1, kept=True)
    text = summary_text(load_run(tmp_path))
    assert "copy lag: median 1.35 s (1 snapshots), max 2.5 s (2 snapshots)" in text, text
    assert "every rank's copy had reached step 2 (newest snapshot 6)" in text
    logs[0].write("memory", time=7.0, step=7, stall_s=0.001, bytes=100)
    EventLog(tmp_path, rank=2).write("memory", time=7.0, step=7, stall_s=0.001, bytes=100)
    assert "rank 2 had no copy kept" in summary_text(load_run(tmp_path))


def test_snapshots_that_waited_for_the_copies_are_counted_with_their_median_wait(tmp_path: Path) -> None:
    log = EventLog(tmp_path, rank=0)
    log.write("start", time=0.0, pid=0, policy="Every", keep=3)
    for step in range(1, 5):
        log.write("memory", time=float(step), step=step, stall_s=0.001, bytes=100)
        log.write("replica", time=step + 0.5, step=step, to=1, bytes=100, seconds=0.9, kept=True)
    for step, seconds in ((2, 0.2), (3, 0.4), (4, 0.3)):
        log.write("replica wait", time=float(step), step=step, seconds=seconds, to=[1], done=True)
    text = summary_text(load_run(tmp_path))
    assert "memory copies on another machine: 4 kept there (400 B, 100 B sent a snapshot" in text, text
    assert "3 snapshots waited for the copies of the one before (median 300 ms" in text, text
    assert "not copied" not in text
