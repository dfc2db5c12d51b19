"""The ``checkfreq`` command line. Each group of commands lives in its own module and registers on :data:`app`."""

from __future__ import annotations

from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer vendors click from 0.20 on; before, it uses the click package
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer
    from click.exceptions import UsageError  # type: ignore[assignment]

from checkfreq.cli._output import exit_with_error
from checkfreq.errors import CheckfreqError


class _Group(TyperGroup):
    """Typer's command group, with two changes: a checkfreq error that reaches it from any command,
    and a bad argument (an unknown option or command, a value that does not parse), is one ``error:``
    line and exit status 2, not a traceback or a box; and ``--help`` lists flags without a value
    type (``--json``, not ``--json <bool>``)."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except UsageError as e:
            _usage_error(e)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CheckfreqError as e:
            exit_with_error(e)
        except UsageError as e:
            _usage_error(e)

    def get_help_option(self, ctx: Any) -> Any:
        return _without_type(super().get_help_option(ctx))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            for param in [*command.params, command.get_help_option(ctx)]:
                _without_type(param)
        return command


def _usage_error(error: UsageError) -> Any:
    """A bad argument as one ``error:`` line naming where help is; ``checkfreq`` alone still prints its help."""
    if type(error).__name__ == "NoArgsIsHelpError":
        raise error
    where = f" (see '{error.ctx.command_path} --help')" if error.ctx is not None else ""
    exit_with_error(ValueError(f"{error.format_message()}{where}"))


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
