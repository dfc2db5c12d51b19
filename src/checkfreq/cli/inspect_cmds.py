"""``checkfreq ls / inspect / verify / export / diff``: checkpoints from a shell.

Every command takes a local path or an fsspec URL (``s3://bucket/run``, ``memory://run``).

The work is done by :mod:`checkfreq.tools.catalog`; these commands only format its results.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from checkfreq.cli import app
from checkfreq.cli._output import EXIT_FAILED, JSON_HELP, console, emit_json, fitted_table, human_age, reports_errors
from checkfreq.cli.progress import bytes_to_read, reading
from checkfreq.tools.report import human_bytes, human_seconds

if TYPE_CHECKING:
    from checkfreq.tools.catalog import CheckpointStatus
    from checkfreq.tools.diff import CheckpointDiff
    from checkfreq.tools.memory_cut import MemoryCut

JsonFlag = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
RemoteOption = Annotated[
    str | None,
    typer.Option(
        "--remote",
        help="The job's remote tier (a path or an fsspec URL): where a node-local directory's "
        "checkpoints have the files of other nodes' ranks checked.",
    ),
]


VALUE_CHARS = 300
"""How much of a plain value ``inspect`` prints in its table."""


@app.command("ls")
@reports_errors
def ls_command(
    directory: Annotated[
        str, typer.Argument(help="Run directory (a path or an fsspec URL) holding step_* checkpoints.")
    ],
    quick: Annotated[
        bool, typer.Option("--quick", help="Check manifests and file sizes only; skip checksums.")
    ] = False,
    remote: RemoteOption = None,
    as_json: JsonFlag = False,
) -> None:
    """List checkpoints, newest first: step, epoch, size, age, and valid or invalid with the reason.

    Snapshots of the memory tier on this node (shared memory, see docs/storage.md) are listed too, and
    so are the checkpoints set aside (damaged, or of a course the run left when it went on from an older
    step: never restored, not counted by keep=), with why. A run
    that keeps the best (keep=Retention(n, best=...)) has its best marked, with their metric.
    """
    from checkfreq.tools.aside import set_aside_statuses
    from checkfreq.tools.best import rank_run
    from checkfreq.tools.catalog import is_url, list_checkpoints, memory_snapshots
    from checkfreq.tools.memory_cut import memory_cut

    disk = list_checkpoints(directory, checksums=not quick, remote=remote)
    statuses = sorted(
        memory_snapshots(directory, checksums=not quick) + disk + set_aside_statuses(directory),
        key=lambda s: (-s.step, s.tier != "memory", s.set_aside is not None),
    )
    ranking = rank_run(directory)
    listed = [s for s in statuses if s.tier == "disk" and s.set_aside is None]
    marks = {id(s): ranking.best.get(s.step) for s in listed}
    if as_json:
        emit_json(
            [
                {
                    **s.to_dict(),
                    "score": ranking.scores.get(s.step) if id(s) in marks else None,
                    "best": None if (mark := marks.get(id(s))) is None else mark.to_dict(),
                }
                for s in statuses
            ]
        )
        return
    table = Table(title=f"{directory} ({'sizes only' if quick else 'checksums verified'})")
    for column in ("checkpoint", "tier", "step", "epoch", "size", "age", "status"):
        table.add_column(column, no_wrap=column != "status", justify="right" if column in ("step", "size") else "left")
    for s in statuses:
        if s.set_aside is not None:
            status = f"[yellow]set aside[/yellow]{_aside_name(s)}: {s.reason}"
        else:
            status = f"[green]valid[/green]{_elsewhere(s.elsewhere)}" if s.valid else f"[red]INVALID[/red]: {s.reason}"
        if (mark := marks.get(id(s))) is not None:
            status += f", [cyan]best {mark.rank} of {mark.top} by {mark.metric} ({mark.mode}): {mark.value:.6g}[/cyan]"
        epoch = "-" if s.epoch is None else str(s.epoch)
        table.add_row(s.name, s.tier, str(s.step), epoch, human_bytes(s.bytes), human_age(s.created), status)
    out = console()
    out.print(table)
    aside = sum(s.set_aside is not None for s in statuses)
    invalid = sum(not s.valid for s in statuses) - aside
    out.print(
        f"{sum(s.valid for s in statuses)} valid, {invalid} invalid"
        + (f", {aside} set aside (never restored, not counted by keep=)" if aside else "")
    )
    counted = (
        "its data files, as its manifest lists them"
        if is_url(directory)
        else "its data files and manifest.json on disk"
    )
    out.print(f"size: {counted} (docs/cli.md, 'Sizes')")
    if (cut := memory_cut(statuses)) is not None:
        out.print(_memory_cut_text(cut), soft_wrap=True)
    if any(s.valid for s in listed):
        best = min(ranking.best.items(), key=lambda item: item[1].rank, default=None)
        out.print(
            "to resume from one of them: ckpt.restore(step=N), N a valid step above"
            + (f'; ckpt.restore(step="best") takes step {best[0]}' if best else ""),
            soft_wrap=True,
        )


def _memory_cut_text(cut: MemoryCut) -> str:
    """Where the other machines' ranks would resume from memory if lost now, and the copy lag."""
    ranks = ", ".join(map(str, cut.copied_ranks))
    head = f"memory: this machine keeps copies of rank {ranks}"
    if cut.resume_step is None:
        return (
            f"{head}, but no step is held whole by every rank listed here: if their machine were lost now, "
            "it would resume from disk"
        )
    lag = f"{cut.lag_steps} steps" + ("" if cut.lag_s is None else f", {human_seconds(cut.lag_s)}")
    return (
        f"{head}: if their machine were lost now, every rank would resume from memory at step {cut.resume_step}, "
        f"{lag} behind this machine's newest snapshot ({cut.newest_step}): the copy lag"
    )


