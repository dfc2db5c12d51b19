"""The DDP tutorial's epoch loop over a ResumableLoader, SIGKILLed right after the checkpoint that
ends an epoch and resumed: each rank peeks at a batch (``next(iter(loader))``, then the defaulted
form), calls ``set_epoch(epoch)`` on the sampler and the loader, and trains the epoch. The resumed
run starts at the next epoch, and every rank takes the samples of the uninterrupted run, in its
order, each sample once per epoch; the weights end bit-identical. At world size 1 (one process)
and 2 (real gloo processes under DDP), and with an LR scheduler stepped after each epoch's batches:
the loop does nothing for checkfreq, whose checkpoint due at the epoch's last batch is taken at the
next peek, after the scheduler."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing import ProcessExitedException
from torch.nn.parallel import DistributedDataParallel

from checkfreq import Checkpointer
from checkfreq.data import ResumableLoader
from helpers import assert_state_equal, spawn_ranks

SAMPLES, BATCH, EPOCHS = 24, 4, 3
"""At world size 2: 3 batches per rank and epoch."""


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = torch.tensor([index / SAMPLES, 1.0 - index / SAMPLES])
        return x, x.sum(0, keepdim=True) * 0.5, index


def _train(rank: int, world: int, epoch_work: bool, directory: str, out: str, kill_after_epoch: int | None) -> None:
    """The tutorial's loop in ``directory``; write what each epoch took and the final state to ``out``.

    With ``kill_after_epoch``, SIGKILL every rank once the checkpoint that ends that epoch is durable
    on all of them: due at the epoch's last batch, taken at the next epoch's peek (after the work of
    the epoch, with ``epoch_work`` an LR scheduler stepped after each epoch's batches).
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    net = DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = ResumableLoader(Points(), batch_size=BATCH, shuffle=True, seed=5)
    ckpt = Checkpointer(
        directory,
        policy=SAMPLES // BATCH // world,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
    )
    ckpt.restore()
    taken: dict[int, list[int]] = {}

    for epoch in range(loader.epoch, EPOCHS):
        batch_size = len(next(iter(loader))[0])  # the tutorial's peek, at the top of every epoch
        if kill_after_epoch is not None and epoch == kill_after_epoch + 1:  # the peek took the checkpoint
            assert ckpt._timeline.last_checkpoint == ckpt.global_step
            ckpt.wait()
            Path(f"{out}.{rank}.json").write_text(json.dumps({"taken": taken}))
            _die_together(Path(out).parent, rank, world)
        assert batch_size == BATCH and next(iter(loader), None) is not None
        loader.sampler.set_epoch(epoch)
        loader.set_epoch(epoch)
        for x, y, index in loader:
            taken.setdefault(epoch, []).extend(index.tolist())
            loss = nn.functional.mse_loss(net(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
        if epoch_work:
            scheduler.step()
    ckpt.close()
    Path(f"{out}.{rank}.json").write_text(json.dumps({"taken": taken}))
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        f"{out}.{rank}.pt",
    )


def _die_together(where: Path, rank: int, world: int) -> None:
    """SIGKILL this rank once every rank got here (none dies while another still waits on it)."""
    (where / f"durable.{rank}").touch()
    while not all((where / f"durable.{r}").exists() for r in range(world)):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _job(rank: int, world: int, epoch_work: bool, store: str, sessions: list[tuple[str, str, int | None]]) -> None:
    if world > 1:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    for directory, out, kill_after_epoch in sessions:
        _train(rank, world, epoch_work, directory, out, kill_after_epoch)
    if world > 1:
        dist.destroy_process_group()


def _taken(out: Path, rank: int) -> dict[int, list[int]]:
    return {int(e): idx for e, idx in json.loads(Path(f"{out}.{rank}.json").read_text())["taken"].items()}


@pytest.mark.parametrize(
    ("world", "epoch_work"),
    [(1, False), (1, True), (2, True)],
    ids=["1-rank", "1-rank-epoch-scheduler", "2-ranks-epoch-scheduler"],
)
def test_the_tutorial_loop_resumed_at_an_epoch_end_takes_each_sample_once_in_order(
    tmp_path: Path, world: int, epoch_work: bool
) -> None:
    killed, resumed, uninterrupted = tmp_path / "killed", tmp_path / "resumed", tmp_path / "uninterrupted"
    with pytest.raises(ProcessExitedException, match="SIGKILL"):
        spawn_ranks(
            _job, (world, epoch_work, str(tmp_path / "store1"), [(str(tmp_path / "run"), str(killed), 0)]), world
        )
    spawn_ranks(
        _job,
        (
            world,
            epoch_work,
            str(tmp_path / "store2"),
            [
                (str(tmp_path / "run"), str(resumed), None),  # resumed from the checkpoint that ended epoch 0
                (str(tmp_path / "fresh"), str(uninterrupted), None),
            ],
        ),
        world,
    )

    for rank in range(world):
        before, after, whole = _taken(killed, rank), _taken(resumed, rank), _taken(uninterrupted, rank)
        assert sorted(before) == [0] and sorted(after) == [1, 2]  # the resumed run starts at epoch 1
        assert {**before, **after} == whole  # the same samples, in the same order
        final = torch.load(f"{resumed}.{rank}.pt")
        assert_state_equal(final, torch.load(f"{uninterrupted}.{rank}.pt"))
        assert final["scheduler"]["last_epoch"] == (EPOCHS if epoch_work else 0)
    for epoch in range(EPOCHS):
        seen = Counter(i for rank in range(world) for i in _taken(uninterrupted, rank)[epoch])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, f"epoch {epoch}: {seen}"
