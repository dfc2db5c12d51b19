"""Whether a process of this machine has ended, from its identity as it published it.

A rank publishes where it runs (:class:`ProcessIdentity`: the kernel's boot, its pid namespace, its
pid and when it started); another rank that sees the same boot and the same namespace can tell at
once, from ``/proc``, whether that process still runs. Elsewhere (another machine or container, or
no ``/proc``) nothing can be told, and the heartbeats alone say it.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_PID_NAMESPACE = "/proc/self/ns/pid"
_ENDED_STATES = frozenset("ZXx")
"""``/proc/<pid>/stat`` states of a process that has ended (a zombie not yet reaped, or dead)."""


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as another process of the same kernel and pid namespace can find it again.

    ``started`` (clock ticks after boot) tells the process from a later one given the same pid.
    """

    kernel: str
    """The boot and the pid namespace, e.g. ``35fd9f70-…/pid:[4026531836]``."""
    pid: int
    started: int

    def to_wire(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "pid": self.pid, "started": self.started}

    @classmethod
    def from_wire(cls, wire: Any) -> ProcessIdentity:
        return cls(str(wire["kernel"]), int(wire["pid"]), int(wire["started"]))


def this_process() -> ProcessIdentity | None:
    """This process's identity, or None where ``/proc`` cannot tell it (not Linux, a restricted mount)."""
    kernel = _this_kernel()
    pid = os.getpid()
    stat = _stat(pid)
    if kernel is None or stat is None:
        return None
    return ProcessIdentity(kernel, pid, stat[1])


def started_at() -> float | None:
    """When this process started, in seconds since the epoch (its start in clock ticks after boot, on
    the boot clock), or None where ``/proc`` cannot tell."""
    stat = _stat(os.getpid())
    if stat is None:
        return None
    since_boot = stat[1] / os.sysconf("SC_CLK_TCK")
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)


def has_ended(process: ProcessIdentity) -> bool | None:
    """True if ``process`` has ended, False if it still runs, None if this process cannot see it
    (another machine, container or pid namespace)."""
    if process.kernel != _this_kernel():
        return None
    stat = _stat(process.pid)
    if stat is None:
        return True
    state, started = stat
    return started != process.started or state in _ENDED_STATES


@functools.cache
def _this_kernel() -> str | None:
    """The boot and pid namespace of this process (neither changes while it runs), read once."""
    try:
        with open(_BOOT_ID, encoding="ascii") as boot:
            return f"{boot.read().strip()}/{os.readlink(_PID_NAMESPACE)}"
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """``pid``'s state and start time (clock ticks after boot), or None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after "pid (command) ": the command may hold spaces
    return fields[0], int(fields[19])