@app.command("inspect")
@reports_errors
def inspect_command(
    target: Annotated[
        str, typer.Argument(help="A checkpoint (RUN/step_N), or a run directory for its newest valid one.")
    ],
    as_json: JsonFlag = False,
) -> None:
    """Show a checkpoint's tensors (name, shape, dtype, bytes), registered objects, metadata and versions."""
    from checkfreq.tools.catalog import describe, resolve_checkpoint

    info = describe(resolve_checkpoint(target))
    if as_json:
        emit_json(info.to_dict())
        return
    out = console()
    created = datetime.datetime.fromtimestamp(info.created).isoformat(sep=" ", timespec="seconds")
    out.print(f"[bold]{info.path}[/bold]", soft_wrap=True)
    epoch = "-" if info.epoch is None else info.epoch
    out.print(
        f"step {info.step}, epoch {epoch}, world size {info.world_size}, written {created} ({human_age(info.created)})"
    )
    out.print("versions: " + ", ".join(f"{k} {v}" for k, v in info.versions.items()), soft_wrap=True)
    files = Table(title="files")
    for column in ("file", "size", "xxh3-64"):
        files.add_column(column, no_wrap=True)
    for name, entry in info.files.items():
        files.add_row(name, human_bytes(entry["size"]), entry["xxh3_64"])
    out.print(files)
    objects = Table(title="registered objects")
    for column in ("name", "tensors", "bytes", "value"):
        objects.add_column(column, no_wrap=column in ("tensors", "bytes"), overflow="fold")
    for name, obj in info.objects.items():
        value = json.dumps(obj["value"], ensure_ascii=False) if "value" in obj else ""
        if len(value) > VALUE_CHARS:  # the run state of a convergence-aware policy holds its loss history
            value = f"{value[:VALUE_CHARS]}… ({len(value)} characters; --json shows all)"
        objects.add_row(name, str(obj["tensors"]), human_bytes(obj["bytes"]), value)
    out.print(objects)
    tensors = Table(title=f"{len(info.tensors)} tensors, {human_bytes(sum(t.bytes for t in info.tensors))}")
    for column in ("name", "shape", "dtype", "bytes"):
        if column == "name":  # long names (a transformer's) fold over lines rather than being cut
            tensors.add_column(column, overflow="fold")
        else:
            tensors.add_column(column, no_wrap=True, justify="right" if column == "bytes" else "left")
    for t in info.tensors:
        tensors.add_row(t.name, str(tuple(t.shape)), t.dtype, str(t.bytes))
    out.print(tensors)


