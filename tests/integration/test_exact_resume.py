"""Acceptance: a run SIGKILLed and resumed ends bit-identical to one never interrupted.

Each run is ``scripts/train_exact.py`` in a child process of its own session; after a kill its
orphaned DataLoader workers are killed too, as a node failure would.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from checkfreq.checkpointer import Checkpointer
from checkfreq.data import ResumableLoader
from helpers import SCRIPTS, assert_state_equal

SAMPLES, BATCH, EPOCHS, EVERY = 70, 8, 3, 2  # 9 batches per epoch, 8 with drop_last


def steps_per_epoch(drop_last: bool) -> int:
    batches = SAMPLES // BATCH if drop_last else -(-SAMPLES // BATCH)
    return -(-batches // 2)  # gradient accumulation 2, the odd last batch steps alone


class Trainer:
    """Runs ``train_exact.py`` in forked children of one zygote process, which imports torch once."""

    def __init__(self) -> None:
        self.zygote = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "train_exact.py"), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, workdir: Path, name: str, *args: str, killed: bool = False) -> str:
        """Run (or resume) the training in ``workdir``; return what it printed."""
        argv = [
            "--dir",
            str(workdir / "ckpt"),
            "--out",
            str(workdir / f"{name}.pt"),
            "--log",
            str(workdir / "batches.log"),
            "--samples",
            str(SAMPLES),
            "--batch-size",
            str(BATCH),
            "--epochs",
            str(EPOCHS),
            "--every",
            str(EVERY),
            *args,
        ]
        output = workdir / "output.txt"
        output.write_text("")
        self.zygote.stdin.write(json.dumps({"argv": argv, "output": str(output)}) + "\n")
        self.zygote.stdin.flush()
        answer = self.zygote.stdout.readline()
        assert answer, "the training zygote died"
        exitcode = json.loads(answer)["exitcode"]
        expected = -signal.SIGKILL if killed else 0
        assert exitcode == expected, f"{name} {args}: exit {exitcode}\n{output.read_text()}"
        return output.read_text()

    def close(self) -> None:
        self.zygote.stdin.close()
        self.zygote.wait(timeout=30)


@pytest.fixture(scope="module")
def train() -> Iterator[Trainer]:
    trainer = Trainer()
    yield trainer
    trainer.close()


def consumed_per_epoch(log: Path) -> dict[int, list[int]]:
    """Sample indices per epoch in order; a replayed batch must repeat its first attempt exactly."""
    batches: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, consumed, *indices = map(int, line.split())
        first = batches.setdefault((epoch, consumed), indices)
        assert first == indices, f"epoch {epoch} batch ending at {consumed} differs when replayed"
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for epoch, consumed in sorted(batches):
        per_epoch[epoch].extend(batches[epoch, consumed])
    return dict(per_epoch)


def restored(stdout: str) -> tuple[int, int, int]:
    line = next(line for line in stdout.splitlines() if line.startswith("restored"))
    step, epoch, consumed = (int(part.split("=")[1]) for part in line.split()[1:])
    return step, epoch, consumed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, train) -> dict[bool, tuple[dict, dict[int, list[int]]]]:
    """Final state and consumed log of a run never interrupted, per drop_last (num_workers=0)."""
    results = {}
    for drop_last in (False, True):
        workdir = tmp_path_factory.mktemp(f"uninterrupted-{drop_last}")
        train(workdir, "final", *(["--drop-last"] if drop_last else []))
        results[drop_last] = (torch.load(workdir / "final.pt"), consumed_per_epoch(workdir / "batches.log"))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("num_workers", [0, 2], ids=["workers0", "workers2"])
def test_killed_and_resumed_run_is_bit_identical(tmp_path, train, uninterrupted, num_workers, drop_last):
    options = ["--num-workers", str(num_workers), *(["--drop-last"] if drop_last else [])]
    per_epoch, seen_per_epoch = steps_per_epoch(drop_last), SAMPLES - (SAMPLES % BATCH if drop_last else 0)
    boundary = 2 * per_epoch  # the end of epoch 1, a checkpoint step (EVERY divides it)
    rng = random.Random(f"{num_workers}-{drop_last}")
    mid_epoch = rng.choice([s for s in range(3, boundary) if s % EVERY == 0 and s % per_epoch])
    kills = [[str(mid_epoch)], [str(boundary)]]
    if num_workers:  # once more, later, with the last checkpoint possibly still in flight
        kills.append([str(rng.randrange(boundary + 1, EPOCHS * per_epoch)), "--no-wait"])

    outputs = [train(tmp_path, "killed", "--die-at", *kill, *options, killed=True) for kill in kills]
    outputs.append(train(tmp_path, "final", *options))

    step, _, consumed = restored(outputs[1])
    assert step == mid_epoch and 0 < consumed < seen_per_epoch
    assert restored(outputs[2]) == (boundary, 2, 0)  # after epoch 1's last batch: the start of epoch 2
    expected_state, expected_log = uninterrupted[drop_last]
    assert_state_equal(torch.load(tmp_path / "final.pt"), expected_state)
    log = consumed_per_epoch(tmp_path / "batches.log")
    assert log == expected_log
    for indices in log.values():
        assert sorted(indices) == sorted(set(indices)) and len(indices) == seen_per_epoch


# ------------------------------------------------------------- loaders registered in a Checkpointer


class Indexed:
    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize(("batch_size", "num_workers"), [(4, 2), (7, 0)])
def test_checkpointer_resumes_the_loader_with_other_workers_or_batch_size(tmp_path, batch_size, num_workers):
    first = ResumableLoader(Indexed(), batch_size=4, shuffle=True, seed=3)
    with Checkpointer(tmp_path, policy=1000, loader=first) as ckpt:
        it = iter(first)
        head = [i for _ in range(5) for i in next(it).tolist()]
        ckpt.save(blocking=True)

    second = ResumableLoader(Indexed(), batch_size=batch_size, shuffle=True, seed=3, num_workers=num_workers)
    with Checkpointer(tmp_path, policy=1000, loader=second) as ckpt:
        ckpt.restore()
    rest = [i for batch in second for i in batch.tolist()]
    assert head + rest == second.sampler.global_order(0).tolist()


STATEFUL_LOADER_RUN = """
import sys, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from checkfreq.checkpointer import Checkpointer

