"""Page-locking (pinning) host memory that CUDA copies go to or come from, behind a small interface.

A device-to-host copy into pageable memory is synchronous for the CPU and runs at a fraction of
the PCIe bandwidth (the driver stages it through a pinned bounce buffer: 13.8 GB/s against 54.9 GB/s
pinned on an H100, PCIe gen5). A shared-memory mapping cannot be allocated pinned, but it can be
registered with ``cudaHostRegister`` once, after which copies into it (and out of it, at restore)
run asynchronously at the pinned bandwidth. Registration locks the pages until
``cudaHostUnregister``, which must come before the mapping is unmapped.

:class:`HostRegistry` is what the memory region asks for; :class:`CudaHostRegistry` calls the
CUDA runtime, :class:`RecordingRegistry` only keeps the books (a process without CUDA, and the
tests of the bookkeeping on the CPU). Both refuse to register a range twice or to unregister one
that is not registered, so a bookkeeping mistake is loud on the CPU before it reaches a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Protocol

import torch

from checkfreq.errors import CheckfreqError

log = logging.getLogger("checkfreq.pinning")


class PinningError(CheckfreqError):
    """A host range was registered twice, or unregistered without being registered."""


class HostRegistry(Protocol):
    """Registers host address ranges for fast device copies."""

    def register(self, address: int, nbytes: int) -> bool:
        """Pin ``nbytes`` at ``address``; False if the platform refused (copies still work, pageable)."""
        ...

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` of the range starting at ``address`` (before its memory is unmapped)."""
        ...

    def registered(self) -> dict[int, int]:
        """The ranges registered now: ``{address: nbytes}``."""
        ...

    def seen_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether the device sees ``tensor`` (in a registered range) as pinned memory: its copies then
        run asynchronously at the pinned bandwidth."""
        ...


class RecordingRegistry:
    """Keeps the books of registration without pinning anything (no CUDA), and checks them."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        """Every call, in order: ``("register" | "unregister", address, nbytes)``."""

    def register(self, address: int, nbytes: int) -> bool:
        if address in self._ranges:
            raise PinningError(f"host range at {address:#x} is registered already")
        self._ranges[address] = nbytes
        self.calls.append(("register", address, nbytes))
        return self._pin(address, nbytes)

    def unregister(self, address: int) -> None:
        nbytes = self._ranges.pop(address, None)
        if nbytes is None:
            raise PinningError(f"host range at {address:#x} is not registered")
        self.calls.append(("unregister", address, nbytes))
        self._unpin(address)

    def registered(self) -> dict[int, int]:
        return dict(self._ranges)

    def seen_pinned(self, tensor: torch.Tensor) -> bool:
        return True  # books only: no device to see it otherwise

    def _pin(self, address: int, nbytes: int) -> bool:
        return True

    def _unpin(self, address: int) -> None:
        pass


class CudaHostRegistry(RecordingRegistry):
    """Registers ranges with the CUDA runtime (``cudaHostRegister``, flags 0: pinned, usable by the
    current device's copies); a refusal is logged once and the range stays pageable.

    A refused ``cudaHostRegister`` leaves the runtime's last error set on the calling thread, and
    torch checks that error after its next kernel launch, which would raise in the training loop:
    the error is read (and so cleared) at once with ``cudaGetLastError``, which torch's ``cudart``
    binding does not offer, from the CUDA runtime library torch loaded."""

    def __init__(self) -> None:
        super().__init__()
        self._warned = False

    def _pin(self, address: int, nbytes: int) -> bool:
        start = time.perf_counter()
        status = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))
        if status != 0:
            _clear_last_cuda_error()
            if not self._warned:
                log.warning(
                    "cudaHostRegister of %.1f MiB failed (CUDA error %d): the memory tier's copies "
                    "stay pageable, several times slower",
                    nbytes / 2**20,
                    status,
                )
                self._warned = True
            self._ranges.pop(address, None)  # nothing to unregister
            return False
        log.info(
            "pinned %.1f MiB of shared memory for device copies in %.2f s", nbytes / 2**20, time.perf_counter() - start
        )
        return True

    def seen_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def _unpin(self, address: int) -> None:
        status = int(torch.cuda.cudart().cudaHostUnregister(address))
        if status != 0:
            log.warning("cudaHostUnregister failed (CUDA error %d)", status)


def _clear_last_cuda_error() -> None:
    """Read (and so reset) the CUDA runtime's last error of this thread; a warning if it cannot be."""
    for name in _cudart_names():
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)  # the one loaded, never another
        except OSError:
            continue
        library.cudaGetLastError()
        return
    log.warning(
        "could not reset the CUDA runtime's last error after a refused cudaHostRegister: the next "
        "kernel launch may report it"
    )


def _cudart_names() -> list[str]:
    major = (torch.version.cuda or "").split(".")[0]
    return [f"libcudart.so.{major}", "libcudart.so"] if major else ["libcudart.so"]


def host_registry() -> HostRegistry:
    """The registry of this process: the CUDA runtime's where CUDA is available, else books only."""
    return CudaHostRegistry() if torch.cuda.is_available() else RecordingRegistry()
