"""``checkfreq plan`` and ``checkfreq simulate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import checkfreq.cli.plan  # noqa: F401  (registers the commands)
from checkfreq.cli import app

runner = CliRunner()


def test_plan_json_lists_each_policy() -> None:
    result = runner.invoke(
        app, ["plan", "--iteration", "1", "--stall", "30", "--persist", "60", "--mtbf-hours", "4", "--json"]
    )
    assert result.exit_code == 0, result.output
    plans = {row["policy"]: row for row in json.loads(result.output)["plans"]}
    assert plans["Daly"]["interval_steps"] == 910
    assert plans["Auto"]["interval_s"] >= plans["Daly"]["interval_s"]
    assert plans["Overhead(p=0.035)"]["stall_overhead"] <= 0.035


def test_plan_table_without_mtbf() -> None:
    result = runner.invoke(app, ["plan", "--iteration", "0.1", "--stall", "0.01", "--persist", "1"])
    assert result.exit_code == 0, result.output
    assert "Overhead" in result.output and "Daly" not in result.output


def test_plan_shows_short_intervals_in_readable_units() -> None:
    result = runner.invoke(app, ["plan", "--iteration", "0.046", "--stall", "0.001", "--persist", "0.04"])
    assert result.exit_code == 0 and "46 ms" in result.output and "0.0 s" not in result.output
    result = runner.invoke(app, ["plan", "--iteration", "0.0002", "--stall", "0", "--persist", "0"])
    assert result.exit_code == 0 and "200 µs" in result.output


def test_simulate_fits_80_columns_and_writes_no_plot_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["simulate", "--runs", "50"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "…" not in result.output and max(len(line) for line in result.output.splitlines()[1:]) <= 80
    for header in ("policy", "ckpts", "stall", "lost", "recovery", "overhead", "GPU-h", "Young"):
        assert header in result.output
    assert "COCI" in result.output and "convergence" in result.output and "exact" in result.output
    assert list(tmp_path.iterdir()) == []


def test_simulate_writes_table_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    args = ["simulate", "--runs", "200", "--plot", str(png), "--work-hours", "12"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    rows = {r["name"]: r for r in doc["results"]}
    assert rows["Young"]["overhead_vs_young"] == 0.0
    assert rows["convergence β=1"]["j_vs_young"] < 0 < rows["convergence β=1"]["overhead_vs_young"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = runner.invoke(app, args, terminal_width=200)
    assert table.exit_code == 0 and "Young" in table.output and "time overhead =" in table.output


def test_simulate_rejects_bad_parameters() -> None:
    result = runner.invoke(app, ["simulate", "--mtbf-hours", "0", "--runs", "10"])
    assert result.exit_code == 2
    assert "mtbf" in result.output
