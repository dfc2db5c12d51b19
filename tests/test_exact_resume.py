"""Acceptance: a run SIGKILLed and resumed ends bit-identical to one never interrupted.

Each run is ``scripts/train_exact.py`` in a child process of its own session; after a kill its
orphaned DataLoader workers are killed too, as a node failure would.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_state_equal

SAMPLES, BATCH, EPOCHS, EVERY = 70, 8, 3, 2  # 9 batches per epoch, 8 with drop_last
pytestmark = pytest.mark.slow


def steps_per_epoch(drop_last: bool) -> int:
    batches = SAMPLES // BATCH if drop_last else -(-SAMPLES // BATCH)
    return -(-batches // 2)  # gradient accumulation 2, the odd last batch steps alone


class Trainer:
    """Runs ``train_exact.py`` in forked children of one zygote process, which imports torch once."""

    def __init__(self) -> None:
        self.zygote = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "train_exact.py"), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def __call__(self, workdir: Path, name: str, *args: str, killed: bool = False) -> str:
        """Run (or resume) the training in ``workdir``; return what it printed."""
        argv = [
            "--dir", str(workdir / "ckpt"), "--out", str(workdir / f"{name}.pt"),
            "--log", str(workdir / "batches.log"), "--samples", str(SAMPLES),
            "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--every", str(EVERY), *args,
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
    assert restored(outputs[2]) == (boundary, *((1, seen_per_epoch) if drop_last else (2, 0)))
    expected_state, expected_log = uninterrupted[drop_last]
    assert_state_equal(torch.load(tmp_path / "final.pt"), expected_state)
    log = consumed_per_epoch(tmp_path / "batches.log")
    assert log == expected_log
    for indices in log.values():
        assert sorted(indices) == sorted(set(indices)) and len(indices) == seen_per_epoch
