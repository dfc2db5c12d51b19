"""``checkfreq plan`` and ``checkfreq simulate``."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import checkfreq.cli.plan  # noqa: F401  (registers the commands)
from checkfreq.cli import app

runner = CliRunner()


def test_plan_json_lists_each_policy() -> None:
    result = runner.invoke(app, ["plan", "--iteration", "1", "--stall", "30", "--persist", "60", "--mtbf-hours", "4", "--json"])
    assert result.exit_code == 0, result.output
    plans = {row["policy"]: row for row in json.loads(result.output)["plans"]}
    assert plans["Daly"]["interval_steps"] == 910
    assert plans["Auto"]["interval_s"] >= plans["Daly"]["interval_s"]
    assert plans["Overhead(p=0.035)"]["stall_overhead"] <= 0.035


def test_plan_table_without_mtbf() -> None:
    result = runner.invoke(app, ["plan", "--iteration", "0.1", "--stall", "0.01", "--persist", "1"])
    assert result.exit_code == 0, result.output
    assert "Overhead" in result.output and "Daly" not in result.output


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
    result = runner.invoke(app, ["simulate", "--mtbf-hours", "0", "--plot", "", "--runs", "10"])
    assert result.exit_code == 2
    assert "mtbf" in result.output