make = lambda: StatefulDataLoader(list(range(50)), batch_size=4, shuffle=True)
torch.manual_seed(0)
expected = [batch.tolist() for batch in make()]
torch.manual_seed(0)
first = make()
with Checkpointer(sys.argv[1], policy=1000, loader=first) as ckpt:
    it = iter(first)
    head = [next(it).tolist() for _ in range(5)]
    ckpt.save(blocking=True)
second = make()
with Checkpointer(sys.argv[1], policy=1000, loader=second) as ckpt:
    ckpt.restore()
assert head + [batch.tolist() for batch in second] == expected
"""


def test_a_stateful_dataloader_can_be_registered_instead(tmp_path):
    pytest.importorskip("torchdata.stateful_dataloader")
    proc = subprocess.run(  # in a child: the failure is a crash
        [sys.executable, "-c", STATEFUL_LOADER_RUN, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_restart_right_after_a_kill_is_not_locked_out(tmp_path):
    killed = textwrap.dedent(f"""
        import os, signal
        from checkfreq.checkpointer import Checkpointer
        from checkfreq.data import ResumableLoader
        loader = ResumableLoader(list(range(100)), num_workers=1)
        ckpt = Checkpointer({str(tmp_path)!r}, loader=loader)
        batches = iter(loader)
        next(batches)  # a worker is running, forked after the directory was locked
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", killed], start_new_session=True)
    try:
        assert proc.wait(timeout=120) == -signal.SIGKILL
        Checkpointer(tmp_path, loader=ResumableLoader(list(range(100)))).close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
