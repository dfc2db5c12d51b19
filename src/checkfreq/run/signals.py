"""Preemption: turn a termination signal into one last checkpoint, then honour the signal.

A :class:`SignalTrap` installs a handler that only records which signal arrived (a Python
signal handler may run between any two bytecodes of the training thread, so it must not touch
the training state). The :class:`~checkfreq.checkpointer.Checkpointer` looks at
:attr:`SignalTrap.received` at the next ``step()`` boundary, takes a blocking checkpoint, and
calls :meth:`SignalTrap.honour`, which restores the previous disposition and raises the signal
again: the default action terminates the process as the signal intended, a Python handler runs
(``KeyboardInterrupt`` for SIGINT), and an ignored signal is ignored.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from checkfreq.errors import InvalidArgumentError
from checkfreq.run.events import EventLog

log = logging.getLogger("checkfreq.signals")


UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


class SignalTrap:
    """Records the arrival of any of ``signals`` until :meth:`honour` or :meth:`uninstall`.

    The constructor only validates; :meth:`install` (main thread only, where Python delivers
    signals) puts the handlers in place.
    """

    def __init__(self, signals: Iterable[int]) -> None:
        try:
            self.signals = tuple(signal.Signals(s) for s in signals)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"save_on_signal must be signal numbers, e.g. (signal.SIGTERM,): {e}") from None
        if not self.signals:
            raise InvalidArgumentError("save_on_signal needs at least one signal, e.g. (signal.SIGTERM,)")
        if UNCATCHABLE.intersection(self.signals):
            raise InvalidArgumentError("SIGKILL and SIGSTOP cannot be caught; use SIGTERM, SIGINT or SIGUSR1")
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("save_on_signal needs the Checkpointer to be created in the main thread")
        self.received: int | None = None
        """The signal that arrived and has not been honoured yet, or None."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Put the recording handler in place of the current one for each signal."""
        for signum in self.signals:
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except (OSError, ValueError) as e:
                self.uninstall()
                raise InvalidArgumentError(f"cannot catch {signum.name}: {e}") from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def checkpoint_then_honour(self, step: int, events: EventLog, make_durable: Callable[[], None]) -> None:
        """Preempted: make the state at ``step`` durable, then let the signal act as it would have."""
        signum = self.received
        events.write("signal", step=step, signal=signum)
        log.warning("signal %s received: taking a blocking checkpoint at step %d", signum, step)
        try:
            make_durable()
        except BaseException:
            log.error("the checkpoint taken for signal %s failed", signum, exc_info=True)
            raise
        finally:
            self.honour()

    def honour(self) -> None:
        """Let the received signal take the effect it would have had without checkfreq.

        Restores the previous handlers and raises the signal again. If the process survives
        (a Python handler that returns, or an ignored signal), the trap is armed again.
        """
        signum, self.received = self.received, None
        if signum is None:
            return
        if self._previous.get(signum) is signal.SIG_IGN:
            return
        log.warning("checkpoint for %s is durable; passing the signal on", signal.Signals(signum).name)
        self.uninstall()
        signal.raise_signal(signum)  # the default action ends the process here; a Python handler runs now
        self.install()

    def uninstall(self) -> None:
        """Put back the handlers that were there before (only where ours is still installed)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("signal handlers for %s left in place: not in the main thread", self.signals)
            return
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}
