"""A run's report as files: the figure (PNG, and inline SVG in a self-contained HTML page) and
TensorBoard scalars, from :func:`checkfreq.tools.report.load_run`'s records."""

from __future__ import annotations

import errno
import html
import io
import logging
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from checkfreq.errors import CheckfreqError
from checkfreq.run.units import human_rate
from checkfreq.tools.report import (
    CheckpointRecord,
    RunReport,
    human_bytes,
    human_seconds,
    load_run,
    number_text,
    summary_text,
)

log = logging.getLogger("checkfreq.report")

PNG_NAME = "report.png"
HTML_NAME = "report.html"


SHORT_WINDOW = 0.5
"""A window shorter than this share of its session's median interval (in steps) gets no point in
the overhead panel: its stall weighs on a few steps only (a ``save()`` just after a restore, a last
checkpoint at the end), so its share says little. It still counts in the run's overhead."""


def plotted_overhead(report: RunReport) -> list[float | None]:
    """Each record's overhead as the figure plots it: ``None`` for a window too short to mean anything."""
    medians = {s.index: s.interval_median_steps for s in report.sessions}
    return [
        None
        if r.overhead is None or (r.interval_steps or 0) < SHORT_WINDOW * (medians.get(r.session) or 0)
        else r.overhead
        for r in report.records
    ]


def render_figure(report: RunReport) -> Any:
    """A matplotlib ``Figure`` of the timeline (Agg canvas; pyplot and its global state are not used).

    Each session is drawn as its own line: no line joins the last checkpoint before a restart to
    the first one after it.

    Raises:
        CheckfreqError: matplotlib is not installed (it comes with ``checkfreq[cli]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise CheckfreqError(
            "the report's plots need the matplotlib package: pip install 'checkfreq[cli]' "
            "(or leave them out: checkfreq report --no-plots prints the summary alone)"
        ) from e

    fig = Figure(figsize=(10, 12), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(5, 1, sharex=True)
    t0, recs = report.start_time, report.records
    x = [r.time - t0 for r in recs]
    sessions = [r.session for r in recs]
    _series(axes[0], x, [r.clean_iteration_s for r in recs], sessions, "clean (window mean)", 1e3, "o-")
    _series(axes[0], x, [r.iteration_s for r in recs], sessions, "without persist (smoothed)", 1e3, "d:")
    _series(axes[0], x, [r.iteration_persisting_s for r in recs], sessions, "while persisting (smoothed)", 1e3, "s--")
    axes[0].set_ylabel("iteration (ms)")
    axes[0].legend(loc="best", fontsize="small")
    _series(axes[1], x, [r.stall_s for r in recs], sessions, "checkpoint (persisted)", 1e3, "o")
    axes[1].vlines(x, 0, [1e3 * (r.stall_s or 0) for r in recs], color="C0")
    memory = report.memory_snapshots
    memory_x = [m["time"] - t0 for m in memory]
    _series(
        axes[1], memory_x, [m["stall_s"] for m in memory], [0] * len(memory), "memory snapshot", 1e3, "x", color="C2"
    )
    axes[1].set_ylabel("stall (ms)")
    if memory:
        axes[1].legend(loc="best", fontsize="small")
    _series(axes[2], x, [r.persist_s for r in recs], sessions, "persist", 1e3, "o-")
    axes[2].set_ylabel("persist (ms)")
    twin = axes[2].twinx()
    _series(twin, x, [r.bandwidth_gbps for r in recs], sessions, "bandwidth", 1e3, "^:", color="C1")
    twin.set_ylabel("bandwidth (MB/s)", color="C1")
    _series(axes[3], x, [r.interval_steps for r in recs], sessions, "interval", 1.0, "o-", drawstyle="steps-post")
    axes[3].set_ylabel("interval (steps)")
    for ax in (*axes[:4], twin):  # from zero: a constant series is a flat line, not noise on a magnified axis
        ax.set_ylim(0, max(ax.get_ylim()[1], 0) or 1)
    _series(axes[4], x, plotted_overhead(report), sessions, "per window", 100.0, "o-")
    axes[4].axhline(0, color="grey", linewidth=0.8)
    if report.summary and report.summary.overhead is not None:
        axes[4].axhline(100 * report.summary.overhead, color="C3", linestyle="--", label="run")
    axes[4].set_ylabel("overhead (%)")
    axes[4].legend(loc="best", fontsize="small")
    axes[4].set_xlabel("seconds since the first event")
    _markers(axes, report, t0)
    sessions_text = "1 session" if len(report.starts) == 1 else f"{len(report.starts)} sessions"
    where = _shortened(str(Path(report.directory).resolve()))  # "." or "checkpoints" would say nothing
    fig.suptitle(f"checkfreq report: {where} ({len(recs)} checkpoints, {sessions_text})")
    if not recs:
        axes[0].text(0.5, 0.5, "no checkpoint in the event log", transform=axes[0].transAxes, ha="center")
    return fig


def _shortened(path: str, chars: int = 70) -> str:
    """``path``, or its last ``chars`` characters after an ellipsis."""
    return path if len(path) <= chars else "…" + path[-(chars - 1) :]


def _series(
    ax: Any, x: list[float], ys: list[Any], sessions: list[int], label: str, scale: float, style: str, **kw: Any
) -> None:
    """Plot the points that have a value, one line per session, in one colour under one legend entry."""
    by_session: dict[int, list[tuple[float, float]]] = {}
    for xi, y, session in zip(x, ys, sessions, strict=True):
        if y is not None:
            by_session.setdefault(session, []).append((xi, scale * y))
    for points in by_session.values():
        (line,) = ax.plot(*zip(*points, strict=True), style, label=label, markersize=3, **kw)
        label, kw = "_nolegend_", {**kw, "color": line.get_color()}
    ax.grid(True, alpha=0.3)


def _markers(axes: Any, report: RunReport, t0: float) -> None:
    for restore in report.restores:
        for ax in axes:
            ax.axvline(restore["time"] - t0, color="grey", linestyle=":", linewidth=1)
    for record in report.records:
        if record.status == "failed":
            for ax in axes:
                ax.axvline(record.time - t0, color="red", linewidth=1)


def write_html(report: RunReport, path: str | os.PathLike[str], figure: Any | None = None) -> Path:
    """Write one HTML file with everything inline: the summary, the timeline as SVG, and a table."""
    rows = "\n".join(_html_row(r, report.start_time) for r in report.records)
    page = _HTML.format(
        title=html.escape(f"checkfreq report: {report.directory}"),
        summary=html.escape(summary_text(report)),
        svg=_inline_svg(render_figure(report) if figure is None else figure),
        rows=rows,
    )
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


def _inline_svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    document = buffer.getvalue()
    return document[document.index("<svg") :]  # drop the XML prolog and doctype: it is embedded in HTML


def _html_row(r: CheckpointRecord, t0: float) -> str:
    cells = [
        f"{r.time - t0:.2f}",
        str(r.step),
        r.status,
        human_seconds(r.stall_s),
        human_seconds(r.persist_s),
        human_rate(None if r.bandwidth_gbps is None else r.bandwidth_gbps * 1e9),
        human_bytes(r.bytes),
        number_text(r.interval_steps, "{:g}"),
        number_text(None if r.overhead is None else 100 * r.overhead, "{:.2f}"),
        r.reason or "",
        r.error or "",
    ]
    return "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


_HTML = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}} pre{{background:#f4f4f4;padding:1em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style>
</head><body>
<h1>{title}</h1>
<pre>{summary}</pre>
<div>{svg}</div>
<h2>Checkpoints</h2>
<table><tr><th>t (s)</th><th>step</th><th>status</th><th>stall</th><th>persist</th><th>bandwidth</th><th>bytes</th>
<th>interval (steps)</th><th>overhead (%)</th><th>reason</th><th>error</th></tr>
{rows}
</table></body></html>
"""


