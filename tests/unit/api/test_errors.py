"""Every error a user can meet is a CheckfreqError, and also the builtin type callers expect."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq import errors
from checkfreq.storage.local import LocalStore
from checkfreq.storage.remote import FsspecStore
from checkfreq.tools import catalog, export
from helpers import DOCS


def _error_classes() -> list[type[BaseException]]:
    return [obj for _, obj in inspect.getmembers(errors, inspect.isclass) if issubclass(obj, BaseException)]


def test_every_error_is_a_checkfreq_error_exported_and_documented() -> None:
    documented = (DOCS / "reliability.md").read_text().split("## Errors", 1)[1]
    for error in _error_classes():
        assert issubclass(error, cf.CheckfreqError), error
        assert error.__name__ in cf.__all__ and getattr(cf, error.__name__) is error, error
        assert f"`{error.__name__}`" in documented, f"{error.__name__} is missing from docs/reliability.md"
    exported = [getattr(cf, name) for name in cf.__all__]
    assert {e for e in exported if isinstance(e, type) and issubclass(e, BaseException)} == set(_error_classes())


def _model() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


def _raised(call: Callable[[], object]) -> BaseException:
    with pytest.raises(cf.CheckfreqError) as info:
        call()
    return info.value


def test_argument_errors_are_checkfreq_errors_and_builtins(tmp_path: Path) -> None:
    misspelled = _raised(lambda: cf.Checkpointer(tmp_path / "a", model=_model(), polcy=10))
    assert isinstance(misspelled, cf.ArgumentTypeError) and isinstance(misspelled, TypeError)
    assert "'policy'" in str(misspelled)
    keep = _raised(lambda: cf.Checkpointer(tmp_path / "b", model=_model(), keep=0))
    assert isinstance(keep, cf.InvalidArgumentError) and isinstance(keep, ValueError)
    for bad in (
        lambda: cf.Every(n=0),
        lambda: cf.Overhead(p=2.0),
        lambda: cf.ResumableSampler(4, rank=2, world_size=2),
    ):
        assert isinstance(_raised(bad), ValueError)
    loader = cf.ResumableLoader(list(range(8)), batch_size=2)
    first = iter(loader)
    next(first)
    iter(loader)  # iterating again makes the first iterator stale
    stale = _raised(lambda: next(first))
    assert isinstance(stale, cf.UsageError) and isinstance(stale, RuntimeError)


def test_a_plain_dataloader_is_refused_naming_the_loaders_that_resume(tmp_path: Path) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    refused = _raised(
        lambda: cf.Checkpointer(tmp_path, model=_model(), loader=torch.utils.data.DataLoader(data, batch_size=2))
    )
    assert isinstance(refused, cf.ArgumentTypeError) and isinstance(refused, TypeError)
    assert "loader=DataLoader(...)" in str(refused) and "cannot resume" in str(refused)
    assert "checkfreq.data.ResumableLoader" in str(refused) and "StatefulDataLoader" in str(refused)
    with cf.Checkpointer(tmp_path, model=_model(), loader=cf.ResumableLoader(data, batch_size=2)):
        pass  # the loader it names is accepted


def test_a_second_checkpointer_in_the_same_process_is_told_to_close_the_first(tmp_path: Path) -> None:
    with cf.Checkpointer(tmp_path, model=_model()):
        locked = _raised(lambda: cf.Checkpointer(tmp_path, model=_model()))
    assert isinstance(locked, cf.DirectoryLockedError)
    assert str(locked) == (
        f"checkpoint directory {tmp_path.resolve()} is locked by another checkfreq writer in this process "
        f"(pid {os.getpid()}): close() the Checkpointer open on it first, or use another directory"
    )


def test_the_command_line_prints_a_checkfreq_error_as_one_line(tmp_path: Path) -> None:
    """Any command that meets a checkfreq error, not only the inspection commands, ends with one line."""
    from typer.testing import CliRunner

    from checkfreq.cli import app

    @app.command("open-twice", hidden=True)
    def open_twice(directory: Path) -> None:
        with cf.Checkpointer(directory, model=_model()):
            cf.Checkpointer(directory, model=_model())

    try:
        result = CliRunner().invoke(app, ["open-twice", str(tmp_path)])
    finally:
        app.registered_commands.pop()
    assert result.exit_code == 2 and not isinstance(result.exception, cf.CheckfreqError)
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint directory") and "Traceback" not in result.output


def test_unstorable_dtype_is_an_unserializable_state_error(tmp_path: Path) -> None:
    model = _model()
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    ckpt = cf.Checkpointer(tmp_path, model=model, policy=1)
    try:
        error = _raised(lambda: ckpt.save(blocking=True))
    finally:
        ckpt.close()
    assert isinstance(error, cf.UnsupportedDtypeError)
    assert isinstance(error, cf.UnserializableStateError) and isinstance(error, TypeError)


def test_directory_errors_are_os_errors(tmp_path: Path) -> None:
    missing = _raised(lambda: LocalStore(tmp_path / "absent", create=False))
    assert isinstance(missing, cf.CheckpointNotFoundError) and isinstance(missing, FileNotFoundError)
    absent_url = _raised(lambda: FsspecStore("memory://checkfreq-test-errors/absent", create=False))
    assert isinstance(absent_url, FileNotFoundError)
    (tmp_path / "file").write_text("in the way")
    blocked = _raised(lambda: cf.Checkpointer(tmp_path / "file" / "run", model=_model()))
    assert isinstance(blocked, cf.CheckpointDirectoryError) and isinstance(blocked, OSError) and blocked.errno
    unwritable = _raised(lambda: LocalStore("/proc").check_writable())  # procfs takes no new files, not even root's
    assert isinstance(unwritable, cf.DirectoryNotWritableError) and isinstance(unwritable, PermissionError)


def test_catalog_errors(tmp_path: Path) -> None:
    with cf.Checkpointer(tmp_path, model=_model(), policy=1) as ckpt:
        ckpt.save(blocking=True)
    ref = catalog.resolve_checkpoint(tmp_path)
    unknown = _raised(lambda: export.load_state(ref, only="optimizer"))
    assert isinstance(unknown, cf.UnknownObjectError) and isinstance(unknown, KeyError)
    assert isinstance(_raised(lambda: catalog.resolve_checkpoint(tmp_path / "nothing")), FileNotFoundError)
    assert isinstance(_raised(lambda: export.export(tmp_path, tmp_path / "out.txt")), ValueError)


def test_a_step_never_kept_is_named_as_such_with_the_steps_there_are(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt, policy=10) as ckpt:
        for _ in range(30):
            model(torch.randn(1, 4)).sum().backward()
            opt.step()
            ckpt.step()
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        with pytest.raises(cf.NoValidCheckpointError) as info:
            ckpt.restore(step=50)
    message = str(info.value)
    assert "no checkpoint of step 50" in message and "none was kept at that step" in message
    assert "the steps there are 30, 20, 10" in message and f"checkfreq ls {tmp_path}" in message
    assert "verify" not in message and "damaged" not in message, "nothing is damaged: nothing to verify"
    (tmp_path / "step_000000020").rename(tmp_path / "step_000000020.damaged-0123456789ab")  # as verify sets aside
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        with pytest.raises(cf.NoValidCheckpointError) as info:
            ckpt.restore(step=20)
    assert "the checkpoint of step 20" in str(info.value) and "was set aside as damaged" in str(info.value)
