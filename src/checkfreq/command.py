"""The ``checkfreq`` console script: runs the command line, or says which extra installs it."""

from __future__ import annotations

import sys

CLI_PACKAGES = frozenset({"typer", "rich", "click", "matplotlib"})


def main() -> None:
    """Entry point of the ``checkfreq`` command (its dependencies come with ``checkfreq[cli]``)."""
    try:
        from checkfreq.cli import app
    except ModuleNotFoundError as e:
        if e.name not in CLI_PACKAGES:
            raise
        sys.exit(f"the checkfreq command needs its extra, {e.name} is missing: pip install 'checkfreq[cli]'")
    app()
