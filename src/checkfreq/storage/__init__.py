"""Where checkpoints live, behind one narrow interface chosen by URL (:func:`open_store`).

- a plain path or ``file://`` URL: :class:`~checkfreq.storage.local.LocalStore` (fsync, atomic rename);
- any other fsspec URL (``s3://``, ``gs://``, ``memory://``, ...): :class:`FsspecStore`, where
  the manifest written last is the commit marker;
- a local path plus ``remote=``: :class:`TieredStore`, local commit first, remote copy in the
  background.

The :class:`Store` protocol and the helpers that write through it are in ``storage.base``.
See docs/storage.md.
"""

from __future__ import annotations

import os

from checkfreq.errors import InvalidArgumentError
from checkfreq.storage.base import Location, Store, write_data, write_manifest
from checkfreq.storage.local import LocalStore
from checkfreq.storage.remote import FsspecStore
from checkfreq.storage.tiers import TieredStore, TierLocation

__all__ = [
    "FsspecStore",
    "LocalStore",
    "Location",
    "Store",
    "TierLocation",
    "TieredStore",
    "open_store",
    "write_data",
    "write_manifest",
]


def open_store(
    target: str | os.PathLike[str] | Store,
    *,
    remote: str | os.PathLike[str] | Store | None = None,
    remote_keep: int = 3,
    create: bool = True,
) -> Store:
    """The store for ``target``: a local path, a ``file://`` URL, any fsspec URL, or a ready store.

    Plain paths and ``file://`` URLs give a :class:`~checkfreq.storage.local.LocalStore` (fsync and
    atomic rename); other URLs (``s3://``, ``gs://``, ``memory://``, ...) an
    :class:`~checkfreq.storage.FsspecStore`. With ``remote``, ``target`` must be local: it
    becomes the fast tier of a :class:`~checkfreq.storage.TieredStore` that copies each
    checkpoint to ``remote`` in the background and keeps ``remote_keep`` there.
    """
    store = _single(target, create)
    if remote is None:
        return store
    if not isinstance(store, LocalStore):
        raise InvalidArgumentError(f"with remote=..., the first tier must be a local directory, not {target!r}")
    return TieredStore(store, _single(remote, create), remote_keep=remote_keep)


def _single(target: str | os.PathLike[str] | Store, create: bool) -> Store:
    if not isinstance(target, (str, os.PathLike)):
        return target  # a store built by the caller, e.g. FsspecStore(url, **storage_options)
    text = os.fspath(target)
    if "://" not in text:
        return LocalStore(text, create=create)
    if text.startswith("file://"):
        return LocalStore(text[len("file://") :], create=create)
    return FsspecStore(text, create=create)
