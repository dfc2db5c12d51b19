"""The package's shape, as docs/architecture.md promises it: one concern per module, none over 500 lines."""

from __future__ import annotations

import re
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


ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


def _module_names(*, packages: bool) -> set[str]:
    """The pipeline's modules (and, with ``packages``, its folders), dotted from ``pipeline``."""
    names = set()
    for path in (SRC / "pipeline").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] != "__init__":
            names.add(".".join(parts))
        elif packages:
            names.add(".".join(parts[:-1]))
    return names


def test_every_pipeline_module_has_its_row_in_the_architecture_and_every_name_there_exists() -> None:
    text = ARCHITECTURE.read_text()
    modules = _module_names(packages=True)
    rows = set(re.findall(r"^\| `(pipeline(?:\.[a-z_]+)+)` \|", text, re.MULTILINE))
    missing = _module_names(packages=False) - rows
    assert not missing, f"modules without a row in docs/architecture.md: {sorted(missing)}"
    named = set(re.findall(r"`(pipeline(?:\.[a-z_]+)+)", text))  # up to a class (capitalised) or the quote
    # a module, or a module's function (``pipeline.tiers.chosen.choose_tiers``)
    unknown = {n for n in named if n not in modules and n.rsplit(".", 1)[0] not in modules}
    assert not unknown, f"docs/architecture.md names modules that do not exist: {sorted(unknown)}"
