"""A registration keyword one edit away from a common name, whose object is of that kind, is
checkpointed as given but warned of once; names of one's own and other kinds are not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.data import ResumableLoader
from helpers import make_model, train_step


def _objects() -> dict[str, object]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 3, (16,)))
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2),
        "loader": ResumableLoader(data, batch_size=4, seed=0),
        "scaler": torch.amp.GradScaler("cpu"),
    }


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "did you mean" in r.getMessage()]


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("sheduler", "scheduler"),
        ("optimiser", "optimizer"),
        ("modle", "model"),
        ("laoder", "loader"),
        ("scalar", "scaler"),
        ("Model", "model"),
    ],
)
def test_a_misspelled_common_name_is_warned_of_once_and_still_checkpointed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, typo: str, meant: str
) -> None:
    objects = _objects()
    model, opt = objects["model"], objects["optimizer"]
    objects[typo] = objects.pop(meant)
    with caplog.at_level(logging.WARNING, logger="checkfreq"), cf.Checkpointer(tmp_path, policy=1, **objects) as ckpt:  # type: ignore[arg-type]
        for _ in range(3):
            train_step(model, opt)  # type: ignore[arg-type]
            ckpt.step()
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert f"as {typo!r}: did you mean {meant}=?" in warnings[0]
    assert f"a run that registers it as {meant!r} will not find it" in warnings[0]
    manifest = (tmp_path / "step_000000003" / "manifest.json").read_text()
    assert f'"{typo}' in manifest  # stored under the name given, as before

    objects[meant] = objects.pop(typo)  # the run resumed under the right name: the error names the one held
    with cf.Checkpointer(tmp_path, **objects) as ckpt:  # type: ignore[arg-type]
        with pytest.raises(cf.StateMismatchError) as info:
            ckpt.restore()
    assert f"checkpoint holds no state for {meant}" in str(info.value)
    assert f"it holds state under {typo!r}, within one letter of {meant!r}" in str(info.value)
    assert f"register it as {typo}= here" in str(info.value)


def test_names_of_ones_own_and_objects_of_another_kind_are_not_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    objects = _objects()
    model, opt = objects["model"], objects["optimizer"]
    with (
        caplog.at_level(logging.WARNING, logger="checkfreq"),
        cf.Checkpointer(
            tmp_path,
            policy=1,
            model=model,
            optimizer=opt,
            encoder=make_model(seed=1),
            sheduler=make_model(seed=2),
            scalers=objects["scheduler"],
            loaders=objects["loader"],
            scheduler0=objects["scheduler"],
            scaler_1=objects["scaler"],
        ) as ckpt,
    ):
        train_step(model, opt)  # type: ignore[arg-type]
        ckpt.step()
    assert _warnings(caplog) == []  # a model as 'sheduler' is not a scheduler; plural and numbered are meant
