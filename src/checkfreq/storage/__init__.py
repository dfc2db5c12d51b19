"""Where checkpoints live, behind one narrow interface chosen by URL.

- a plain path or ``file://`` URL: :class:`~checkfreq.storage.local.LocalStore` (fsync, atomic rename);
- any other fsspec URL (``s3://``, ``gs://``, ``memory://``, ...): :class:`FsspecStore`, where
  the manifest written last is the commit marker.

A remote tier (``Checkpointer(..., remote=...)``) is a second store; copying checkpoints to it
is the engine's business (:mod:`checkfreq.upload`).

See docs/storage.md.
"""

from __future__ import annotations

from checkfreq.storage.base import Location, Store, open_store, open_tiers, write_data, write_manifest
from checkfreq.storage.remote import FsspecStore
from checkfreq.storage.local import LocalStore

__all__ = [
    "FsspecStore",
    "LocalStore",
    "Location",
    "Store",
    "open_store",
    "open_tiers",
    "write_data",
    "write_manifest",
]
