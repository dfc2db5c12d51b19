"""Helpers the tests share: where things are, small real models and training steps, jobs in a session of their own.

Test files import these with ``from helpers import ...`` (``pythonpath = ["tests"]`` in pyproject.toml);
pytest fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.multiprocessing as mp

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
"""The repository's root."""
SCRIPTS = TESTS / "scripts"
"""The training scripts the tests launch (as subprocesses or under torchrun)."""
DOCS = ROOT / "docs"
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks"


def make_model(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    )


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int = 16) -> float:
    x = torch.randn(batch, 8)
    y = torch.randint(0, 3, (batch,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), key
        elif isinstance(x, dict):
            assert_state_equal(x, y)
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), key
            for i, (u, v) in enumerate(zip(x, y, strict=True)):
                assert_state_equal({i: u}, {i: v})
        else:
            assert x == y, key


def memory_tier(ckpt: Any) -> Any:
    """The memory tier of a Checkpointer made with ``memory=``."""
    from checkfreq.pipeline.tiers.memory.tier import MemoryTier

    (tier,) = (t for t in ckpt._tiers.all if isinstance(t, MemoryTier))
    return tier


def docs_example(page: Path, heading: str) -> str:
    """The first Python block under ``heading`` of a docs page."""
    section = page.read_text().split(f"## {heading}", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, f"no Python block under {heading!r} in {page.name}"
    return found.group(1)


def run_example(workdir: Path, module: str, steps: int, then: str, *, killed: bool = False) -> None:
    """In a child process, ``result = train(workdir/'ckpt', steps)`` of the example module ``module``
    written into ``workdir``, then the statement ``then``, then a SIGKILL of the child if ``killed``."""
    code = (
        f"import os, signal, sys, torch; sys.path.insert(0, {str(workdir)!r}); torch.set_num_threads(1)\n"
        f"from {module} import train\n"
        f"result = train({str(workdir / 'ckpt')!r}, {steps})\n"
        f"{then}\n"
        f"if {killed}: os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == (-signal.SIGKILL if killed else 0), proc.stderr


def run_job(command: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run a job in a session of its own and return (exit status, output); nothing of it outlives it."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- torchrun jobs of scripts/ddp_train.py

SAMPLES, BATCH, EPOCHS, EVERY = 64, 8, 3, 3
"""The ddp_train.py jobs' data and cadence: at world size 2, 4 steps per epoch, 12 in all."""


def launch_job(workdir: Path, script: str, *args: str, nproc: int = 2, restarts: int = 3) -> subprocess.Popen[str]:
    """Start ``scripts/<script>`` under ``torchrun --standalone`` with ``nproc`` workers (0: one plain process)."""
    # torchrun's shared rendezvous store can hand a restarted worker its predecessor's address
    # (pytorch/pytorch#135712): give the workers their own store, as docs/distributed.md advises.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if nproc:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            str(SCRIPTS / script),
            *args,
        ]
    else:  # one plain process, no process group
        command = [sys.executable, str(SCRIPTS / script), *args]
    return subprocess.Popen(
        command,
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def finish_job(proc: subprocess.Popen[str], expect_success: bool = True) -> str:
    """The job's output once it ended as expected."""
    try:
        out, _ = proc.communicate(timeout=480)
    finally:
        if proc.poll() is None:  # timed out: torchrun's workers run in sessions of their own
            kill_tree(proc.pid)
    assert (proc.returncode == 0) == expect_success, out[-4000:]
    return out


def kill_tree(pid: int) -> None:
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def ddp_train_args(workdir: Path, *extra: str) -> list[str]:
    return [
        "--ckpt-dir",
        str(workdir / "ckpt"),
        "--final",
        str(workdir / "final"),
        "--batch-log",
        str(workdir / "batches.log"),
        "--samples",
        str(SAMPLES),
        "--batch-size",
        str(BATCH),
        "--epochs",
        str(EPOCHS),
        "--every",
        str(EVERY),
        *extra,
    ]


def incarnations(out: str) -> list[tuple[int, int, int]]:
    """(life, rank, restored step) for every incarnation of every rank."""
    return sorted((int(a), int(b), int(c)) for a, b, c in re.findall(r"life=(\d+) rank=(\d+) restored step=(\d+)", out))


def assert_each_sample_once_per_epoch(log: Path) -> None:
    """The last line for each (rank, epoch, position) is what training used: a replay replaces its line."""
    batches: dict[tuple[str, str, str], list[int]] = {}
    for line in log.read_text().splitlines():
        rank, epoch, consumed, *indices = line.split()
        batches[(rank, epoch, consumed)] = [int(i) for i in indices]
    for epoch in range(EPOCHS):
        seen = Counter(i for (_, e, _), idx in batches.items() if int(e) == epoch for i in idx)
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, f"epoch {epoch}: {seen}"


def final_states(workdir: Path) -> list[dict]:
    return [torch.load(workdir / f"final.rank{rank}.pt") for rank in (0, 1)]


# ---------------------------------------------------------------------------- scripts/hf_train.py


def hf_fit(workdir: Path, name: str, *args: str, killed: bool = False, ranks: int = 1, static_restarts: int = 0) -> str:
    """Run scripts/hf_train.py (under torchrun with ``ranks`` > 1: the c10d form, or the static form with
    ``static_restarts``); nothing of the job may outlive it."""
    resume = [] if "--resume_from_checkpoint" in args else ["--resume_from_checkpoint", "true"]
    script = [
        str(SCRIPTS / "hf_train.py"),
        "--dir",
        str(workdir),
        "--out",
        str(workdir / f"{name}.pt"),
        "--read-log",
        str(workdir / f"{name}.log"),
        *resume,
        *args,
    ]
    if static_restarts:
        form = [f"--master-port={free_port()}", f"--max-restarts={static_restarts}", "--monitor-interval=0.1"]
    else:
        form = ["--standalone"]
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", *form, f"--nproc-per-node={ranks}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    returncode, out = run_job(launcher + script, env)
    expected = 0 if not killed else -signal.SIGKILL if ranks == 1 else 1  # torchrun fails when a worker dies
    assert returncode == expected, f"{name}: exit {returncode}\n{out[-4000:]}"
    return out


def sample_reads(log: Path) -> list[int]:
    """The sample indices a run of hf_train.py logged with ``--read-log``, in the order it read them."""
    return [int(line) for line in log.read_text().split()]


def run_forked(
    ctx: multiprocessing.context.BaseContext, target: Any, args: tuple[Any, ...], timeout: float = 300
) -> int | None:
    """``target(*args)`` in a process of ``ctx`` (a forkserver that imported torch once: fast, and a real
    SIGKILL at any point); its exit code, failing the test if it is still running after ``timeout`` s."""
    process = ctx.Process(target=target, args=args)
    process.start()
    process.join(timeout)
    assert not process.is_alive(), f"{args} still running after {timeout} s"
    return process.exitcode


def spawn_ranks(fn: Any, args: tuple[Any, ...], nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, each rank leaving without the interpreter's
    teardown once ``fn`` returned: torch's gloo threads can abort a finished process at teardown
    (docs/distributed.md), and the test is about checkfreq, not that race. ``fn`` writes its results
    before it returns; an exception in it fails the job as usual."""
    mp.spawn(_run_then_leave, args=(fn, *args), nprocs=nprocs, join=True)


def _run_then_leave(rank: int, fn: Any, *args: Any) -> None:
    from worker_exit import exit_without_teardown  # tests/scripts, on the path conftest sets (and children inherit)

    fn(rank, *args)
    exit_without_teardown()


@contextmanager
def tmpfs(path: Path, size: str, *, read_only: bool = False) -> Iterator[Path]:
    """Mount a fresh tmpfs of ``size`` at ``path`` (skip the test if this machine does not allow it)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
