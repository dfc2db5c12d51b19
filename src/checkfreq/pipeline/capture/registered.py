"""The registered state: what a checkpoint captures, and whether the newest one still holds it.

Every checkpoint's capture seals a :mod:`~checkfreq.run.fingerprint` of what it took (a tier's
own snapshot, as often as every step, is not sealed: its cost stays flat): the small state (every
registered object but models and optimizers, the values, the generators), the optimizers'
hyperparameters (``param_groups``: a learning rate set by hand) and which tensors the modules'
buffers are. Two later moments compare it with the live state:

* at ``save()``: that and the tensors' version counters tell whether the checkpoint of the current
  step still is the state to keep, or ``save()`` must take it again.
* at the step's consistent point, after a checkpoint that ``save()`` or ``wait()`` captured before
  it: work the loop did in between (a scheduler stepped, random numbers drawn, a value set) makes
  the Checkpointer take the step again there.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from checkfreq.policies.retention import Retention
from checkfreq.ranks.collectives import Peers, tree_max
from checkfreq.run import scaler_state
from checkfreq.run.fingerprint import Fingerprint, changed, fingerprint
from checkfreq.run.scores import SCORE_KEY, Scores
from checkfreq.run.state import Stateful, flatten, optimizer_owned

log = logging.getLogger("checkfreq")

RNG = "rng"
"""The registered name of the random generators' state."""

RUN_STATE = "checkfreq"
"""The entry of a checkpoint that holds checkfreq's own state (the step, the profile)."""

Captured = tuple[Any, dict[str, torch.Tensor], set[str]]
"""(skeleton, tensors, names of the tensors copied behind the fence: the optimizer-owned ones, and the
GradScalers' scales and growth trackers, copies of their own)."""


Versions = tuple[tuple[str, int], ...]
"""Each registered tensor's name and version counter."""


@dataclass
class Seal:
    """What a checkpoint took, as fingerprints."""

    step: int
    small: Fingerprint
    versions: Versions
    at: str = "ckpt.step()"
    """The consistent point (or call) that captured it."""
    checked: bool = False


