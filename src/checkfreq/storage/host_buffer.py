"""A host buffer that device copies go to, registered with the CUDA runtime rather than taken from
torch's pinned caching allocator.

torch's pinned allocator rounds a request up to the next power of two (a 12.5 GB state takes 16 GiB
of page-locked memory) and keeps the block in its cache for the life of the process, even once the
tensor is gone. :class:`RegisteredBuffer` maps exactly the bytes asked for (anonymous memory, page
aligned, so aligned for direct I/O too), registers them once through a
:class:`~checkfreq.storage.host_pinning.HostRegistry`, and gives them back at :meth:`release`: the
pages are unregistered there and unmapped with the last tensor that views them.
"""

from __future__ import annotations

import mmap

import torch

from checkfreq.storage.format import BLOCK_BYTES
from checkfreq.storage.host_pinning import HostRegistry

assert mmap.PAGESIZE % BLOCK_BYTES == 0  # a mapping starts on a page: aligned for direct I/O


class RegisteredBuffer:
    """``nbytes`` of host memory registered with ``registry`` (see the module docstring).

    Args:
        nbytes: its size.
        registry: registers its pages for device copies.
    """

    def __init__(self, nbytes: int, registry: HostRegistry) -> None:
        mapping = mmap.mmap(-1, max(nbytes, 1))
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
        """The buffer (``uint8``): it keeps the mapping alive, and so does every view of it."""
        self._registry = registry
        self._address: int | None = self.tensor.data_ptr()
        if not registry.register(self._address, len(mapping)):
            self._address = None

    @property
    def pinned(self) -> bool:
        """Its registration was accepted (and not released yet)."""
        return self._address is not None

    def release(self) -> None:
        """Unregister it (no copy may be in flight to or from it); its memory goes with the last view."""
        if self._address is not None:
            self._registry.unregister(self._address)
            self._address = None
