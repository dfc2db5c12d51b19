"""Output helpers shared by the inspection and report commands: consoles, JSON, and error exits."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from checkfreq.errors import CheckfreqError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_FAILED = 1
"""A check failed (``verify``), or two checkpoints differ (``diff``)."""
EXIT_ERROR = 2
"""The command could not run: a missing path, an unreadable checkpoint, a bad argument."""

JSON_HELP = "Print machine-readable JSON on stdout instead of tables."


def console() -> Console:
    return Console(highlight=False)


def fitted_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], wrap: Mapping[str, int], title: str | None = None
) -> Table:
    """A table that stays readable in 80 columns.

    Every column not in ``wrap`` is right-aligned and exactly as wide as its widest cell or header
    word (a header of several words takes several lines); the ``wrap`` columns share the width that
    is left (the table spans the terminal) in the ratios given, wrapping their text (a word too
    long for its column, such as a tensor name, is folded).
    """
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False, expand=True)
    for i, header in enumerate(headers):
        if header in wrap:
            table.add_column(header, overflow="fold", ratio=wrap[header])
        else:
            words = max(len(word) for word in header.split())
            table.add_column(header, justify="right", width=max([words, *(len(row[i]) for row in rows)]))
    for row in rows:
        table.add_row(*row)
    return table


def emit_json(document: Any) -> None:
    """Print ``document`` as strict JSON (NaN and infinities are not allowed)."""
    typer.echo(json.dumps(document, indent=2, allow_nan=False))


def reports_errors(command: F) -> F:
    """Turn the library's expected errors into one red line on stderr and exit status 2."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (CheckfreqError, OSError, KeyError, ValueError) as e:
            exit_with_error(e)

    return wrapper  # type: ignore[return-value]


def exit_with_error(error: Exception) -> NoReturn:
    """Print ``error`` as one red ``error:`` line on stderr (no traceback) and exit with status 2."""
    message = escape(str(error.args[0] if isinstance(error, KeyError) and error.args else error))
    Console(stderr=True, highlight=False).print(f"[red]error:[/red] {message}", soft_wrap=True, markup=True)
    raise typer.Exit(EXIT_ERROR) from None


def human_age(created: float | None) -> str:
    """How long ago ``created`` (seconds since the epoch) was, for people."""
    if created is None:
        return "?"
    seconds = max(time.time() - created, 0.0)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"