class Registered:
    """The objects (by name) and plain values a Checkpointer checkpoints, and the seal of the newest snapshot.

    Args:
        objects: the registered objects (``state_dict()``/``load_state_dict()``), the generators included.
        values: the plain values, by name (the dict ``ckpt[name] = value`` fills).
        allow_pickle: the Checkpointer's option.
        scores: the metrics the loop reports, of which a capture takes its score (a retention keeping the best).
    """

    def __init__(
        self, objects: dict[str, Stateful], values: dict[str, Any], *, allow_pickle: bool, scores: Scores | None = None
    ) -> None:
        self.objects, self.values, self.allow_pickle = objects, values, allow_pickle
        self.scores = Scores(Retention(1)) if scores is None else scores
        self.optimizers = {n: o for n, o in objects.items() if isinstance(o, torch.optim.Optimizer)}
        self.scalers = [n for n, o in objects.items() if scaler_state.is_grad_scaler(o)]
        self._epoch_source = next((o for o in objects.values() if _has_int_epoch(o)), None)
        self.modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
        self.seal: Seal | None = None
        self._generators: dict[str, Any] | None = None
        self.sealed_at = "ckpt.step()"
        """Where the next capture happens: the consistent point that came, or the call."""
        self._warned: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [*self.objects, *self.values]

    @property
    def small(self) -> list[str]:
        """Every name but models' and optimizers' (whose state changes by optimizer steps)."""
        return [n for n in self.names if not isinstance(self.objects.get(n), (torch.nn.Module, torch.optim.Optimizer))]

    def epoch(self) -> int | None:
        """The epoch of the first registered object that has one (the loader)."""
        epoch = getattr(self._epoch_source, "epoch", None)
        return epoch if _is_int(epoch) else None

    def state_of(self, names: list[str]) -> dict[str, Any]:
        """The live state of ``names`` (objects' ``state_dict()``, values as they are); a GradScaler's
        without a device sync (:mod:`~checkfreq.run.scaler_state`)."""
        return {n: (_state_of(self.objects[n]) if n in self.objects else self.values[n]) for n in names}

    def capture(self, step: int, run_state: Callable[[], Any], *, persisted: bool) -> Captured:
        """The state at ``step`` with ``run_state()`` as its ``checkfreq`` entry, sealed if ``persisted`` (a
        checkpoint, not a tier's snapshot of its own)."""
        state = self.state_of(self.names)
        if self._generators is not None and RNG in state:
            state[RNG] = self._generators
        small = fingerprint({**{n: state[n] for n in self.small}, **self._identities()}) if persisted else {}
        state[RUN_STATE] = run_state()
        if (score := self.scores.entry(step, self.values, checkpoint=persisted)) is not None:
            state[RUN_STATE][SCORE_KEY] = score
        skeleton, tensors = flatten(state, allow_pickle=self.allow_pickle)
        if persisted:  # a tier's own snapshot (as often as every step) is not compared: its cost stays flat
            self.seal = Seal(step, small, _versions(tensors), self.sealed_at)
        frozen = scaler_state.freeze(tensors, self.scalers)  # copied behind the fence, like the optimizer state
        return skeleton, tensors, optimizer_owned(tensors, self.optimizers) | frozen

    @contextlib.contextmanager
    def generators_as(self, states: dict[str, Any] | None) -> Iterator[None]:
        """While open, captures take the generators' ``states`` (None: as they are) instead of the live ones."""
        self._generators = states
        try:
            yield
        finally:
            self._generators = None

    def forget(self) -> None:
        """A restore or ``start_at``: the state is another run's."""
        self.seal = None
        self.scores.forget()

    def changed_since_early_capture(self, step: int, peers: Peers) -> list[str] | None:
        """At the consistent point of ``step``, once per checkpoint that a call (``save()``, ``wait()``)
        captured before it: None if the state is as that call took it on every rank of ``peers``
        (collective then), else what changed on this rank (maybe nothing: another rank's state changed)."""
        seal = self.seal
        if seal is None or seal.checked or seal.step != step or seal.at not in EARLY_CALLS:
            return None
        seal.checked = True
        if self.holds(step, peers):
            return None
        return changed(seal.small, fingerprint({**self.state_of(self.small), **self._identities()}))

    def warn_logged_after_capture(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``log()`` of the ranked metric at ``step`` came after the checkpoint of ``step`` was captured."""
        if "log()" in self._warned:
            return
        self._warned.add("log()")
        at = "its capture" if self.seal is None else self.seal.at
        log.warning(
            "log(%s) at step %d came after the checkpoint of step %d was captured (at %s), so that checkpoint has "
            "no score and is never kept as the best. Evaluate and log() before the loop asks for its next batch or "
            "runs its next training forward; an evaluation under torch.no_grad() or model.eval() is not the next "
            'step (docs/exactness.md, "The consistent point").',
            ", ".join(f"{k}={v}" for k, v in metrics.items()),
            step,
            step,
            at,
        )

    def _identities(self) -> dict[str, Any]:
        """What the state dicts of models and optimizers do not tell cheaply: each optimizer's hyperparameters
        (``param_groups`` less the parameters) and which tensor each module buffer is."""
        identities: dict[str, Any] = {}
        for name, optimizer in self.optimizers.items():
            identities[f"{name}.param_groups"] = [
                {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups
            ]
        for name, module in self.modules.items():
            identities[f"{name}.buffers"] = [(n, id(b), _address(b), b._version) for n, b in module.named_buffers()]
        return identities

    def holds(self, step: int, peers: Peers) -> bool:
        """Whether the newest checkpoint is of ``step`` and the live state is what it took, on every rank
        of ``peers`` (collective: a rank whose state changed makes every rank take the step again)."""
        seal = self.seal
        held = seal is not None and seal.step == step
        if seal is not None and held:
            state = self.state_of(self.names)
            tensors = flatten(state, allow_pickle=self.allow_pickle)[1]
            now = fingerprint({**{n: state[n] for n in self.small}, **self._identities()})
            held = not changed(seal.small, now) and _versions(tensors) == seal.versions
        return not int(tree_max(peers, torch.tensor([0 if held else 1]))[0])


def _state_of(obj: Stateful) -> Any:
    return scaler_state.capture(obj) if scaler_state.is_grad_scaler(obj) else obj.state_dict()  # type: ignore[arg-type]


def _versions(tensors: Mapping[str, torch.Tensor]) -> Versions:
    """Every registered tensor's name and version counter (moved by each in-place change), in the
    state's order: a tuple, compared whole, so that a checkpoint of thousands of tensors costs the
    training thread one attribute read per tensor."""
    own = f"{RUN_STATE}/"
    return tuple(
        (name, getattr(tensor, "_version", 0))
        for name, tensor in tensors.items()
        if not (name == RUN_STATE or name.startswith(own))
    )


EARLY_CALLS = ("save()", "wait()", "consistent_point()", "log()")
"""Calls that capture a checkpoint decided at a step before the step's consistent point."""


def _address(tensor: torch.Tensor) -> int:
    """Where a plain tensor's data lies (0 for a DTensor or a tensor without storage)."""
    return tensor.data_ptr() if type(tensor) is torch.Tensor and tensor.device.type != "meta" else 0


def _describe(names: list[str]) -> str:
    described = [("the random generators (rng)" if n == "rng" else repr(n)) for n in names]
    return described[0] if len(described) == 1 else ", ".join(described[:-1]) + " and " + described[-1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _has_int_epoch(obj: object) -> bool:
    return _is_int(getattr(obj, "epoch", None))


__all__ = ["RUN_STATE", "Captured", "Registered", "Seal"]
