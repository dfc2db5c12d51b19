"""Acceptance: a Lightning fit with CheckFreqCallback, SIGKILLed and resumed, ends bit-identical.

Each run is ``scripts/lightning_train.py`` in a child process: 2 epochs of 9 optimizer steps, a
checkpoint every 3 steps. The first run dies mid-epoch 0 at step 5 (restore: step 3, mid-epoch),
the second at step 10 (restore: step 9, the end of epoch 0), the third finishes; in one process,
and under ``strategy="ddp"`` on two CPU processes where one rank is killed (rank 1, then rank 0).
Skipped when the ``lightning`` extra is not installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, assert_state_equal

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow


def fit(workdir: Path, name: str, *args: str, killed: bool = False, ddp: bool = False) -> str:
    """Run the fit; under DDP a killed rank makes the others fail, and nothing of the job may outlive it."""
    command = [sys.executable, str(SCRIPTS / "lightning_train.py"), "--dir", str(workdir / "ckpt"),
               "--out", str(workdir / f"{name}.pt"), "--log", str(workdir / "batches.log"), *args]
    if ddp:
        command += ["--devices", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        _kill_session(proc.pid)
    expected = (1, -signal.SIGKILL) if killed and ddp else (-signal.SIGKILL,) if killed else (0,)
    assert proc.returncode in expected, f"{name}: exit {proc.returncode}\n{out}"
    return out


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def batches(log: Path) -> dict[int, list[int]]:
    """Sample indices per epoch in batch order; a replayed batch must repeat its first attempt."""
    seen: dict[tuple[int, int], list[int]] = {}
    for line in log.read_text().splitlines():
        epoch, batch_idx, *indices = map(int, line.split())
        first = seen.setdefault((epoch, batch_idx), indices)
        assert first == indices, f"epoch {epoch} batch {batch_idx} differs when replayed"
    per_epoch: dict[int, list[int]] = {}
    for epoch, batch_idx in sorted(seen):
        per_epoch.setdefault(epoch, []).extend(seen[epoch, batch_idx])
    return per_epoch


def test_killed_and_resumed_fit_is_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    assert "restored 0 final 18" in fit(reference, "final")

    run = tmp_path / "run"
    run.mkdir()
    fit(run, "killed", "--die-at", "5", killed=True)
    fit(run, "killed", "--die-at", "10", killed=True)
    assert "restored 9 final 18" in fit(run, "final")

    expected, actual = torch.load(reference / "final.pt"), torch.load(run / "final.pt")
    assert_state_equal(actual["model"], expected["model"])
    assert_state_equal(actual["optimizer"], expected["optimizer"])
    assert actual["scheduler"] == expected["scheduler"]
    order = [tuple(map(int, line.split()[:2])) for line in (run / "batches.log").read_text().splitlines()]
    # Run 1 trains batches 0-4 of epoch 0; run 2 restores step 3 and replays batches 3-4, then
    # goes on to batch 0 of epoch 1; run 3 restores step 9 (end of epoch 0) and replays that batch.
    assert order == [(0, i) for i in range(5)] + [(0, i) for i in range(3, 9)] + [(1, i) for i in (0, *range(9))]
    log = batches(run / "batches.log")
    assert log == batches(reference / "batches.log")
    for indices in log.values():
        assert sorted(indices) == list(range(72))



def test_ddp_fit_with_a_rank_killed_resumes_bit_identical(tmp_path: Path) -> None:
    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    out = fit(reference, "final", ddp=True)
    assert "rank 0 restored 0 final 18" in out and "rank 1 restored 0 final 18" in out
    fit(run, "killed", "--die-at", "5", "--die-rank", "1", killed=True, ddp=True)
    fit(run, "killed", "--die-at", "10", "--die-rank", "0", killed=True, ddp=True)
    out = fit(run, "final", ddp=True)
    assert "rank 0 restored 9 final 18" in out and "rank 1 restored 9 final 18" in out

    for name in ("final.pt", "final.pt.1"):  # every rank, BatchNorm buffers (per rank under DDP) included
        expected, actual = torch.load(reference / name), torch.load(run / name)
        assert_state_equal(actual["model"], expected["model"])
        assert_state_equal(actual["optimizer"], expected["optimizer"])
        assert actual["scheduler"] == expected["scheduler"]
    for rank in (0, 1):
        assert batches(run / f"batches.log.{rank}") == batches(reference / f"batches.log.{rank}")
    for epoch in range(2):  # the ranks' shares make up the epoch, each sample once
        shares = [batches(run / f"batches.log.{rank}")[epoch] for rank in (0, 1)]
        assert sorted(shares[0] + shares[1]) == list(range(72))


def test_policy_sees_the_loss_of_each_optimizer_step(tmp_path: Path) -> None:
    """The loss training_step returns reaches the policy, once per optimizer step (the last micro-batch's)."""
    import lightning.pytorch as pl

    from checkfreq.integrations.lightning import CheckFreqCallback
    from checkfreq.policies import Every

    class Recording(Every):
        def should_save(self, ctx):  # type: ignore[no-untyped-def]
            self.seen.append(ctx.loss)
            return super().should_save(ctx)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.losses = torch.nn.Linear(4, 1), []

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            loss = self.net(batch[0]).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    policy = Recording(n=3)
    policy.seen = []
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    model = Model()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CheckFreqCallback(tmp_path, policy=policy)])
    trainer.fit(model, train_dataloaders=data)
    assert policy.seen == model.losses[1::2] and len(policy.seen) == 4
