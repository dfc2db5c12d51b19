"""A GradScaler's state is captured without a device sync (checkfreq.run.scaler_state): its scale and
growth tracker as tensors copied with the snapshot, turned back into numbers on restore and export."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

import checkfreq as cf
from checkfreq.run import scaler_state
from helpers import assert_state_equal, make_model


class NoSyncScaler(torch.amp.GradScaler):
    """A GradScaler whose number getters (each a ``.item()``: a device sync on a GPU) raise once armed."""

    armed = False

    def get_scale(self) -> float:
        if self.armed:
            raise AssertionError("get_scale() called: a device sync")
        return super().get_scale()

    def _get_growth_tracker(self) -> int:
        if self.armed:
            raise AssertionError("_get_growth_tracker() called: a device sync")
        return super()._get_growth_tracker()


class SavesNumbers:
    """Saves a GradScaler's state as ``state_dict()`` gives it, numbers: a checkpoint written before this change."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state)


OVERFLOWS = {2, 3, 7}
"""Steps whose loss overflows: the scaler skips the optimizer step and backs off; between them it grows."""


def _stack(seed: int = 0, scaler_type: type[torch.amp.GradScaler] = torch.amp.GradScaler):
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = scaler_type("cpu", init_scale=2.0**8, growth_interval=2)
    return model, opt, scaler


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if step in OVERFLOWS:
        loss = loss * float("inf")
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _numbers(scaler: torch.amp.GradScaler) -> tuple[float, int]:
    return scaler.get_scale(), scaler._get_growth_tracker()


def test_a_resume_is_bit_identical_with_the_scale_and_growth_tracker_after_overflows_and_growth(
    tmp_path: Path,
) -> None:
    model, opt, scaler = _stack()
    seen = []
    with cf.Checkpointer(tmp_path, policy=1, keep=20, model=model, optimizer=opt, scaler=scaler) as ckpt:
        for step in range(1, 11):
            _train(model, opt, scaler, step)
            ckpt.step()
            seen.append(_numbers(scaler))
            if step == 5:
                ckpt.wait()
                at_5 = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))
    moves = [b - a for (a, _), (b, _) in itertools.pairwise(seen)]
    assert min(moves) < 0 < max(moves)  # backed off and grown
    expected = copy.deepcopy((model.state_dict(), opt.state_dict(), scaler.state_dict()))

    for restored_at, state in ((10, expected), (5, at_5)):
        model2, opt2, scaler2 = _stack(seed=1)
        with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scaler=scaler2) as again:
            assert again.restore(restored_at) == restored_at
            assert_state_equal(model2.state_dict(), state[0])
            assert_state_equal(opt2.state_dict(), state[1])
            assert scaler2.state_dict() == state[2]
            assert type(scaler2.state_dict()["scale"]) is float and type(scaler2.state_dict()["_growth_tracker"]) is int
            if restored_at == 5:  # trained on from 5, the run is the original one, scale and tracker included
                for step in range(6, 11):
                    _train(model2, opt2, scaler2, step)
                    again.step()
                    assert _numbers(scaler2) == seen[step - 1]
                assert_state_equal(model2.state_dict(), expected[0])
                assert scaler2.state_dict() == expected[2]


def test_capturing_the_state_never_reads_the_scale_or_the_growth_tracker(tmp_path: Path) -> None:
    """Every snapshot, save() and the check before the next batch take the scaler's state without
    ``get_scale()``/``_get_growth_tracker()`` (``.item()``, a device sync on a GPU)."""
    model, opt, scaler = _stack(scaler_type=NoSyncScaler)
    with cf.Checkpointer(tmp_path, policy=2, memory=1, model=model, optimizer=opt, scaler=scaler) as ckpt:
        _train(model, opt, scaler, 1)
        ckpt.step()  # a session's first step() reads the scale once (checkfreq.run.step_order)
        scaler.armed = True
        for step in range(2, 7):
            _train(model, opt, scaler, step)
            ckpt.step()
        ckpt.save(blocking=True)  # the checkpoint at 6 still holds the state: compared, not taken again
        ckpt.wait()
        scaler.armed = False
        expected = scaler.state_dict()
    model2, opt2, scaler2 = _stack(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scaler=scaler2) as again:
        assert again.restore() == 6
        assert scaler2.state_dict() == expected


def test_a_checkpoint_that_saved_the_scale_as_numbers_still_restores(tmp_path: Path) -> None:
    model, opt, scaler = _stack()
    with cf.Checkpointer(tmp_path, policy=1, model=model, optimizer=opt, scaler=SavesNumbers(scaler)) as ckpt:
        for step in range(1, 5):
            _train(model, opt, scaler, step)
            ckpt.step()
        expected = scaler.state_dict()
    model2, opt2, scaler2 = _stack(seed=1)
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2, scaler=scaler2) as again:
        assert again.restore() == 4
        assert scaler2.state_dict() == expected


@pytest.mark.parametrize("fresh", [True, False])
def test_export_writes_the_numbers_grad_scaler_load_state_dict_takes(tmp_path: Path, fresh: bool) -> None:
    from checkfreq.tools.export import export

    model, opt, scaler = _stack()
    with cf.Checkpointer(tmp_path / "run", policy=1, model=model, optimizer=opt, scaler=scaler) as ckpt:
        for step in range(1, 6):
            _train(model, opt, scaler, step)
            ckpt.step()
        expected = scaler.state_dict()
    export(tmp_path / "run", tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["scaler"]
    assert saved == expected and type(saved["scale"]) is float and type(saved["_growth_tracker"]) is int
    other = torch.amp.GradScaler("cpu")
    if not fresh:  # a scaler already used holds its scale as a tensor, which load_state_dict fills
        _train(*_stack(seed=2)[:2], other, 1)
    other.load_state_dict(saved)
    assert other.state_dict() == expected


def test_loadable_turns_only_a_grad_scalers_state_into_numbers() -> None:
    state = {
        "scale": torch.tensor(4.0),
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 3,
        "_growth_tracker": torch.tensor(2, dtype=torch.int32),
    }
    assert scaler_state.loadable(state) == {**state, "scale": 4.0, "_growth_tracker": 2}
    other = {"scale": torch.ones(3), "growth_factor": 2.0}
    assert scaler_state.loadable(other) is other
