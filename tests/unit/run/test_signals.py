"""Preemption: ``save_on_signal`` turns a signal into a final checkpoint, then honours the signal.

Real signals throughout: SIGTERM to a child training process, and signals raised in this process
for the dispositions a child cannot show (a Python handler, SIGINT, an ignored signal).
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import checkfreq as cf
from checkfreq.pipeline.restore import read_checkpoint
from helpers import SCRIPTS, assert_state_equal, make_model, train_step

sys.path.insert(0, str(SCRIPTS))
import chaos_train  # noqa: E402


def _train_in_process(directory: Path, log: Path) -> dict[str, list[str]]:
    """Run (or resume) the chaos job in this process; return its progress lines by first word."""
    with open(log, "wb") as f:
        chaos_train.run(chaos_train.parse(["--dir", str(directory), "--progress-fd", str(f.fileno())]))
    lines: dict[str, list[str]] = {}
    for line in log.read_text().splitlines():
        word, *rest = line.split()
        lines.setdefault(word, []).append(rest[0])
    return lines


@pytest.mark.slow
def test_sigterm_to_a_training_process_commits_and_resume_loses_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "preempted"
    child = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPTS / "chaos_train.py"),
            "--dir",
            str(directory),
            "--every",
            "1000",
            "--save-on-signal",
            str(int(signal.SIGTERM)),
            "--step-sleep",
            "0.02",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    optimizer_steps = 0
    for line in child.stdout:  # type: ignore[union-attr]
        word, *rest = line.split()
        if word == "optimizer":
            optimizer_steps = int(rest[0])
        if word == "step" and int(rest[0]) == 20:
            child.send_signal(signal.SIGTERM)
    for _line in child.stdout:  # type: ignore[union-attr]
        pass
    assert child.wait(timeout=120) == -signal.SIGTERM, child.stderr.read()  # type: ignore[union-attr]
    assert 20 < optimizer_steps < 96, "the signal must arrive mid-run"

    committed = sorted(p.name for p in directory.glob("step_*"))
    assert committed == [f"step_{optimizer_steps:09d}"], committed  # the policy never fired: only the signal's
    manifest, _ = read_checkpoint(directory / committed[0])
    assert manifest.step == optimizer_steps

    resumed = _train_in_process(directory, tmp_path / "resumed.log")
    assert resumed["ready"] == [str(optimizer_steps)]  # zero steps lost
    reference = _train_in_process(tmp_path / "reference", tmp_path / "reference.log")
    assert resumed["final"] == reference["final"]  # and the resumed run is bit-identical


def _stack() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_previous_python_handler_runs_after_the_checkpoint_and_the_trap_rearms(tmp_path: Path) -> None:
    model, opt = _stack()
    seen: list[list[str]] = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: seen.append(sorted(p.name for p in tmp_path.glob("step_*"))))
    try:
        with cf.Checkpointer(
            tmp_path, policy=1000, keep=5, model=model, optimizer=opt, save_on_signal=(signal.SIGUSR1,)
        ) as ckpt:
            for step in range(1, 9):
                train_step(model, opt)
                if step in (3, 6):
                    os.kill(os.getpid(), signal.SIGUSR1)
                    assert seen == [] or len(seen) == 1  # the handler only records; nothing happens yet
                ckpt.step()
            assert seen == [["step_000000003"], ["step_000000003", "step_000000006"]]
        assert signal.getsignal(signal.SIGUSR1) is not None
        os.kill(os.getpid(), signal.SIGUSR1)  # after close: the user's handler alone
        assert len(seen) == 3
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_sigint_becomes_keyboard_interrupt_after_a_durable_checkpoint(tmp_path: Path) -> None:
    model, opt = _stack()
    # Python's own SIGINT handler, which a process started in the background (SIGINT ignored) lacks
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    ckpt = cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt, save_on_signal=(signal.SIGINT,))
    try:
        train_step(model, opt)
        ckpt.step()
        train_step(model, opt)
        expected = copy.deepcopy(model.state_dict())
        signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt here: the trap only records it
        ckpt.step()  # the checkpoint, then the signal, come at the step's consistent point
        with pytest.raises(KeyboardInterrupt):
            train_step(model, opt)  # its forward is that point
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        ckpt.close()
        signal.signal(signal.SIGINT, inherited)
    manifest, tensors = read_checkpoint(tmp_path / "step_000000002")
    assert manifest.step == 2
    model2, opt2 = _stack()
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2) as ckpt2:
        assert ckpt2.restore() == 2
    assert_state_equal(model2.state_dict(), expected)


def test_ignored_signal_still_checkpoints_and_training_goes_on(tmp_path: Path) -> None:
    model, opt = _stack()
    previous = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with cf.Checkpointer(
            tmp_path, policy=1000, model=model, optimizer=opt, save_on_signal=(signal.SIGUSR2,)
        ) as ckpt:
            train_step(model, opt)
            os.kill(os.getpid(), signal.SIGUSR2)
            ckpt.step()
            assert not (tmp_path / "step_000000001").exists()  # at the step's consistent point
            train_step(model, opt)  # its forward: the point, then training goes on
            assert (tmp_path / "step_000000001" / "manifest.json").exists()
            ckpt.step()
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_signal_after_the_last_step_is_honoured_by_close(tmp_path: Path) -> None:
    model, opt = _stack()
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, _: calls.append(s))
    try:
        ckpt = cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt, save_on_signal=(signal.SIGUSR1,))
        for _ in range(4):
            train_step(model, opt)
            ckpt.step()
        os.kill(os.getpid(), signal.SIGUSR1)
        ckpt.close()
        assert calls == [signal.SIGUSR1]
        assert [p.name for p in tmp_path.glob("step_*")] == ["step_000000004"]
        assert signal.getsignal(signal.SIGUSR1) is not None and not calls[1:]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_no_signal_no_checkpoint_and_handlers_restored(tmp_path: Path) -> None:
    model, opt = _stack()
    before = signal.getsignal(signal.SIGTERM)
    with cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt, save_on_signal=[signal.SIGTERM]) as ckpt:
        assert signal.getsignal(signal.SIGTERM) is not before
        for _ in range(50):
            train_step(model, opt)
            assert not ckpt.step()
    assert not list(tmp_path.glob("step_*"))
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_signal_arguments_fail_at_construction(tmp_path: Path) -> None:
    model = make_model()
    with pytest.raises(ValueError, match="SIGKILL and SIGSTOP cannot be caught"):
        cf.Checkpointer(tmp_path, model=model, save_on_signal=(signal.SIGKILL,))
    with pytest.raises(ValueError, match="signal numbers"):
        cf.Checkpointer(tmp_path, model=model, save_on_signal=("TERM",))
    errors: list[BaseException] = []

    def in_thread() -> None:
        try:
            cf.Checkpointer(tmp_path / "t", model=model, save_on_signal=(signal.SIGTERM,))
        except ValueError as e:
            errors.append(e)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(30)
    assert len(errors) == 1 and "main thread" in str(errors[0])
    with cf.Checkpointer(tmp_path, model=model):  # nothing was left locked or installed
        pass


def test_blocking_save_is_safe_anywhere_in_the_loop(tmp_path: Path) -> None:
    """Mid-iteration (gradients computed, step not taken) and right after a policy checkpoint started.

    ``save()`` records the state as it is at the call, labelled with the last completed step.
    """
    model, opt = _stack()
    with cf.Checkpointer(tmp_path, policy=3, keep=10, model=model, optimizer=opt) as ckpt:
        for step in range(1, 7):
            x = torch.randn(16, 8)
            loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 3, (16,)))
            opt.zero_grad()
            loss.backward()
            if step == 2:
                ckpt.save(blocking=True)  # between backward and optimizer.step: durable on return
                assert (tmp_path / "step_000000001" / "manifest.json").exists()
                at_save = copy.deepcopy((model.state_dict(), opt.state_dict()))
            opt.step()
            started = ckpt.step()
            if step == 4:  # Every(3) counts from the save at step 1
                assert started
                ckpt.save(blocking=True)  # the policy's checkpoint is in flight: this waits for it
                assert (tmp_path / "step_000000004" / "manifest.json").exists()
    model2, opt2 = _stack()
    with cf.Checkpointer(tmp_path, model=model2, optimizer=opt2) as ckpt2:
        assert ckpt2.restore(step=1) == 1
    assert_state_equal(model2.state_dict(), at_save[0])
    assert_state_equal(opt2.state_dict(), at_save[1])
