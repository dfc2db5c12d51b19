"""``checkfreq report``: a run's checkpointing timeline (PNG and HTML) and summary, from its event log."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from checkfreq.cli import app
from checkfreq.cli._output import JSON_HELP, console, emit_json, reports_errors


@app.command("report")
@reports_errors
def report_command(
    directory: Annotated[Path, typer.Argument(help="Run directory holding events.jsonl.")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Where to write report.png and report.html (default: DIRECTORY, "
            "or a new temporary directory when DIRECTORY cannot be written).",
        ),
    ] = None,
    tensorboard: Annotated[
        Path | None,
        typer.Option("--tensorboard", help="Also write the numbers as TensorBoard scalars into this log directory."),
    ] = None,
    no_plots: Annotated[
        bool, typer.Option("--no-plots", help="Write no report.png or report.html (and need no matplotlib).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Plot iteration time, stall, persist time and bandwidth, the chosen interval and overhead; print a summary."""
    from dataclasses import asdict

    from checkfreq.tools.report import load_run, summary_text
    from checkfreq.tools.report_files import write_report, write_tensorboard

    report, files = (load_run(directory), None) if no_plots else write_report(directory, out)
    scalars = None if tensorboard is None else write_tensorboard(report, tensorboard)
    if as_json:
        emit_json({**report.to_dict(), "files": files and asdict(files), "tensorboard_scalars": scalars})
        return
    output = console()
    output.print(summary_text(report), soft_wrap=True)
    if files is not None:
        if files.not_written_in:
            output.print(
                f"could not write into {files.not_written_in}: the files went to a new temporary "
                "directory instead (--out DIR chooses where)",
                soft_wrap=True,
            )
        output.print(f"timeline: {files.png}\npage:     {files.html}", soft_wrap=True)
    if tensorboard is not None:
        output.print(f"tensorboard: {scalars} scalars in {tensorboard}", soft_wrap=True)
