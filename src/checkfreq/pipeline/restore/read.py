"""One checkpoint read and verified outside any training job (``cf.read_checkpoint``), and the
stored arrays of verified data files as views of their bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkfreq.errors import CorruptCheckpointError
from checkfreq.ranks.rebuild import complete
from checkfreq.storage.base import Store
from checkfreq.storage.format import Manifest, entry_view
from checkfreq.storage.local import LocalStore

Files = dict[str, tuple[torch.Tensor, dict[str, Any]]]
"""Data files a rank holds whole: name → (verified data section, parsed header)."""


def read_checkpoint(path: Any, store: Store | None = None) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Read and verify one checkpoint; return its manifest and tensors (CPU).

    ``path`` is a local checkpoint directory or, with ``store``, a location that ``store`` listed.
    Every file's checksum is verified before this returns. Tensors of a local checkpoint are
    views of a private, copy-on-write mapping of its files: nothing is copied until they are
    used, and writing to them never changes the checkpoint.
    """
    source: Store = LocalStore(Path(path).parent, create=False) if store is None else store
    location = Path(path) if store is None else path
    manifest = source.read_manifest(location)
    files = {
        name: source.read_data(location, name, entry["size"], entry["xxh3_64"])
        for name, entry in manifest.files.items()
    }
    return stored_views(manifest, files)


def stored_views(manifest: Manifest, files: Files, partial: bool = False) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest completed from the files' headers (``files``: name → (data section, header); with
    ``partial``, some of them: the other ranks' parts stay unknown), and every stored array of
    ``files`` as a view of its file's data section."""
    manifest = complete(manifest, {name: header for name, (_, header) in files.items()}, partial=partial)
    try:
        tensors = {name: entry_view(files[e["file"]][0], e) for name, e in manifest.tensors.items()}
    except RuntimeError as e:
        raise CorruptCheckpointError(f"manifest tensor index is inconsistent: {e}") from None
    return manifest, tensors