TENSORBOARD_SCALARS: dict[str, tuple[str, float]] = {
    "checkfreq/stall_ms": ("stall_s", 1e3),
    "checkfreq/persist_ms": ("persist_s", 1e3),
    "checkfreq/bandwidth_MBps": ("bandwidth_gbps", 1e3),
    "checkfreq/interval_steps": ("interval_steps", 1.0),
    "checkfreq/iteration_ms": ("iteration_s", 1e3),
    "checkfreq/iteration_persisting_ms": ("iteration_persisting_s", 1e3),
    "checkfreq/overhead_pct": ("overhead", 100.0),
}
"""TensorBoard tag → (:class:`CheckpointRecord` attribute, scale)."""


def write_tensorboard(report: RunReport, logdir: str | os.PathLike[str]) -> int:
    """Write each checkpoint's numbers as TensorBoard scalars (at its step and wall time) into ``logdir``.

    Needs the optional ``tensorboard`` package (``pip install 'checkfreq[tensorboard]'``).
    Returns the number of scalars written.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise CheckfreqError(
            "TensorBoard output needs the tensorboard package: pip install 'checkfreq[tensorboard]'"
        ) from e
    written = 0
    writer = SummaryWriter(os.fspath(logdir))
    try:
        for record in report.records:
            for tag, (attribute, scale) in TENSORBOARD_SCALARS.items():
                value = getattr(record, attribute)
                if value is not None:
                    writer.add_scalar(tag, scale * value, record.step, walltime=record.time)
                    written += 1
    finally:
        writer.close()
    return written


@dataclass(frozen=True)
class ReportFiles:
    """Where :func:`write_report` put its output."""

    png: str
    html: str
    not_written_in: str | None = None
    """The run directory and why the files could not go there (they went to a new temporary
    directory instead); ``None`` when they are where they were asked for."""


def write_report(
    directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
) -> tuple[RunReport, ReportFiles]:
    """Load a run's event log and write ``report.png`` and ``report.html`` into ``out`` (default: the run
    directory; where that cannot be written, a read-only run, a new temporary directory, said in
    :attr:`ReportFiles.not_written_in`)."""
    report = load_run(directory)
    figure = render_figure(report)
    try:
        files = _write_files(report, figure, Path(directory if out is None else out))
    except OSError as e:
        if out is not None or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        elsewhere = Path(tempfile.mkdtemp(prefix="checkfreq-report-"))
        log.warning("cannot write the report into %s (%s); writing it into %s", directory, e.strerror, elsewhere)
        files = replace(_write_files(report, figure, elsewhere), not_written_in=f"{directory} ({e.strerror})")
    log.info("wrote %s and %s", files.png, files.html)
    return report, files


def _write_files(report: RunReport, figure: Any, out_dir: Path) -> ReportFiles:
    out_dir.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_dir / PNG_NAME, format="png")
    return ReportFiles(str(out_dir / PNG_NAME), str(write_html(report, out_dir / HTML_NAME, figure)))
