"""The package's shape, as docs/architecture.md promises it: one concern per module, none over 500 lines."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "checkfreq"
MOST_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    long = {
        p.relative_to(SRC).as_posix(): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"split these modules by concern (docs/architecture.md): {long}"