@app.command("verify")
@reports_errors
def verify_command(
    target: Annotated[str, typer.Argument(help="A run directory (every checkpoint in it) or one checkpoint.")],
    remote: RemoteOption = None,
    set_aside: Annotated[
        bool,
        typer.Option(
            "--set-aside/--no-set-aside",
            help="Set aside each checkpoint that fails (renamed step_N.damaged-<id>; in an object store, marked): "
            "never restored again, not counted by keep=. Left in place where a job holds the directory "
            "or it cannot be changed.",
        ),
    ] = True,
    as_json: JsonFlag = False,
) -> None:
    """Read every byte of every checkpoint against its checksum; exit 1 if any fails (or none exists).

    Each checkpoint that fails is set aside (--no-set-aside: left in place). In a node-local directory,
    the files of other nodes' ranks are checked in --remote, or named as not checked.
    """
    from checkfreq.storage import open_store
    from checkfreq.tools.aside import set_aside_damaged, set_aside_statuses
    from checkfreq.tools.catalog import check_checkpoint, list_checkpoints, names_checkpoint, resolve_checkpoint

    single = names_checkpoint(target)
    tier = None if remote is None else open_store(remote, create=False)
    with reading(f"verifying {_short(target)}", lambda: bytes_to_read(target, every=True), as_json=as_json):
        if single:
            ref = resolve_checkpoint(target)
            store, statuses, earlier = ref.store, [check_checkpoint(ref, remote=tier)], []
        else:
            store = open_store(target, create=False)
            statuses, earlier = list_checkpoints(store, remote=remote), set_aside_statuses(store)
    note = None
    if set_aside:
        statuses, note = set_aside_damaged(store, statuses)
    failed = [s for s in statuses if not s.valid]
    if as_json:
        emit_json(
            {
                "ok": bool(statuses) and not failed,
                "checkpoints": [s.to_dict() for s in statuses],
                "set_aside_before": [s.to_dict() for s in earlier],
                "left_in_place": note,
            }
        )
    else:
        out = console()
        for s in statuses:
            if s.valid:
                out.print(
                    f"[green]ok[/green]     {s.name}  step {s.step}, {human_bytes(s.bytes)}{_elsewhere(s.elsewhere)}",
                    soft_wrap=True,
                )
            else:
                done = f"; set aside{_aside_name(s)}" if s.set_aside else "; left in place" if set_aside else ""
                out.print(f"[red]FAILED[/red] {s.name}: {s.reason}{done}", soft_wrap=True)
        if note:
            out.print(note, soft_wrap=True)
        for s in earlier:
            out.print(f"[yellow]set aside earlier[/yellow] {s.name}{_aside_name(s)}: {s.reason}", soft_wrap=True)
        if not statuses:
            out.print(f"[red]no checkpoint in {target}[/red]", soft_wrap=True)
        else:
            out.print(f"{len(statuses) - len(failed)} of {len(statuses)} checkpoints verified")
    if failed or not statuses:
        raise typer.Exit(EXIT_FAILED)


def _short(target: str) -> str:
    """A checkpoint or run as a progress bar names it: the last part of its path or URL."""
    return target.rstrip("/").rpartition("/")[2] or target


def _aside_name(status: CheckpointStatus) -> str:
    """`` as NAME`` for a checkpoint set aside under another name (a local directory's), else ``""``."""
    return "" if status.set_aside in (None, status.name) else f" as {status.set_aside}"


