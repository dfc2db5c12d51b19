"""Smoke test of the benchmark suite: a tiny ``--quick`` run produces every table row (timings never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import matplotlib.image
import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.report import BEGIN, END, splice  # noqa: E402
from benchmarks.state_bench import all_methods  # noqa: E402
from benchmarks.training import variants  # noqa: E402

PUBLISHED = [ROOT / "docs" / name for name in ("performance.md", "performance.png", "performance.json")]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first command of docs/performance.md, made quick: without --out it writes into a new
    temporary directory, which it names, and leaves the checkout's docs/performance.* alone."""
    published = [path.read_bytes() if path.exists() else None for path in PUBLISHED]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "TMPDIR": str(tmp_path_factory.mktemp("scratch")),
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--cuda", "--intervals", "1,10"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert [path.read_bytes() if path.exists() else None for path in PUBLISHED] == published
    out = Path(done.stdout.rsplit("written into ", 1)[1].split(":")[0])
    assert out.parent == Path(env["TMPDIR"])
    return out


def test_a_run_keeps_the_prose_around_its_section(tmp_path: Path) -> None:
    """What ``--out docs`` does to the published page: only the generated section changes."""
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n\nprose kept\n\n{BEGIN}\nold\n{END}\n\nmore prose\n")
    splice(doc, f"{BEGIN}\nnew\n{END}")
    assert doc.read_text() == f"# Performance\n\nprose kept\n\n{BEGIN}\nnew\n{END}\n\nmore prose\n"


def test_quick_run_writes_every_row(quick_run: Path) -> None:
    doc = (quick_run / "performance.md").read_text()
    assert doc.count(BEGIN) == 1
    section = doc.split(BEGIN)[1].split(END)[0]
    rows = {line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")}
    for method in all_methods(quick=True):
        assert method.name in rows, method.name
    for variant in variants((1, 10)):
        if variant != "no checkpoints":
            assert variant in rows, variant
    for target in (
        "stall / raw copy_",
        "torch.save+fsync stall / checkfreq stall",
        "write bandwidth / raw write+fsync",
        "peak extra RSS (save) / state size",
    ):
        assert target in rows, target
    assert any(r.startswith("checkfreq auto") and r.endswith("whole-run overhead") for r in rows)
    assert "#### GPU mode" in section
    assert "failed:" not in section


def test_quick_run_writes_png_and_raw_results(quick_run: Path) -> None:
    assert (quick_run / "performance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((quick_run / "performance.json").read_text())
    (state,) = results["states"].values()
    rounds = {len(samples) for samples in state["samples"].values()}
    assert rounds == {2}, "every method runs in every interleaved round"
    assert all(runs for runs in results["training"]["runs"].values())


def test_the_tensor_count_benchmark_measures_every_count_and_mode_in_one_run(tmp_path: Path) -> None:
    """``benchmarks.tensor_count`` at two small counts: a row per count and mode, each with its baseline."""
    out = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.tensor_count", "--counts", "8", "40", "--rounds", "1", "--megabytes", "1"]
        + ["--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    rows = json.loads(out.read_text())
    assert [(r["count"], r["mode"]) for r in rows] == [(8, "disk"), (8, "memory"), (40, "disk"), (40, "memory")]
    for row in rows:
        assert row["checkpoint_s"] > 0 and row["copy_loop_s"] > 0
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # the header, its rule, a line per row


def test_copies_slower_than_snapshots_always_leave_a_step_both_machines_hold() -> None:
    """``benchmarks.copy_lag`` with each copy taking three snapshot intervals: under the memory tier's rule
    every copy is kept, the snapshots come at the copies' pace, and at every begin a step is held whole
    by both the sender's region and the keeper's copies, one snapshot behind at most."""
    from benchmarks.copy_lag import RULES, run

    row = run(RULES[0], ratio=3.0, interval=0.05, snapshots=10, megabytes=1.0)
    assert row.copies_kept == row.snapshots and row.without_cut == 0, row
    assert row.lag_max == 1 and row.behind_max == 1, row
    assert row.waits >= 1 and row.interval_s > 0.05, row


def test_the_goodput_benchmark_breaks_each_failure_down_and_checks_the_final_state(tmp_path: Path) -> None:
    """``benchmarks.goodput`` made short: checkfreq with ``memory=1`` and ``replicas=1`` under real torchrun
    agents, killed (a rank or node 1) every few seconds, and the fault-free reference. Each failure comes
    back from a restore with at most a step or two replayed, each phase of its cost measured, and the
    job's final state is the reference's at the same step, bit for bit."""
    from benchmarks.goodput import measure
    from benchmarks.goodput_plot import plot

    measured = measure(["checkfreq-memory", "none"], 45.0, 10.0, 0.5, 1, seed=3)
    runs = {run.variant: run for run in measured}
    run = runs["checkfreq-memory"]
    assert run.finished and run.failures and run.steps > 0, run
    for failure in run.failures:
        assert failure["replayed"] is not None and failure["replayed"] <= 2, run.failures
        assert {"restart", "imports", "group", "model", "setup", "restore"} <= failure.keys(), failure
    assert run.identical is not False, run  # None only where the reference stopped short of its step
    assert runs["none"].finished and not runs["none"].failures
    plot([asdict(run) for run in measured], str(tmp_path / "goodput.png"))
    assert matplotlib.image.imread(tmp_path / "goodput.png").shape[2] in (3, 4)  # a picture, drawn
