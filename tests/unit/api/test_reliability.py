"""Reliability: full disks, I/O errors, read-only directories, two writers, a dead or hung writer, long runs.

Storage faults use a real small filesystem (a tmpfs mounted for the test; skipped where mounting
is not permitted). I/O errors cannot be produced on demand without device-mapper, so that one
test injects an ``OSError(EIO)`` at the write call.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import psutil
import pytest
import torch

import checkfreq as cf
import checkfreq.storage.posix
from checkfreq.pipeline.restore import read_checkpoint
from checkfreq.storage.format import MANIFEST_NAME
from helpers import make_model, tmpfs, train_step


def _fill(directory: Path) -> Path:
    """Write a ballast file until the filesystem is full; return it."""
    ballast = directory / "ballast"
    block = b"\0" * 4096
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return ballast


def _errno_of(error: BaseException) -> int | None:
    while error is not None:
        if isinstance(error, OSError):
            return error.errno
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return None


def _visible(directory: Path) -> tuple[list[str], list[str]]:
    names = sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))
    return [n for n in names if ".tmp-" not in n], [n for n in names if ".tmp-" in n]


def _stack(width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(width=width)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


# ------------------------------------------------------------------ storage faults


def test_disk_full_raises_keeps_the_previous_and_recovers(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "1m") as root:
        model, opt = _stack(width=256)  # ~60 KB per checkpoint
        with cf.Checkpointer(root / "ckpt", policy=1000, keep=2, model=model, optimizer=opt) as ckpt:
            train_step(model, opt)
            ckpt.step()
            ckpt.save(blocking=True)
            ballast = _fill(root)
            train_step(model, opt)
            ckpt.step()
            ckpt.save()
            with pytest.raises(cf.PersistError, match="persist failed") as failure:
                ckpt.wait()
            assert _errno_of(failure.value) == errno.ENOSPC
            cause = failure.value.__cause__  # the OSError itself, as documented, on the background path too
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC, repr(cause)
            assert _visible(root / "ckpt") == (["step_000000001"], [])  # nothing partial, previous kept
            read_checkpoint(root / "ckpt" / "step_000000001")
            train_step(model, opt)
            ckpt.step()  # the error was reported once; training goes on
            ballast.unlink()
            ckpt.save(blocking=True)  # space is back
        assert _visible(root / "ckpt") == (["step_000000001", "step_000000003"], [])
        model2, opt2 = _stack(width=256)
        with cf.Checkpointer(root / "ckpt", model=model2, optimizer=opt2) as ckpt2:
            assert ckpt2.restore() == 3


def test_disk_full_with_warn_logs_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tmpfs(tmp_path / "fs", "1m") as root:
        model, opt = _stack(width=256)
        with caplog.at_level(logging.WARNING, logger="checkfreq"):
            with cf.Checkpointer(root / "ckpt", policy=1, keep=1, on_error="warn", model=model, optimizer=opt) as ckpt:
                train_step(model, opt)
                ckpt.step()
                ckpt.wait()
                ballast = _fill(root)
                for _ in range(5):
                    train_step(model, opt)
                    ckpt.step()  # every one of these checkpoints fails: never raises
                ckpt.wait()
                assert sum("training goes on" in r.message for r in caplog.records) >= 4
                assert _visible(root / "ckpt") == (["step_000000001"], [])
                ballast.unlink()
                for _ in range(2):
                    train_step(model, opt)
                    ckpt.step()
        assert _visible(root / "ckpt") == (["step_000000008"], [])
        read_checkpoint(root / "ckpt" / "step_000000008")


def test_io_error_during_write_is_surfaced_and_leaves_nothing_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No device-mapper here to make a disk fail: the error is injected at the write call."""
    real_write_all = checkfreq.storage.posix._write_all
    failing = {"on": False}

    def write_all(fd: int, chunk: memoryview, offset: int) -> None:
        if failing["on"]:
            real_write_all(fd, chunk[: len(chunk) // 2], offset)
            raise OSError(errno.EIO, "Input/output error")
        real_write_all(fd, chunk, offset)

    monkeypatch.setattr(checkfreq.storage.posix, "_write_all", write_all)
    model, opt = _stack()
    with cf.Checkpointer(tmp_path, policy=1000, keep=2, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        ckpt.save(blocking=True)
        failing["on"] = True
        train_step(model, opt)
        ckpt.step()
        with pytest.raises(cf.PersistError) as failure:
            ckpt.save(blocking=True)
        assert _errno_of(failure.value) == errno.EIO
        cause = failure.value.__cause__  # as documented: the OSError itself, not a wrapper of it
        assert isinstance(cause, OSError) and cause.errno == errno.EIO, repr(cause)
        assert _visible(tmp_path) == (["step_000000001"], [])
        failing["on"] = False
        train_step(model, opt)
        ckpt.step()
        ckpt.save(blocking=True)
    assert _visible(tmp_path) == (["step_000000001", "step_000000003"], [])


def test_a_filesystem_that_cannot_map_files_is_read_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore maps data files; where mapping fails (ENODEV, as on some FUSE mounts) it reads them."""
    model, opt = _stack()
    with cf.Checkpointer(tmp_path, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        ckpt.save(blocking=True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    def no_mapping(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(checkfreq.storage.posix.mmap, "mmap", no_mapping)
    restored = make_model(seed=1)
    with cf.Checkpointer(tmp_path, model=restored, optimizer=torch.optim.Adam(restored.parameters())) as ckpt:
        assert ckpt.restore() == 1
    for name, value in restored.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_read_only_filesystem_fails_at_construction(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as root:
        with pytest.raises(PermissionError, match="not writable"):
            cf.Checkpointer(root, model=make_model())
        with pytest.raises(OSError, match="cannot create checkpoint directory"):
            cf.Checkpointer(root / "missing" / "deeper", model=make_model())


def test_a_directory_made_unwritable_mid_run_fails_naming_on_error_warn(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    model, opt = _stack()
    with cf.Checkpointer(directory, policy=1, model=model, optimizer=opt) as ckpt:
        train_step(model, opt)
        ckpt.step()
        ckpt.wait()
        if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:  # not even root adds files
            pytest.skip("cannot make a directory immutable here (chattr +i needs root and a filesystem that has it)")
        try:
            train_step(model, opt)
            ckpt.step()  # its persist fails
            with pytest.raises(cf.PersistError) as info:
                ckpt.wait()
        finally:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
    assert "Operation not permitted" in str(info.value)
    assert 'with on_error="warn" the Checkpointer logs such a failure and trains on' in str(info.value)


def test_missing_directory_is_created_and_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    with cf.Checkpointer(tmp_path / "a" / "b", model=make_model()) as ckpt:
        ckpt.save(blocking=True)
    assert (tmp_path / "a" / "b" / "step_000000000" / MANIFEST_NAME).exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match="cannot create checkpoint directory"):
        cf.Checkpointer(tmp_path / "file", model=make_model())


# ------------------------------------------------------------------ two writers, stale locks

HOLDER = """
import sys, time, torch
import checkfreq as cf
ckpt = cf.Checkpointer(sys.argv[1], model=torch.nn.Linear(2, 2))
print("locked", flush=True)
time.sleep(600)
"""


def test_second_job_is_refused_and_a_killed_jobs_lock_is_recovered(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"  # type: ignore[union-attr]
        with pytest.raises(cf.DirectoryLockedError, match=f"pid {holder.pid}") as refused:
            cf.Checkpointer(tmp_path, model=make_model())
        # One line: the directory, the process holding it (its command line), what to do.
        message = str(refused.value)
        assert (
            "\n" not in message
            and str(tmp_path.resolve()) in message
            and f"pid {holder.pid}: {sys.executable} -c" in message
        )
        assert "wait for it to end or stop it, or give this job a directory of its own" in message
        (tmp_path / "step_000000007.tmp-0123456789ab").mkdir()  # what a job killed mid-persist leaves
    finally:
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(60) == -signal.SIGKILL
    with cf.Checkpointer(tmp_path, model=make_model()) as ckpt:  # the stale lock file is still there
        assert (tmp_path / ".checkfreq.lock").read_text() == str(os.getpid())
        assert not list(tmp_path.glob("*.tmp-*"))
        ckpt.save(blocking=True)


# ------------------------------------------------------------------ dead or hung writer


class _WriterKilled(BaseException):
    """Raised asynchronously inside the writer thread to kill it."""


def _writer_thread() -> threading.Thread:
    (thread,) = [t for t in threading.enumerate() if t.name == "checkfreq-writer"]
    return thread


def _kill_thread(thread: threading.Thread) -> None:
    """Make ``thread`` die with an exception the next time it runs Python code."""
    hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_WriterKilled))
    assert hit == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("detected_by", ["wait", "step", "fence"])
def test_writer_death_is_detected_and_nothing_hangs(tmp_path: Path, detected_by: str) -> None:
    model, opt = _stack()
    ckpt = cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt, persist_timeout=60)
    try:
        train_step(model, opt)
        ckpt.step()
        writer = _writer_thread()
        _kill_thread(writer)  # pending until the thread wakes up for the next job
        ckpt.save()
        writer.join(30)
        assert not writer.is_alive()
        with pytest.raises(cf.PersistError, match="writer thread"):  # not a TimeoutError after 60 s
            if detected_by == "wait":
                ckpt.wait()
            elif detected_by == "step":
                ckpt.step()
            else:
                train_step(model, opt)  # optimizer.step() waits on the snapshot fence
        with pytest.raises(cf.PersistError, match="writer thread is gone"):
            ckpt.save(blocking=True)
    finally:
        ckpt.close()  # returns: nothing left to wait for
    with cf.Checkpointer(tmp_path, model=make_model()):  # and the directory lock was released
        pass


def test_a_hung_writer_times_out_instead_of_blocking_forever(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that never returns (a hung network filesystem), injected: a frozen filesystem here
    would also block the training thread's event-log append, which is not the case under test."""
    release = threading.Event()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (release.wait(60), real_fsync(fd))[1])
    model, opt = _stack()
    ckpt = cf.Checkpointer(tmp_path, policy=1000, model=model, optimizer=opt, persist_timeout=1.0)
    try:
        train_step(model, opt)
        ckpt.step()
        ckpt.save()
        with pytest.raises(TimeoutError, match="still running after 1.0 s"):
            ckpt.wait()
        train_step(model, opt)  # the fence waits for the copy only: training goes on while fsync hangs
        ckpt.step()
        with pytest.raises(TimeoutError):
            ckpt.close()
    finally:
        release.set()
        ckpt.wait()
    assert (tmp_path / "step_000000001" / MANIFEST_NAME).exists()


# ------------------------------------------------------------------ long runs

STEPS = 10_000


def _count_calls(fn: Callable[[], object]) -> int:
    """Python function calls made by ``fn()`` in this thread: a deterministic measure of work."""
    calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.slow
def test_ten_thousand_checkpoints_leave_no_trace(tmp_path: Path) -> None:
    """RSS, open fds, threads and Python objects flat; the same work per step() at the end as at the start."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path  # fsyncs are free there: 10k in seconds
    directory = root / f"checkfreq-hygiene-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(4, 16)
    process = psutil.Process()
    samples: dict[str, dict[str, int]] = {}
    seconds: list[float] = []
    calls: dict[str, int] = {}

    def one_step(ckpt: cf.Checkpointer) -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        ckpt.step()
        ckpt.wait()

    try:
        with cf.Checkpointer(directory, policy=1, keep=1, model=model, optimizer=opt) as ckpt:
            for i in range(1, STEPS + 1):
                start = time.perf_counter()
                one_step(ckpt)
                seconds.append(time.perf_counter() - start)
                if i in (1000, STEPS):
                    gc.collect()
                    window = "early" if i == 1000 else "late"
                    calls[window] = _count_calls(lambda: [one_step(ckpt) for _ in range(20)])
                    samples[window] = {
                        "rss": process.memory_info().rss,
                        "fds": process.num_fds(),
                        "threads": process.num_threads(),
                        "objects": len(gc.get_objects()),
                    }
            entries = sorted(p.name for p in directory.iterdir())
    finally:
        subprocess.run(["rm", "-rf", str(directory)], check=False)
    early, late = samples["early"], samples["late"]
    ratio = statistics.median(seconds[-1000:]) / statistics.median(seconds[500:1500])
    print(
        f"10k checkpoints: step()+wait() median late/early {ratio:.2f}, RSS {early['rss'] / 1e6:.1f} -> "
        f"{late['rss'] / 1e6:.1f} MB, fds {early['fds']} -> {late['fds']}, "
        f"threads {early['threads']} -> {late['threads']}"
    )
    assert entries == [".checkfreq.lock", "events.jsonl", f"step_{STEPS + 40:09d}"]
    assert late["fds"] == early["fds"]
    assert late["threads"] == early["threads"]
    assert late["rss"] - early["rss"] < 8 << 20, "RSS grew"
    assert late["objects"] - early["objects"] < 500, "Python objects accumulate"
    assert abs(calls["late"] - calls["early"]) <= 0.02 * calls["early"], calls  # no step() work growing with history
