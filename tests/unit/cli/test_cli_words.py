"""What the command line says to a person: one ``error:`` line for a bad argument, the report's
words, and where it writes when the run directory is read-only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from checkfreq.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ls", "--jsn", "."], "No such option: --jsn (Possible options: --json) (see 'checkfreq ls --help')"),
        (["lss"], "No such command 'lss'. Did you mean 'ls'? (see 'checkfreq --help')"),
        (["plan", "--iteration", "abc"], "Invalid value for '--iteration'"),
        (["ls"], "Missing argument 'directory'."),
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
    done = subprocess.run([sys.executable, "-m", "checkfreq.cli", "verify", "--remot", "x", "y"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: No such option: --remot (Possible options: --remote) (see 'python -m checkfreq.cli verify --help')"
    ]


def test_no_arguments_still_prints_the_help() -> None:
    result = runner.invoke(app, [], prog_name="checkfreq")
    assert "Usage: checkfreq" in result.output and "error:" not in result.output
