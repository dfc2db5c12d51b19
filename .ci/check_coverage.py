"""Fail CI unless the lint and the test run see every file git tracks.

ruff's default ``exclude`` and pytest's default ``norecursedirs`` both hold names such as ``dist``
and ``build``: a folder of that name is skipped without a word, and its files are never linted or
run. This script compares what they see with ``git ls-files`` (so untracked files, such as the
``.ci-venv`` that .ci/run creates, do not count):

* every tracked ``*.py`` file is among the files ``ruff check --show-files PATH...`` checks (the
  paths .ci/run lints, given as arguments);
* every tracked test file (``tests/**/test_*.py`` or ``*_test.py``, pytest's default names) is a
  module pytest collects with the project's configuration (``--collect-only``, which imports
  every test module: a few seconds).

Usage, from anywhere in the repository: ``python .ci/check_coverage.py src tests benchmarks .ci``.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked_python_files() -> set[str]:
    """The ``*.py`` files git tracks, relative to the repository's root."""
    out = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, check=True, capture_output=True).stdout
    return {name for name in out.decode().split("\0") if name}


def is_test_file(name: str) -> bool:
    """Whether ``name`` (relative to the root) is a test module by pytest's default ``python_files``."""
    path = Path(name)
    return path.parts[0] == "tests" and (path.name.startswith("test_") or path.name.endswith("_test.py"))


def linted_files(paths: list[str]) -> set[str]:
    """The files ``ruff check PATH...`` checks, relative to the root (ruff prints absolute paths)."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", *paths],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {Path(line).resolve().relative_to(ROOT).as_posix() for line in out.splitlines() if line.strip()}


class _Modules:
    """A pytest plugin that records every module collected (skipped ones too) and every collection error."""

    def __init__(self) -> None:
        self.modules: set[str] = set()
        self.errors: list[str] = []

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        path = report.nodeid.split("::", 1)[0]  # a parametrized id may hold "::" too
        if path.endswith(".py"):
            self.modules.add(path)
        if report.failed:
            self.errors.append(f"{report.nodeid or '<session>'}: {report.longreprtext.strip()}")


def collected_modules() -> tuple[set[str], list[str]]:
    """The test modules pytest collects with the project's configuration (its ``testpaths``), and
    the collection errors."""
    recorder = _Modules()
    os.chdir(ROOT)  # where pytest finds its configuration, and testpaths from there
    with contextlib.redirect_stdout(io.StringIO()):  # its list of tests; the errors are in the recorder
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[recorder])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and not recorder.errors:
        recorder.errors.append(f"pytest --collect-only exited with {code!r}")
    return recorder.modules, recorder.errors


def main(lint_paths: list[str]) -> int:
    if not lint_paths:
        print(__doc__, file=sys.stderr)
        return 2
    tracked = tracked_python_files()
    problems = []
    if unlinted := sorted(tracked - linted_files(lint_paths)):
        problems.append(
            f"ruff check {' '.join(lint_paths)} does not check these tracked files (an excluded "
            f"folder name such as dist or build?): {', '.join(unlinted)}"
        )
    modules, errors = collected_modules()
    if errors:
        problems.append("pytest cannot collect the tests:\n" + "\n".join(errors))
    if uncollected := sorted(name for name in tracked if is_test_file(name) and name not in modules):
        problems.append(
            f"pytest does not collect these tracked test files (a folder name in norecursedirs such "
            f"as dist or build?): {', '.join(uncollected)}"
        )
    for problem in problems:
        print(f"check_coverage: {problem}", file=sys.stderr)
    if not problems:
        print(
            f"check_coverage: ruff checks all {len(tracked)} tracked Python files; pytest collects all "
            f"{sum(map(is_test_file, tracked))} tracked test files"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
