"""A progress bar for the commands that read whole checkpoints (``verify``, ``export``, ``diff``):
shown on a terminal when what they will read reaches :data:`PROGRESS_BYTES` (1 GB; the environment
variable :data:`PROGRESS_BYTES_ENV` sets another), never with ``--json`` or when stdout is a pipe or
a file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from checkfreq.cli._output import console
from checkfreq.storage.progress import (  # noqa: F401 - the threshold is named here too
    PROGRESS_BYTES,
    PROGRESS_BYTES_ENV,
    progress_bytes,
    watching_reads,
)


def bytes_to_read(target: str, *, every: bool = False) -> int:
    """The data bytes a command will read and verify for ``target``: a checkpoint's files; for a run
    directory, every checkpoint's (``every``, as ``verify`` reads them) or its newest one's twice (it
    is verified to be chosen, then read). 0 where a manifest cannot be read: the command says why."""
    from checkfreq.storage import open_store
    from checkfreq.tools.catalog import CheckpointRef, names_checkpoint, resolve_checkpoint

    try:
        if names_checkpoint(target):
            return _size(resolve_checkpoint(target))
        store = open_store(target, create=False)
        sizes = [_size(CheckpointRef(store, location)) for _, location in store.checkpoints()]
    except Exception:  # noqa: BLE001 - the command itself will say what is wrong with it
        return 0
    return sum(sizes) if every else 2 * sizes[0] if sizes else 0


def _size(ref: Any) -> int:
    try:
        return sum(int(entry["size"]) for entry in ref.read_manifest().files.values())
    except Exception:  # noqa: BLE001 - the command itself will say what is wrong with it
        return 0


@contextmanager
def reading(what: str, planned: Callable[[], int], *, as_json: bool) -> Iterator[None]:
    """Show a bar of the bytes read while the block runs, if the command should (see the module
    docstring); ``planned`` tells how many it will read, asked only on a terminal without ``--json``."""
    out = console()
    total = 0 if as_json or not out.is_terminal else planned()
    if total < progress_bytes() or total == 0:
        yield
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=out) as progress:
        task = progress.add_task(what, total=total)

        def advance(nbytes: int) -> None:
            state = progress.tasks[task]
            done = state.completed + nbytes
            if state.total is not None and done > state.total:  # a newer checkpoint failed: an older one is read
                progress.update(task, total=done)
            progress.update(task, completed=done)

        with watching_reads(advance):
            yield
