"""The ``checkfreq`` command line. Each group of commands lives in its own module and registers on :data:`app`."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="checkfreq",
    help="Inspect, verify and export checkfreq checkpoints; plan and simulate checkpoint policies; run the demo.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """checkfreq: cheap, frequent, exact checkpointing for PyTorch training."""


def _register_commands() -> None:
    # Imported for their side effect of adding commands to ``app``.
    from checkfreq.cli import demo  # noqa: F401
    from checkfreq.cli import inspect_cmds, plan, report_cmd  # noqa: F401


_register_commands()
