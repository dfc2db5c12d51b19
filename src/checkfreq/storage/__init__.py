"""Where checkpoints live, behind one narrow interface chosen by URL (:func:`open_store`).

- a plain path or ``file://`` URL: :class:`~checkfreq.storage.local.LocalStore` (fsync, atomic rename);
- any other fsspec URL (``s3://``, ``gs://``, ``memory://``, ...): :class:`FsspecStore`, where
  the manifest written last is the commit marker.

A remote tier (``Checkpointer(..., remote=...)``) is a second store; copying checkpoints to it
is the engine's business (:mod:`checkfreq.pipeline.tiers.remote`).

The :class:`Store` protocol and the helpers that write through it are in ``storage.base``.
See docs/storage.md.
"""

from __future__ import annotations

import os

from checkfreq.errors import InvalidArgumentError
from checkfreq.storage.base import Location, Store, write_data, write_manifest
from checkfreq.storage.local import LocalStore
from checkfreq.storage.remote import FsspecStore

__all__ = [
    "FsspecStore",
    "LocalStore",
    "Location",
    "Store",
    "open_store",
    "open_stores",
    "write_data",
    "write_manifest",
]


def open_store(target: str | os.PathLike[str] | Store, *, create: bool = True) -> Store:
    """The store for ``target``: a local path, a ``file://`` URL, any fsspec URL, or a ready store.

    Plain paths and ``file://`` URLs give a :class:`~checkfreq.storage.local.LocalStore` (fsync and
    atomic rename); other URLs (``s3://``, ``gs://``, ``memory://``, ...) an
    :class:`~checkfreq.storage.FsspecStore`.
    """
    if not isinstance(target, (str, os.PathLike)):
        return target  # a store built by the caller, e.g. FsspecStore(url, **storage_options)
    text = os.fspath(target)
    if "://" not in text:
        return LocalStore(text, create=create)
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :], create=create)
    return FsspecStore(text, create=create)


def open_stores(
    directory: str | os.PathLike[str] | Store, remote: str | os.PathLike[str] | Store | None
) -> tuple[Store, list[Store]]:
    """The stores of a Checkpointer: its directory, and the stores behind it (the remote tier, if
    given, which needs a local directory in front); each checked writable now."""
    local = open_store(directory)
    far = [] if remote is None else [open_store(remote)]
    if far and not isinstance(local, LocalStore):
        raise InvalidArgumentError(f"with remote=..., the first tier must be a local directory, not {directory!r}")
    for store in (local, *far):
        store.check_writable()
    return local, far
