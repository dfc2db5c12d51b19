"""When to snapshot into the memory tier: a cadence of its own, beside the disk policy.

A memory snapshot costs no disk write, so it can be taken far more often than the disk policy
persists. By default it is taken as often as the overhead bound allows: every ``k`` steps with
``k`` the smallest interval at which the measured cost of one memory snapshot stays within
``overhead`` of the iteration time (every step when it is cheap enough). A persist is a memory
snapshot too, so it restarts the count.

A snapshot's cost is what the training thread waits (the copy now, the fence) plus what the
memory tier's thread works in the background (the deferred copies and the checksum): on a host
whose cores the training loop keeps busy, that work slows the next iterations by about its own
length. Counting it in full errs on the side of the bound where spare cores would absorb it. The
thread's work is its CPU time, not its wall time: on a loaded machine the thread waits for a core
far longer than it works, and that wait takes nothing from training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from checkfreq.errors import ArgumentTypeError, InvalidArgumentError
from checkfreq.policies.profiler import Smoothed

DEFAULT_OVERHEAD = 0.035


@dataclass
class MemoryCadence:
    """Decides, at each step the disk policy skips, whether to snapshot into shared memory.

    Args:
        every: a fixed interval in steps; ``None`` adapts it to the overhead bound.
        overhead: the share of iteration time memory snapshots may cost (adaptive mode).
    """

    every: int | None = None
    overhead: float = DEFAULT_OVERHEAD
    cost: Smoothed = field(default_factory=Smoothed)
    """Seconds the training thread loses per memory snapshot (copy plus fence); a lone spike
    (a busy machine) moves it little, a lasting change is adopted after a few snapshots."""
    background: Smoothed = field(default_factory=Smoothed)
    """Seconds the memory tier's thread works per memory-only snapshot (written by that thread)."""
    _last_step: int = 0
    _warm: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise InvalidArgumentError(f"the memory cadence must be a positive number of steps, got {self.every!r}")
        if not 0 < self.overhead < 1:
            raise InvalidArgumentError(f"overhead must lie in (0, 1), got {self.overhead}")

    @classmethod
    def for_option(cls, memory: bool | int) -> MemoryCadence | None:
        """The cadence for ``Checkpointer(memory=...)``: None (no memory tier), adaptive, or every ``n`` steps."""
        if memory is False:
            return None
        if memory is True:
            return cls()
        if isinstance(memory, int) and not isinstance(memory, bool) and memory >= 1:
            return cls(every=memory)
        raise ArgumentTypeError(f"memory must be True, False or a positive number of steps, got {memory!r}")

    def interval(self, iteration_time: float) -> int:
        """Steps between memory snapshots for the current measurements."""
        if self.every is not None:
            return self.every
        cost = self.cost.value + (self.background.value if self.background.count else 0.0)
        if not (cost > 0 and iteration_time > 0):
            return 1  # not measured yet: snapshot, which measures it
        return max(1, math.ceil(cost / (self.overhead * iteration_time)))

    def due(self, step: int, iteration_time: float) -> bool:
        """True if a memory snapshot should be taken at ``step``."""
        return step - self._last_step >= self.interval(iteration_time)

    def taken(self, step: int) -> None:
        """A snapshot (memory or persist) was taken at ``step``."""
        self._last_step = step

    def record_background(self, seconds: float) -> None:
        """The memory tier's thread worked ``seconds`` (its CPU time) on one memory-only snapshot."""
        self.background.add(seconds)

    def record_device_wait(self, seconds: float) -> None:
        """A CUDA training stream waited ``seconds`` on a memory snapshot's copies (measured on the
        GPU, after the snapshot's cost was recorded): the cost estimate rises by it."""
        if self.cost.count:
            self.cost.value += seconds

    def record(self, seconds: float) -> None:
        """One memory snapshot cost the training thread ``seconds`` (the first one is not
        representative: it pays one-time costs such as lazy imports, and is left out)."""
        if self._warm:
            self.cost.add(seconds)
        self._warm = True