def _elsewhere(ranks: list[int]) -> str:
    """What a status line says of the ranks whose files are on other nodes (not checked)."""
    if not ranks:
        return ""
    return f" (the files of rank{'s' if len(ranks) > 1 else ''} {_ranges(ranks)} are on other nodes: not checked)"


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@app.command("export")
@reports_errors
def export_command(
    target: Annotated[str, typer.Argument(help="A checkpoint, or a run directory for its newest valid one.")],
    to: Annotated[Path, typer.Option("--to", help="Output file: NAME.safetensors, NAME.pt or NAME.pth.")],
    only: Annotated[str | None, typer.Option("--only", help="Export one registered object, e.g. 'model'.")] = None,
    best: Annotated[
        bool, typer.Option("--best", help="Export the run's best-scored checkpoint (Retention(best=...)).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write a plain state dict: torch.load(weights_only=True) reads .pt, safetensors reads .safetensors."""
    from checkfreq.tools.best import best_checkpoint
    from checkfreq.tools.export import export

    source = best_checkpoint(target).address if best else target
    with reading(f"reading {_short(source)}", lambda: bytes_to_read(source), as_json=as_json):
        result = export(source, to, only=only)
    if as_json:
        emit_json(result.to_dict())
        return
    out = console()
    what = f"'{only}'" if only else "the state"
    out.print(
        f"exported {what} of step {result.step} ({result.tensors} tensors) from {result.source} "
        f"to {result.destination} ({human_bytes(result.bytes)})",
        soft_wrap=True,
    )
    if result.dropped:
        counts = ", ".join(f"{name} ({n})" for name, n in result.dropped.items())
        out.print(f"left out non-tensor values (a safetensors file holds tensors only): {counts}", soft_wrap=True)


@app.command("diff")
@reports_errors
def diff_command(
    a: Annotated[str, typer.Argument(help="Checkpoint A (or a run directory: its newest valid checkpoint).")],
    b: Annotated[str, typer.Argument(help="Checkpoint B.")],
    show_all: Annotated[bool, typer.Option("--all", help="List equal tensors too.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Compare two checkpoints tensor by tensor; exit 1 if they differ, like diff(1)."""
    from checkfreq.tools.diff import diff

    with reading(f"reading {_short(a)} and {_short(b)}", lambda: bytes_to_read(a) + bytes_to_read(b), as_json=as_json):
        result = diff(a, b)
    if as_json:
        emit_json(result.to_dict())
    else:
        _print_diff(result, show_all)
    if not result.identical:
        raise typer.Exit(EXIT_FAILED)


def _print_diff(result: CheckpointDiff, show_all: bool) -> None:
    out = console()
    out.print(f"A: {result.a} (step {result.step_a})\nB: {result.b} (step {result.step_b})", soft_wrap=True)
    rows = [
        (
            t.name,
            t.status if t.detail is None else f"{t.status}: {t.detail}",
            f"{t.changed}/{t.numel}" if t.status in ("differs", "equal") else "-",
            _g(t.max_abs),
            _g(t.rel_l2),
        )
        for t in result.tensors
        if show_all or t.status != "equal"
    ]
    if rows:
        headers = ("tensor", "status", "changed", "max |A-B|", "‖A-B‖/‖A‖")
        out.print(fitted_table(headers, rows, wrap={"tensor": 3, "status": 2}))
    equal = sum(t.status == "equal" for t in result.tensors)
    out.print(f"{len(result.tensors) - equal} of {len(result.tensors)} tensors differ")
    values = [(v.name, v.status, _shown(v.a), _shown(v.b)) for v in result.values if show_all or v.status != "equal"]
    if values:
        out.print(fitted_table(("value", "status", "A", "B"), values, wrap={"value": 3, "A": 2, "B": 2}))
    equal = sum(v.status == "equal" for v in result.values)
    out.print(f"{len(result.values) - equal} of {len(result.values)} other values differ")


def _shown(value: Any, limit: int = 60) -> str:
    """A value for a table cell: a long list is summarised, a long text shortened (``--json`` has them whole)."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} items: {', '.join(map(repr, value[:2]))}, ...]"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
