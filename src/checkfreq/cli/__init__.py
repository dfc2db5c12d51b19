"""The ``checkfreq`` command line. Each group of commands lives in its own module and registers on :data:`app`."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

from checkfreq.cli._output import exit_with_error
from checkfreq.errors import CheckfreqError


class _Group(TyperGroup):
    """Typer's command group, with two changes: a checkfreq error that reaches it from any command is
    one ``error:`` line and exit status 2, not a traceback; and ``--help`` lists flags without a value
    type (``--json``, not ``--json <bool>``)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CheckfreqError as e:
            exit_with_error(e)

    def get_help_option(self, ctx: Any) -> Any:
        return _without_type(super().get_help_option(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            for param in [*command.params, command.get_help_option(ctx)]:
                _without_type(param)
        return command


def _without_type(param: Any) -> Any:
    """A flag takes no value: give it an empty metavar, which help shows instead of its type."""
    if getattr(param, "is_flag", False):
        param.metavar = ""
    return param


app = typer.Typer(
    name="checkfreq",
    cls=_Group,
    help="Inspect, verify and export checkfreq checkpoints; plan and simulate checkpoint policies; run the demo.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """checkfreq: cheap, frequent, exact checkpointing for PyTorch training."""


def _register_commands() -> None:
    # Imported for their side effect of adding commands to ``app``.
    from checkfreq.cli import (  # noqa: F401
        demo,  # noqa: F401
        inspect_cmds,
        plan,
        report_cmd,
    )


_register_commands()
